"""Lazy KV-cache catch-up: a member runs only when it is needed.

Each member keeps its own KV cache and a list of *pending* tokens per
sequence: text the ensemble has emitted that this member has not read yet.
When the member is next needed, it reads all its pending tokens in ONE forward
pass (``brf.models.prefill`` with ``logits='last'``). In mixture sampling the
members not chosen at a step only accumulate pending tokens, which is where
its speedup comes from.

Jit shapes: a catch-up of T tokens is right-padded to a length bucket (the
next power of two), so a whole generation compiles at most log2(max T) + 1
catch-up shapes per member. Padding tokens take cache slots with position -1
(never attended to; see brf/models/cache.py), so the cache needs more slots
than tokens; :func:`catch_up` grows the cache (doubling, so again few shapes)
when a catch-up would not fit.

Everything here is a function of (member, state) returning a new state; the
host-side parts (pending lists, slot counter) are plain Python.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf import sharding
from brf.models import cache as model_cache
from brf.models.transformer import cache_reads, prefill, prefill_donated


def bucket(n: int, smallest: int = 1) -> int:
    """The padded length for n tokens: the next power of two >= max(n, smallest)."""
    n = max(int(n), int(smallest), 1)
    return 1 << (n - 1).bit_length()


class MemberState(NamedTuple):
    """A member's decoding state for a batch of B sequences.

    Attributes:
        cache: its KV cache (brf.models.cache layout), batch B.
        logits_BxV: next-token logits after the last token it has read
            (float32; stale for a sequence with pending tokens).
        pending: per sequence, the token ids it has not read yet.
        end: host copy of ``cache['end']`` (slots used), to avoid a device sync.
        n_read: per sequence, tokens read so far (its next position).
    """

    cache: dict
    logits_BxV: jax.Array
    pending: tuple[tuple[int, ...], ...]
    end: int
    n_read: tuple[int, ...]


def _padded(token_lists: Sequence[Sequence[int]], T: int, pad_id: int):
    B = len(token_lists)
    tokens_BxT = np.full((B, T), pad_id, np.int32)
    valid_BxT = np.zeros((B, T), bool)
    for b, ids in enumerate(token_lists):
        tokens_BxT[b, :len(ids)] = ids
        valid_BxT[b, :len(ids)] = True
    return tokens_BxT, valid_BxT


def _data_mesh(params, batch: int):
    """The mesh whose 'data' axis a decoding batch goes over, or None.

    Weights placed on a mesh with a 'data' axis that ``batch`` divides
    (``brf.sharding``): the batch axis of the cache, tokens and masks goes over
    'data', so each data shard decodes its own sequences. Otherwise None: the
    arrays are left where they are and jit places them with the weights
    (replicated on their mesh).
    """
    mesh = getattr(sharding.leaf_sharding(params), "mesh", None)
    d = sharding.data_size(mesh)
    return mesh if d > 1 and batch % d == 0 else None


def start(member, prompts_ids: Sequence[Sequence[int]], *, slots: int | None = None,
          dtype=jnp.float32, cache_dtype=None, smallest_bucket: int = 8) -> MemberState:
    """Prefills a member on a batch of prompts.

    Args:
        member: a :class:`brf.ensemble.member.Member`.
        prompts_ids: per sequence, the member's prompt token ids (non-empty).
        slots: cache slots to allocate at least (the decoder asks for room
            for the tokens it expects; the cache grows on demand anyway).
            Rounded up to a power of two, so few cache shapes are compiled,
            and capped at the member's context (``cfg.max_seq_len``, or the
            prompts' padded length if longer): it never reads more tokens.
        dtype: compute dtype.
        cache_dtype: KV cache dtype (default: dtype).
        smallest_bucket: the smallest prompt bucket.

    Returns:
        A MemberState with nothing pending and the logits after each prompt.
    """
    T = bucket(max(len(p) for p in prompts_ids), smallest_bucket)
    slots = min(bucket(max(slots or 0, 2 * T)), max(member.cfg.max_seq_len, T))
    mesh = _data_mesh(member.params, len(prompts_ids))
    cache = sharding.shard_cache(
        model_cache.init_cache(member.cfg, len(prompts_ids), slots, cache_dtype or dtype), mesh)
    tokens, valid = _padded(prompts_ids, T, 0)
    logits, cache = prefill_donated(member.params, member.cfg,
                                    sharding.shard_batch(jnp.asarray(tokens), mesh),
                                    sharding.shard_batch(jnp.asarray(valid), mesh), cache,
                                    dtype=jnp.dtype(dtype), logits="last")
    B = len(prompts_ids)
    return MemberState(cache, logits, ((),) * B, T, tuple(len(p) for p in prompts_ids))


def add_pending(state: MemberState, new: Sequence[Sequence[int]]) -> MemberState:
    """Appends tokens to each sequence's pending list (``new[b]`` may be empty)."""
    pending = tuple(tuple(p) + tuple(n) for p, n in zip(state.pending, new))
    return state._replace(pending=pending)


def edit_pending(state: MemberState, edits: Sequence[tuple[int, Sequence[int]]]
                 ) -> MemberState:
    """Per sequence, drops the last ``n_retract`` pending tokens, then appends tokens.

    Args:
        state: a MemberState.
        edits: per sequence ``(n_retract, tokens)`` (a re-encoding step; only
            tokens not yet read can be retracted).
    """
    pending = []
    for p, (n_retract, new) in zip(state.pending, edits):
        if n_retract > len(p):
            raise ValueError(f"cannot retract {n_retract} tokens: only {len(p)} are pending "
                             "(the rest are in the KV cache)")
        pending.append(tuple(p[:len(p) - n_retract]) + tuple(int(t) for t in new))
    return state._replace(pending=tuple(pending))


def catch_up(member, state: MemberState, *, dtype=jnp.float32, donate: bool = True
             ) -> MemberState:
    """Reads every sequence's pending tokens in one forward pass.

    Sequences with nothing pending keep their logits (their row is all padding).

    Args:
        member: the Member the state belongs to.
        state: its MemberState.
        dtype: compute dtype.
        donate: let XLA update the cache in place (the old state's cache is
            invalidated); False keeps it usable (tests compare the two).

    Returns:
        The new MemberState: nothing pending, logits after the last token read.
    """
    lengths = [len(p) for p in state.pending]
    if max(lengths) == 0:
        return state
    T = bucket(max(lengths))
    cache = state.cache
    S = cache["pos"].shape[1]
    if state.end + T > S:
        cache = model_cache.grow(cache, bucket(state.end + T))
    tokens, valid = _padded(state.pending, T, 0)
    mesh = _data_mesh(member.params, len(lengths))
    fn = prefill_donated if donate else prefill
    # Attention reads the slots written so far (and a local layer its window), not
    # the whole allocation.
    reads = cache_reads(member.cfg, state.end, cache["pos"].shape[1],
                        [n for n, k in zip(state.n_read, lengths) if k], T)
    logits_BxV, cache = fn(member.params, member.cfg,
                           sharding.shard_batch(jnp.asarray(tokens), mesh),
                           sharding.shard_batch(jnp.asarray(valid), mesh), cache,
                           dtype=jnp.dtype(dtype), logits="last", reads=reads)
    if min(lengths) == 0:
        read_B = jnp.asarray(np.array(lengths) > 0)
        logits_BxV = jnp.where(read_B[:, None], logits_BxV, state.logits_BxV)
    n_read = tuple(n + k for n, k in zip(state.n_read, lengths))
    return MemberState(cache, logits_BxV, ((),) * len(lengths), state.end + T, n_read)
