"""Input checks shared by every fusion entry point.

Checks run *before* any computation and raise :class:`FusionInputError` with a
message that names the offending argument. Shape checks always run; checks that
need values (NaN, weights on the simplex) run only on concrete arrays, i.e.
outside ``jax.jit``. Inside a trace nothing can raise on a value: a checked
call there (`brf.fuse`, a `Fuser` with ``validate=True``) returns NaN in every
entry of a row whose values break the checks (:func:`bad_rows`), so that a bad
row can never pass for a distribution.
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
    check_logits_shape(logits)
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


def check_logits_shape(logits) -> None:
    """The checks of :func:`check_logits` that read no values (shape and dtype)."""
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
    check_weights_shape(weights, logits_shape)
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


def check_weights_shape(weights, logits_shape) -> None:
    """The checks of :func:`check_weights` that read no values."""
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


def check_shapes(logits, weights=None, where=None) -> None:
    """The checks of :func:`check_inputs` that read no values: shapes and dtypes only.

    They cost no transfer and no device work, so a compiled fuser runs them on
    every call; the value checks run on the device (:func:`value_status`).
    """
    check_logits_shape(logits)
    shape = tuple(np.shape(logits))
    check_where(where, shape)
    if weights is not None:
        check_weights_shape(weights, shape)


# Bits of :func:`value_status`: what the value checks of `check_inputs` found.
NAN, POSINF, EMPTY_MEMBER, EMPTY_WHERE, BAD_WEIGHTS = (1 << k for k in range(5))


def value_status(logits, weights=None, where=None):
    """The value checks of :func:`check_inputs` as one int32 on the device (jit-able).

    0 when the inputs pass; otherwise an OR of the bits above. Each member's
    row maximum answers three checks at once (NaN propagates through the max,
    +inf is the max, a row of -inf has max -inf), so the checks cost one
    reduction over the logits -- the one the kernels' own softmax takes, which
    XLA can share -- and no transfer to the host. Callers read the status (a
    4-byte copy) and, when it is not 0, rerun :func:`check_inputs` on the host
    for the message naming the first bad index.
    """
    top = jnp.max(logits, axis=-1)
    status = (jnp.where(jnp.any(jnp.isnan(top)), NAN, 0)
              | jnp.where(jnp.any(top == jnp.inf), POSINF, 0)
              | jnp.where(jnp.any(top == -jnp.inf), EMPTY_MEMBER, 0))
    if where is not None:
        kept = jnp.max(jnp.where(where, logits, -jnp.inf), axis=-1)
        status = status | jnp.where(jnp.any(kept == -jnp.inf), EMPTY_WHERE, 0)
    if weights is not None:
        w = jnp.asarray(weights, jnp.float32)
        bad = (~jnp.all(jnp.isfinite(w)) | jnp.any(w < 0)
               | jnp.any(jnp.abs(jnp.sum(w, axis=-1) - 1.0) > WEIGHT_SUM_ATOL))
        status = status | jnp.where(bad, BAD_WEIGHTS, 0)
    return jnp.asarray(status, jnp.int32)


def bad_rows(logits, weights=None, where=None):
    """The value checks of :func:`check_inputs` per fused row, bool [...] (jit-able):
    True where a row's logits hold NaN or +inf, a member has no valid token, or its
    weights are off the simplex. What a traced call (inside the caller's ``jax.jit``,
    where no check can raise) marks as NaN in its output."""
    top = jnp.max(logits, axis=-1)  # [..., n]: NaN propagates, +inf is the max
    bad = jnp.any(jnp.isnan(top) | (top == jnp.inf) | (top == -jnp.inf), axis=-1)
    if where is not None:
        kept = jnp.max(jnp.where(where, logits, -jnp.inf), axis=-1)
        bad = bad | jnp.any(kept == -jnp.inf, axis=-1)
    if weights is not None:
        w = jnp.asarray(weights, jnp.float32)
        off = (jnp.any(~jnp.isfinite(w) | (w < 0), axis=-1)
               | (jnp.abs(jnp.sum(w, axis=-1) - 1.0) > WEIGHT_SUM_ATOL))
        bad = bad | jnp.broadcast_to(off, bad.shape)
    return bad


def uniform_weights(n: int, dtype):
    """Uniform weights for n members, [n]."""
    return jnp.full((n,), 1.0 / n, dtype=dtype)
