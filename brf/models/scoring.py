"""Teacher-forced scoring of long texts, chunk by chunk, with bounded logits memory.

A text of N tokens is fed in fixed-size chunks through one KV cache, so only
B x chunk x V logits exist at a time (Gemma 3 has V = 262144) and every chunk
has the same shape (one compilation).
"""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from brf.models.cache import init_cache
from brf.models.config import ModelConfig
from brf.models.transformer import prefill_donated


def iter_logits_chunks(params: dict, cfg: ModelConfig, tokens_BxN, valid_BxN=None, *,
                       chunk: int = 256, dtype=jnp.float32,
                       cache_dtype=None, mesh=None) -> Iterator[tuple[int, jax.Array]]:
    """Yields (start, logits_BxCxV) for consecutive chunks of a long batch of texts.

    logits[:, j] are the next-token logits after token start + j, identical to
    the logits of a single full forward pass over the text.

    Args:
        params: params pytree.
        cfg: the architecture.
        tokens_BxN: int token ids (host or device array).
        valid_BxN: optional bool mask of real tokens (padding anywhere).
        chunk: C, tokens per forward pass.
        dtype: compute dtype.
        cache_dtype: KV cache dtype (default: dtype).
        mesh: optional ``jax.sharding.Mesh`` (:mod:`brf.sharding`): the batch
            (tokens, cache) is split over its 'data' axis; B must divide by
            its size. Place params with ``brf.sharding.shard_params`` for the
            'model' axis. None: one device.

    Yields:
        (start, logits) with logits float32 [B, C', V], C' = min(C, N - start).
    """
    tokens_BxN = np.asarray(tokens_BxN)
    B, N = tokens_BxN.shape
    valid_BxN = np.ones((B, N), bool) if valid_BxN is None else np.asarray(valid_BxN, bool)
    n_chunks = -(-N // chunk)
    pad = n_chunks * chunk - N
    tokens_BxN = np.pad(tokens_BxN, ((0, 0), (0, pad)))
    valid_BxN = np.pad(valid_BxN, ((0, 0), (0, pad)))
    cache = init_cache(cfg, B, n_chunks * chunk, cache_dtype or dtype)
    put = jnp.asarray
    if mesh is not None:
        from brf import sharding
        cache = sharding.shard_cache(cache, mesh)
        put = functools.partial(sharding.shard_batch, mesh=mesh)
    for c in range(n_chunks):
        sl = slice(c * chunk, (c + 1) * chunk)
        logits, cache = prefill_donated(params, cfg, put(tokens_BxN[:, sl]),
                                        put(valid_BxN[:, sl]), cache,
                                        dtype=jnp.dtype(dtype), logits="all")
        yield c * chunk, logits[:, :min(chunk, N - c * chunk)]


def score_tokens(params: dict, cfg: ModelConfig, tokens_BxN, valid_BxN=None, *,
                 chunk: int = 256, dtype=jnp.float32, mesh=None) -> np.ndarray:
    """Log-probability of each next token, computed chunk by chunk.

    Args:
        params: params pytree.
        cfg: the architecture.
        tokens_BxN: int token ids.
        valid_BxN: optional bool mask of real tokens (right padding expected:
            the target of position t is token t + 1).
        chunk: tokens per forward pass.
        dtype: compute dtype.
        mesh: optional mesh (see `iter_logits_chunks`); the batch is padded
            with copies of its last row to a multiple of the 'data' size.

    Returns:
        logp_Bx(N-1) float32 numpy: log p(tokens[:, t+1] | tokens[:, :t+1]); NaN
        where token t or t + 1 is padding.
    """
    tokens_BxN = np.asarray(tokens_BxN)
    B, N = tokens_BxN.shape
    valid_BxN = np.ones((B, N), bool) if valid_BxN is None else np.asarray(valid_BxN, bool)
    out = np.full((B, N - 1), np.nan, np.float32)
    run_tokens, run_valid = tokens_BxN, valid_BxN
    if mesh is not None and B % mesh.shape["data"]:
        extra = mesh.shape["data"] - B % mesh.shape["data"]
        run_tokens = np.concatenate([tokens_BxN, np.repeat(tokens_BxN[-1:], extra, 0)])
        run_valid = np.concatenate([valid_BxN, np.repeat(valid_BxN[-1:], extra, 0)])
    for start, logits_BxCxV in iter_logits_chunks(params, cfg, run_tokens, run_valid,
                                                  chunk=chunk, dtype=dtype, mesh=mesh):
        C = logits_BxCxV.shape[1]
        stop = min(start + C, N - 1)
        if stop <= start:
            break
        tgt = run_tokens[:, start + 1:stop + 1]
        logp = _target_logprob(logits_BxCxV[:, :stop - start], jnp.asarray(tgt))
        out[:, start:stop] = np.asarray(logp)[:B]
    ok = valid_BxN[:, :-1] & valid_BxN[:, 1:]
    return np.where(ok, out, np.nan)


@jax.jit
def _target_logprob(logits_BxCxV, tgt_BxC):
    logp = jax.nn.log_softmax(logits_BxCxV, axis=-1)
    return jnp.take_along_axis(logp, tgt_BxC[..., None], axis=-1)[..., 0]
