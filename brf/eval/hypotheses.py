"""The paper's falsifiable tests on an event table (docs/design.md §4).

* **Phase Coherence Test** — for each member pair and phase map, the phase
  differences over all positions: Rayleigh z = n R̄² with Zar's small-sample
  p-value, and a permutation null (positions of one member shuffled), which
  matters because a map onto half the circle rejects uniformity trivially.
  Per-position maps read each member's top-1 minus top-2 gap; per-token maps
  are evaluated at the gold token, at the positions where the gold is an
  event of its own (not one of the strings OTHER stands for).
* **Cross-Term Discrimination Test** — with a fitted BRF setting, the
  interference term ``cross(t) = 2 sum_{i<j} sqrt(w_i w_j p_i p_j)
  cos(phi_i - phi_j)`` of the gold event against that of every competitor
  event (at the positions where the gold is an event of its own): AUROC with
  a bootstrap CI, for the raw term and for the relative
  term ``cross / linear`` (the fraction by which interference moves an event
  away from the linear pool), next to the same AUROC with equal phases (a
  control: with equal phases the cross-term is pure member agreement
  sqrt(p_i p_j), so only the difference is due to the phase map).
* **NLL comparison** — paired (block) bootstrap CI of the per-position test
  NLL difference between the best BRF setting and the best tuned baseline.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from brf.eval import stats
from brf.event_table import EventTable
from brf.eval.fitting import Fitted, split_phase
from brf.fusion import born_terms, phase_map
from brf.fusion.phase import PhaseMap


def member_phases(table: EventTable, pm: PhaseMap) -> np.ndarray:
    """[P, n] phases: from the gap (per-position) or at the gold event (per-token)."""
    if pm.kind == "token":
        logp = np.asarray(table.logp, np.float64)
        top = logp.max(-1)
        gold_lp = np.take_along_axis(logp, table.gold[:, None, None].repeat(
            logp.shape[1], 1), -1)[..., 0]
        d = np.where(np.isfinite(gold_lp), top - gold_lp, 0.0)
        return np.asarray(pm(jnp.asarray(d, jnp.float32), member_axis=-1), np.float64)
    return np.asarray(pm(jnp.asarray(table.gap, jnp.float32), member_axis=-1), np.float64)


def phase_coherence(table: EventTable, phase_specs: Mapping[str, Any], *,
                    n_perm: int = 2000, seed: int = 0) -> list[dict]:
    """Rayleigh and permutation tests of phase differences per pair and map.

    Args:
      table: positions (all of them: the test uses no fitted quantity but the
        phase map).
      phase_specs: label -> phase map spec (string/dict/PhaseMap).
      n_perm: permutations of the null.
      seed: of the permutation generator.

    Returns:
      One dict per (map, pair) with n, mean resultant length, mean direction,
      Rayleigh z and p, permutation p, and the phase differences themselves
      (key "diffs", for plots and paired comparisons) with the table rows they
      were taken at (key "positions": every row, or for a per-token map the rows
      whose gold is listed).
    """
    n = table.logp.shape[1]
    out = []
    for label, spec in phase_specs.items():
        pm = phase_map(spec)
        rows = (np.flatnonzero(table.gold_listed) if pm.kind == "token"
                else np.arange(table.n_positions))
        phi = member_phases(table.take(rows), pm)
        for i, j in itertools.combinations(range(n), 2):
            diff = np.mod(phi[:, i] - phi[:, j] + np.pi, 2 * np.pi) - np.pi
            ray = stats.rayleigh_test(diff)
            perm = stats.permutation_rayleigh(phi[:, i], phi[:, j], n_perm,
                                              np.random.default_rng(seed))
            out.append({
                "phase_map": label, "spec": pm.spec(), "pair": [i, j],
                "n": int(ray.n), "mean_resultant_length": float(ray.mean_resultant_length),
                "mean_direction": float(ray.mean_direction), "rayleigh_z": float(ray.z),
                "rayleigh_p": float(ray.p_value), "permutation_p": float(perm.p_value),
                "null_mean_resultant_length": float(np.mean(perm.null_mean_resultant_length)),
                "diffs": diff, "positions": rows,
            })
    return out


def coherence_summary(rows: list[dict]) -> list[dict]:
    """The coherence rows without their per-position arrays ("diffs", "positions"):
    what the reports keep."""
    return [{k: v for k, v in r.items() if k not in ("diffs", "positions")} for r in rows]


def cross_term_scores(table: EventTable, fitted: Fitted) -> dict[str, np.ndarray]:
    """Interference per event for gold and competitor events.

    Returns:
      {"gold_cross", "comp_cross", "gold_rel", "comp_rel"}: the raw cross-term
      and cross/linear of the gold event (one per position) and of every
      competitor event the members give mass to.
    """
    pm = phase_map(fitted.params["phase"], **split_phase(fitted.params)[1])
    terms = born_terms(jnp.asarray(table.logp), jnp.asarray(fitted.weights, jnp.float32),
                       phase=pm)
    cross = np.asarray(terms.cross, np.float64).sum(-2)
    lin = np.asarray(terms.linear, np.float64)
    rel = np.where(lin > 0, cross / np.where(lin > 0, lin, 1.0), 0.0)
    p_idx = np.arange(table.n_positions)
    is_gold = np.zeros(cross.shape, bool)
    is_gold[p_idx, table.gold] = True
    live = lin > 0
    return {"gold_cross": cross[p_idx, table.gold], "gold_rel": rel[p_idx, table.gold],
            "comp_cross": cross[live & ~is_gold], "comp_rel": rel[live & ~is_gold]}


# The cross-term test's AUROCs, each with its own random stream (its index here).
CROSS_TERM_KEYS = ("cross", "rel", "rel_equal_phases")


def cross_term_test(table: EventTable, fitted: Fitted, *, n_boot: int = 1000,
                    seed: int = 0, max_competitors: int = 200_000,
                    keys: tuple[str, ...] = CROSS_TERM_KEYS) -> dict:
    """AUROC (gold vs competitors) of the interference term, with bootstrap CIs,
    over the positions whose gold is an event of its own.

    ``keys`` chooses which of :data:`CROSS_TERM_KEYS` to compute (the raw cross-term,
    cross/linear, and cross/linear with equal phases, the control). Each draws from
    its own stream, ``default_rng((seed, index))``, so a key's interval does not
    depend on which others were computed: a tied row tested on ``rel`` alone gets the
    interval it would get as the chosen row."""
    bad = [k for k in keys if k not in CROSS_TERM_KEYS]
    if bad:
        raise ValueError(f"unknown cross-term key {bad[0]!r}; use {CROSS_TERM_KEYS}")
    table = table.take(table.gold_listed)
    s = cross_term_scores(table, fitted)
    # Control: the same weights with equal phases. Its cross-term is the pure
    # agreement term sqrt(p_i p_j); what the phase map adds is the difference.
    control = (cross_term_scores(table, Fitted("equal phases", "born", {"phase": "constant"},
                                               fitted.weights, 0.0))
               if "rel_equal_phases" in keys else None)
    out = {"setting": fitted.label}
    for i, (key, src, k) in enumerate((("cross", s, "cross"), ("rel", s, "rel"),
                                       ("rel_equal_phases", control, "rel"))):
        if key not in keys:
            continue
        rng = np.random.default_rng((seed, i))
        comp = src[f"comp_{k}"]
        if comp.size > max_competitors:  # subsample competitors for the bootstrap
            comp = rng.choice(comp, max_competitors, replace=False)
        ci = stats.auroc_bootstrap_ci(src[f"gold_{k}"], comp, n_boot=n_boot, rng=rng)
        out[key] = {"auroc": float(ci.estimate), "ci": [float(ci.ci_low), float(ci.ci_high)],
                    "p_value": float(ci.p_value), "n_gold": int(src[f"gold_{k}"].size),
                    "n_competitors": int(src[f"comp_{k}"].size)}
    out["scores"] = s
    return out


def nll_difference(nll_a: np.ndarray, nll_b: np.ndarray, *, n_boot: int = 2000,
                   block: int = 32, seed: int = 0) -> dict:
    """Paired circular-block bootstrap of mean(nll_a - nll_b) per position."""
    ci = stats.paired_bootstrap_ci(nll_a, nll_b, n_boot=n_boot,
                                   rng=np.random.default_rng(seed),
                                   block_size=min(block, max(1, len(nll_a) // 4)))
    return {"mean_difference": float(ci.estimate), "ci": [float(ci.ci_low), float(ci.ci_high)],
            "p_value": float(ci.p_value), "block": block, "n": int(len(nll_a))}


def mean_ci(x: np.ndarray, *, n_boot: int = 2000, block: int = 32, seed: int = 0):
    """Block-bootstrap CI of a per-position mean."""
    d = nll_difference(x, np.zeros_like(x), n_boot=n_boot, block=block, seed=seed)
    return d["mean_difference"], d["ci"]
