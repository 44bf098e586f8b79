"""Decoding as one compiled step, and blocks of steps looped on the device.

The decoding loop of :mod:`brf.ensemble.decode` in the shape serving codebases
give it: a :class:`RoundState` pytree (a :class:`DecodeState`: every member's
KV cache and last logits, the step counter, the base random key, per sequence
its finished flag and event count; and each sequence's last event, not read
yet) and one pure function, :func:`spec_round`, that maps ``(params, tables,
state)`` to ``(state, events)``. With ``k = 0`` it is plain fused decoding's
step, in any event space:

1. every member reads the pending event's tokens into its cache (one token in
   a shared vocabulary; in aligned spaces the event's canonical tokens from
   :func:`brf.ensemble.aligned.event_tokens`, in chunks of a few tokens when an
   event is longer than one);
2. the step's keys: ``fold_in(PRNGKey(seed), step)`` split into a member key
   and a token key, as the host loop draws them;
3. every member's logits aligned onto the event space (identity: log-softmax;
   'union' / 'topk_union': ``brf.align``'s maps, their index tables passed as
   device arrays);
4. the fusion method (``brf.fusion.Fuser.fn``), and the sampler's draw,
   restricted to the events every member can read;
5. the finish rules the host applies (an end-of-sequence event, the
   ``max_new_tokens``-th event, a member's context full); the event drawn is
   the new pending one.

With ``k > 0`` (a shared vocabulary) it is a speculative round: the drafter's
k events are read with the pending one in one pass and verified (greedy or
sampled, the n-gram drafter or a member drafter, :func:`ngram_drafts`,
:func:`member_drafts`, :func:`accept_sampled`), the caches cut back to the
accepted text.

:func:`run_rounds` runs up to ``rounds`` of them in one ``lax.while_loop`` with
the state donated (the caches are updated in place) and stops early once every
sequence has finished or a cache's read span is full; the host reads back only
the block's events and each cache's fill. What needs the host stays there,
between blocks: text and stop strings, the members' re-encoding of the text
(checked against the tokens the device reads), growing a cache. Nothing in a
step reads a value back to Python. Mixture sampling in a shared vocabulary
has its own step (:func:`run_block` loops it): a member is picked per
sequence, and the others only queue the event.

Which cache slots the attention reads is fixed per block (``Reads``): the
slots written by the block's end, and for sliding-window layers their window.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from brf.align import topk_union_logprobs, union_logprobs
from brf.fusion.api import _apply
from brf.fusion.mixture import select_member
from brf.fusion.sampling import Sampler, filter_logprobs
from brf.fusion.sampling import sample as _sample
from brf.ensemble.catchup import bucket
from brf.models import cache as model_cache
from brf.models import transformer as T

# Tokens a member reads per forward pass when an event is longer than one token.
CHUNK = 4


class DecodeState(NamedTuple):
    """Everything a decoding step reads and writes (a pytree).

    Attributes:
        caches: per member its KV cache (``brf.models.cache``), batch B.
        logits: per member [B, V_i] float32: its next-token logits after what it read.
        step: int32 []: steps taken (the random key of step t is fold_in(key, t)).
        finished: bool [B]: the sequence has ended (it draws and reads nothing more).
        n_events: int32 [B]: events generated per sequence.
        key: the base PRNG key (``PRNGKey(seed)``).
        pending: mixture modes: per member [B, P] int32, the events it has not
            read yet (lazy catch-up); () in mode 'fuse'.
        n_pending: mixture modes: per member [B] int32, how many; () in mode 'fuse'.
    """
    caches: tuple
    logits: tuple
    step: jax.Array
    finished: jax.Array
    n_events: jax.Array
    key: jax.Array
    pending: tuple = ()
    n_pending: tuple = ()


class Tables(NamedTuple):
    """The device arrays a step reads; traced arguments, nothing baked into the program.

    Attributes:
        weights: [n] member weights.
        fusion: the fusion method's traced parameters (``Fuser``'s dynamic part).
        eos: bool [E]: events that end a sequence (identity: the members' EOS ids).
        mask: bool [E] or None: events every member can read (sampling is limited to them).
        index: union spaces: per member int32 [V_i] token -> event; else None.
        anchor: topk_union: int32 [n, U] backoff anchors; else None.
        tokens: union spaces: per member (starts [U], lengths [U], flat) of
            :class:`brf.ensemble.aligned.EventTokens`; else None.
    """
    weights: jax.Array
    fusion: Any
    eos: jax.Array
    mask: Any = None
    index: Any = None
    anchor: Any = None
    tokens: Any = None


class Spec(NamedTuple):
    """The static description of a step (hashable: part of the compiled program's key).

    Attributes:
        cfgs: per member its ModelConfig.
        space: 'identity' | 'union' | 'topk_union'.
        sizes: per member the tokens its logits are cut to before aligning
            (the tokenizer's size; a model's head may be padded beyond it).
        num_events: U (union spaces) or V.
        k: topk_union's k (0 otherwise).
        method: the fusion method's registered name.
        static: its static parameters (``Fuser``'s static part).
        sampler: the sampler.
        max_new_tokens: events per sequence at most.
        dtype: the members' compute dtype (a name).
        longest: per member the most tokens one event can take (1 in a shared
            vocabulary).
        mode: 'fuse', or a mixture mode in a shared vocabulary: 'mixture_exact'
            (each sequence's event drawn from the member it picked, plain
            sampling) or 'mixture_per_member' (the sampler applied to the picked
            member's distribution); see :mod:`brf.ensemble.decode`.
        shared: mixture modes: one pick per step for the whole batch.
    """
    cfgs: tuple
    space: str
    sizes: tuple
    num_events: int
    k: int
    method: str
    static: tuple
    sampler: Sampler
    max_new_tokens: int
    dtype: str
    longest: tuple
    mode: str = "fuse"
    shared: bool = False

    def slots_per_step(self, i: int) -> int:
        """The cache slots member i's read of one event takes at most (mode 'fuse')."""
        n = self.longest[i]
        return 1 if n <= 1 else _chunked(n)


def _chunked(n):
    """Slots a read of n tokens takes: one, or chunks of CHUNK."""
    return jnp.where(n <= 1, n, CHUNK * ((n + CHUNK - 1) // CHUNK)) if isinstance(
        n, jax.Array) else (n if n <= 1 else CHUNK * -(-n // CHUNK))


def _aligned(spec: Spec, tables: Tables, logits: tuple):
    """Members' log-probs over the events [B, n, E], and the columns' event ids (or None)."""
    if spec.space == "identity":
        return jnp.stack([jax.nn.log_softmax(l, axis=-1) for l in logits], axis=1), None
    cut = tuple(l[:, :v] for l, v in zip(logits, spec.sizes))
    full = union_logprobs(cut, tables.index, num_events=spec.num_events)
    if spec.space == "union":
        return full, None
    logp, events, _ = topk_union_logprobs(full, tables.anchor, k=spec.k)
    return logp, events


def _draw(key, logq_BxE, mask_BxE, sampler: Sampler):
    """The sampler's draw from logq restricted to mask (renormalised), as the host loop draws."""
    if mask_BxE is not None:
        logq_BxE = jax.nn.log_softmax(jnp.where(mask_BxE, logq_BxE, -jnp.inf), axis=-1)
    return _sample(key, logq_BxE, sampler)


def _read(cfg, params, cache, tokens_BxT, valid_BxT, dtype, reads):
    """One forward pass of a member over new tokens: (last valid logits [B, V], cache)."""
    out, new_L, write_at, meta = T._compute(params, cfg, tokens_BxT, valid_BxT, cache,
                                            jnp.dtype(dtype), "last", reads)
    return out, T.ordered_write(cache, out, new_L, write_at, meta)


def _read_tokens(cfg, dtype, params, cache, logits_BxV, token_at, n_B, longest: int, reads):
    """A member reads ``n_B[b]`` tokens per sequence (``token_at(j_BxW) -> ids``), one
    forward pass when no sequence has more than one, else chunks of CHUNK; a
    sequence with nothing to read keeps its logits."""
    def chunk(j, width, carry):
        cache, logits_BxV = carry
        at_BxW = j * width + jnp.arange(width)[None, :]
        valid_BxW = at_BxW < n_B[:, None]
        ids_BxW = jnp.where(valid_BxW, token_at(at_BxW), 0)
        out, cache = _read(cfg, params, cache, ids_BxW, valid_BxW, dtype, reads)
        return cache, jnp.where(valid_BxW.any(1)[:, None], out, logits_BxV)

    if longest <= 1:
        return chunk(0, 1, (cache, logits_BxV))

    def one(carry):
        return chunk(0, 1, carry)

    def several(carry):
        rounds = (jnp.max(n_B) + CHUNK - 1) // CHUNK
        return jax.lax.fori_loop(0, rounds, lambda j, c: chunk(j, CHUNK, c), carry)

    return jax.lax.cond(jnp.max(n_B) <= 1, one, several, (cache, logits_BxV))


def _read_event(spec: Spec, i: int, params, cache, logits_BxV, event_B, reading_B, tables,
                reads):
    """Member i reads the tokens of each reading sequence's event; the others keep their logits."""
    cfg, dtype = spec.cfgs[i], spec.dtype
    if spec.space == "identity":
        out, cache = _read(cfg, params, cache, event_B[:, None], reading_B[:, None], dtype,
                           reads)
        return jnp.where(reading_B[:, None], out, logits_BxV), cache
    starts, lengths, flat = tables.tokens[i]
    n_B = jnp.where(reading_B, jnp.maximum(lengths[event_B], 0), 0)
    first_B = starts[event_B]
    cache, logits_BxV = _read_tokens(
        cfg, dtype, params, cache, logits_BxV,
        lambda at_BxW: flat[jnp.clip(first_B[:, None] + at_BxW, 0, flat.shape[0] - 1)],
        n_B, spec.longest[i], reads)
    return logits_BxV, cache


def _mixture_step(spec: Spec, params, tables: Tables, state: DecodeState, reads):
    """One step of mixture sampling in a shared vocabulary, as the host loop takes it.

    Each sequence picks a member (``select_member`` with the step's member key;
    one pick for the batch when ``spec.shared``); every member some live sequence
    picked first reads all its pending events (lazy catch-up, every sequence at
    once); the event is drawn from each sequence's member (mixture_exact: a
    token of that member at temperature 1, with key ``fold_in(token key, i)``;
    mixture_per_member: the sampler on its distribution); then every member
    appends the event to its pending list.
    """
    n, B = len(spec.cfgs), state.finished.shape[0]
    k_member, k_token = jax.random.split(jax.random.fold_in(state.key, state.step))
    if spec.shared:
        member_B = jnp.broadcast_to(select_member(k_member, tables.weights), (B,))
    else:
        member_B = select_member(k_member, jnp.broadcast_to(tables.weights, (B, n)))
    live_B = ~state.finished
    caches, logits, ran = list(state.caches), list(state.logits), []
    pending, n_pending = list(state.pending), list(state.n_pending)
    for i in range(n):
        need = jnp.any(live_B & (member_B == i))
        ran.append(need)

        def catch_up(carry, i=i):
            cache, logits_BxV, n_B = carry
            cache, logits_BxV = _read_tokens(
                spec.cfgs[i], spec.dtype, params[i], cache, logits_BxV,
                lambda at_BxW: jnp.take_along_axis(
                    pending[i], jnp.minimum(at_BxW, pending[i].shape[1] - 1), axis=1),
                n_B, 2, reads[i])
            return cache, logits_BxV, jnp.zeros_like(n_B)

        caches[i], logits[i], n_pending[i] = jax.lax.cond(
            need, catch_up, lambda c: c, (caches[i], logits[i], n_pending[i]))
    if spec.mode == "mixture_exact":
        event_B = jnp.zeros((B,), jnp.int32)
        for i in range(n):
            tok_B = _draw(jax.random.fold_in(k_token, i), logits[i], None, Sampler())
            event_B = jnp.where(member_B == i, tok_B, event_B)
    else:
        logp_nxBxV = jnp.stack([jax.nn.log_softmax(l, axis=-1) for l in logits])
        rows_BxV = jnp.take_along_axis(logp_nxBxV, member_B[None, :, None], axis=0)[0]
        event_B = _draw(k_token, rows_BxV, None, spec.sampler)
    n_events = state.n_events + live_B.astype(jnp.int32)
    end_B = tables.eos[event_B] | (n_events >= spec.max_new_tokens)
    for i, cfg in enumerate(spec.cfgs):
        end_B = end_B | (caches[i]["next_pos"] + n_pending[i] + 1 >= cfg.max_seq_len)
    keep_B = live_B & ~end_B
    for i in range(n):  # every member appends the event to its pending list
        at_B = jnp.minimum(n_pending[i], pending[i].shape[1] - 1)
        row = jnp.arange(B)
        pending[i] = pending[i].at[row, at_B].set(
            jnp.where(keep_B, event_B, pending[i][row, at_B]))
        n_pending[i] = n_pending[i] + keep_B.astype(jnp.int32)
    new = DecodeState(tuple(caches), tuple(logits), state.step + 1, state.finished | end_B,
                      n_events, state.key, tuple(pending), tuple(n_pending))
    return new, jnp.where(live_B, event_B, -1), jnp.stack(ran)


def _run_block(spec: Spec, params, tables, state, *, steps: int, reads: tuple, spans: tuple):
    """Up to ``steps`` mixture steps in one while loop (see :func:`run_block`)."""
    B = state.finished.shape[0]

    def room(state):
        ok = jnp.bool_(True)
        for i, span in enumerate(spans):
            # the next step may catch up on every pending event at once
            most = jnp.max(state.n_pending[i])
            ok = (ok & (state.caches[i]["end"] + _chunked(most) <= span)
                  & (most < state.pending[i].shape[1]))
        return ok

    def cond(carry):
        state, _, _, k = carry
        return (k < steps) & ~jnp.all(state.finished) & room(state)

    def body(carry):
        state, events_KxB, ran_KxN, k = carry
        state, event_B, ran_N = _mixture_step(spec, params, tables, state, reads)
        return state, events_KxB.at[k].set(event_B), ran_KxN.at[k].set(ran_N), k + 1

    events_KxB = jnp.full((steps, B), -1, jnp.int32)
    ran_KxN = jnp.zeros((steps, len(spec.cfgs)), bool)
    state, events_KxB, ran_KxN, k = jax.lax.while_loop(
        cond, body, (state, events_KxB, ran_KxN, jnp.int32(0)))
    ends = jnp.stack([c["end"] for c in state.caches])
    return state, events_KxB, ran_KxN, k, ends


_run_block_jit = jax.jit(_run_block, static_argnames=("spec", "steps", "reads", "spans"),
                         donate_argnames=("state",))


def run_block(spec: Spec, params: tuple, tables: Tables, state: DecodeState, *, steps: int,
              reads: tuple, spans: tuple):
    """Runs mixture steps (:func:`_mixture_step`; ``spec.mode`` a mixture mode) on the
    device until ``steps`` are done, every sequence has finished, or a member's next
    read could pass its span. Fused decoding's steps are rounds that draft nothing
    (:func:`run_rounds` with ``k=0``).

    Args:
        spec: the static description.
        params: per member its params pytree.
        tables: the device tables.
        state: the decode state (donated: its caches are updated in place).
        steps: the block's length (static).
        reads: per member ``Reads`` or None (static; exact for the whole block).
        spans: per member the slots its reads may fill up to (static; at most
            the cache's allocation; reads' spans must cover them).

    Returns:
        (state, events_KxB int32 (-1: no event), ran_KxN bool (which members ran
        a forward pass at each step), steps run (int32 []), each member's cache
        fill (int32 [n])).
    """
    return _run_block_jit(spec, params, tables, state, steps=steps, reads=reads, spans=spans)


def compiled_count() -> int:
    """Programs :func:`run_block` and :func:`run_rounds` have compiled (retrace checks)."""
    return _run_block_jit._cache_size() + _run_rounds_jit._cache_size()


def block_reads(cfg, end: int, slots: int, n_read, horizon: int):
    """The ``(reads, span)`` of a member for a block that may write ``horizon`` more slots.

    ``span`` is the slots the block may fill: the allocation, or where that is
    at least twice what the block can reach, the power of two (at least
    ``T.SMALLEST_SPAN``) that covers ``end + horizon``; the reads cover it, and
    a local layer's window is widened by the padding the block may add.
    """
    reads = T.cache_reads(cfg, end + horizon, slots, n_read, horizon)
    span = slots if reads is None or reads.span is None else reads.span
    return reads, span


def block_room(cfg, cache: dict, end: int, n_read, horizon: int):
    """``(cache, reads, span)`` of a member for a block that may write ``horizon`` more
    slots: the cache grown to the next power of two when they would not fit, and its
    :func:`block_reads`."""
    if end + horizon > cache["pos"].shape[1]:
        cache = model_cache.grow(cache, bucket(end + horizon))
    return (cache, *block_reads(cfg, end, cache["pos"].shape[1], n_read, horizon))





# ----------------------------------------------------------------------------- speculative rounds

class DrafterState(NamedTuple):
    """A member drafter's own state on the device (a pytree): its cache and logits for
    B sequences, and per sequence the accepted tokens it has not read yet (at most
    two after a round: the last draft when every draft was accepted, and the event
    emitted after them).

    Attributes:
        cache: its KV cache (its next position per sequence: ``cache['next_pos']``).
        logits: float32 [B, V]: its logits after the last token it read.
        pending: int32 [B, 2]: tokens to read first; ``n_pending`` int32 [B] how many.
    """
    cache: dict
    logits: jax.Array
    pending: jax.Array
    n_pending: jax.Array


class RoundState(NamedTuple):
    """A speculative decoding's state on the device (a pytree): the decode state with
    the last emitted event not yet read, and the n-gram drafter's context.

    Attributes:
        dec: the :class:`DecodeState` (mode 'fuse'). Where ``has_last`` is set, a
            member's logits are stale: the next round reads ``last`` first.
        last: int32 [B]: the last emitted event (read at the next round's start).
        has_last: bool [B]: ``last`` is pending (False at the start: the prompt is
            read and its logits are the first position's).
        history: int32 [B, H]: per sequence its prompt's ids and the emitted events
            (the n-gram drafter's context).
        n_history: int32 [B]: how many of ``history`` are filled.
        drafter: a member drafter's state (:class:`DrafterState`), or None (the
            n-gram drafter).
    """
    dec: DecodeState
    last: jax.Array
    has_last: jax.Array
    history: jax.Array
    n_history: jax.Array
    drafter: DrafterState | None = None


def ngram_drafts(history_BxH, n_history_B, *, n: int, min_n: int, k: int, control=None):
    """The n-gram drafter on the device, as :func:`brf.drafting.ngram_draft` per sequence:
    the up to k events that followed the latest earlier occurrence of the last m
    events of the history (m = n, n - 1, .., min_n: the longest that matches), cut
    before the first control event (``control``: bool [V] or None).

    Returns:
        (drafts int32 [B, k], their lengths int32 [B]).
    """
    B, H = history_BxH.shape
    L = n_history_B[:, None]
    j = jnp.arange(H)[None, :]                     # a window's last index
    start_B = jnp.full((B,), -1, jnp.int32)
    for m in range(n, min_n - 1, -1):              # the longest match first
        if m < 1:
            break
        hit = (j >= m - 1) & (j <= L - 2) & (L - 1 >= m)
        for t in range(m):                          # window[t] == tail[t]
            tail_B = jnp.take_along_axis(history_BxH, jnp.clip(L - m + t, 0, H - 1), axis=1)
            at = jnp.clip(j - m + 1 + t, 0, H - 1)
            hit = hit & (jnp.take_along_axis(history_BxH, jnp.broadcast_to(at, (B, H)),
                                             axis=1) == tail_B)
        last_B = jnp.max(jnp.where(hit, j, -1), axis=1)
        start_B = jnp.where((start_B < 0) & (last_B >= 0), last_B + 1, start_B)
    at_BxK = jnp.clip(start_B[:, None] + jnp.arange(k)[None], 0, H - 1)
    drafts = jnp.take_along_axis(history_BxH, at_BxK, axis=1)
    length = jnp.where(start_B >= 0, jnp.minimum(k, n_history_B - start_B), 0)
    if control is not None:
        stop_BxK = control[drafts] | (jnp.arange(k)[None] >= length[:, None])
        length = jnp.min(jnp.where(stop_BxK, jnp.arange(k)[None], k), axis=1)
    return drafts.astype(jnp.int32), length.astype(jnp.int32)


def rollback_slots(pos_BxS, keep_B):
    """A cache's slot positions cut back to each sequence's first ``keep_B[b]``
    positions (later slots emptied: never attended to again), and the write pointer
    just past the last slot still in use."""
    pos = jnp.where(pos_BxS >= keep_B[:, None], -1, pos_BxS)
    S = pos.shape[1]
    return pos, jnp.max(jnp.where(pos >= 0, jnp.arange(S, dtype=jnp.int32)[None], -1)) + 1


def _rolled_back(cache, keep_B):
    """The cache cut back to each sequence's first ``keep_B[b]`` positions
    (:func:`rollback_slots`; :func:`brf.ensemble.speculative.rollback` on the host)."""
    pos, end = rollback_slots(cache["pos"], keep_B)
    return dict(cache, pos=pos, next_pos=keep_B.astype(jnp.int32),
                end=end.astype(cache["end"].dtype))


def draft_draw(logits_BxV, key, sampler: Sampler):
    """A member drafter's draw: (tokens int32 [B], the log-probs [B, V] they were drawn
    from: its distribution with the sampler applied; greedy: its argmax, log-probs
    None). The host's rounds and :func:`member_drafts` draw with this one function."""
    if sampler.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), None
    lp = filter_logprobs(jax.nn.log_softmax(logits_BxV, axis=-1), sampler)
    return jax.random.categorical(key, lp, axis=-1).astype(jnp.int32), lp


def member_drafts(cfg, params, ds: DrafterState, live_B, n_steps, key, *, k: int,
                  sampler: Sampler, dtype, reads):
    """A member drafter's drafts on the device: it reads its pending tokens, then draws
    ``n_steps`` (traced, at most k) tokens one after another from its own distribution
    with the sampler applied (greedy: its argmax), reading each draft but the last.
    Draw j uses the key ``fold_in(key, j)``. Rows not in ``live_B`` read nothing.

    Returns:
        (drafts int32 [B, k], their log-probs [B, k, V] (None when greedy), the
        state: pending emptied, the last draft not read).
    """
    B = live_B.shape[0]
    valid = (jnp.arange(2)[None] < ds.n_pending[:, None]) & live_B[:, None]
    out, cache = _read(cfg, params, ds.cache, ds.pending, valid, dtype, reads)
    logits = jnp.where(jnp.any(valid, axis=1)[:, None], out, ds.logits)

    def body(carry):
        cache, logits, drafts, logp, j = carry
        d_B, lp = draft_draw(logits, jax.random.fold_in(key, j), sampler)
        if lp is not None:
            logp = logp.at[:, j].set(lp)
        drafts = drafts.at[:, j].set(d_B)

        def read(c_l):
            out, c = _read(cfg, params, c_l[0], d_B[:, None], live_B[:, None], dtype, reads)
            return c, jnp.where(live_B[:, None], out, c_l[1])
        cache, logits = jax.lax.cond(j + 1 < n_steps, read, lambda c_l: c_l, (cache, logits))
        return cache, logits, drafts, logp, j + 1

    V = logits.shape[-1]
    logp = None if sampler.greedy else jnp.full((B, k, V), -jnp.inf, jnp.float32)
    cache, logits, drafts, logp, _ = jax.lax.while_loop(
        lambda c: c[-1] < n_steps, body,
        (cache, logits, jnp.zeros((B, k), jnp.int32), logp, jnp.int32(0)))
    return drafts, logp, ds._replace(cache=cache, logits=logits,
                                     n_pending=jnp.where(live_B, 0, ds.n_pending))


def _leading(ok_BxK):
    """Per row, how many of its first entries are all True (drafts accepted in order)."""
    return jnp.sum(jnp.cumprod(ok_BxK.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def accept_sampled(key, logq_BxPxV, drafts_BxK, dlen_B, sampler: Sampler, logp_BxKxV=None):
    """The accept / resample step of speculative sampling on the device
    (:func:`brf.fusion.speculative.verify`).

    The target at each position is the sampler's distribution of the fused one
    (``q = filter_logprobs(logq)``); ``p`` is the draft's (``logp_BxKxV``; None: a
    deterministic drafter, p one-hot at each draft). Drafts are accepted in order
    while a uniform u has ``u p_j(x_j) < q_j(x_j)``; at the first rejection the
    event is drawn from ``max(0, q_j - p_j)`` (for a deterministic drafter: ``q_j``
    without ``x_j``), and after every draft from ``q`` at the next position.

    ``key`` is the round's (``fold_in(base key, step)``), split as a plain step
    splits it: the uniforms come from its first half, the event's draw from its
    second (a round that drafts nothing draws exactly what the plain step
    :func:`spec_round` with ``k=0`` draws with the same key).

    Args:
        logq_BxPxV: the fused log-probs at the drafted positions and the one after
            (positions past ``dlen_B[b]`` are never read).
        drafts_BxK: int32 [B, K] the drafts; ``dlen_B`` int32 [B] their lengths.

    Returns:
        (accepted int32 [B], event int32 [B]).
    """
    B, K = drafts_BxK.shape
    k_uniform, k_token = jax.random.split(key)
    logt = filter_logprobs(logq_BxPxV, sampler)
    q_x = jnp.exp(jnp.take_along_axis(logt[:, :K], drafts_BxK[:, :, None], axis=2)[..., 0])
    p_x = 1.0 if logp_BxKxV is None else jnp.exp(
        jnp.take_along_axis(logp_BxKxV, drafts_BxK[:, :, None], axis=2)[..., 0])
    u = jax.random.uniform(k_uniform, (B, K))
    ok = (u * p_x < q_x) & (p_x > 0) & (jnp.arange(K)[None] < dlen_B[:, None])
    acc_B = _leading(ok)
    row = jnp.take_along_axis(logt, acc_B[:, None, None], axis=1)[:, 0]
    rejected = acc_B < dlen_B
    if K:
        at = jnp.minimum(acc_B, K - 1)[:, None]
        if logp_BxKxV is None:
            x_B = jnp.take_along_axis(drafts_BxK, at, axis=1)[:, 0]
            cut = rejected[:, None] & (jnp.arange(row.shape[-1])[None] == x_B[:, None])
            residual = jnp.where(cut, -jnp.inf, row)
        else:
            p_row = jnp.take_along_axis(logp_BxKxV, at[:, :, None], axis=1)[:, 0]
            r = jnp.maximum(jnp.exp(row) - jnp.exp(p_row), 0.0)
            residual = jnp.where(rejected[:, None], jnp.log(r), row)
        # no mass left only if x was rejected by rounding: draw from q
        row = jnp.where(jnp.any(residual > -jnp.inf, axis=-1, keepdims=True), residual, row)
    return acc_B, jax.random.categorical(k_token, row, axis=-1).astype(jnp.int32)


def spec_round(spec: Spec, params: tuple, tables: Tables, st: RoundState, reads: tuple, *,
               k: int, n: int = 3, min_n: int = 1, control=None, groups: tuple | None = None,
               k_now=None, dparams=None, draft: int | None = None, dreads=None):
    """One round of fused decoding (pure): a plain step, or a speculative round.

    With ``k = 0`` the round is a plain fused step, in any event space: every member
    reads the pending event (:func:`_plain_read_and_draw`), the members' logits are
    aligned, fused (``spec.method``) and the sampler draws the next event. This is
    the one step plain fused decoding (:mod:`brf.ensemble.decode`) and speculative
    decoding's paused blocks run.

    With ``k > 0`` (a shared vocabulary): the drafter drafts up to k events per
    sequence (none past its ``max_new_tokens``): the n-gram drafter, or with
    ``draft`` member ``draft``'s model (:func:`member_drafts`; ``dparams`` its
    weights, ``dreads`` its reads, its state ``st.drafter``); every member reads the
    pending event and the draft in one forward pass over its cache; the members'
    distributions at the draft's k + 1 positions are fused and the drafts verified.
    Greedy: they are accepted while they equal the fused argmax, and the argmax
    where they stop is emitted after them (plain greedy fused decoding's events).
    Sampled: the accept / resample step (:func:`accept_sampled`, the round's key
    ``fold_in(key, step)``), so the events follow plain sampled fused decoding's
    law. Each member's cache is then cut back to the accepted text. A round that
    drafts nothing draws what the plain step draws with the same key.

    Either way the emitted event is pending (read at the next round's start), and
    the finish rules apply event by event: an end-of-sequence event, the
    ``max_new_tokens``-th, an event some member could not read (its context full).

    ``k`` (static) fixes the round's shapes; ``k_now`` (traced, at most k; default
    k) is what this round drafts at most, so one program serves every k a
    schedule picks.

    ``groups`` (static): members that share weights, read as one batch: per group its
    member indices; ``params``, ``reads`` and the state's caches and logits are then
    per group (rows member-major). None: a group per member.

    A member drafter keeps what it read of the accepted text; the rest of it (the
    emitted event, and the last draft when every draft was accepted) is pending.

    Returns:
        (the new state, emitted int32 [B, k + 1] (-1 past a sequence's emitted
        events), count int32 [B] (events emitted), drafted int32 [B], accepted
        int32 [B] (drafts accepted, before the finish rules cut the round)).
    """
    B = st.dec.finished.shape[0]
    key = jax.random.fold_in(st.dec.key, st.dec.step)
    groups = tuple((i,) for i in range(len(spec.cfgs))) if groups is None else groups
    drafting = None
    if k == 0:  # a plain fused step, in any event space
        if any(len(idx) > 1 for idx in groups):
            raise ValueError("a round that drafts nothing reads one cache per member")
        caches, logits, event_B, full_B = _plain_read_and_draw(spec, params, tables, st,
                                                                 reads, key)
        drafts_BxK = jnp.zeros((B, 0), jnp.int32)
        dlen_B = acc_B = jnp.zeros((B,), jnp.int32)
        ds = st.drafter
    else:
        if spec.space != "identity":
            raise ValueError("drafts are read as the members' shared token ids: identity "
                             "space only")
        caches, logits, drafts_BxK, dlen_B, acc_B, event_B, ds, drafting = _draft_and_verify(
            spec, params, tables, st, reads, key, k=k, n=n, min_n=min_n, control=control,
            groups=groups, k_now=k_now, dparams=dparams, draft=draft, dreads=dreads)
        full_B = jnp.zeros((B,), bool)
    return _end_round(spec, tables, st, caches, logits, drafts_BxK, dlen_B, acc_B, event_B,
                      full_B, ds, k=k, groups=groups, drafting=drafting)


def _plain_read_and_draw(spec: Spec, params, tables: Tables, st: RoundState, reads, key):
    """A plain fused step (a round that drafts nothing): every member reads the
    pending event's tokens (one token in a shared vocabulary; in aligned spaces its
    table row, in chunks), the logits are aligned onto the events and fused, and the
    sampler draws the event, limited to the events every member can read. Key: the
    round's, split as every step splits it (member key, token key).

    Returns:
        (caches, logits, event_B, full_B: a member could not read the event: its
        context would be full, or it has no tokens for it).
    """
    dec = st.dec
    _, k_token = jax.random.split(key)
    reading_B = st.has_last & ~dec.finished
    caches, logits = [], []
    for i in range(len(spec.cfgs)):
        l, c = _read_event(spec, i, params[i], dec.caches[i], dec.logits[i], st.last,
                           reading_B, tables, reads[i])
        caches.append(c)
        logits.append(l)
    logp_BxnxE, events = _aligned(spec, tables, tuple(logits))
    logq_BxE, _ = _apply(logp_BxnxE, tables.weights, None, tables.fusion, name=spec.method,
                         static=spec.static)
    mask = tables.mask
    if mask is not None and events is not None:
        mask = jnp.where(events >= 0, mask[jnp.maximum(events, 0)], False)
    col_B = _draw(k_token, logq_BxE, mask, spec.sampler)
    event_B = col_B if events is None else jnp.take_along_axis(events, col_B[:, None], 1)[:, 0]
    full_B = jnp.zeros_like(reading_B)
    for i, cfg in enumerate(spec.cfgs):
        if spec.space == "identity":
            need_B = jnp.ones_like(event_B)
        else:
            need_B = tables.tokens[i][1][event_B]
            full_B = full_B | (need_B < 0)  # unreadable: the host raises as reencode does
        full_B = full_B | (caches[i]["next_pos"] + need_B >= cfg.max_seq_len)
    return caches, logits, event_B.astype(jnp.int32), full_B


def _draft_and_verify(spec: Spec, params, tables: Tables, st: RoundState, reads, key, *,
                      k, n, min_n, control, groups, k_now, dparams, draft, dreads):
    """A drafting round's drafts, one read of the pending event and them by every
    member, and their verification (see :func:`spec_round`). ``drafting`` (returned):
    a member drafter's drafting rows and steps, else None."""
    dec = st.dec
    B = dec.finished.shape[0]
    live_B = ~dec.finished
    dlogp, ds = None, st.drafter
    drafting_B = n_steps = None
    cap_B = jnp.maximum(spec.max_new_tokens - dec.n_events - 1, 0)
    if k_now is not None:
        cap_B = jnp.minimum(cap_B, k_now)
    if draft is None:
        drafts_BxK, dlen_B = ngram_drafts(st.history, st.n_history, n=n, min_n=min_n,
                                          k=k, control=control)
        dlen_B = jnp.where(live_B, jnp.minimum(dlen_B, cap_B), 0)
    else:  # every drafting row drafts as many as the longest may (its own cut after)
        drafting_B = live_B & (cap_B > 0)
        n_steps = jnp.max(jnp.where(drafting_B, cap_B, 0))
        drafts_BxK, dlogp, ds = member_drafts(
            spec.cfgs[draft], dparams, st.drafter, drafting_B, n_steps,
            jax.random.fold_in(key, 1), k=k, sampler=spec.sampler,
            dtype=jnp.dtype(spec.dtype), reads=dreads)
        dlen_B = jnp.where(drafting_B, cap_B, 0)
    first_B = st.has_last.astype(jnp.int32)
    seq_BxT = jnp.concatenate([st.last[:, None], drafts_BxK], axis=1)
    shifted = jnp.concatenate([drafts_BxK, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens_BxT = jnp.where(st.has_last[:, None], seq_BxT, shifted)
    n_tok_B = jnp.where(live_B, first_B + dlen_B, 0)
    valid_BxT = jnp.arange(k + 1)[None] < n_tok_B[:, None]
    at_BxP = first_B[:, None] + jnp.arange(k + 1)[None]   # rows of [old, read...]
    tokens_BxT = jnp.where(valid_BxT, tokens_BxT, 0)

    def read_and_fuse(width, caches):
        """Every group reads the round's first ``width`` tokens and the members' logits
        at the positions a row can reach (at most ``width + 1``) are fused: (caches,
        the fused argmax [B, k + 1], -1 past those positions)."""
        P = min(width + 1, k + 1)
        rows = [None] * len(spec.cfgs)
        new_caches = []
        for g, idx in enumerate(groups):  # members that share weights read as one batch
            r = len(idx)
            out_RxWxV, new_L, write_at, meta = T._compute(
                params[g], spec.cfgs[idx[0]], jnp.tile(tokens_BxT[:, :width], (r, 1)),
                jnp.tile(valid_BxT[:, :width], (r, 1)), caches[g], jnp.dtype(spec.dtype),
                "all", reads[g])
            new_caches.append(T.ordered_write(caches[g], out_RxWxV, new_L, write_at, meta))
            both = jnp.concatenate([dec.logits[g][:, None], out_RxWxV], axis=1)
            at = jnp.tile(jnp.minimum(at_BxP[:, :P], width), (r, 1))
            got = jnp.take_along_axis(both, at[:, :, None], axis=1)
            for j, i in enumerate(idx):
                rows[i] = got[j * B:(j + 1) * B]
        V = rows[0].shape[-1]
        logp = jnp.stack([jax.nn.log_softmax(x, axis=-1) for x in rows], axis=2)
        logq, _ = _apply(logp.reshape(B * P, len(rows), V), tables.weights, None,
                         tables.fusion, name=spec.method, static=spec.static)
        if not spec.sampler.greedy:  # the fused distributions (never read past P)
            return tuple(new_caches), jnp.pad(logq.reshape(B, P, V),
                                              ((0, 0), (0, k + 1 - P), (0, 0)))
        top = _draw(None, logq, None, spec.sampler).reshape(B, P)
        return tuple(new_caches), jnp.pad(top, ((0, 0), (0, k + 1 - P)), constant_values=-1)

    # the narrowest of three compiled widths that holds every row's tokens (1, 1 + half
    # of k, 1 + k): a round costs about the tokens it reads and fuses, and each width
    # is a forward pass of every member to compile
    widths = sorted({1, 1 + -(-k // 2), 1 + k})
    pick = jnp.searchsorted(jnp.asarray(widths), jnp.max(n_tok_B), side="left")
    caches, fused = jax.lax.switch(jnp.minimum(pick, len(widths) - 1),
                                   [functools.partial(read_and_fuse, w) for w in widths],
                                   tuple(dec.caches))
    caches, logits = list(caches), list(dec.logits)
    if spec.sampler.greedy:  # fused: the argmax at each position [B, k + 1]
        match = (drafts_BxK == fused[:, :k]) & (jnp.arange(k)[None] < dlen_B[:, None])
        acc_B = _leading(match)
        event_B = jnp.take_along_axis(fused, acc_B[:, None], axis=1)[:, 0]
    else:  # fused: the fused log-probs at each position [B, k + 1, V]
        acc_B, event_B = accept_sampled(key, fused, drafts_BxK, dlen_B, spec.sampler, dlogp)
    drafting = None if draft is None else (drafting_B, n_steps)
    return caches, logits, drafts_BxK, dlen_B, acc_B, event_B, ds, drafting


def _end_round(spec: Spec, tables: Tables, st: RoundState, caches, logits, drafts_BxK, dlen_B,
               acc_B, event_B, full_B, ds, *, k: int, groups, drafting):
    """A round's end (see :func:`spec_round`): the events emitted (the accepted drafts,
    then the event), the finish rules event by event (an end-of-sequence event, the
    ``max_new_tokens``-th; ``full_B``: the first event cannot be read), the caches
    cut back to the accepted text (drafting rounds), the n-gram context, the member
    drafter's state; the emitted event pending."""
    dec = st.dec
    B = dec.finished.shape[0]
    live_B = ~dec.finished
    first_B = st.has_last.astype(jnp.int32)
    j_1xP = jnp.arange(k + 1)[None]
    emitted = jnp.where(j_1xP < acc_B[:, None], jnp.concatenate(
        [drafts_BxK, jnp.zeros((B, 1), jnp.int32)], axis=1), event_B[:, None])
    # the finish rules, event by event: the first emitted event that ends the sequence
    ends = (tables.eos[emitted] | (dec.n_events[:, None] + j_1xP + 1 >= spec.max_new_tokens)
            | ((j_1xP == acc_B[:, None]) & full_B[:, None]))
    ends = ends & (j_1xP <= acc_B[:, None])
    end_B = live_B & jnp.any(ends, axis=1)
    count_B = jnp.where(end_B, jnp.argmax(ends, axis=1) + 1, acc_B + 1)
    count_B = jnp.where(live_B, count_B, 0).astype(jnp.int32)
    emitted = jnp.where(j_1xP < count_B[:, None], emitted, -1)
    if k > 0:  # every member read the pending event and the drafts: cut back
        kept_B = jnp.where(live_B, first_B + acc_B, 0)
        caches = [_rolled_back(c, d["next_pos"] + jnp.tile(kept_B, len(idx)))
                  for c, d, idx in zip(caches, dec.caches, groups)]
    H = st.history.shape[1]
    at_BxP2 = jnp.clip(st.n_history[:, None] + j_1xP, 0, H - 1)
    old_h = jnp.take_along_axis(st.history, at_BxP2, axis=1)
    history = st.history.at[jnp.arange(B)[:, None], at_BxP2].set(
        jnp.where(j_1xP < count_B[:, None], emitted, old_h))
    new_dec = dec._replace(caches=tuple(caches), logits=tuple(logits), step=dec.step + 1,
                           finished=dec.finished | end_B, n_events=dec.n_events + count_B)
    if drafting is not None:
        drafting_B, n_steps = drafting
        # it read its pending tokens and the drafts but the last: it keeps what of those
        # the accepted text holds; pending: the rest (the event, after the last draft
        # when every draft was accepted)
        read_B = jnp.where(drafting_B, jnp.minimum(jnp.maximum(n_steps - 1, 0), acc_B), 0)
        two_B = acc_B > read_B
        prev_B = jnp.take_along_axis(drafts_BxK, jnp.clip(acc_B - 1, 0, k - 1)[:, None],
                                     axis=1)[:, 0]
        pend = jnp.stack([jnp.where(two_B, prev_B, event_B),
                          jnp.where(two_B, event_B, 0)], axis=1)
        kept_B = jnp.where(drafting_B, st.drafter.n_pending + read_B, 0)
        ds = DrafterState(_rolled_back(ds.cache, st.drafter.cache["next_pos"] + kept_B),
                          ds.logits, jnp.where(drafting_B[:, None], pend, ds.pending),
                          jnp.where(drafting_B, 1 + two_B, ds.n_pending).astype(jnp.int32))
    new = RoundState(new_dec, jnp.where(live_B, event_B, st.last),
                     st.has_last | live_B, history, st.n_history + count_B, ds)
    return new, emitted, count_B, dlen_B, acc_B


class Schedule(NamedTuple):
    """:class:`brf.drafting.KSchedule` while it drafts, followed on the device: it picks
    each round's k there, and a block of rounds ends where it would pause (static
    parts: ``rule`` of :func:`run_rounds`).

    Attributes:
        hits, misses: float32 []: the faded counts of accepted and rejected drafts.
        size: int32 []: the most a round may draft (adaptive schedules move it).
    """
    hits: jax.Array
    misses: jax.Array
    size: jax.Array


def _next_k(sched: Schedule, drafted, accepted, rejected, rule):
    """The schedule after a round, and the k it would draft next (``KSchedule.update``
    while drafting; float32, where the host's schedule is float64)."""
    decay, overhead, cost, never_pause, adaptive, k_max = rule
    seen = (accepted > 0) | (rejected > 0)
    hits = jnp.where(seen, decay * sched.hits + accepted, sched.hits)
    misses = jnp.where(seen, decay * sched.misses + rejected, sched.misses)
    size = sched.size
    if adaptive:
        size = jnp.where(drafted > 0, jnp.where(accepted == drafted,
                                                jnp.minimum(k_max, size + 2),
                                                jnp.maximum(1, size - 1)), size)
    if never_pause:
        return Schedule(hits, misses, size), size
    a = hits / (hits + misses)
    ks = jnp.arange(1, k_max + 1)
    gain = jnp.stack([sum(a ** j for j in range(kk + 1)) / (1 + overhead + kk * cost)
                      for kk in range(1, k_max + 1)])
    gain = jnp.where(ks <= size, gain, -jnp.inf)
    best = jnp.argmax(gain)
    return Schedule(hits, misses, size), jnp.where(gain[best] > 1, ks[best], 0)


def _run_rounds(spec, params, tables, st, control, sched, k_first, dparams, *, rounds, k, n,
                min_n, rule, reads, spans, groups, draft, dreads, dspan):
    """Up to ``rounds`` speculative rounds in one while loop (see :func:`run_rounds`)."""
    B = st.dec.finished.shape[0]

    def cond(carry):
        st, _, _, _, _, _, r, _, k_now = carry
        room = jnp.bool_(True)
        for i, span in enumerate(spans):  # a plain step reads one event (chunks of tokens)
            need = k + 1 if k else spec.slots_per_step(i)
            room = room & (st.dec.caches[i]["end"] + need <= span)
        if draft is not None:
            room = room & (st.drafter.cache["end"] + k + 1 <= dspan)
        go = (r < rounds) & ~jnp.all(st.dec.finished) & room
        return go & (k_now > 0) if k > 0 else go

    def body(carry):
        st, em, cnt, dra, acc, ks, r, sched, k_now = carry
        live_B = ~st.dec.finished
        st, e, c, d, a = spec_round(spec, params, tables, st, reads, k=k, n=n, min_n=min_n,
                                    control=control, groups=groups, k_now=k_now,
                                    dparams=dparams, draft=draft, dreads=dreads)
        ks = ks.at[r].set(k_now)
        if rule is not None:
            rejected = jnp.sum(live_B & ((a < d) | (d == 0)))
            sched, k_now = _next_k(sched, jnp.sum(d), jnp.sum(a), rejected, rule)
        return (st, em.at[r].set(e), cnt.at[r].set(c), dra.at[r].set(d), acc.at[r].set(a),
                ks, r + 1, sched, k_now.astype(jnp.int32))

    zeros = jnp.zeros((rounds, B), jnp.int32)
    carry = (st, jnp.full((rounds, B, k + 1), -1, jnp.int32), zeros, zeros, zeros,
             jnp.zeros((rounds,), jnp.int32), jnp.int32(0), sched,
             jnp.asarray(k_first, jnp.int32))
    st, em, cnt, dra, acc, ks, r, _, _ = jax.lax.while_loop(cond, body, carry)
    ends = jnp.stack([c["end"] for c in st.dec.caches])
    return st, em, cnt, dra, acc, ks, r, ends


ROUND_STATICS = ("spec", "rounds", "k", "n", "min_n", "rule", "reads", "spans", "groups",
                 "draft", "dreads", "dspan")
_run_rounds_jit = jax.jit(_run_rounds, static_argnames=ROUND_STATICS, donate_argnames=("st",))


def run_rounds(spec: Spec, params: tuple, tables: Tables, st: RoundState, control,
               sched: Schedule | None = None, k_first=None, dparams=None, *, rounds: int,
               k: int, n: int, min_n: int, rule: tuple | None = None, reads: tuple,
               spans: tuple, groups: tuple | None = None, draft: int | None = None,
               dreads=None, dspan: int | None = None):
    """Runs speculative rounds (:func:`spec_round`) on the device until ``rounds`` are
    done, every sequence has finished, or a member's next round could pass its span.

    Args:
        spec, params, tables: the static description (mode 'fuse'; drafting rounds:
            the identity space), per member (per group) its params, the device tables.
        st: the round state (donated: the caches are updated in place).
        control: bool [V]: events a draft stops before, or None.
        sched, rule: the drafting schedule's state and its static rule (decay,
            overhead, cost per token, never_pause, adaptive, the spec's k): after
            each round the schedule picks the next round's k, and the block ends
            where it would pause (k = 0). None: every round drafts ``k_first``.
        k_first: the first round's k (traced; default k).
        rounds: the block's most rounds (static).
        k: events a round drafts at most (static: the rounds' shapes; 0: plain steps).
        n, min_n: the n-gram drafter's longest and shortest match.
        reads, spans: per member (per group), as for :func:`run_block` (a round
            writes up to k + 1 slots before it is cut back).
        groups: as for :func:`spec_round`.
        dparams, draft, dreads, dspan: a member drafter (``st.drafter`` its state):
            its weights, its member index (static; None: the n-gram drafter), its
            reads and span (a round writes up to k + 1 of its slots).

    Returns:
        (state, emitted [R, B, k + 1], count [R, B], drafted [R, B], accepted [R, B]
        (as :func:`spec_round`, per round), each round's k [R], rounds run (int32 []),
        each member's cache fill (int32 [n])).
    """
    k_first = k if k_first is None else k_first
    return _run_rounds_jit(spec, params, tables, st, control, sched, k_first, dparams,
                           rounds=rounds, k=k, n=n, min_n=min_n, rule=rule, reads=reads,
                           spans=spans, groups=groups, draft=draft, dreads=dreads, dspan=dspan)


__all__ = ["CHUNK", "DecodeState", "DrafterState", "RoundState", "Schedule", "Spec",
           "Tables", "accept_sampled", "block_reads", "block_room", "compiled_count",
           "draft_draw", "member_drafts", "ngram_drafts", "rollback_slots",
           "run_block", "run_rounds", "spec_round"]
