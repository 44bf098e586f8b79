"""KV cache: a plain dict pytree with a static number of slots.

    k         L-tuple of [B, K, E, S]: per layer, keys (after RoPE), transposed
              so that scores are a plain matmul q @ k
    v         L-tuple of [B, K, S, E]: per layer, values
              (cache dtype; one buffer per layer, updated in place)
    pos       [B, S] int32      position of the token in each slot; -1 = empty/padding
    end       [] int32          next slot to write (shared by the batch)
    next_pos  [B] int32         position the next valid token of each sequence gets

Slots are written in order for the whole batch; padding tokens take a slot with
pos -1 and are never attended to, so left- and right-padded batches work and
the mask is computed from positions, not slot indices.
"""

from __future__ import annotations

import jax.numpy as jnp

from brf.models.config import ModelConfig


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty KV cache.

    Args:
        cfg: the architecture.
        batch: B.
        max_len: S, the number of slots (prompt + generated tokens, padding included).
        dtype: storage dtype of k and v.

    Returns:
        The cache dict described in the module docstring.
    """
    v_shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    k_shape = (batch, cfg.n_kv_heads, cfg.head_dim, max_len)
    return dict(
        k=tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.n_layers)),
        v=tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.n_layers)),
        pos=jnp.full((batch, max_len), -1, jnp.int32),
        end=jnp.zeros((), jnp.int32),
        next_pos=jnp.zeros((batch,), jnp.int32),
    )


def grow(cache: dict, slots: int) -> dict:
    """The same cache with ``slots`` slots (>= current); new slots are empty (pos -1)."""
    extra = slots - cache["pos"].shape[1]
    if extra <= 0:
        return cache
    pad_k, pad_v = [(0, 0), (0, 0), (0, 0), (0, extra)], [(0, 0), (0, 0), (0, extra), (0, 0)]
    return dict(k=tuple(jnp.pad(c, pad_k) for c in cache["k"]),
                v=tuple(jnp.pad(c, pad_v) for c in cache["v"]),
                pos=jnp.pad(cache["pos"], [(0, 0), (0, extra)], constant_values=-1),
                end=cache["end"], next_pos=cache["next_pos"])


def room(cache: dict) -> int:
    """Free slots left (forces a host sync; call it outside jit, e.g. before a step)."""
    return int(cache["pos"].shape[1] - cache["end"])


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> int:
    """Bytes taken by k and v of `init_cache(cfg, batch, max_len, dtype)`."""
    n = 2 * cfg.n_layers * batch * max_len * cfg.n_kv_heads * cfg.head_dim
    return n * jnp.dtype(dtype).itemsize
