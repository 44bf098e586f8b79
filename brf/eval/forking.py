"""Forking tokens: where, by the members' uncertainty, fusion gains over one model.

Only a minority of positions are "forks" where the next token is genuinely
open (high entropy); elsewhere every member is sure and fusion can change
little. These analyses split a method's per-position gain over a reference
(the best single member) by entropy strata, and ask how much of full fusion's
gain an entropy-gated fusion keeps when it runs the other members only at the
highest-entropy positions.

All functions take per-position arrays over the same positions (a test split);
gains are in nats per position, positive = better than the reference.
"""

from __future__ import annotations

import numpy as np

from brf.event_table import EventTable


def member_entropy(table: EventTable) -> np.ndarray:
    """[P, n] each member's entropy (nats) over the table's events."""
    logp = np.asarray(table.logp, np.float64)
    p = np.exp(logp)
    return -np.sum(p * np.where(p > 0, logp, 0.0), axis=-1)


def strata(entropy_P: np.ndarray, n_bins: int = 10) -> np.ndarray:
    """[P] stratum 0..n_bins-1 of each position by quantiles of ``entropy_P`` (ties by rank)."""
    order = np.argsort(entropy_P, kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return (rank * n_bins) // max(len(order), 1)


def gain_by_entropy(nll_method: np.ndarray, nll_reference: np.ndarray,
                    entropy_P: np.ndarray, *, n_bins: int = 10, top_fraction: float = 0.2,
                    n_boot: int = 1000, seed: int = 0) -> dict:
    """A method's gain over a reference, by entropy decile and in the top fraction.

    Args:
        nll_method: [P] the method's NLL per position.
        nll_reference: [P] the reference's NLL (e.g. the best single member).
        entropy_P: [P] the stratifying entropy (e.g. the members' mean entropy).
        n_bins: strata of equal size by entropy (10 = deciles).
        top_fraction: the high-entropy share asked about (0.2 = top 20%).
        n_boot: bootstrap replicates for the per-stratum CIs (positions i.i.d.
            within a stratum: a stratum's positions are scattered over the text).
        seed: bootstrap seed.

    Returns:
        {"mean_gain": [n_bins], "ci": [n_bins, 2], "entropy_edges": [n_bins + 1],
         "total_gain": sum of gains, "top_fraction": f, "top_share": share of the
         total gain carried by the top-f entropy positions (can exceed 1 or be
         negative when other positions lose), "top_mean_gain", "rest_mean_gain"}.
    """
    g = np.asarray(nll_reference, np.float64) - np.asarray(nll_method, np.float64)
    e = np.asarray(entropy_P, np.float64)
    if not (g.shape == e.shape and g.ndim == 1 and g.size >= 2 * n_bins):
        raise ValueError(f"gain_by_entropy: need equal 1-D arrays with >= {2 * n_bins} "
                         f"positions; got {g.shape} and {e.shape}")
    s = strata(e, n_bins)
    rng = np.random.default_rng(seed)
    means, cis = [], []
    for b in range(n_bins):
        x = g[s == b]
        boot = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(1)
        means.append(float(x.mean()))
        cis.append([float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))])
    if not 0 < top_fraction < 1:
        raise ValueError(f"top_fraction must lie in (0, 1); got {top_fraction}")
    top = np.zeros(e.size, bool)  # the ceil(f P) highest-entropy positions (ties by rank)
    top[np.argsort(e, kind="stable")[e.size - int(np.ceil(top_fraction * e.size)):]] = True
    total = float(g.sum())
    return {"mean_gain": means, "ci": cis,
            "entropy_edges": np.quantile(e, np.linspace(0, 1, n_bins + 1)).tolist(),
            "total_gain": total, "top_fraction": top_fraction,
            "top_share": float(g[top].sum() / total) if total != 0 else float("nan"),
            "top_mean_gain": float(g[top].mean()), "rest_mean_gain": float(g[~top].mean())}


def gated_fusion(nll_full: np.ndarray, nll_primary: np.ndarray, nll_reference: np.ndarray,
                 primary_entropy: np.ndarray, threshold: float, n_members: int) -> dict:
    """Entropy-gated fusion: full fusion where the primary member's entropy > threshold,
    the primary member alone elsewhere (the other members are not run there).

    Args:
        nll_full: [P] full fusion's NLL.
        nll_primary: [P] the primary member's NLL alone.
        nll_reference: [P] the reference of the gains (best single member).
        primary_entropy: [P] the primary member's entropy (known before the others run).
        threshold: fuse where primary_entropy > threshold (choose it on calibration data).
        n_members: n (member calls per position when every member runs).

    Returns:
        {"fused_fraction", "gain_full", "gain_gated" (mean per position),
         "kept" (gain_gated / gain_full), "calls_saved" (fraction of all member calls
         that gating avoids: (1 - fused_fraction) (n - 1) / n)}.
    """
    fuse_here = np.asarray(primary_entropy) > threshold
    nll_gated = np.where(fuse_here, nll_full, nll_primary)
    gain_full = float(np.mean(nll_reference - nll_full))
    gain_gated = float(np.mean(nll_reference - nll_gated))
    frac = float(fuse_here.mean())
    return {"threshold": float(threshold), "fused_fraction": frac, "gain_full": gain_full,
            "gain_gated": gain_gated,
            "kept": gain_gated / gain_full if gain_full != 0 else float("nan"),
            "calls_saved": (1.0 - frac) * (n_members - 1) / n_members}
