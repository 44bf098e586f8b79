"""Fusion tables: every method applied to the same members, side by side.

What experiments/demo.py prints; :data:`SCHEMA` is its config's (configs/demo.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from brf import schema as S
from brf.errors import UserError
from brf.fusion import born_terms, fuse


def _check_shape(logits_nV, tokens: Sequence[str], names: Sequence[str] | None = None,
                 weights=None) -> None:
    """One label per token and per member, one weight per member: the table's columns
    and rows line up with the logits (issue 54: two labels for six logits printed a
    misaligned table)."""
    rows = [len(r) for r in logits_nV] if not hasattr(logits_nV, "shape") else \
        [logits_nV.shape[-1]] * logits_nV.shape[0]
    if not rows or len(set(rows)) != 1:
        raise UserError(f"logits: every member needs the same number of logits; got rows "
                        f"of {rows}")
    n, v = len(rows), rows[0]
    if len(tokens) != v:
        raise UserError(f"tokens: {len(tokens)} labels for {v} logits per member; give one "
                        f"label per logit")
    if names is not None and len(names) != n:
        raise UserError(f"member_names: {len(names)} names for {n} members")
    if weights is not None and len(weights) != n:
        raise UserError(f"weights: {len(weights)} weights for {n} members")


def _rows_check(rows) -> None:
    from brf.fusion import get_method
    from brf.fusion.methods import resolve_params
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        raise UserError(f"must be a list of dicts (method, label and its parameters); got "
                        f"{rows!r}")
    for i, row in enumerate(rows, 1):
        if not hasattr(row, "items") or "method" not in row:
            raise UserError(f"row {i} must be a dict with a 'method'; got {row!r}")
        row = dict(row)
        label = row.pop("label", row["method"])
        if not isinstance(label, str):
            raise UserError(f"row {i}: label must be a string; got {label!r}")
        try:
            resolve_params(get_method(row.pop("method")), row)
        except ValueError as e:
            raise UserError(f"row {i} ({label}): {e}") from None


def _phase_check(value) -> None:
    from brf.fusion import phase_map
    phase_map(value)


# configs/demo.py, every key (brf.schema).
SCHEMA = {
    "tokens": S.texts(empty=False),
    "member_names": S.texts(empty=False),
    "logits": S.numbers(),
    "weights": S.numbers(0, 1),
    "rows": S.custom(_rows_check),
    "cross_terms_phase": S.text(empty=False, check=_phase_check),
}


def check_config(c) -> None:
    """Every key of a demo config against :data:`SCHEMA`, then the shapes: a label
    per logit, a name and a weight per member.

    Raises:
        UserError: the first key that is wrong, named.
    """
    S.check(c, SCHEMA, error=UserError)
    try:
        _check_shape(c.logits, c.tokens, c.member_names, c.weights)
    except UserError as e:
        raise UserError(f"config.{e}") from None


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
    _check_shape(logits_nV, tokens, member_names, weights)
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
    _check_shape(logits_nV, tokens, weights=weights)
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
