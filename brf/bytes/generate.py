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

**A dummy prefix.** A member whose tokenizer puts a space before every text
(`brf.bytes.lm`'s module docstring) reads that space first wherever its
tokenizer would put one after its context (`ByteLM.lead_after`: an empty
prompt after BOS, a chat template that ends with a control token); a prompt
with text after its last control token already holds it, and the generated
bytes go on after it. The member is then conditioned on the lead, its first
token ('▁The') half read, and reports ``member_ids`` that spell the lead too.

**Precision.** With ``threshold=0`` and a beam no smaller than the cover
nothing is pruned and each member's distribution is exact. With pruning,
``pruned`` reports the mass each member dropped; generation never merges, so a
member's kept hypotheses are real tokenizations with their exact probabilities
and their mass is a lower bound of the generated text's probability under the
member (a one-sided bound: nothing bounds a single byte's distribution).
`measure_precision` measures that per byte: it rescores the generated text at
the reference settings (`brf.bytes.REFERENCE`) and compares.

**One loop.** Generation runs in rounds (`_Loop`) that speculative generation
(`brf.bytes.speculative`) shares: a round reads the bytes a drafter proposes, the
law (what the sampler draws from) is computed at each of them and the one after,
and verification emits the accepted drafts and one byte of its own. Plain
generation never drafts, so each of its rounds is the one step described above.

Reproducibility: byte k uses ``fold_in(PRNGKey(seed), k)`` split into a
member-choice key and a byte key (as `brf.ensemble.decode` does per token).
"""

from __future__ import annotations

import dataclasses
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
from brf.fusion.sampling import filter_logprobs, sample
from brf.fusion.speculative import Verdict, verify, verify_greedy
from brf.models import init_cache, prefill_donated
from brf.models.cache import grow

MODES = ("fuse", "mixture_exact", "mixture_per_member")
# tokens per tree-attention call, padded up to one of these (most bytes need 0 or 1)
TREE_BUCKETS = (1, 2, 4, 8, 16, 64, 256)
MAX_CHAIN = 8  # tokens of a guessed canonical continuation computed ahead (speculative)


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


class _Stop(Exception):
    """A round cannot go on at a position: 'context' or 'no_common_byte'."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Member:
    """One member's byte-level reading of the text: its forward passes (`_Tree`), the
    token sequences its hypotheses commit to, its state after the bytes read, and the
    next-token distributions its hypotheses use (``tables``). Byte states are
    immutable, so a round keeps one per position it reads and the member goes on from
    the one at the accepted length."""

    def __init__(self, lm: ByteLM, ctx: Sequence[int], eos_ids: Sequence[int] | None,
                 beam: int, threshold: float):
        self.lm = lm
        self.tree = _Tree(lm, ctx)
        self.eos_ids = tuple(int(i) for i in (lm.eos_ids if eos_ids is None else eos_ids))
        self.seqs = SeqTree()
        self.state = initial_state()
        self.tables: dict = {0: NextTokens(lm.trie, self.tree.first, self.eos_ids)}
        self.beam, self.threshold = beam, threshold
        self.computed = 0  # distributions computed (the first one excluded)
        self.lead = lm.lead_after(ctx)
        if self.lead:
            self._read_lead()

    def _read_lead(self) -> None:
        """Reads the dummy prefix the member's tokenizer puts before the text
        (`ByteLM.lead_after`), then counts offsets from the text after it: its
        hypotheses are then conditioned on the lead (a first token such as '▁The'
        is half read), and every offset is the shared text's."""
        for b in self.lead:
            if self.read(b) is None:
                raise ByteInputError(f"{self.lm.name}: its dummy prefix does not fit in its "
                                     "context")
        L = len(self.lead)
        self.state = ByteState(self.state.offset - L, tuple(
            h._replace(start=h.start - L) for h in self.state.hyps))
        self.seqs.shift(-L)

    def advance(self, state: ByteState, byte: int):
        """(the state after ``byte``, the step's `brf.bytes.state.Step`)."""
        return advance(state, byte, self.tables, self.lm.trie, self.seqs, beam=self.beam,
                       threshold=self.threshold)

    def dist(self, state: ByteState) -> np.ndarray:
        """The next-byte log-distribution [257] at ``state`` (its distributions ready)."""
        return next_byte(state, self.tables)[0]

    def _fit(self, seqs: Sequence[int]) -> bool:
        """Whether every one of ``seqs`` fits in the model's context."""
        return all(self.tree.room(self.seqs, s) for s in seqs)

    def fits(self, state: ByteState) -> bool:
        """Whether every sequence ``state`` still needs a pass for fits in the context."""
        return self._fit(pending(state, self.tables))

    def read(self, byte: int) -> float | None:
        """Reads one byte (of the prompt) and runs the passes it needs: the fraction of
        mass pruning dropped; None when the context is full."""
        state, step = self.advance(self.state, byte)
        try:
            self.ready(state)
        except _Stop:
            return None
        self.state = state
        self.forget(state)
        return step.pruned

    def fetch(self, seqs: Sequence[int]) -> None:
        """Computes the distributions of ``seqs`` in one call (in their order, which has
        parents before children)."""
        todo = [s for s in dict.fromkeys(seqs) if s not in self.tables]
        if not todo:
            return
        logits = self.tree.compute(self.seqs, todo)
        for s, row in zip(todo, logits):
            self.tables[s] = NextTokens(self.lm.trie, row, self.eos_ids)
        self.computed += len(todo)

    def ready(self, state: ByteState, text: bytes | None = None, end: int = 0) -> None:
        """Makes every hypothesis of ``state`` have its distribution; with ``text``, a
        look-ahead to byte ``end`` adds what later bytes will need
        (`brf.bytes.speculative`'s module docstring).

        Raises:
            _Stop('context'): a needed sequence does not fit in the model's context.
        """
        while True:
            need = pending(state, self.tables)
            if not need:
                return
            if not self._fit(need):
                raise _Stop("context")
            extra = [] if text is None else self._lookahead(state, text, end)
            self.fetch(need + [s for s in extra if self.tree.room(self.seqs, s)])

    def _chain(self, seq: int, text: bytes, end: int) -> list[int]:
        """``seq`` followed by the canonical tokens of the text after it, up to ``end``."""
        out, start = [], self.seqs.end[seq]
        if end <= start or start < 0:  # (< 0: inside the dummy prefix)
            return out
        try:
            toks = self.lm.encode(text[start:end])
        except (UnexpressibleByteError, ValueError):
            return out
        cur, pos = seq, start
        for t in toks[:MAX_CHAIN]:
            pos += len(self.lm.codec.table.token_bytes[t])
            if pos > end:
                break
            cur = self.seqs.child(cur, t, pos)
            out.append(cur)
        return out

    def _lookahead(self, state: ByteState, text: bytes, end: int) -> list[int]:
        """An approximate walk from ``state`` to byte ``end`` of ``text``: hypotheses
        without a distribution are set aside (with their canonical continuations),
        the others advance and prune as in the real walk."""
        out, seen = [], set()
        s = state
        while True:
            miss = [h for h in s.hyps if h.seq not in self.tables]
            for h in miss:
                if h.seq not in seen:
                    seen.add(h.seq)
                    out.append(h.seq)
                    out.extend(self._chain(h.seq, text, end))
            s = ByteState(s.offset, tuple(h for h in s.hyps if h.seq in self.tables))
            if s.offset >= end or not s.hyps:
                return out
            try:
                s, _ = self.advance(s, text[s.offset])
            except UnexpressibleByteError:
                return out

    def walk(self, state: ByteState, text: bytes, end: int) -> tuple[list, list]:
        """The states after each byte of ``text[state.offset:end]`` (as far as the
        member can follow them), each with its distributions ready, and the steps.

        Raises:
            _Stop('context') only for the first state (later ones end the walk).
        """
        states, steps = [state], []
        self.ready(state, text, end)
        s = state
        while s.offset < end:
            try:
                s, step = self.advance(s, text[s.offset])
            except UnexpressibleByteError:
                break  # the member gives that byte probability 0: the round stops there
            try:
                self.ready(s, text, end)
            except _Stop:
                states.append(None)  # reached, but its distribution needs a context it lacks
                steps.append(step)
                break
            states.append(s)
            steps.append(step)
        return states, steps

    def forget(self, keep: ByteState) -> None:
        """Drops the distributions no hypothesis of ``keep`` uses."""
        alive = {h.seq for h in keep.hyps}
        for s in [s for s in self.tables if s not in alive]:
            del self.tables[s]

    def tokenization(self, full: bytes) -> tuple[int, ...] | None:
        """The heaviest of the member's hypotheses that tokenize all of ``full`` (its
        tokens after the context), None when every hypothesis ends inside a token. The
        state may lag one byte behind (the last byte emitted is read here, without
        forward passes)."""
        s = self.state
        if s.offset > len(full) or s.offset < len(full) - 1:
            return None
        if s.offset == len(full) - 1:
            if pending(s, self.tables):
                return None
            s, _ = self.advance(s, full[-1])
        whole = [h for h in s.hyps if h.node == ROOT]
        return self.seqs.ext[max(whole, key=lambda h: h.logp).seq] if whole else None


def _members(members: Sequence[ByteLM], contexts, eos_ids, prompt: bytes, beam: int,
             threshold: float) -> list[_Member]:
    """Every member's reader, after its context and the prompt's bytes.

    Raises:
        ByteInputError: a context or prompt that does not fit.
        UnexpressibleByteError: prompt bytes a member cannot read.
    """
    eos_ids = list(eos_ids) if eos_ids is not None else [None] * len(members)
    mems = [_Member(lm, ctx, e, beam, threshold)
            for lm, ctx, e in zip(members, contexts, eos_ids)]
    for b in prompt:
        for m in mems:
            try:
                got = m.read(b)
            except UnexpressibleByteError as e:
                raise UnexpressibleByteError(f"{m.lm.name}: prompt {e}") from None
            if got is None:
                raise ByteInputError(f"{m.lm.name}: the prompt does not fit in its context")
    return mems


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
        computed: per member, next-token distributions computed after the context.
        member_ids: per member, the tokens (after its context) of its heaviest
            hypothesis that tokenizes all of prompt + data -- what it would
            condition on to go on at the token level; None when every kept
            hypothesis ends inside a token.
        trace: per event emitted (``trace=True``): 'logq' (float64 [257], the
            fused distribution in mode 'fuse' before the sampler and the UTF-8 mask;
            the chosen member's in the mixture modes), 'member_logp' ([n, 257]),
            'event', 'member' (mixture modes; else None), 'round' (the round that
            emitted it: the byte's index in plain generation) and 'drafted'
            (speculative: whether it was an accepted draft).
    """
    data: bytes = b""
    text: str = ""
    finish_reason: str | None = None
    pruned: list[list[float]] = dataclasses.field(default_factory=list)
    n_hyp: list[list[int]] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    calls: list[int] = dataclasses.field(default_factory=list)
    computed: list[int] = dataclasses.field(default_factory=list)
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
    mems = _members(members, contexts, eos_ids, prompt, beam, threshold)
    out = ByteGeneration(pruned=[[] for _ in mems], n_hyp=[[] for _ in mems])
    return _Loop(mems, out, prompt=prompt, w=w, mode=mode, method=method,
                method_params=method_params, sampler=sampler, max_bytes=max_bytes, stop=stop,
                seed=seed, utf8=utf8, trace=trace).run(on_piece)


class _Loop:
    """One byte-level generation, plain or speculative: rounds until a finish.

    A round drafts k >= 0 bytes (``drafting``, `brf.bytes.speculative`; None: plain
    generation, which never drafts), every member reads them with its covering
    hypotheses, the target (what plain generation draws from) is computed at each
    drafted position and the one after, and verification
    (`brf.fusion.speculative`) emits the accepted drafts and one event of its own;
    the members go on from their states at the accepted length and read the last
    emitted byte. A round without drafts is plain generation's step: its event is
    drawn as `generate_bytes` documents (a JAX key per byte), in every mode.
    """

    def __init__(self, mems: list[_Member], out: ByteGeneration, *, prompt: bytes,
                 w: np.ndarray, mode: str, method: str, method_params: Mapping[str, Any],
                 sampler: Sampler, max_bytes: int, stop: Sequence[str], seed: int, utf8: bool,
                 trace: bool, drafting=None):
        self.mems, self.out, self.drafting = mems, out, drafting
        self.prompt, self.w, self.mode = bytes(prompt), w, mode
        self.method, self.method_params, self.sampler = method, method_params, sampler
        self.max_bytes, self.utf8, self.trace = max_bytes, utf8, trace
        if drafting is None:  # plain: byte k's keys from fold_in(PRNGKey(seed), k)
            self.key, self.w_dev = jax.random.PRNGKey(seed), jnp.asarray(w, jnp.float32)
        else:  # speculative: the drafts' and verification's draws
            self.rng = np.random.default_rng(seed)
        self.text = TextStream(stop)
        self.data = bytearray()
        self.round = 0

    def _law(self, logp_nxE: np.ndarray, before: bytes) -> dict:
        """The law at a position after ``before`` (the prompt and the bytes up to it):
        'logq' (the fused distribution, or in the mixture modes the chosen member's,
        before the masks and the sampler), 'allowed' (the events every member can
        follow, and with ``utf8`` those keeping the text valid), 'sampler', 'member'
        and, in plain generation, 'key' (the byte's draw)."""
        law = dict(member_logp=logp_nxE, member=None, sampler=self.sampler, key=None)
        if self.drafting is None:
            k_member, law["key"] = jax.random.split(jax.random.fold_in(self.key, len(self.data)))
        if self.mode == "fuse":
            law["logq"] = fused_bytes(self.method, self.method_params, logp_nxE, self.w)
        else:
            law["member"] = int(select_member(k_member, self.w_dev))
            law["logq"] = logp_nxE[law["member"]]
            if self.mode == "mixture_exact":
                law["sampler"] = Sampler()
        allowed = np.isfinite(logp_nxE).all(axis=0)
        if self.utf8:
            allowed &= utf8_allowed(before)
        law["allowed"] = allowed
        return law

    def _round(self) -> tuple[list[int], str | None]:
        """One round: the emitted events (end-of-text included when drawn) and a finish
        reason that arises inside it ('context', 'no_common_byte'; else None)."""
        mems, d = self.mems, self.drafting
        states: list[list] = [[m.state] for m in mems]
        steps: list[list] = [[] for _ in mems]
        draft, p_rows, di, plan = [], None, None, None
        if d is not None:
            plan = d.plan(self)
            di = d.index
            if di is not None:
                try:
                    mems[di].ready(mems[di].state)
                except _Stop as e:
                    return [], e.reason
            draft, p_rows = d.draft(self, plan[0], states, steps)
        base = self.prompt + bytes(self.data)
        text, o0 = base + bytes(draft), len(base)
        for j, m in enumerate(mems):
            if j == di:
                continue  # the member drafter's states are its drafting's
            try:
                states[j], steps[j] = m.walk(m.state, text, o0 + len(draft))
            except _Stop as e:
                return [], e.reason
        laws: dict[int, dict] = {}

        def law_at(i: int) -> dict:
            got = laws.get(i)
            if got is None:
                rows = []
                for j, m in enumerate(mems):
                    chain = states[j]
                    if i >= len(chain):
                        raise AssertionError("a drafted byte a member cannot follow was "
                                             "accepted")  # its target probability is 0
                    s = chain[i]
                    if s is None:
                        raise _Stop("context")
                    if j == di and i == len(chain) - 1:
                        try:
                            m.ready(s)
                        except _Stop:
                            raise _Stop("context") from None
                    rows.append(m.dist(s))
                got = self._law(np.stack(rows), text[:o0 + i])
                if d is not None:
                    got["target"] = _target(got["logq"], got["allowed"], got["sampler"])
                    if got["target"] is None:
                        raise _Stop("no_common_byte")
                laws[i] = got
            return got

        reason = None
        try:
            if d is None:  # a plain step
                law = law_at(0)
                event = _draw(law["key"], law["logq"], law["allowed"], law["sampler"])
                if event is None:  # nothing emitted: no trace row, no step recorded
                    raise _Stop("no_common_byte")
                v = Verdict(0, event)
            elif self.sampler.greedy:
                v = verify_greedy(lambda i: int(np.argmax(law_at(i)["target"])), draft)
            else:
                v = verify(self.rng, lambda i: law_at(i)["target"], draft, p_rows)
            emitted, acc = list(draft[:v.accepted]) + [v.event], v.accepted
        except _Stop as e:
            # A member that cannot follow draft[i] ends its chain at i, where the target
            # gives draft[i] probability 0: the round never looks further.
            acc = min(max(laws, default=-1) + 1, len(draft))  # law_at(acc) stopped it
            emitted, reason = list(draft[:acc]), e.reason
        if d is not None:
            d.settle(plan, len(draft), acc, emitted, reason)
        if self.trace:
            for i, e in enumerate(emitted):
                if i in laws:
                    law = laws[i]
                    self.out.trace.append(dict(logq=law["logq"], member_logp=law["member_logp"],
                                               event=e, member=law["member"],
                                               round=self.round, drafted=i < acc))
        for i in range(min(len(emitted), len(laws))):
            for j in range(len(mems)):
                self.out.n_hyp[j].append(len(states[j][i].hyps))
        # members go on from the state at the accepted length
        for j, m in enumerate(mems):
            m.state = states[j][min(acc, len(states[j]) - 1)] or m.state
            for step in steps[j][:acc]:
                self.out.pruned[j].append(step.pruned)
        self.round += 1
        return emitted, reason

    def _read_emitted(self, event: int) -> str | None:
        """Every member reads the round's last emitted byte (a plain step's event, a
        replacement or a bonus); its new hypotheses get their distributions in the
        next round. 'context' when one of them would not fit."""
        for j, m in enumerate(self.mems):
            s, step = m.advance(m.state, event)
            self.out.pruned[j].append(step.pruned)
            m.state = s
            m.forget(s)
            if not m.fits(s):
                return "context"
        return None

    def run(self, on_piece: Callable[[BytePiece], None] | None) -> ByteGeneration:
        finish = "length"
        data, text, d = self.data, self.text, self.drafting
        while True:
            emitted, reason = self._round()
            end = None
            for i, event in enumerate(emitted):
                if event == EOT:
                    end = "eot"
                else:
                    data.append(event)
                    piece = text.update(utf8_prefix(bytes(data)))
                    if on_piece is not None and piece:
                        on_piece(BytePiece(piece))
                    if text.stopped:
                        end = "stop"
                    # max_bytes, or with utf8 up to 3 more bytes that complete the last
                    # character
                    elif len(data) >= self.max_bytes and (not self.utf8
                                                          or _valid_text(bytes(data))):
                        end = "length"
                if end is not None:
                    if d is not None:
                        d.stats.discard(len(emitted) - i - 1)  # verified past the end
                    break
                if i == len(emitted) - 1 and reason is None:
                    end = self._read_emitted(event)
            if end is None:
                end = reason
            if end is not None:
                finish = end
                break
        piece = text.update(bytes(data).decode("utf-8", errors="replace"), final=True)
        if on_piece is not None:
            on_piece(BytePiece(piece, finish))
        out = self.out
        out.data, out.text, out.finish_reason = bytes(data), text.text, finish
        full = self.prompt + bytes(data)
        out.member_ids = [m.tokenization(full) for m in self.mems]
        out.tokens = [m.tree.tokens for m in self.mems]
        out.calls = [m.tree.calls for m in self.mems]
        out.computed = [m.computed for m in self.mems]
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


def fused_bytes(method: str, params: Mapping[str, Any], logp_nxE: np.ndarray,
           w: np.ndarray) -> np.ndarray:
    """The fused byte distribution, float64 [257] (the method's own precision)."""
    if method == "linear":  # exact in float64: the linear pool of the members' rows
        return logsumexp_rows((logp_nxE + np.log(np.where(w > 0, w, 1.0))[:, None]
                               + np.where(w > 0, 0.0, -np.inf)[:, None]).T)
    logq = fuse(method, jnp.asarray(logp_nxE, jnp.float32), jnp.asarray(w, jnp.float32),
                **params)
    logq = np.asarray(logq, np.float64)
    return logq - logsumexp_rows(logq[None])[0]


def _target(logq: np.ndarray, allowed: np.ndarray, sampler: Sampler) -> np.ndarray | None:
    """The distribution a byte is drawn from (what :func:`_draw` samples): ``logq``
    restricted to ``allowed`` and renormalised, then the sampler's; float64
    probabilities (greedy: one-hot at the argmax). None when nothing allowed has mass."""
    x = np.where(allowed, logq, -np.inf)
    top = np.max(x)
    if top == -np.inf:
        return None
    if sampler.greedy:
        out = np.zeros(N_EVENTS)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x - top
    x = x - np.log(np.exp(x).sum())
    if sampler != Sampler():
        x = np.asarray(filter_logprobs(jnp.asarray(x, jnp.float32), sampler), np.float64)
    p = np.exp(x)
    return p / p.sum()


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
           "fused_bytes", "generate_bytes", "measure_precision", "utf8_allowed"]
