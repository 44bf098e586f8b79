"""A member's byte-level view: its next-byte distributions on a text, every byte.

`ByteLM` bundles a model, its tokenizer's byte tables and trie. `score_text`
reads a text byte by byte with the hypothesis state of `brf.bytes.state` and
returns, for every byte, the member's distribution over the 257 byte events
(256 bytes, end-of-text) given the context and the bytes before it.

**Where the forward passes come from.**

1. *The canonical pass.* The text's canonical tokenization (the tokenizer's
   own, `brf.align.reencode.encode_bytes`) runs once, teacher-forced, chunk
   by chunk into one KV cache -- the pass token-level scoring makes. It gives
   the distribution after every canonical prefix. The canonical hypothesis is
   never pruned, so a byte's distribution is never without support.
2. *Alternative tokenizations.* A hypothesis that leaves the canonical path
   (the text's first i canonical tokens, then other tokens) needs its own
   distributions. They run as tree attention over the canonical cache
   (`brf.models.forward_tree`): each extra token sits at its position and sees
   the cache's first slots and its own chain only, so hundreds of alternatives
   share one padded call and no cache is copied.
3. *Prefetch.* Which alternatives survive pruning is mostly known from the
   canonical pass alone: an alternative's weight p(T) p(t | T) is known before
   its pass, and the canonical hypothesis's weight at every byte bounds the
   prefix mass from below. So before reading the bytes, the alternatives that
   could pass the threshold are computed in a few large calls (rounds: those
   branching off the canonical path, then those branching off them). The
   byte walk then finds its tables ready; anything else it needs (rare) runs
   on demand, batched per byte.
4. *Continuations.* An alternative that survived so far and ends where a
   canonical token does likely goes on like the canonical text, so up to
   ``max_speculation`` of its canonical continuations run in the same call
   (a chain seen through the tree mask). A call runs padded to a tree bucket
   anyway, and a padding token costs what a real one does: ``fill`` spends
   that padding on more continuations, the oldest alternatives first, which
   later rounds then find ready (fewer, fuller calls). Neither changes a
   distribution: they decide which tokens share a call.

With ``threshold=0`` and a beam no smaller than the cover, nothing is pruned
and the distributions are exact (the tests check it against brute force). The
number of covering sequences grows exponentially with the text's length, so
exact mode is for short texts.

**A dummy prefix.** A SentencePiece tokenizer that puts a space before every
text (Llama 2, Mistral 7B, Phi-3: ``ByteLM.lead``) makes the model a
distribution over byte strings that start with that space. Its view of a text
x is that distribution conditioned on the space: P(x | lead) = P(lead x) /
P(lead). `score_text` reads lead + x with the same hypotheses (every
tokenization of lead + x counts, the lead inside a first token such as
'▁The' included) and returns the rows of x's bytes; text read after
``context_ids`` gets the lead only where the tokenizer would put one there
(`brf.align.reencode.lead_after`: no text after the context's last control
token). The canonical tokenization is that of lead + x, i.e. the tokenizer's
own ids for x.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.bytes import DEFAULT_BEAM, DEFAULT_MAX_LAG, DEFAULT_THRESHOLD
from brf.align.reencode import check_reencodable, encode_bytes, lead_after, make_codec
from brf.align.union import default_cache_dir
from brf.bytes.masses import N_EVENTS, PathTable, device_vocab, path_tables
from brf.bytes.state import (ByteInputError, ByteState, SeqTree, advance, check_bounds,
                             initial_state, next_byte, pending)
from brf.bytes.trie import UnexpressibleByteError, byte_trie
from brf.models import forward_tree, init_cache, prefill_donated
from brf.models.cache import grow
from brf.models.transformer import Reads, is_unstacked, unstack_layers

# Tokens per tree-attention call (padded up to one of these; each is one compiled program).
TREE_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class ByteLM:
    """One member's byte-level view.

    Attributes:
        name: a label.
        params: per-layer params (`brf.models.transformer.unstack_layers`).
        cfg: the ModelConfig.
        codec: tokenizer + TokenTable (`brf.align.reencode.make_codec`).
        trie: the vocabulary's ByteTrie.
        lead: the bytes the tokenizer puts before a text (b" ": a SentencePiece
            dummy prefix; module docstring).
        eos_ids: the tokens whose mass is the end-of-text event (``cfg.eos_ids``).
        dtype: compute dtype of the forward passes.
    """

    def __init__(self, params, cfg, tokenizer, *, name: str = "", eos_ids=None,
                 dtype=jnp.float32, cache_dir: str | None = None):
        self.name = name
        self.cfg = cfg
        self.params = params if is_unstacked(params) else unstack_layers(params)
        self.codec = make_codec(tokenizer)
        try:
            check_reencodable(self.codec, f"{name or 'the member'}'s tokenizer")
        except ValueError as e:
            raise ByteInputError(str(e)) from None
        if self.codec.table.size > cfg.vocab_size:
            raise ValueError(f"{name}: the tokenizer has {self.codec.table.size} tokens, the "
                             f"model {cfg.vocab_size} logits")
        self.trie = byte_trie(self.codec.table, cache_dir)
        self.lead = self.codec.lead
        self.eos_ids = tuple(int(i) for i in (cfg.eos_ids if eos_ids is None else eos_ids))
        self.vocab = device_vocab(self.trie, self.eos_ids)
        self.dtype = jnp.dtype(dtype)

    @classmethod
    def load(cls, source: str, **kwargs) -> "ByteLM":
        """A registered model (or model path) as a ByteLM; its trie cached on disk.

        Raises:
            brf.checkpoints.registry.ModelSourceError: an unknown member (UserError).
        """
        from brf.checkpoints import registry
        model = registry.load(source)  # bars only while a first use converts
        kwargs.setdefault("cache_dir", default_cache_dir())
        return cls(model.params, model.cfg, model.tokenizer, name=source, **kwargs)

    def context(self, prefix_ids: Sequence[int] = ()) -> list[int]:
        """BOS (when the model has one) and the prefix tokens: what every text is read after."""
        ctx = ([self.cfg.bos_id] if self.cfg.bos_id is not None else []) + [int(i) for i in
                                                                              prefix_ids]
        if not ctx:
            raise ByteInputError(f"{self.name}: the model has no BOS token; give a prefix so "
                                 "that the first byte has a context")
        return ctx

    def lead_after(self, ctx: Sequence[int]) -> bytes:
        """The dummy prefix text read after the tokens ``ctx`` starts with (b"" when the
        text goes on after text of the context; `brf.align.reencode.lead_after`)."""
        return lead_after(self.codec, ctx)

    def encode(self, text: bytes) -> list[int]:
        """The canonical tokens of ``text`` in the middle of a string (no dummy prefix
        added; UnexpressibleByteError for bytes it lacks)."""
        self.trie.check_text(text)
        try:
            return encode_bytes(self.codec, text)
        except ValueError as e:
            raise UnexpressibleByteError(f"{self.name}: {e}") from None


class _Runner:
    """Forward passes of one text: the canonical pass into a KV cache, then tree calls
    whose tokens are written after it, so that every token runs once.

    Slot layout: [0, canon_slots) the context and canonical tokens (slot =
    position), then ``ALT_SLOTS`` slots for the alternative tokenizations' tokens
    in call order. A tree call reads the canonical region and, of the
    alternatives' region, only the slots its tokens attend to (`ancestor_gather`):
    it costs about what a canonical chunk of its size costs, however many
    alternatives are stored. When the region is full, the tokens that later bytes
    may still attend to (those of the live sequences and their ancestors) move to
    its start and the rest is overwritten, so the cache keeps one shape (one
    compiled program per call size) unless the live alternatives outgrow it.
    """

    def __init__(self, lm: ByteLM, ids: Sequence[int], n_ctx: int, chunk: int, pad_to: int):
        self.lm, self.chunk, self.n_ctx = lm, chunk, n_ctx
        n = len(ids)
        if n > lm.cfg.max_seq_len:
            raise ByteInputError(f"{lm.name}: context + text make {n} tokens, more than the "
                                 f"model's context {lm.cfg.max_seq_len}; use shorter segments")
        self.canon_slots = -(-max(n, pad_to) // chunk) * chunk
        self.slots = self.canon_slots + ALT_SLOTS  # the alternatives' region is compacted
        self.ids = np.zeros(self.canon_slots, np.int32)
        self.ids[:n] = ids
        self.n = n
        self.cache = None
        self.end = self.canon_slots
        self.anc: dict[int, np.ndarray] = {}  # seq -> slots of its tokens off the canonical path
        self.slot: dict[int, int] = {}  # seq -> slot of its last token (off the canonical path)
        self.live = lambda: ()  # the sequences whose tokens may still be attended to
        self.tokens = 0       # tokens run (canonical + alternatives, padding excluded)
        self.padded = 0       # tokens run including padding
        self.calls = 0        # tree-attention calls
        self.compactions = 0  # times the alternatives' region was compacted

    def canonical(self):
        """Yields (position of the chunk's first token, logits [C, V]) of the canonical pass."""
        lm = self.lm
        # The canonical region alone while it is filled (each chunk attends to the
        # whole cache), then room for the alternatives.
        cache = init_cache(lm.cfg, 1, self.canon_slots, lm.dtype)
        valid = np.arange(self.canon_slots) < self.n
        for p0 in range(0, self.n, self.chunk):  # chunks of padding alone are skipped
            sl = slice(p0, p0 + self.chunk)
            logits, cache = prefill_donated(lm.params, lm.cfg, jnp.asarray(self.ids[None, sl]),
                                            jnp.asarray(valid[None, sl]), cache,
                                            dtype=lm.dtype, logits="all")
            self.cache = cache
            yield p0, logits[0]
        # The alternatives' tokens go after the canonical region, however short the text.
        self.cache = dict(grow(self.cache, self.slots),
                          end=jnp.asarray(self.canon_slots, jnp.int32))
        self.tokens += self.n
        self.padded += -(-self.n // self.chunk) * self.chunk

    def compute(self, seqs: SeqTree, wanted: Sequence[int]) -> list[tuple[int, jax.Array]]:
        """Logits after the wanted sequences, one token per sequence, in calls whose
        sizes are tree buckets: (how many of ``wanted`` the call took, in order, and
        its logits [T, V], whose first rows are theirs).

        ``wanted`` is cut into as few calls as the largest bucket allows, of equal
        sizes, each padded up to the smallest bucket that holds it: a call's fixed
        cost (reading every weight once) is several tokens' worth, so one padded
        call beats two exact ones. A sequence's parent must be a canonical prefix,
        computed before, or earlier in ``wanted``.
        """
        out, i = [], 0
        calls = -(-len(wanted) // TREE_BUCKETS[-1])
        for c in range(calls):
            take = -(-(len(wanted) - i) // (calls - c))
            out.append((take, self._call(seqs, wanted[i:i + take], wanted)))
            i += take
        return out

    def _compact(self, seqs: SeqTree, keep: set[int], T: int) -> None:
        """Moves the tokens of the ``keep`` sequences (and of their ancestors) to the
        start of the alternatives' region, so that ``T`` more fit; the slots of every
        other sequence are forgotten. Grows the cache only when they do not fit."""
        live = [s for s in keep if s in self.slot]
        old = np.unique(np.concatenate([self.anc[s] for s in live] + [
            np.asarray([self.slot[s] for s in live], np.int64), _NO_SLOTS])).astype(np.int64)
        room = self.slots - self.canon_slots
        if old.size + T > room:  # more live alternatives than the region holds
            room = max(2 * room, old.size + T)
            self.cache = grow(self.cache, self.canon_slots + room)
            self.slots = self.canon_slots + room
        new = {int(o): self.canon_slots + j for j, o in enumerate(old)}
        self.anc = {s: np.asarray([new[int(a)] for a in self.anc[s]], np.int64) for s in live}
        self.slot = {s: new[self.slot[s]] for s in live}
        src = np.zeros(room, np.int32)
        src[:old.size] = old
        self.cache = _moved(self.cache, jnp.asarray(src), jnp.asarray(old.size, jnp.int32),
                            canon=self.canon_slots)
        self.end = self.canon_slots + int(old.size)
        self.compactions += 1

    def _call(self, seqs: SeqTree, wanted: Sequence[int], batch: Sequence[int]) -> jax.Array:
        T = next(b for b in TREE_BUCKETS if b >= len(wanted))
        if self.end + T > self.slots:
            keep = set(self.live()) | set(batch) | {seqs.parent[s] for s in batch}
            self._compact(seqs, keep, T)
        logits, self.cache = tree_call(self.lm, self.cache, seqs, wanted, T, n_ctx=self.n_ctx,
                                       end=self.end, span=self.canon_slots, anc=self.anc,
                                       slot=self.slot)
        self.end += T
        self.tokens += len(wanted)
        self.padded += T
        self.calls += 1
        return logits[0]


def tree_call(lm: ByteLM, cache: dict, seqs: SeqTree, wanted: Sequence[int], T: int, *,
              n_ctx: int, end: int, span: int, anc: dict, slot: dict):
    """One tree call (`forward_tree`): the last token of each ``wanted`` sequence, padded
    to ``T`` tokens and written at cache slots [end, end + T). Scoring and byte-level
    generation both run their alternatives' tokens through it.

    A sequence is a protected prefix (``seqs.base``: the canonical tokens in scoring,
    none in generation) after the ``n_ctx`` context tokens, then tokens of its own:
    its token sees the first ``n_ctx + base`` slots (all below ``span``, the slots the
    call reads besides what it gathers) and its own earlier tokens. Those lie in the
    cache at ``anc[seq]`` (written by earlier calls: gathered, `ancestor_gather`) or in
    this call (its parent earlier in ``wanted``: the tree mask). ``anc`` and ``slot``
    (sequence -> slots of its own tokens, and of its last one) are updated in place; a
    sequence not in ``slot`` (a protected prefix) has no tokens of its own.

    Returns:
        (logits [1, T, V] on the device, the cache).
    """
    slots = cache["pos"].shape[1]
    tokens = np.zeros(T, np.int32)
    pos = np.full(T, -1, np.int32)
    cache_allow = np.zeros((T, slots), bool)
    tree_allow = np.eye(T, dtype=bool)  # padding sees itself: no empty softmax
    olds = []
    for t, s in enumerate(wanted):
        p = seqs.parent[s]
        a = np.append(anc[p], slot[p]) if p in slot else _NO_SLOTS
        anc[s] = a
        base = n_ctx + seqs.base[s]
        tokens[t] = seqs.token[s]
        pos[t] = base + len(seqs.ext[s]) - 1
        cache_allow[t, :base] = True
        olds.append(a[a < end])
        tree_allow[t, a[a >= end] - end] = True
        slot[s] = end + t
    return forward_tree(lm.params, lm.cfg, cache, tokens[None], pos[None], cache_allow[None],
                        tree_allow[None], dtype=lm.dtype, donate=True, reads=Reads(span=span),
                        gather=ancestor_gather(olds, T))


_NO_SLOTS = np.zeros(0, np.int64)
# KV slots of the alternative tokenizations (compacted when full). A tree call reads
# only the slots its tokens attend to there (`ancestor_gather`), so the region's size
# costs memory (about 190 MB for SmolLM2 in float32), not time; a large one is rarely
# outgrown, and growing it recompiles every call size.
ALT_SLOTS = 4096
# Slots a tree call gathers (`ancestor_gather`): each size is a compiled program per
# call size, and gathering a few slots more than needed costs next to nothing.
GATHER_SIZES = (64, 256, 1024, 4096)


def ancestor_gather(olds: Sequence[np.ndarray], T: int) -> tuple[np.ndarray, np.ndarray]:
    """``forward_tree``'s ``gather`` for a call of T tokens, token t attending to the
    cache slots ``olds[t]`` beyond the context it sits on (its ancestors written by
    earlier calls): their union, padded to A slots (the smallest of ``GATHER_SIZES``
    that holds it, so that a call size compiles once or twice), and which token sees
    which.

    A call then reads its context and A slots, however far down the cache its
    tokens' ancestors lie and however many other alternatives are stored there.
    """
    union = np.unique(np.concatenate([np.asarray(o, np.int64) for o in olds] + [_NO_SLOTS]))
    A = next((a for a in GATHER_SIZES if a >= union.size), None)
    A = A or GATHER_SIZES[-1] * -(-union.size // GATHER_SIZES[-1])
    idx = np.zeros(A, np.int32)
    idx[:union.size] = union
    allow = np.zeros((T, A), bool)
    for t, o in enumerate(olds):
        allow[t, np.searchsorted(union, o)] = True
    return idx[None], allow[None]


@functools.partial(jax.jit, static_argnames="canon", donate_argnames="cache")
def _moved(cache, src_R, n, *, canon):
    """The cache with slots ``src_R[:n]`` copied to ``canon, canon + 1, ...`` and the rest
    of the alternatives' region emptied (position -1); ``end`` after the copies."""
    def region(x, axis):
        return jax.lax.dynamic_update_slice_in_dim(x, jnp.take(x, src_R, axis=axis), canon,
                                                   axis=axis)
    kept = jnp.arange(src_R.shape[0]) < n
    pos = jnp.where(kept[None], jnp.take(cache["pos"], src_R, axis=1), -1)
    return dict(k=tuple(region(k, 3) for k in cache["k"]),
                v=tuple(region(v, 2) for v in cache["v"]),
                pos=jax.lax.dynamic_update_slice_in_dim(cache["pos"], pos, canon, axis=1),
                end=jnp.asarray(canon, jnp.int32) + n, next_pos=cache["next_pos"])


class TextScores(NamedTuple):
    """A member's byte-level scores of one text (every array has one row per byte).

    Row k is the distribution of byte k given the context and bytes [0, k).

    Attributes:
        logp: float64 [N, 257] log-probs over the 256 bytes and end-of-text.
        gap: float64 [N] top-1 minus top-2 log-prob of that distribution.
        pruned: float32 [N] fraction of the prefix mass dropped by pruning while
            reading byte k.
        n_hyp: int32 [N] hypotheses the distribution of byte k was read from.
        stats: counts and log-likelihoods of the text (see `score_text`).
        merged: float32 [N] fraction of the prefix mass merged into the canonical
            hypothesis while reading byte k (``max_lag``).
    """
    logp: np.ndarray
    gap: np.ndarray
    pruned: np.ndarray
    n_hyp: np.ndarray
    stats: dict
    merged: np.ndarray


def top2_gap(logp_NxE: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 value along the last axis (0 with fewer than two finite values)."""
    part = -np.partition(-logp_NxE, 1, axis=-1)[..., :2]
    gap = part[..., 0] - part[..., 1]
    return np.where(np.isfinite(gap), gap, 0.0)


def score_text(lm: ByteLM, text: bytes, *, prefix_ids: Sequence[int] = (),
               beam: int = DEFAULT_BEAM, threshold: float = DEFAULT_THRESHOLD,
               chunk: int = 256, pad_to: int = 0,
               max_lag: int = DEFAULT_MAX_LAG, window: int = 512,
               max_speculation: int = 4, fill: bool = True, n_bytes: int | None = None,
               context_ids: Sequence[int] | None = None) -> TextScores:
    """The member's next-byte distribution at every byte of ``text``.

    Args:
        lm: the member.
        text: the bytes to score (read after BOS and the prefix tokens; after the
            member's dummy prefix, ``lm.lead``, which it is conditioned on).
        prefix_ids: tokens read before the text (e.g. an instruction).
        beam: at most this many hypotheses are kept after each byte.
        threshold: hypotheses below this fraction of the prefix mass are dropped
            (0: none). A new hypothesis is weighed before its forward pass.
        max_lag: a hypothesis that left the canonical tokenization and has since
            read the canonical tokens for this many tokens is merged into the
            canonical hypothesis: its mass is kept, its future read from the
            canonical tokenization's distributions (0: never; `brf.bytes.state`).
        chunk: tokens per canonical forward pass (and the KV cache's granule).
        pad_to: pad the canonical sequence to at least this many tokens, so
            texts of different lengths share compiled shapes.
        window: bytes a look-ahead walk reads to collect the forward passes of
            one batched call (module docstring).
        max_speculation: at most this many tokens of a surviving alternative's
            canonical continuation are computed ahead in one go.
        fill: a call's padding up to its tree bucket runs more of the surviving
            alternatives' canonical continuations (the oldest first) instead of
            nothing; a padding token costs what a real one does. No distribution
            depends on it (nor on ``window`` and ``max_speculation``): they decide
            which tokens share a call, so only float32 rounding differs.
        n_bytes: score only the first ``n_bytes`` bytes (None: all). The rows are
            those of the whole text's first ``n_bytes`` rows with the same settings
            (the canonical tokenization is the whole text's, cut after the token
            that reaches byte ``n_bytes``): a slice of a scored text, rescored.
        context_ids: the whole context, BOS included (None: BOS and ``prefix_ids``),
            e.g. the chat-templated prompt a generation was read after; the text
            goes on after it (a dummy prefix only where `ByteLM.lead_after` says).

    Returns:
        TextScores. ``stats`` holds: ``bytes``; ``byte_ll`` (sum of the gold
        bytes' log-probs, nats); ``canonical_ll`` (log-prob of the canonical
        tokenization, conditioned on text + EOS tokens like the byte view) and
        ``canonical_ll_raw`` (the model's own, as token-level scoring reports
        it; both of the tokens of lead + text); ``lead_ll`` (log P(lead), the
        dummy prefix the text is conditioned on; 0 without one); ``lost`` (-sum log(1 - pruned): how far the reported NLL may lie
        below the exact one, at most); ``merged`` (the summed fractions of merged mass);
        ``canonical_tokens``, ``context_tokens``, ``extra_tokens`` (tokens of
        alternative tokenizations run), ``padded_tokens`` (every token a call
        ran, padding included), ``tree_calls``, ``compactions`` (of the
        alternatives' KV region), ``lookaheads`` (look-ahead walks,
        one batch of forward passes each), ``tables`` (distributions computed),
        ``used_tables`` (distinct sequences the walk read), ``max_hyp``.

    Raises:
        ByteInputError: bad beam / threshold, a text too long for the model.
        UnexpressibleByteError: a byte the vocabulary cannot produce (named).
    """
    check_bounds(beam, threshold, max_lag)
    if context_ids is not None and prefix_ids:
        raise ValueError("give prefix_ids or context_ids, not both")
    ctx = lm.context(prefix_ids) if context_ids is None else [int(i) for i in context_ids]
    if not ctx:
        raise ByteInputError(f"{lm.name}: an empty context; the first byte needs one")
    n_text = len(text) if n_bytes is None else int(n_bytes)
    if not 0 <= n_text <= len(text):
        raise ValueError(f"n_bytes must lie in [0, {len(text)}]; got {n_bytes!r}")
    # rows [0, L) are the dummy prefix's, conditioned on and not returned
    lead = lm.lead if context_ids is None else lm.lead_after(ctx)
    L = len(lead)
    text = lead + bytes(text)
    canon = lm.encode(text)
    N = L + n_text
    if N < len(text):  # the canonical tokens up to the one that reaches byte N
        ends = np.cumsum([len(lm.codec.table.token_bytes[t]) for t in canon])
        canon = canon[:int(np.searchsorted(ends, N)) + 1]
    tx = _Text(lm, text, canon, ctx, beam, threshold, chunk, pad_to, max_speculation, max_lag,
               stop=N, fill=fill)
    n = len(canon)
    logp = np.zeros((N, N_EVENTS))
    pruned = np.zeros(N, np.float32)
    merged = np.zeros(N, np.float32)
    n_hyp = np.zeros(N, np.int32)
    byte_ll, lead_ll, lookaheads, used = 0.0, 0.0, 0, set()
    state = initial_state()
    tx.runner.live = lambda: tx.live(state)
    for k in range(N):
        while pending(state, tx.tables):
            tx.fetch(tx.lookahead(state, window))
            lookaheads += 1
        used.update(h.seq for h in state.hyps)
        lp, _ = next_byte(state, tx.tables)
        logp[k] = lp
        n_hyp[k] = len(state.hyps)
        if k < L:
            lead_ll += lp[text[k]]
        else:
            byte_ll += lp[text[k]]
        state, step = advance(state, text[k], tx.tables, lm.trie, tx.seqs, beam=beam,
                              threshold=threshold, max_lag=max_lag)
        pruned[k], merged[k] = step.pruned, step.merged
    r = tx.runner
    lost = float(-np.log1p(-np.minimum(pruned.astype(np.float64), 1.0 - 1e-16)).sum())
    logp, pruned, merged, n_hyp = logp[L:], pruned[L:], merged[L:], n_hyp[L:]
    stats = dict(bytes=N - L, byte_ll=float(byte_ll), canonical_ll=float(tx.canon_lp[n]),
                 canonical_ll_raw=tx.canon_raw, lead_ll=float(lead_ll), lost=lost,
                 merged=float(merged.astype(np.float64).sum()),
                 canonical_tokens=n, context_tokens=len(ctx), extra_tokens=r.tokens - r.n,
                 padded_tokens=r.padded, tree_calls=r.calls, compactions=r.compactions,
                 lookaheads=lookaheads,
                 speculated=tx.speculated,
                 tables=len(tx.tables), used_tables=len(used), max_hyp=int(n_hyp.max(initial=0)))
    return TextScores(logp, top2_gap(logp), pruned, n_hyp, stats, merged)


class _Text:
    """One text's sequences, tables and forward passes (see the module docstring)."""

    def __init__(self, lm, text, canon, ctx, beam, threshold, chunk, pad_to, max_speculation,
                 max_lag, stop=None, fill=True):
        self.lm, self.text, self.canon = lm, text, canon
        self.fill = fill
        self.stop = len(text) if stop is None else stop  # bytes the walk reads
        self.max_lag = max_lag
        self.beam, self.threshold, self.max_spec = beam, threshold, max_speculation
        self.speculated = 0  # sequences computed ahead as canonical continuations
        self.lens = [len(lm.codec.table.token_bytes[t]) for t in canon]
        ends = np.cumsum(self.lens).tolist()
        n, N = len(canon), len(text)
        self.seqs = SeqTree(canon, ends)
        self.boundary = {e: i for i, e in enumerate([0] + ends)}  # offset -> canonical prefix
        self.runner = _Runner(lm, ctx + canon, len(ctx), chunk, pad_to)
        self.tables: dict[int, PathTable] = {}
        starts = [0] + ends
        c0 = len(ctx)
        for p0, logits in self.runner.canonical():
            # row r follows position p0 + r, i.e. canonical prefix p0 + r - (c0 - 1);
            # prefixes ending before the text's end have a next byte to predict
            i0 = max(0, p0 - (c0 - 1))
            i1 = min(n, N, p0 + logits.shape[0] - (c0 - 1))
            if i1 > i0:
                self.tables.update(zip(range(i0, i1), path_tables(
                    lm.vocab, lm.trie, logits, text, starts[i0:i1],
                    rows=np.arange(i0, i1) + c0 - 1 - p0)))
        self.canon_lp = np.zeros(n + 1)
        self.canon_raw = 0.0
        for i in range(n):
            q = self._logq(i, canon[i])
            self.canon_lp[i + 1] = self.canon_lp[i] + q
            self.canon_raw += q + self.tables[i].log_den

    def _logq(self, seq: int, token: int) -> float:
        """log q(token | seq) from the sequence's table (the token lies on its path)."""
        ids, lq = self.tables[seq].equal(len(self.lm.codec.table.token_bytes[token]), 0)
        return float(lq[np.flatnonzero(ids == token)[0]])

    def _chain(self, seq: int) -> list[int]:
        """``seq`` and, when it ends at a canonical boundary, up to ``age`` (its tokens
        off the canonical path, at most ``max_speculation``) canonical tokens after it
        (`_next`): an alternative that survived so far likely goes on like the
        canonical one."""
        out = [seq]
        for _ in range(min(self.max_spec, len(self.seqs.ext[seq]))):
            nxt = self._next(out[-1])
            if nxt is None:
                break
            out.append(nxt)
        return out

    def _next(self, seq: int) -> int | None:
        """The canonical continuation of ``seq`` by one token, when it may be computed
        ahead (``seq`` off the canonical path, at a canonical boundary, the next
        token ending before the scored bytes do and within ``max_lag``)."""
        i = self.boundary.get(self.seqs.end[seq])
        if i is None or i >= len(self.canon) or self.seqs.is_protected(seq):
            return None
        if self.max_lag and self.seqs.synced[seq] >= self.max_lag - 1:
            return None
        end = self.seqs.end[i + 1]
        return None if end >= self.stop else self.seqs.child(seq, self.canon[i], end)

    def _fill(self, todo: list[int], wanted) -> None:
        """Fills the padding of the calls ``todo`` will run with more of the chains'
        canonical continuations (``todo`` is extended in place).

        A call is padded to a tree bucket anyway (`_Runner.compute`), and a padding
        token costs what a real one does; the slack goes to the oldest alternatives first
        (the likeliest to survive), a token each in turn. Which tables exist changes no
        distribution, only which later calls are needed. Only a batch of one call is
        filled (more are cut into equal calls, whose padding filling would move).
        """
        if len(todo) > TREE_BUCKETS[-1] or self.max_spec <= 0:
            return
        room = next(b for b in TREE_BUCKETS if b >= len(todo)) - len(todo)
        have = set(todo)
        tips = []
        for s in sorted(dict.fromkeys(wanted), key=lambda s: -len(self.seqs.ext[s])):
            tip = s
            while True:  # the chain's last sequence whose table is, or will be, computed
                nxt = self._next(tip)
                if nxt is None or not (nxt in have or nxt in self.tables):
                    break
                tip = nxt
            if tip in have or tip in self.tables:
                tips.append(tip)
        while room > 0 and tips:
            grown = []
            for tip in tips:
                nxt = self._next(tip)
                if nxt is None or room == 0:
                    continue
                if nxt not in have and nxt not in self.tables:
                    todo.append(nxt)
                    have.add(nxt)
                    self.speculated += 1
                    room -= 1
                grown.append(nxt)
            tips = grown

    def live(self, state: ByteState) -> set[int]:
        """The sequences later bytes may extend: the state's, and those computed ahead."""
        ends = self.seqs.end
        return ({h.seq for h in state.hyps}
                | {s for s in self.tables if ends[s] >= state.offset})

    def fetch(self, wanted) -> list[int]:
        """Computes the tables of ``wanted`` (parents first) and of their speculative
        canonical continuations; returns the sequences computed."""
        todo = []
        for s in wanted:
            for j, c in enumerate(self._chain(s)):
                if c not in self.tables and c not in todo:
                    todo.append(c)
                    self.speculated += j > 0
        if not todo:
            return []
        if self.fill:
            self._fill(todo, wanted)
        i = 0
        for take, logits in self.runner.compute(self.seqs, todo):
            part = todo[i:i + take]
            i += take
            self.tables.update(zip(part, path_tables(self.lm.vocab, self.lm.trie, logits,
                                                     self.text, [self.seqs.end[s] for s in part])))
        return todo

    def lookahead(self, state: ByteState, window: int) -> list[int]:
        """The sequences a walk from ``state`` over the next ``window`` bytes needs.

        An approximate walk: a hypothesis without a table is recorded and left
        out (its forward pass is the next batch's), the others advance and prune
        as in the real walk. The first miss is exact (everything before it is);
        later ones may include a few the real walk prunes and miss a few it
        keeps (found by the next look-ahead).
        """
        needs, seen = [], set()
        k0, N = state.offset, self.stop
        for k in range(k0, min(N, k0 + window)):
            miss = [h for h in state.hyps if h.seq not in self.tables]
            if miss:
                for h in miss:
                    if h.seq not in seen:
                        seen.add(h.seq)
                        needs.append(h.seq)
                state = ByteState(k, tuple(h for h in state.hyps if h.seq in self.tables))
            state, _ = advance(state, self.text[k], self.tables, self.lm.trie, self.seqs,
                               beam=self.beam, threshold=self.threshold, max_lag=self.max_lag)
        return needs


__all__ = ["ByteLM", "TREE_BUCKETS", "TextScores", "score_text", "top2_gap"]
