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

**Precision.** The device computes each row's normalised probabilities in the
sorted order (float32, each exact to its own rounding); the host sums every
queried range of them in float64, element by element (one `np.add.reduceat`
over the block's rows). A range's sum is therefore exact to about
``len(range) * 1e-16`` of *its own* mass, however small that mass is and
whatever the rest of the vocabulary holds (a difference of prefix sums would
carry an absolute error of the whole distribution's size). The ranges a path
asks for nest (the root's children partition the vocabulary, a node's children
its range), so the work is about one pass over the vocabulary per row plus the
sizes of the path's nodes. Equal-token probabilities and EOS are read straight
from the logits (log-domain, never underflow).

A block of rows is one jitted call (normalise, sort, read EOS and equal tokens);
the host walks the trie to list the queries (`path_queries`) and sums the ranges.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.bytes.trie import ROOT, ByteTrie

EOT = 256  # the end-of-text event: index 256 of a 257-event byte distribution
N_EVENTS = 257
ROWS = 16  # rows per device call


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


@jax.jit
def _sorted_probs(logits_RxV, perm_Vt, eos_ids, e_row, e_tok):
    """Each row's probabilities in the sorted order, its EOS mass, and the
    equal-token queries' log-probs (all normalised over the full vocabulary)."""
    m = jnp.max(logits_RxV, axis=-1, keepdims=True)
    log_z = m[:, 0] + jnp.log(jnp.sum(jnp.exp(logits_RxV - m), axis=-1))
    p_RxV = jnp.exp(logits_RxV - log_z[:, None])
    # Normalise, then permute: a gather fused into the exponential is several
    # times slower on XLA:CPU.
    p_RxV = jax.lax.optimization_barrier(p_RxV)
    probs = jnp.take(p_RxV, perm_Vt, axis=1)
    eos = jnp.sum(jnp.take(p_RxV, eos_ids, axis=1), axis=-1)
    eq_log = logits_RxV[e_row, e_tok] - log_z[e_row]
    return probs, eos, eq_log


def range_sums(probs_RxN: np.ndarray, row: np.ndarray, lo: np.ndarray,
               hi: np.ndarray) -> np.ndarray:
    """float64 sums of ``probs_RxN[row, lo:hi]`` (each range non-empty), element by element.

    One `np.add.reduceat` over the flattened rows: the ranges in order of their
    start, each start followed by its end; the sums between one range's end and
    the next one's start are read and dropped (in start order they cover each
    element at most once, or are single elements where ranges nest).
    """
    R, N = probs_RxN.shape
    flat = np.concatenate([np.asarray(probs_RxN).reshape(-1), np.zeros(1, probs_RxN.dtype)])
    a = row.astype(np.int64) * N + lo
    b = row.astype(np.int64) * N + hi
    order = np.argsort(a, kind="stable")
    idx = np.empty(2 * a.size, np.int64)
    idx[0::2], idx[1::2] = a[order], b[order]
    out = np.empty(a.size)
    out[order] = np.add.reduceat(flat, idx, dtype=np.float64)[0::2] if a.size else ()
    return out


class DeviceVocab(NamedTuple):
    """What `path_tables` needs on the device, made once per member."""
    perm_Vt: jax.Array
    eos_ids: jax.Array


def device_vocab(trie: ByteTrie, eos_ids: Sequence[int]) -> DeviceVocab:
    """The sorted order and EOS ids of a member, placed on the device."""
    return DeviceVocab(jnp.asarray(trie.sorted_ids), jnp.asarray(np.asarray(eos_ids, np.int32)))


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
    ne = _bucket(qs.e_row.size, 16)
    probs, eos, eq_log = jax.device_get(_sorted_probs(
        logits, vocab.perm_Vt, vocab.eos_ids, np.pad(qs.e_row, (0, ne - qs.e_row.size)),
        np.pad(qs.e_tok, (0, ne - qs.e_tok.size))))
    R = len(starts)
    text_mass = probs[:R].sum(axis=1, dtype=np.float64)
    eos = np.asarray(eos[:R], np.float64)
    with np.errstate(divide="ignore"):
        log_den = np.log(text_mass + eos)
        range_log = np.log(range_sums(probs, qs.q_row, qs.q_lo, qs.q_hi)) - log_den[qs.q_row]
        eos_log = np.log(eos) - log_den
    eq_log = np.asarray(eq_log[:qs.e_row.size], np.float64) - log_den[qs.e_row]
    offsets = np.concatenate([[0], np.cumsum(qs.n_depth)])
    rows = np.full((int(offsets[-1]), N_EVENTS), -np.inf)
    rows[offsets[qs.q_row] + qs.q_depth, qs.q_byte] = range_log
    rows[offsets[:-1], EOT] = eos_log
    totals = logsumexp_rows(rows[:, :EOT])
    e_split = np.searchsorted(qs.e_row, np.arange(R + 1))
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
           "logsumexp_rows", "path_nodes", "path_queries", "path_tables", "range_sums"]
