"""Reductions over the (small, static) member axis, unrolled.

XLA:CPU emits a reduction over a non-minor axis inside an elementwise fusion
as a scalar loop that recomputes its operands (measured: a Born output pass
over [8, 2, 262144] took 79 ms with ``jnp.sum(axis=-2)`` and 6 ms unrolled).
With n_members small and static, brf unrolls those reductions into
elementwise chains over per-member slices, which fuse and vectorise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def unstack(x: jax.Array, axis: int = -2) -> list[jax.Array]:
    """Per-member slices of ``x`` along ``axis`` (default: the member axis)."""
    return [jnp.take(x, i, axis=axis) for i in range(x.shape[axis])]


def msum(xs):
    return functools.reduce(jnp.add, xs)


def mmax(xs):
    return functools.reduce(jnp.maximum, xs)


def mmin(xs):
    return functools.reduce(jnp.minimum, xs)


def mlogsumexp(xs):
    """log sum_i exp(x_i) over a list of arrays; -inf where all are -inf."""
    if len(xs) == 1:
        return xs[0]
    top = mmax(xs)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    total = msum([jnp.exp(x - safe) for x in xs])
    # log(0) = -inf with a gradient that stays finite (no 0 * inf in backprop).
    pos = total > 0
    return jnp.where(pos, safe + jnp.log(jnp.where(pos, total, 1.0)), -jnp.inf)


def chunked_top2_gap(logits: jax.Array, chunk: int = 256):
    """Top-1 logit and top-1 minus top-2 gap along the last axis, in one pass.

    The vocabulary is cut into chunks; one pass takes every chunk's maximum,
    then the second-largest value is the larger of the runner-up chunk maximum
    and the runner-up inside the winning chunk (a gather of ``chunk`` values).
    Ties for the top give a gap of 0; with fewer than two valid (finite)
    tokens the gap is 0. On CPU this is ~40x faster than ``lax.top_k``.

    Args:
      logits: [..., V].
      chunk: chunk length; V not a multiple of it is handled as one chunk.

    Returns:
      (top1 [...], gap [...]).
    """
    v = logits.shape[-1]
    c = chunk if (v % chunk == 0 and v > chunk) else v
    xb = logits.reshape(logits.shape[:-1] + (v // c, c))
    chunk_max = jnp.max(xb, axis=-1)
    top1 = jnp.max(chunk_max, axis=-1)
    k = jnp.argmax(chunk_max, axis=-1)
    others = jnp.where(jnp.arange(v // c) == k[..., None], -jnp.inf, chunk_max)
    runner_up_chunk = jnp.max(others, axis=-1)
    win = jnp.take_along_axis(xb, k[..., None, None], axis=-2)[..., 0, :]
    is_top = win == top1[..., None]
    runner_up_in = jnp.max(jnp.where(is_top, -jnp.inf, win), axis=-1)
    top2 = jnp.where(jnp.sum(is_top, axis=-1) > 1, top1,
                     jnp.maximum(runner_up_chunk, runner_up_in))
    gap = top1 - top2
    return top1, jnp.where(jnp.isfinite(gap), gap, 0.0).astype(logits.dtype)
