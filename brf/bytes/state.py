"""Hypotheses over token sequences: the incremental state of a byte-level view.

A token-level model defines a model over bytes. After reading bytes x[:k] its
*cover* is every token sequence t_1..t_m whose first m - 1 tokens decode to a
proper prefix x[:j] (j < k) and whose last token starts with the rest, x[j:k]
(it may run past k). The prefix probability P(x[:k]) is the total probability
of the cover; P(b | x[:k]) = P(x[:k] b) / P(x[:k]); and end-of-text is the
mass of the sequences that decode to exactly x[:k] and then emit EOS.

The state keeps the cover as *hypotheses*: a committed token sequence T (a
node of a `SeqTree`, with log p(T)) whose tokens decode to x[:start], and the
trie node of x[start:k], the part of its next token read so far (the root
when start == k: T has just completed a token and needs its next-token
distribution, i.e. a forward pass). Each hypothesis's next-token distribution
is a *table* (`brf.bytes.masses.PathTable` when the text is known) that gives
the next-byte masses at any depth of its partial token, so a distribution
serves every byte inside the token it predicts.

One step (`advance`) reads byte b. A hypothesis whose partial token can go on
with b keeps the tokens strictly longer than its new partial bytes (weight
p(T) * their mass); each token *equal* to the new partial bytes spawns a new
hypothesis T + t at the root (weight p(T) p(t | T)), which needs a forward pass
before the next byte. Without pruning the weights sum to exactly P(x[:k+1]).

Pruning bounds the work: hypotheses whose weight is below ``threshold`` times
the total are dropped, then all but the ``beam`` heaviest; a *kept* hypothesis
(the canonical tokenization's, in scoring) is never dropped. A spawned
hypothesis is weighed before its forward pass, so a pruned one costs nothing.
Every step reports the fraction of the mass it dropped.

Merging (``max_lag``, scoring only: it needs a protected tokenization). A
hypothesis that left the protected (canonical) tokenization and has since read
exactly the protected tokens, at the same bytes, for ``max_lag`` tokens is
merged into the protected hypothesis that ends at the same byte: its mass is
added there, and from then on it is read from the protected tokenization's
next-token distributions (the two contexts differ only before those tokens).
The prefix mass is kept, so nothing is lost from it; what changes is the
distribution the merged mass follows. Such shadows would otherwise each need a
forward pass per token for as long as they last (often the rest of the text).
Every step reports the fraction of the mass it merged; ``max_lag=0`` never
merges. The state is immutable; tables live in a mapping the driver fills (`pending` says which
hypotheses still need one).
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from brf.bytes.masses import logsumexp_rows
from brf.bytes.trie import ROOT, ByteTrie, UnexpressibleByteError
from brf.errors import UserError


class ByteInputError(UserError):
    """A bad byte-level setting (beam size, prune threshold, member)."""


def check_bounds(beam: int, threshold: float, max_lag: int = 0) -> None:
    """Raises ByteInputError unless beam >= 1, 0 <= threshold < 1 and max_lag >= 0."""
    if isinstance(beam, bool) or not isinstance(beam, (int, np.integer)) or beam < 1:
        raise ByteInputError(f"beam size must be an integer >= 1; got {beam!r}")
    if not (isinstance(threshold, (int, float, np.floating)) and 0.0 <= threshold < 1.0):
        raise ByteInputError(f"prune threshold must lie in [0, 1); got {threshold!r}")
    if isinstance(max_lag, bool) or not isinstance(max_lag, (int, np.integer)) or max_lag < 0:
        raise ByteInputError(f"max_lag must be an integer >= 0 (0: never merge); got {max_lag!r}")


class Table(Protocol):
    """A hypothesis's next-token distribution as next-byte masses (log, conditioned)."""

    def row(self, depth: int, node: int) -> np.ndarray: ...        # [257]
    def total(self, depth: int, node: int) -> float: ...            # log mass below, strictly longer
    def equal(self, depth: int, node: int) -> tuple[np.ndarray, np.ndarray]: ...  # ids, log-probs


