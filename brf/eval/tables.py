"""Fusion tables: every method applied to the same members, side by side."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from brf.fusion import born_terms, fuse


def fusion_table(logits_nV, tokens: Sequence[str], rows: Sequence[Mapping[str, Any]],
                 weights=None, member_names: Sequence[str] | None = None) -> str:
    """A plain-text table of member and fused probabilities.

    Args:
      logits_nV: [n, V] member logits over a tiny vocabulary.
      tokens: V token labels.
      rows: fusion specs, each ``{"method": name, "label": str, **params}``.
      weights: member weights (default uniform).
      member_names: labels of the member rows.

    Returns:
      The table; one line per member and per fused row, probabilities in
      percent, and for Born rows the normaliser Z and whether the Z guard
      fell back to the linear pool.
    """
    x = jnp.asarray(logits_nV, jnp.float32)
    n, v = x.shape
    names = member_names or [f"member {i}" for i in range(n)]
    p = np.exp(np.asarray(x - jnp.log(jnp.sum(jnp.exp(x), -1, keepdims=True))))
    width = max(8, max(len(t) for t in tokens) + 1)
    label_w = max(30, *(len(r.get("label", r["method"])) + 1 for r in rows))
    head = " " * label_w + "".join(f"{t:>{width}}" for t in tokens) + "   note"
    lines = [head, "-" * len(head)]
    for name, row in zip(names, p):
        lines.append(f"{name:<{label_w}}" + "".join(f"{100 * q:>{width}.1f}" for q in row))
    lines.append("-" * len(head))
    for spec in rows:
        spec = dict(spec)
        label = spec.pop("label", spec["method"])
        method = spec.pop("method")
        logq, info = fuse(method, x[None], weights, return_info=True, **spec)
        q = np.exp(np.asarray(logq[0]))
        note = ""
        if method == "born":
            note = f"Z={float(info['z'][0]):.3f}"
            if bool(info["fallback"][0]):
                note += " (Z guard: linear pool)"
            below = [t for t, qt, col in zip(tokens, q, p.T) if qt < col.min() - 1e-9]
            if below:
                note += "; below every member: " + ",".join(below)
        lines.append(f"{label:<{label_w}}" + "".join(f"{100 * qt:>{width}.1f}" for qt in q)
                     + f"   {note}")
    return "\n".join(lines)


def cross_terms_table(logits_nV, tokens: Sequence[str], phase: str, weights=None) -> str:
    """Linear part and interference cross-term per token for one Born setting."""
    t = born_terms(jnp.asarray(logits_nV, jnp.float32)[None], weights, phase=phase)
    lin = np.asarray(t.linear[0])
    cross = np.asarray(t.cross[0]).sum(0)
    z = float(t.z[0])
    width = max(8, max(len(s) for s in tokens) + 1)
    lines = [f"{'':<14}" + "".join(f"{s:>{width}}" for s in tokens),
             f"{'linear part':<14}" + "".join(f"{100 * a:>{width}.1f}" for a in lin),
             f"{'cross-term':<14}" + "".join(f"{100 * a:>{width}.1f}" for a in cross),
             f"{'fused':<14}" + "".join(f"{100 * (a + b) / z:>{width}.1f}"
                                        for a, b in zip(lin, cross)),
             f"Z = {z:.4f}; Bhattacharyya overlap = {float(t.bhattacharyya[0, 0]):.4f}"]
    return "\n".join(lines)
