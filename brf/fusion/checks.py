"""Input checks shared by every fusion entry point.

Checks run *before* any computation and raise :class:`FusionInputError` with a
message that names the offending argument. Shape checks always run; checks that
need values (NaN, weights on the simplex) run only on concrete arrays, i.e.
outside ``jax.jit`` — inside a trace the caller is responsible for its inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from brf.errors import UserError

WEIGHT_SUM_ATOL = 1e-5


class FusionInputError(UserError):
    """Bad input to a fusion kernel: shapes, values or parameters."""


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_logits(logits) -> None:
    """Checks member logits of shape [..., n_members, V]."""
    shape = np.shape(logits)
    if len(shape) < 2:
        raise FusionInputError(
            f"logits must have shape [..., n_members, V]; got shape {shape}")
    if shape[-2] < 1 or shape[-1] < 1:
        raise FusionInputError(
            f"logits need at least one member and one token; got shape {shape}")
    if not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
        raise FusionInputError(
            f"logits must be floating point; got dtype {jnp.result_type(logits)}")
    if not is_concrete(logits):
        return
    x = np.asarray(logits)
    if np.isnan(x).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(x))[0])
        raise FusionInputError(f"logits contain NaN (first at index {idx})")
    if np.isposinf(x).any():
        idx = tuple(int(i) for i in np.argwhere(np.isposinf(x))[0])
        raise FusionInputError(f"logits contain +inf (first at index {idx})")
    empty = np.isneginf(x).all(axis=-1)
    if empty.any():
        idx = tuple(int(i) for i in np.argwhere(empty)[0])
        raise FusionInputError(
            f"a member has no valid token (all logits -inf) at [..., member] "
            f"index {idx}")


def check_where(where, logits_shape) -> None:
    if where is None:
        return
    wshape = np.shape(where)
    try:
        np.broadcast_shapes(wshape, logits_shape)
    except ValueError:
        raise FusionInputError(
            f"`where` of shape {wshape} does not broadcast to logits of shape "
            f"{logits_shape}") from None
    if np.broadcast_shapes(wshape, logits_shape) != tuple(logits_shape):
        raise FusionInputError(
            f"`where` of shape {wshape} would enlarge logits of shape "
            f"{logits_shape}")
    if jnp.result_type(where) != jnp.bool_:
        raise FusionInputError(
            f"`where` must be boolean (True = token allowed); got "
            f"{jnp.result_type(where)}")


def check_weights(weights, logits_shape) -> None:
    """Checks member weights: shape [n] or [..., n], finite, >= 0, sum to 1."""
    n = logits_shape[-2]
    wshape = np.shape(weights)
    if len(wshape) < 1 or wshape[-1] != n:
        raise FusionInputError(
            f"weights must have shape [..., n_members] with n_members={n} (the "
            f"logits have shape {tuple(logits_shape)}); got shape {wshape}")
    try:
        out = np.broadcast_shapes(wshape, tuple(logits_shape[:-1]))
    except ValueError:
        out = None
    if out != tuple(logits_shape[:-1]):
        raise FusionInputError(
            f"weights of shape {wshape} do not broadcast to the logits' leading "
            f"shape {tuple(logits_shape[:-1])}")
    if not is_concrete(weights):
        return
    w = np.asarray(weights, dtype=np.float64)
    if not np.isfinite(w).all():
        raise FusionInputError(f"weights must be finite; got {w}")
    if (w < 0).any():
        raise FusionInputError(f"weights must be >= 0; got {w}")
    total = w.sum(axis=-1)
    if np.abs(total - 1.0).max() > WEIGHT_SUM_ATOL:
        raise FusionInputError(
            f"weights must sum to 1 (within {WEIGHT_SUM_ATOL}); they sum to "
            f"{np.unique(np.round(total, 8))}. brf does not renormalise silently: "
            f"pass w / w.sum(-1, keepdims=True) if that is what you mean")


def check_inputs(logits, weights=None, where=None) -> None:
    """All checks of a fusion call, in order, before any computation."""
    check_logits(logits)
    shape = tuple(np.shape(logits))
    check_where(where, shape)
    if weights is not None:
        check_weights(weights, shape)
    if where is not None and is_concrete(where) and is_concrete(logits):
        allowed = np.asarray(where) & ~np.isneginf(np.asarray(logits))
        empty = ~np.broadcast_to(allowed, shape).any(axis=-1)
        if empty.any():
            idx = tuple(int(i) for i in np.argwhere(empty)[0])
            raise FusionInputError(
                f"`where` leaves a member with no valid token at [..., member] "
                f"index {idx}")


def uniform_weights(logits_shape, dtype):
    n = logits_shape[-2]
    return jnp.full((n,), 1.0 / n, dtype=dtype)
