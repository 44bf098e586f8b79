"""Generation on bytes: sample the fused next-byte distribution, one byte at a time.

Every member reads the text as bytes (`brf.bytes.state`): its hypotheses are
the token sequences that cover what was generated so far, and its next-byte
distribution over the 257 events (256 bytes, end-of-text) sums over all of
them. The members' distributions share one event space whatever their
tokenizers, so any fusion method (`brf.fusion.METHODS`) fuses them as they
are, and the sampler (greedy, temperature, top-k, top-p, min-p) draws the next
byte from the fused distribution. Each member then reads the drawn byte: its
hypotheses that continue with it survive, those that complete a token spawn
new ones, and those need a forward pass before the next byte. So no member is
ever handed a token split it would not have produced: each keeps every
tokenization of the generated text its beam holds, canonical or not, and the
fused text needs no re-encoding.

**Modes** (the names of `brf.ensemble.decode`):

* ``fuse``: the method fuses the members' byte distributions; the sampler
  draws from the result. Per-position phase maps read the byte-level gap (top
  1 minus top 2 log-prob of a member's next-byte distribution).
* ``mixture_exact``: one member k ~ Categorical(w) per byte, the byte drawn
  from its distribution: an exact draw from the linear pool (plain sampling
  only). Every member still reads every byte (its hypotheses must follow).
* ``mixture_per_member``: as above with the sampler applied to the chosen
  member's distribution.

**Forward passes.** A member's context (BOS, prompt, chat template) runs once
into a KV cache. Every token sequence a hypothesis commits to then takes one
slot of that cache: the tokens that need a pass at one byte (all children of
sequences already computed) run in one tree-attention call
(`brf.models.forward_tree`), each attending to the context and to its own
ancestors' slots, so a token is computed once however many hypotheses share
it, and no cache is copied. A hypothesis's next-token distribution is read at
whatever byte depth it needs on the host, in float64 (`NextTokens`).

**Common support.** A byte that some member cannot follow (its vocabulary
has no token sequence producing it, or its beam dropped every hypothesis that
could) has probability 0 for that member; draws are restricted to the events
every member can follow, renormalised, so every member can always read the
drawn byte. Where the members' supports agree (the usual case: both tokenizer
families cover all 256 bytes) this changes nothing.

**Valid UTF-8.** With ``utf8=True`` (the default) the fused distribution is
restricted to the events that keep the text a prefix of valid UTF-8 (end of
text only between characters) and renormalised: the sampled text then always
decodes. Either way the streamed pieces (`BytePiece`) hold complete
characters only; with ``utf8=False`` bytes that can never decode show as
U+FFFD.

**Precision.** With ``threshold=0`` and a beam no smaller than the cover
nothing is pruned and each member's distribution is exact. With pruning,
``pruned`` reports the mass each member dropped; generation never merges, so a
member's kept hypotheses are real tokenizations with their exact probabilities
and their mass is a lower bound of the generated text's probability under the
member (a one-sided bound: nothing bounds a single byte's distribution).
`measure_precision` measures that per byte: it rescores the generated text at
the reference settings (`brf.bytes.REFERENCE`) and compares.

Reproducibility: byte k uses ``fold_in(PRNGKey(seed), k)`` split into a
member-choice key and a byte key (as `brf.ensemble.decode` does per token).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.bytes import DEFAULT_BEAM, DEFAULT_THRESHOLD, REFERENCE, Settings
from brf.bytes.lm import ByteLM, tree_call
from brf.bytes.masses import EOT, N_EVENTS, logsumexp_rows
from brf.bytes.state import (ByteInputError, ByteState, SeqTree, advance, check_bounds,
                             initial_state, next_byte, pending)
from brf.bytes.trie import ROOT, ByteTrie, UnexpressibleByteError
from brf.text import TextStream, utf8_prefix
from brf.fusion import Sampler, fuse
from brf.fusion import methods as fusion_methods
from brf.fusion.mixture import select_member
from brf.fusion.sampling import sample
from brf.models import init_cache, prefill_donated
from brf.models.cache import grow

MODES = ("fuse", "mixture_exact", "mixture_per_member")
# tokens per tree-attention call, padded up to one of these (most bytes need 0 or 1)
TREE_BUCKETS = (1, 2, 4, 8, 16, 64, 256)


class NextTokens:
    """One hypothesis's next-token distribution, read as next-byte masses at any
    trie node (the `brf.bytes.state.Table` interface, for text not known yet).

    Probabilities are conditioned on "a text token or EOS" as in
    `brf.bytes.masses`. A node's row is computed on first use, in float64: each
    child's mass is the plain sum of its range of the sorted probabilities
    (non-negative terms, so its relative error is at most its range's length
    times float64's epsilon, whatever the rest of the vocabulary holds).
    """

    __slots__ = ("trie", "logq_V", "p_sorted", "eos_log", "_rows")

    def __init__(self, trie: ByteTrie, logits_V: np.ndarray, eos_ids: Sequence[int]):
        x = np.asarray(logits_V, np.float64)
        x = x - x.max()
        p = np.exp(x)
        text = p[trie.sorted_ids]
        eos = float(p[list(eos_ids)].sum()) if len(eos_ids) else 0.0
        den = float(text.sum()) + eos
        self.trie = trie
        self.logq_V = x - math.log(den)
        self.p_sorted = text / den
        self.eos_log = math.log(eos / den) if eos > 0 else -math.inf
        self._rows: dict[int, tuple[np.ndarray, float]] = {}

    def _row(self, node: int) -> tuple[np.ndarray, float]:
        got = self._rows.get(node)
        if got is None:
            trie = self.trie
            row = np.full(N_EVENTS, -np.inf)
            kids = trie.children(node)
            if kids.size:
                lo, hi = trie.node_lo[kids], trie.node_hi[kids]
                # children partition their parent's range after its equal tokens
                sums = np.add.reduceat(self.p_sorted[lo[0]:hi[-1]], lo - lo[0])
                with np.errstate(divide="ignore"):
                    row[trie.node_byte[kids]] = np.log(sums)
            if node == ROOT:
                row[EOT] = self.eos_log
            got = (row, float(logsumexp_rows(row[None, :EOT])[0]))
            self._rows[node] = got
        return got

    def row(self, depth: int, node: int) -> np.ndarray:
        return self._row(node)[0]

    def total(self, depth: int, node: int) -> float:
        return self._row(node)[1]

    def equal(self, depth: int, node: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.trie.equal_tokens(node)
        return ids, self.logq_V[ids]


class _Tree:
    """One member's forward passes: the context once, then every committed token
    sequence as one cache slot seen by its descendants (module docstring)."""

    def __init__(self, lm: ByteLM, ctx: Sequence[int]):
        self.lm = lm
        n = len(ctx)
        if n == 0:
            raise ByteInputError(f"{lm.name}: empty context; give BOS or prompt tokens")
        if n >= lm.cfg.max_seq_len:
            raise ByteInputError(f"{lm.name}: the context is {n} tokens, the model's "
                                 f"context only {lm.cfg.max_seq_len}")
        self.n_ctx = n
        width = max(16, 1 << (n - 1).bit_length())
        self.slots = width + 4 * TREE_BUCKETS[-1]
        ids = np.zeros((1, width), np.int32)
        ids[0, :n] = ctx
        valid = np.arange(width)[None] < n
        cache = init_cache(lm.cfg, 1, self.slots, lm.dtype)
        logits, self.cache = prefill_donated(lm.params, lm.cfg, jnp.asarray(ids),
                                             jnp.asarray(valid), cache, dtype=lm.dtype,
                                             logits="last")
        self.first = np.asarray(logits[0])
        self.width = self.end = width
        self.anc: dict[int, np.ndarray] = {0: np.zeros(0, np.int64)}  # seq -> its tokens' slots
        self.slot_of: dict[int, int] = {}  # seq -> the slot of its last token
        self.tokens = n      # tokens run (padding excluded)
        self.calls = 0       # tree-attention calls

    def room(self, seqs: SeqTree, seq: int) -> bool:
        """Whether the sequence's last token fits in the model's context."""
        return self.n_ctx + len(seqs.ext[seq]) <= self.lm.cfg.max_seq_len

    def compute(self, seqs: SeqTree, wanted: Sequence[int]) -> np.ndarray:
        """Logits [len(wanted), V] (host) after each wanted sequence, whose parents
        have been computed."""
        cap = TREE_BUCKETS[-1]
        return np.concatenate([self._call(seqs, wanted[i:i + cap])
                               for i in range(0, len(wanted), cap)])

    def _call(self, seqs: SeqTree, wanted: Sequence[int]) -> np.ndarray:
        """One tree call; a wanted sequence's parent may be earlier in the same call
        (its tokens then see it through the tree mask: speculative chains)."""
        T = next(b for b in TREE_BUCKETS if b >= len(wanted))
        if self.end + T > self.slots:
            self.slots = max(2 * self.slots, self.end + T)
            self.cache = grow(self.cache, self.slots)
        # the prompt's slots, and of the tokens after them only each token's ancestors
        logits, self.cache = tree_call(self.lm, self.cache, seqs, wanted, T, n_ctx=self.n_ctx,
                                       end=self.end, span=self.width, anc=self.anc,
                                       slot=self.slot_of)
        self.end += T
        self.tokens += len(wanted)
        self.calls += 1
        return np.asarray(logits[0, :len(wanted)])


@dataclasses.dataclass
class _Reader:
    """One member's byte-level reading of the generated text."""
    lm: ByteLM
    tree: _Tree
    seqs: SeqTree
    state: ByteState
    tables: dict
    eos_ids: tuple

    def dist(self) -> np.ndarray:
        return next_byte(self.state, self.tables)[0]

    def read(self, byte: int, beam: int, threshold: float) -> float | None:
        """Reads one byte; runs the forward passes its new hypotheses need.
        Returns the fraction of mass pruning dropped; None when the context is full."""
        state, step = advance(self.state, byte, self.tables, self.lm.trie, self.seqs,
                              beam=beam, threshold=threshold)
        need = pending(state, self.tables)
        if any(not self.tree.room(self.seqs, s) for s in need):
            return None
        if need:
            logits = self.tree.compute(self.seqs, need)
            for s, row in zip(need, logits):
                self.tables[s] = NextTokens(self.lm.trie, row, self.eos_ids)
        alive = {h.seq for h in state.hyps}
        for s in [s for s in self.tables if s not in alive]:
            del self.tables[s]
        self.state = state
        return step.pruned

    def tokenization(self, text: bytes, beam: int, threshold: float) -> tuple[int, ...] | None:
        """The heaviest of the member's hypotheses that tokenize all of ``text``
        (its tokens after the context), None when every hypothesis ends inside a
        token. The state may lag one byte behind (the last byte drawn is read here,
        without forward passes)."""
        state = self.state
        if state.offset == len(text) - 1:
            state, _ = advance(state, text[-1], self.tables, self.lm.trie, self.seqs,
                               beam=beam, threshold=threshold)
        whole = [h for h in state.hyps if h.node == ROOT]
        return self.seqs.ext[max(whole, key=lambda h: h.logp).seq] if whole else None


def _reader(lm: ByteLM, ctx: Sequence[int], eos_ids: Sequence[int] | None) -> _Reader:
    tree = _Tree(lm, ctx)
    eos = tuple(int(i) for i in (lm.eos_ids if eos_ids is None else eos_ids))
    seqs = SeqTree()
    return _Reader(lm, tree, seqs, initial_state(), {0: NextTokens(lm.trie, tree.first, eos)},
                   eos)


def utf8_allowed(data: bytes) -> np.ndarray:
    """bool [257]: the events that keep ``data`` a prefix of valid UTF-8 (end of
    text only after a complete character). ``data`` must be such a prefix."""
    ok = np.zeros(N_EVENTS, bool)
    # the last character's lead byte and how many bytes of it are there
    i = len(data)
    while i > 0 and len(data) - i < 3 and 0x80 <= data[i - 1] <= 0xBF:
        i -= 1
    lead = data[i - 1] if i > 0 else None
    have = len(data) - i + 1 if lead is not None and lead >= 0xC0 else 0
    need = {0xC: 2, 0xD: 2, 0xE: 3, 0xF: 4}.get(lead >> 4, 0) if have else 0
    if have and have < need:
        lo, hi = 0x80, 0xBF
        if have == 1:
            lo, hi = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF),
                      0xF4: (0x80, 0x8F)}.get(lead, (lo, hi))
        ok[lo:hi + 1] = True
        return ok
    ok[0x00:0x80] = True
    ok[0xC2:0xF5] = True
    ok[EOT] = True
    return ok


