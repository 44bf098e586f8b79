"""Next-byte masses of next-token distributions, along a known byte path.

For a token sequence T (a *hypothesis*: its tokens decode to the text's first
j bytes) and the text's bytes after it, ``x[j:]``, the byte-level view needs,
at each depth d (the next token's first d bytes read, ``s = x[j:j+d]``):

* the mass of every next byte b: the total probability of the tokens that
  start with ``s + b`` -- one range sum of the sorted distribution per child
  of the trie node of ``s`` (`brf.bytes.trie`);
* the probability of each token *equal* to ``s`` (a hypothesis that ends its
  token there spawns a new hypothesis per such token);
* at depth 0 the end-of-text mass: the model's EOS tokens (``cfg.eos_ids``).

**Special tokens.** Control tokens other than EOS decode to no bytes, so a
byte-level model has no event for them. brf conditions each next-token
distribution on "a text token or EOS": every mass above is divided by
``sum(text tokens) + sum(EOS tokens)``. So p(b | T) over the 256 bytes plus
end-of-text sums to one, and a sequence's probability is the product of these
conditioned token probabilities. (Embedding rows past the tokenizer's
vocabulary count as control tokens.)

**Precision.** Range sums come from a sum tree (pairwise sums of the sorted
non-negative probabilities): a range is the sum of at most 2 log2(Vt) tree
nodes, each exact to about log2(Vt) roundings of its own size, so the
relative error of any range -- however small its mass -- is bounded by about
3 log2(Vt) eps and does not depend on the rest of the vocabulary (float32
differences of prefix sums over 262,144 tokens have an absolute error of
about 1e-7, which is all of a 1e-7 mass). Equal-token probabilities and EOS
are read straight from the logits (log-domain, never underflow).

All of a batch's queries run in one jitted call; the host only walks the
trie to list them (`path_queries`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.bytes.trie import ROOT, ByteTrie

EOT = 256  # the end-of-text event: index 256 of a 257-event byte distribution
N_EVENTS = 257
ROWS = 16  # rows per device call (the sum trees take 2 x 2^ceil(log2 Vt) floats each)


class PathTable(NamedTuple):
    """One hypothesis's next-token distribution, read along the text that follows it.

    Depth d means "the next token's first d bytes are ``text[start:start+d]``"
    (node d of the path; depth 0 is the root).

    Attributes:
        start: byte offset where the hypothesis's tokens end.
        rows: float64 [D, 257] log masses: ``rows[d, b]`` (b < 256) is log P(the
            next token starts with text[start:start+d] + b); ``rows[0, 256]`` is
            log P(EOS); ``rows[d > 0, 256]`` is -inf. Conditioned on text + EOS.
        totals: float64 [D] log of the masses of the tokens strictly longer than
            depth d that extend the path's first d bytes (logsumexp of
            ``rows[d, :256]``).
        eq: per depth, (token ids int32 [k], log-probs float64 [k]) of the tokens
            equal to the path's first d bytes (empty at depth 0).
        log_den: log(text + EOS mass) of the raw distribution: a conditioned
            log-prob plus ``log_den`` is the model's own log-prob.
    """
    start: int
    rows: np.ndarray
    totals: np.ndarray
    eq: tuple
    log_den: float

    @property
    def depth(self) -> int:
        return int(self.rows.shape[0])

    # The table interface of `brf.bytes.state` (node is implied by the depth on a path).
    def row(self, depth: int, node: int) -> np.ndarray:
        return self.rows[depth]

    def total(self, depth: int, node: int) -> float:
        return float(self.totals[depth])

    def equal(self, depth: int, node: int) -> tuple[np.ndarray, np.ndarray]:
        return self.eq[depth]


class Queries(NamedTuple):
    """Range and point queries of a batch of rows (built by `path_queries`)."""
    q_row: np.ndarray    # int32 [Q] row of each range query
    q_lo: np.ndarray     # int32 [Q] its range in the sorted order
    q_hi: np.ndarray
    q_depth: np.ndarray  # int32 [Q] depth of the path node whose child it is
    q_byte: np.ndarray   # int32 [Q] that child's byte
    e_row: np.ndarray    # int32 [E] row of each equal-token query
    e_tok: np.ndarray    # int32 [E] token id
    e_depth: np.ndarray  # int32 [E] depth of the path node it equals
    n_depth: np.ndarray  # int32 [R] path nodes of each row


def path_nodes(trie: ByteTrie, text: bytes, start: int) -> list[int]:
    """Trie nodes of text[start:start+d] for d = 0, 1, ... while some token has
    that prefix and start + d <= len(text)."""
    nodes, node, pos, end = [ROOT], ROOT, start, len(text)
    while pos < end:
        node = trie.child(node, text[pos])
        if node < 0:
            break
        nodes.append(node)
        pos += 1
    return nodes


def path_queries(trie: ByteTrie, text: bytes, starts: Sequence[int]) -> Queries:
    """The queries that fill the PathTables of rows starting at ``starts``."""
    q_parts, e_parts, n_depth = [], [], []
    for r, start in enumerate(starts):
        nodes = path_nodes(trie, text, int(start))
        n_depth.append(len(nodes))
        for d, node in enumerate(nodes):
            kids = trie.children(node)
            if kids.size:
                q_parts.append((np.full(kids.size, r), trie.node_lo[kids], trie.node_hi[kids],
                                np.full(kids.size, d), trie.node_byte[kids]))
            if d:
                eq = trie.equal_tokens(node)
                if eq.size:
                    e_parts.append((np.full(eq.size, r), eq, np.full(eq.size, d)))

    def cat(parts, k):
        return (np.concatenate([p[k] for p in parts]).astype(np.int32) if parts
                else np.zeros(0, np.int32))

    return Queries(*(cat(q_parts, k) for k in range(5)), *(cat(e_parts, k) for k in range(3)),
                   np.asarray(n_depth, np.int32))


def _bucket(n: int, least: int = 256) -> int:
    """n rounded up to a power of two (at least ``least``): few compiled shapes."""
    return max(least, 1 << max(0, int(n - 1).bit_length()))


@functools.partial(jax.jit, static_argnames=("levels",))
def _masses(logits_RxV, perm_Vt, eos_ids, q_row, q_lo, q_hi, e_row, e_tok, *, levels):
    """Range sums (as log, conditioned) of sorted probabilities, equal-token and EOS
    log-probs, and each row's log(text + EOS mass)."""
    R, V = logits_RxV.shape
    m = jnp.max(logits_RxV, axis=-1, keepdims=True)
    log_z = m[:, 0] + jnp.log(jnp.sum(jnp.exp(logits_RxV - m), axis=-1))
    n = 1 << levels
    leaves = jnp.exp(jnp.take(logits_RxV, perm_Vt, axis=1) - log_z[:, None])
    leaves = jnp.pad(leaves, ((0, 0), (0, n - perm_Vt.shape[0])))
    # Heap layout: node i has children 2i and 2i + 1; leaves at [n, 2n).
    level, heap = leaves, [leaves]
    for _ in range(levels):
        level = level.reshape(R, -1, 2).sum(-1)
        heap.append(level)
    heap = jnp.concatenate([jnp.zeros((R, 1), leaves.dtype)] + heap[::-1], axis=1).reshape(-1)
    base = q_row * (2 * n)
    lo, hi = q_lo + n, q_hi + n
    acc = jnp.zeros(q_row.shape, leaves.dtype)
    for _ in range(levels + 1):
        live = lo < hi
        left = live & (lo % 2 == 1)
        acc = acc + jnp.where(left, heap[base + lo], 0.0)
        lo = lo + left
        right = live & (hi % 2 == 1)
        acc = acc + jnp.where(right, heap[base + hi - 1], 0.0)
        hi = hi - right
        lo, hi = lo // 2, hi // 2
    eos = jnp.sum(jnp.exp(jnp.take(logits_RxV, eos_ids, axis=1) - log_z[:, None]), axis=-1)
    text = heap.reshape(R, 2 * n)[:, 1]
    log_den = jnp.log(text + eos)
    range_log = jnp.log(acc) - log_den[q_row]
    eq_log = logits_RxV[e_row, e_tok] - log_z[e_row] - log_den[e_row]
    return range_log, eq_log, jnp.log(eos) - log_den, log_den