class SeqTree:
    """Committed token sequences as a tree hanging off the context.

    Sequences 0..n are the prefixes of a protected tokenization c_1..c_n of
    the text (the canonical one, in scoring): sequence i is c_1..c_i and ends
    at byte ``ends[i - 1]``. Other sequences are added as hypotheses spawn
    them; each is a protected prefix (its *base*) followed by extra tokens.
    """

    def __init__(self, protected: Sequence[int] = (), ends: Sequence[int] = ()):
        n = len(protected)
        self.n_protected = n
        self.token = [-1] + [int(t) for t in protected]
        self.parent = list(range(-1, n))
        self.end = [0] + [int(e) for e in ends]
        self.base = list(range(n + 1))
        self.ext: list[tuple[int, ...]] = [()] * (n + 1)
        # synced[s]: how many of s's last tokens are the protected tokens ending at
        # the same bytes (s left the protected path earlier and follows it again).
        self.synced = [0] * (n + 1)
        self._kids = {(i, self.token[i + 1]): i + 1 for i in range(n)}
        self._at_end = {int(e): i + 1 for i, e in enumerate(ends)}

    def __len__(self) -> int:
        return len(self.token)

    def child(self, seq: int, token: int, end: int) -> int:
        """The sequence ``seq`` + ``token`` (created on first use), ending at byte ``end``."""
        key = (seq, int(token))
        got = self._kids.get(key)
        if got is None:
            got = len(self.token)
            self._kids[key] = got
            self.token.append(int(token))
            self.parent.append(seq)
            self.end.append(int(end))
            self.base.append(self.base[seq])
            self.ext.append(self.ext[seq] + (int(token),))
            i = self._at_end.get(int(end))
            same = i is not None and self.token[i] == int(token)
            self.synced.append(self.synced[seq] + 1 if same else 0)
        return got

    def shift(self, by: int) -> None:
        """Moves every sequence's end ``by`` bytes (offsets counted from elsewhere)."""
        self.end = [e + by for e in self.end]
        self._at_end = {e + by: i for e, i in self._at_end.items()}

    def is_protected(self, seq: int) -> bool:
        return seq <= self.n_protected

    def protected_at(self, end: int) -> int:
        """The protected sequence ending at byte ``end`` (-1: none ends there)."""
        return self._at_end.get(int(end), -1)

    def protected_end(self, seq: int) -> int:
        """Where the protected next token of a protected sequence ends (-1: none)."""
        return self.end[seq + 1] if seq < self.n_protected else -1


class Hyp(NamedTuple):
    """One hypothesis (see the module docstring).

    Attributes:
        seq: its committed tokens (a SeqTree id).
        start: the byte offset where they end.
        logp: log p(committed tokens | context), conditioned as in `brf.bytes.masses`.
        node: trie node of the partial token read since ``start``.
        keep: never pruned.
    """
    seq: int
    start: int
    logp: float
    node: int
    keep: bool


class ByteState(NamedTuple):
    """The hypotheses after reading ``offset`` bytes."""
    offset: int
    hyps: tuple[Hyp, ...]


class Step(NamedTuple):
    """What `advance` did.

    Attributes:
        pruned: fraction of the new prefix's mass dropped by pruning.
        log_mass: log of the new prefix's mass before pruning (the units of
            the hypotheses' logp: the old state's mass times P(byte | old state)).
        kept: hypotheses kept.
        dropped: hypotheses dropped by pruning.
        merged: fraction of the new prefix's mass merged into the protected
            hypothesis (``max_lag``; kept, but read from the protected path).
    """
    pruned: float
    log_mass: float
    kept: int
    dropped: int
    merged: float = 0.0


def initial_state() -> ByteState:
    """Nothing read yet: the context alone (sequence 0), to be kept."""
    return ByteState(0, (Hyp(0, 0, 0.0, ROOT, True),))


def pending(state: ByteState, tables: Mapping[int, Table]) -> list[int]:
    """Sequences of the state's hypotheses that still need a table (a forward pass)."""
    return [h.seq for h in state.hyps if h.seq not in tables]