@dataclasses.dataclass(frozen=True)
class BytePiece:
    """Streamed text: complete characters only (``finished``: None, or the finish reason)."""
    text: str
    finished: str | None = None


@dataclasses.dataclass
class ByteGeneration:
    """The result of one byte-level generation.

    Attributes:
        data: the generated bytes (stop string included).
        text: their decoding, cut at the first stop string.
        finish_reason: 'eot' (end-of-text drawn), 'stop' (a stop string),
            'length' (max_bytes), 'context' (a member's context is full) or
            'no_common_byte' (no event that every member can follow has mass).
        pruned: per member, per byte read, the fraction of its mass pruning dropped.
        n_hyp: per member, per byte drawn, how many hypotheses its distribution summed.
        tokens: per member, tokens run through the model (context included).
        calls: per member, tree-attention calls.
        member_ids: per member, the tokens (after its context) of its heaviest
            hypothesis that tokenizes all of prompt + data -- what it would
            condition on to go on at the token level; None when every kept
            hypothesis ends inside a token.
        trace: per byte drawn (``trace=True``): 'logq' (float64 [257], the fused
            distribution in mode 'fuse' before the sampler and the UTF-8 mask;
            the chosen member's in the mixture modes), 'member_logp' ([n, 257]),
            'event', 'member' (mixture modes).
    """
    data: bytes = b""
    text: str = ""
    finish_reason: str | None = None
    pruned: list[list[float]] = dataclasses.field(default_factory=list)
    n_hyp: list[list[int]] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    calls: list[int] = dataclasses.field(default_factory=list)
    member_ids: list[tuple[int, ...] | None] = dataclasses.field(default_factory=list)
    trace: list[dict] = dataclasses.field(default_factory=list)