class DeviceVocab(NamedTuple):
    """What `path_tables` needs on the device, made once per member."""
    perm_Vt: jax.Array
    eos_ids: jax.Array
    levels: int


def device_vocab(trie: ByteTrie, eos_ids: Sequence[int]) -> DeviceVocab:
    """The sorted order and EOS ids of a member, placed on the device."""
    levels = max(1, math.ceil(math.log2(max(2, trie.n_text))))
    return DeviceVocab(jnp.asarray(trie.sorted_ids), jnp.asarray(np.asarray(eos_ids, np.int32)),
                       levels)


def path_tables(vocab: DeviceVocab, trie: ByteTrie, logits_MxV: jax.Array, text: bytes,
                starts: Sequence[int], rows: Sequence[int] | None = None) -> list[PathTable]:
    """PathTables of next-token distributions, each read along the text after it.

    Args:
        vocab: from `device_vocab`.
        trie: the member's trie.
        logits_MxV: logits (device or host); rows beyond those used may be padding.
        text: the bytes the paths follow.
        starts: for each table, its byte offset in ``text``.
        rows: for each table, its row of ``logits_MxV`` (default: 0, 1, ...).

    Returns:
        One PathTable per start.
    """
    rows = np.arange(len(starts)) if rows is None else np.asarray(rows)
    logits_MxV = jnp.asarray(logits_MxV)
    out = []
    for r0 in range(0, len(starts), ROWS):
        idx = np.zeros(ROWS, np.int32)  # a fixed block shape: one compilation per M
        block = rows[r0:r0 + ROWS]
        idx[:len(block)] = block
        out.extend(_tables_block(vocab, trie, _take_rows(logits_MxV, idx), text,
                                 list(starts[r0:r0 + ROWS])))
    return out


