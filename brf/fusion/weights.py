"""Ways to choose member weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def perplexity_weights(nll_per_token_Xn: jax.Array, temperature: float = 1.0):
    """PackLLM-style weights from each member's perplexity on the prompt.

    ``w_i ∝ exp(-log PPL_i / temperature)`` with ``log PPL_i`` the member's mean
    per-token negative log-likelihood of the prompt: lower perplexity, more
    weight; temperature -> 0 picks the best member, -> inf gives uniform.

    Args:
      nll_per_token_Xn: [..., n] mean NLL (nats per token) of each member.
      temperature: > 0.

    Returns:
      weights [..., n] on the simplex.
    """
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    return jax.nn.softmax(-jnp.asarray(nll_per_token_Xn) / temperature, axis=-1)


def softmax_weights(logits_Xn: jax.Array) -> jax.Array:
    """Unconstrained parameters -> simplex weights (what optimisers fit)."""
    return jax.nn.softmax(logits_Xn, axis=-1)