def check_request(*, mode: str, method: str, method_params: Mapping[str, Any] | None,
                  sampler: Sampler, beam: int, threshold: float, max_bytes: int) -> None:
    """Raises a UserError for settings byte-level generation cannot honour."""
    check_bounds(beam, threshold)
    if mode not in MODES:
        raise ByteInputError(f"unknown mode {mode!r}; use one of {MODES}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ByteInputError(f"max_bytes must be an integer >= 1; got {max_bytes!r}")
    m = fusion_methods.get_method(method)
    arrays = [k for k, p in m.params.items() if p.kind == "array"]
    if arrays:
        raise ByteInputError(f"method {method!r} needs token-level arrays ({', '.join(arrays)}); "
                             "byte distributions have none")
    if mode != "fuse" and (method != "linear" or method_params):
        raise ByteInputError(f"mode {mode!r} mixes members (a linear pool); it takes no method")
    if mode == "mixture_exact" and sampler != Sampler():
        raise ByteInputError(f"mode 'mixture_exact' samples the linear pool exactly only at "
                             f"temperature 1 without truncation; got {sampler}. Use "
                             "mode='mixture_per_member' or mode='fuse' with method='linear'")


def checked_arguments(members, contexts, weights, prompt: bytes, utf8: bool, *, mode: str,
                      method: str, method_params, sampler, beam: int, threshold: float,
                      max_bytes: int):
    """A byte-level generation's arguments checked (`check_request`, one context per
    member, the weights, a valid prompt): (sampler, method_params, weights [n]).

    Raises:
        ByteInputError, FusionInputError: what cannot be honoured, named.
    """
    sampler = Sampler.parse(sampler)
    method_params = dict(method_params or {})
    check_request(mode=mode, method=method, method_params=method_params, sampler=sampler,
                  beam=beam, threshold=threshold, max_bytes=max_bytes)
    n = len(members)
    if n == 0 or len(contexts) != n:
        raise ByteInputError(f"{n} members and {len(contexts)} contexts; give one context "
                             "per member (and at least one member)")
    w = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or \
            not math.isclose(w.sum(), 1.0, abs_tol=1e-6):
        raise ByteInputError(f"weights must be {n} finite numbers >= 0 summing to 1; got "
                             f"{np.asarray(weights).tolist()}")
    if utf8 and not _valid_text(prompt):
        raise ByteInputError("the prompt is not valid UTF-8 text (whole characters); utf8=True "
                             "continues valid text only")
    return sampler, method_params, w


def generate_bytes(members: Sequence[ByteLM], contexts: Sequence[Sequence[int]], *,
                   prompt: bytes = b"", weights: Sequence[float] | None = None,
                   mode: str = "fuse", method: str = "linear",
                   method_params: Mapping[str, Any] | None = None,
                   sampler: Sampler | str | None = None, max_bytes: int = 256,
                   stop: Sequence[str] = (), seed: int = 0, beam: int = DEFAULT_BEAM,
                   threshold: float = DEFAULT_THRESHOLD, utf8: bool = True,
                   eos_ids: Sequence[Sequence[int] | None] | None = None, trace: bool = False,
                   on_piece: Callable[[BytePiece], None] | None = None) -> ByteGeneration:
    """Samples bytes from the members' fused byte-level distribution (module docstring).

    Args:
        members: the members' byte-level views.
        contexts: per member, the token ids it conditions on (BOS, chat template
            and prompt included), read before any byte.
        prompt: bytes every member reads through its byte view before the first
            drawn byte (a text to continue; not part of the output; whole UTF-8
            characters when ``utf8``).
        weights: member weights on the simplex (default uniform).
        mode: 'fuse' | 'mixture_exact' | 'mixture_per_member'.
        method, method_params: the fusion method (``brf.fusion.METHODS``) of mode 'fuse'.
        sampler: a `brf.fusion.Sampler` or its spec ('greedy', 'temperature=0.7,top_p=0.9').
        max_bytes: at most this many bytes are drawn (with ``utf8``, up to 3 more
            that complete the last character).
        stop: stop strings (the text is cut before the first).
        seed: PRNG seed.
        beam: at most this many hypotheses per member after each byte.
        threshold: per member, hypotheses below this fraction of its mass are dropped.
        utf8: draw only bytes that keep the text valid UTF-8 (module docstring).
        eos_ids: per member, the tokens whose mass is end-of-text (default: its ``eos_ids``).
        trace: record every step's distributions in ``trace``.
        on_piece: called with each new piece of text as it becomes final.

    Returns:
        ByteGeneration.

    Raises:
        ByteInputError: a bad beam, threshold, mode, method or max_bytes, a
            context that does not fit.
        UnexpressibleByteError: prompt bytes a member cannot read.
        FusionInputError: an unknown method or parameter, weights off the simplex.
    """
    sampler, method_params, w = checked_arguments(
        members, contexts, weights, prompt, utf8, mode=mode, method=method,
        method_params=method_params, sampler=sampler, beam=beam, threshold=threshold,
        max_bytes=max_bytes)
    n = len(members)
    eos_ids = list(eos_ids) if eos_ids is not None else [None] * n
    readers = [_reader(lm, ctx, e) for lm, ctx, e in zip(members, contexts, eos_ids)]
    out = ByteGeneration(pruned=[[] for _ in range(n)], n_hyp=[[] for _ in range(n)])
    for k, b in enumerate(prompt):
        for r, lm in zip(readers, members):
            try:
                got = r.read(b, beam, threshold)
            except UnexpressibleByteError as e:
                raise UnexpressibleByteError(f"{lm.name}: prompt {e}") from None
            if got is None:
                raise ByteInputError(f"{lm.name}: the prompt does not fit in its context")
    base = jax.random.PRNGKey(seed)
    w_dev = jnp.asarray(w, jnp.float32)
    text = TextStream(stop)
    data = bytearray()
    finish = "length"
    for k in itertools.count():
        logp_nxE = np.stack([r.dist() for r in readers])
        for j, r in enumerate(readers):
            out.n_hyp[j].append(len(r.state.hyps))
        k_member, k_byte = jax.random.split(jax.random.fold_in(base, k))
        member = None
        if mode == "fuse":
            logq = _fused(method, method_params, logp_nxE, w)
            s = sampler
        else:
            member = int(select_member(k_member, w_dev))
            logq = logp_nxE[member]
            s = sampler if mode == "mixture_per_member" else Sampler()
        allowed = np.isfinite(logp_nxE).all(axis=0)  # every member can follow it
        if utf8:
            allowed &= utf8_allowed(bytes(prompt + data))
        event = _draw(k_byte, logq, allowed, s)
        if trace:
            out.trace.append(dict(logq=logq, member_logp=logp_nxE, event=event, member=member))
        if event is None:
            finish = "no_common_byte"
            break
        if event == EOT:
            finish = "eot"
            break
        data.append(event)
        piece = text.update(utf8_prefix(bytes(data)))
        if on_piece is not None and piece:
            on_piece(BytePiece(piece))
        if text.stopped:
            finish = "stop"
            break
        # max_bytes, or with utf8 up to 3 more bytes that complete the last character
        if len(data) >= max_bytes and (not utf8 or _valid_text(bytes(data))):
            break
        full = False
        for j, r in enumerate(readers):
            got = r.read(event, beam, threshold)
            if got is None:
                full = True
                break
            out.pruned[j].append(got)
        if full:
            finish = "context"
            break
    piece = text.update(bytes(data).decode("utf-8", errors="replace"), final=True)
    if on_piece is not None:
        on_piece(BytePiece(piece, finish))
    out.data, out.text, out.finish_reason = bytes(data), text.text, finish
    out.member_ids = [r.tokenization(bytes(prompt + data), beam, threshold) for r in readers]
    out.tokens = [r.tree.tokens for r in readers]
    out.calls = [r.tree.calls for r in readers]
    return out


def measure_precision(members: Sequence[ByteLM], contexts: Sequence[Sequence[int]],
                      generation: ByteGeneration, *, prompt: bytes = b"",
                      reference: Settings = REFERENCE) -> list[dict]:
    """How far each member's view, as the generation read it, lay from the reference.

    The generated bytes are rescored by every member after the same context with
    the ``reference`` settings (`brf.bytes.lm.score_text`), and the next-byte
    distributions the generation fused (``generation.trace``: generate with
    ``trace=True``) are compared with them (`brf.bytes.precision.compare`).

    Returns:
        per member, ``compare``'s dict (``bytes``, ``dbpb``, ``tv_mean``,
        ``tv_p99``, ``tv_max``, ...), empty when nothing was generated.

    Raises:
        ValueError: a generation without its trace.
    """
    from brf.bytes.lm import score_text
    from brf.bytes.precision import compare
    n = len(generation.data)
    if n == 0:
        return [{} for _ in members]
    if len(generation.trace) < n:
        raise ValueError("measure_precision needs the generation's trace (trace=True)")
    gold = np.frombuffer(generation.data, np.uint8).astype(np.int64)
    text = bytes(prompt) + generation.data
    out = []
    for j, (lm, ctx) in enumerate(zip(members, contexts)):
        ref = score_text(lm, text, context_ids=ctx, **reference._asdict()).logp[len(prompt):]
        rows = np.stack([t["member_logp"][j] for t in generation.trace[:n]])
        out.append(compare(rows, ref, gold))
    return out


def _valid_text(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8 (whole characters)."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _fused(method: str, params: Mapping[str, Any], logp_nxE: np.ndarray,
           w: np.ndarray) -> np.ndarray:
    """The fused byte distribution, float64 [257] (the method's own precision)."""
    if method == "linear":  # exact in float64: the linear pool of the members' rows
        return logsumexp_rows((logp_nxE + np.log(np.where(w > 0, w, 1.0))[:, None]
                               + np.where(w > 0, 0.0, -np.inf)[:, None]).T)
    logq = fuse(method, jnp.asarray(logp_nxE, jnp.float32), jnp.asarray(w, jnp.float32),
                **params)
    logq = np.asarray(logq, np.float64)
    return logq - logsumexp_rows(logq[None])[0]


def _draw(key, logq: np.ndarray, allowed: np.ndarray | None, sampler: Sampler) -> int | None:
    """One event from ``logq`` restricted to ``allowed`` (renormalised) under the
    sampler; None when nothing allowed has mass."""
    if allowed is not None:
        logq = np.where(allowed, logq, -np.inf)
        total = logsumexp_rows(logq[None])[0]
        if total == -np.inf:  # nothing allowed has mass
            return None
        logq = logq - total
    if sampler.greedy:
        return int(np.argmax(logq))
    return int(sample(key, jnp.asarray(logq, jnp.float32), sampler))


__all__ = ["BytePiece", "ByteGeneration", "MODES", "NextTokens", "check_request", "checked_arguments",
           "generate_bytes", "measure_precision", "utf8_allowed"]
