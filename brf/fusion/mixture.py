"""Mixture sampling (ME): run one member per step, chosen by weight.

Picking member ``k ~ Categorical(w)`` and then sampling from ``p_k`` draws
exactly from the linear pool ``sum_i w_i p_i`` while running a single member
per step. Applying a sampler (temperature, top-k, top-p, min-p) to each member
*before* mixing is a different distribution, ``sum_i w_i filter(p_i)``, which
is in general not ``filter(sum_i w_i p_i)``: :func:`mixture_logprobs` names the
former, and the ensemble decoder offers both modes under their own names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from brf.fusion.pools import linear_pool
from brf.fusion.sampling import Sampler, filter_logprobs, sample


def select_member(key: jax.Array, weights_Xn: jax.Array) -> jax.Array:
    """Which member to run: k ~ Categorical(weights), shape [...] (int32)."""
    w = jnp.asarray(weights_Xn)
    logw = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf)
    return jax.random.categorical(key, logw, axis=-1).astype(jnp.int32)


def mixture_logprobs(logits_XnV: jax.Array, weights_Xn: jax.Array,
                     sampler: Sampler | None = None) -> jax.Array:
    """log sum_i w_i filter(p_i): what per-member-truncated ME samples from."""
    logp = jax.nn.log_softmax(logits_XnV, axis=-1)
    if sampler is not None:
        logp = filter_logprobs(logp, sampler)
    return linear_pool(logp, weights_Xn)


def mixture_sample(key: jax.Array, logits_XnV: jax.Array, weights_Xn: jax.Array,
                   sampler: Sampler | None = None):
    """One ME draw: pick a member, then sample from its (filtered) distribution.

    Args:
      key: PRNG key.
      logits_XnV: [..., n, V]; only the chosen member's row is read per
        position (in the decoder the others are not even computed).
      weights_Xn: [n] or [..., n] member weights.
      sampler: applied to the chosen member's distribution (None = plain
        temperature-1 sampling, which makes the draw exact for the linear pool).

    Returns:
      (token ids [...], chosen member [...]).
    """
    k_member, k_token = jax.random.split(key)
    shape = logits_XnV.shape[:-2]
    member = select_member(k_member, jnp.broadcast_to(
        weights_Xn, shape + logits_XnV.shape[-2:-1]))
    rows = jnp.take_along_axis(logits_XnV, member[..., None, None], axis=-2)[..., 0, :]
    logp = jax.nn.log_softmax(rows, axis=-1)
    return sample(k_token, logp, sampler or Sampler()), member