def next_byte(state: ByteState, tables: Mapping[int, Table]) -> tuple[np.ndarray, float]:
    """The next-byte distribution over 257 events (256 bytes, then end-of-text).

    Returns:
        (log-probs float64 [257], log of the hypotheses' total mass).
    """
    k = state.offset
    rows = np.stack([tables[h.seq].row(k - h.start, h.node) + h.logp for h in state.hyps])
    joint = logsumexp_rows(rows.T)
    total = float(logsumexp_rows(joint[None])[0])
    return joint - total, total


def _logsumexp(xs: Sequence[float]) -> float:
    """log(sum(exp(x))) of a few floats (-inf for none or all -inf)."""
    top = max(xs, default=-math.inf)
    if top == -math.inf:
        return -math.inf
    return top + math.log(math.fsum(math.exp(x - top) for x in xs))


def advance(state: ByteState, byte: int, tables: Mapping[int, Table], trie: ByteTrie,
            seqs: SeqTree, *, beam: int, threshold: float,
            max_lag: int = 0) -> tuple[ByteState, Step]:
    """Reads one byte (see the module docstring).

    Raises:
        UnexpressibleByteError: no hypothesis can produce the byte.
    """
    k = state.offset
    weights, hyps, lagging = [], [], []
    for h in state.hyps:
        t = tables[h.seq]
        d = k - h.start
        if t.row(d, h.node)[byte] == -math.inf:
            continue
        node = trie.child(h.node, byte)
        tot = t.total(d + 1, node)
        if tot > -math.inf:  # the tokens strictly longer than the partial bytes
            keep = h.keep and k + 1 < seqs.protected_end(h.seq)
            weights.append(h.logp + tot)
            hyps.append(Hyp(h.seq, h.start, h.logp, node, keep))
            lagging.append(False)
        ids, logq = t.equal(d + 1, node)
        for tok, lq in zip(ids.tolist(), logq.tolist()):
            if lq == -math.inf:
                continue
            seq = seqs.child(h.seq, tok, k + 1)
            weights.append(h.logp + lq)
            hyps.append(Hyp(seq, k + 1, h.logp + lq, ROOT, h.keep and seqs.is_protected(seq)))
            lagging.append(max_lag > 0 and seqs.synced[seq] >= max_lag)
    if not hyps:
        raise UnexpressibleByteError(f"byte {byte:#04x} at offset {k}: no token sequence "
                                     "covering the text so far can continue with it")
    # A few hypotheses a byte: plain floats are several times faster here than NumPy.
    w = weights
    log_mass = _logsumexp(w)
    merged = 0.0
    if any(lagging):  # merged into the protected hypothesis that ends here (kept)
        j = next((j for j, h in enumerate(hyps) if h.keep and h.start == k + 1
                  and h.seq == seqs.protected_at(k + 1)), None)
        if j is not None:
            extra = _logsumexp([x for x, m in zip(w, lagging) if m])
            merged = math.exp(extra - log_mass)
            w[j] = float(np.logaddexp(w[j], extra))
            hyps[j] = hyps[j]._replace(logp=w[j])
            w = [x for x, m in zip(w, lagging) if not m]
            hyps = [h for h, m in zip(hyps, lagging) if not m]
            lagging = [False] * len(hyps)
    floor = log_mass + math.log(threshold) if threshold > 0 else -math.inf
    ok = [h.keep or (x >= floor and not lag) for h, x, lag in zip(hyps, w, lagging)]
    if sum(ok) > beam:
        n_keep = sum(h.keep for h in hyps)
        # the protected ones first, then by weight (ties: in order)
        order = sorted(range(len(w)), key=lambda i: (not hyps[i].keep, -w[i]))
        ok = [False] * len(w)
        for i in order[:max(beam, n_keep)]:
            ok[i] = True
    lost = [x for x, o in zip(w, ok) if not o]
    pruned = math.exp(_logsumexp(lost) - log_mass) if lost else 0.0
    kept = tuple(h for h, o in zip(hyps, ok) if o)
    dropped = len(lost)
    return ByteState(k + 1, kept), Step(pruned, log_mass, len(kept), dropped, merged)


__all__ = ["ByteInputError", "ByteState", "Hyp", "SeqTree", "Step", "Table", "advance",
           "check_bounds", "initial_state", "next_byte", "pending"]