@jax.jit
def _take_rows(logits_MxV, idx):
    return jnp.take(logits_MxV, idx, axis=0)


_NO_TOKENS = (np.zeros(0, np.int32), np.zeros(0))


def logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x), axis=-1)) in float64, -inf for rows with no finite entry."""
    top = np.max(x, axis=-1, initial=-np.inf)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(x - safe[..., None]).sum(-1)) + safe


def _tables_block(vocab, trie, logits, text, starts) -> list[PathTable]:
    qs = path_queries(trie, text, starts)
    nq, ne = _bucket(qs.q_row.size), _bucket(qs.e_row.size, 16)

    def pad(a, n):
        return np.pad(a, (0, n - a.size))

    range_log, eq_log, eos_log, log_den = jax.device_get(_masses(
        logits, vocab.perm_Vt, vocab.eos_ids, pad(qs.q_row, nq), pad(qs.q_lo, nq),
        pad(qs.q_hi, nq), pad(qs.e_row, ne), pad(qs.e_tok, ne), levels=vocab.levels))
    range_log = np.asarray(range_log[:qs.q_row.size], np.float64)
    eq_log = np.asarray(eq_log[:qs.e_row.size], np.float64)
    offsets = np.concatenate([[0], np.cumsum(qs.n_depth)])
    rows = np.full((int(offsets[-1]), N_EVENTS), -np.inf)
    rows[offsets[qs.q_row] + qs.q_depth, qs.q_byte] = range_log
    rows[offsets[:-1], EOT] = np.asarray(eos_log[:len(starts)], np.float64)
    totals = logsumexp_rows(rows[:, :EOT])
    e_split = np.searchsorted(qs.e_row, np.arange(len(starts) + 1))
    out = []
    for r, start in enumerate(starts):
        a, b = offsets[r], offsets[r + 1]
        eq = [_NO_TOKENS] * int(b - a)
        lo, hi = e_split[r], e_split[r + 1]
        for d in np.unique(qs.e_depth[lo:hi]):
            sel = lo + np.flatnonzero(qs.e_depth[lo:hi] == d)
            eq[int(d)] = (qs.e_tok[sel], eq_log[sel])
        out.append(PathTable(int(start), rows[a:b], totals[a:b], tuple(eq),
                             float(log_den[r])))
    return out


__all__ = ["EOT", "N_EVENTS", "DeviceVocab", "PathTable", "Queries", "device_vocab",
           "logsumexp_rows", "path_nodes", "path_queries", "path_tables"]
