"""How far one byte-level setting's next-byte distributions lie from another's.

A byte-level view with pruning (or merging) is an approximation of the member's
own distribution over bytes. `compare` measures it against a finer setting
(`brf.bytes.REFERENCE`) on the same bytes: the difference in bits per byte of the
text, and each byte's total variation between the two next-byte distributions
(257 events), summarised by its mean, 99th percentile and maximum.

What is and is not bounded: without merging, every kept hypothesis is a real
covering tokenization with its exact probability, so the kept mass is a lower
bound of the exact prefix probability, and a text's reported NLL lies at most
``lost`` (the pruned log-mass, `brf.bytes.lm.score_text`) below the exact NLL.
Nothing bounds it from above, nor bounds a single byte's distribution: a dropped
hypothesis may later have carried much of the mass. Those are what this module
measures, against a reference that is itself pruned (far less), so a figure here
is a distance from the reference, not from the exact distributions.
"""

from __future__ import annotations

import math

import numpy as np


def total_variation(logp_a: np.ndarray, logp_b: np.ndarray) -> np.ndarray:
    """[N] total variation between the rows of two [N, E] log-prob arrays (float64)."""
    a = np.exp(np.asarray(logp_a, np.float64))
    b = np.exp(np.asarray(logp_b, np.float64))
    return 0.5 * np.abs(a - b).sum(axis=-1)


def compare(logp: np.ndarray, ref_logp: np.ndarray, gold: np.ndarray) -> dict:
    """One setting's byte distributions against a reference's on the same bytes.

    Args:
        logp: [N, 257] log-probs of the setting measured.
        ref_logp: [N, 257] log-probs of the reference.
        gold: [N] the bytes that followed (event ids).

    Returns:
        ``bytes``; ``bpb`` and ``ref_bpb`` (bits per byte of the gold bytes) and
        ``dbpb`` (their difference, setting minus reference); ``tv_mean``,
        ``tv_p99``, ``tv_max`` (per-byte total variation); ``over_1e3`` and
        ``over_5e2`` (bytes whose total variation exceeds 1e-3 and 5%).
    """
    logp, ref_logp = np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64)
    if logp.shape != ref_logp.shape or logp.shape[0] != len(gold):
        raise ValueError(f"shapes differ: {logp.shape}, {ref_logp.shape}, {len(gold)} bytes")
    n = len(gold)
    if n == 0:
        raise ValueError("no bytes to compare")
    idx = np.arange(n), np.asarray(gold, np.int64)
    bpb = -float(logp[idx].sum()) / n / math.log(2)
    ref_bpb = -float(ref_logp[idx].sum()) / n / math.log(2)
    tv = total_variation(logp, ref_logp)
    return {"bytes": int(n), "bpb": bpb, "ref_bpb": ref_bpb, "dbpb": bpb - ref_bpb,
            "tv_mean": float(tv.mean()), "tv_p99": float(np.quantile(tv, 0.99)),
            "tv_max": float(tv.max()), "over_1e3": int((tv > 1e-3).sum()),
            "over_5e2": int((tv > 0.05).sum())}


__all__ = ["compare", "total_variation"]
