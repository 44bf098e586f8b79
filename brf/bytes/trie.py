"""The token-byte trie of a vocabulary, as flat arrays.

Sort a vocabulary's *text* tokens by their bytes. A trie node -- a byte string
``s`` that some token starts with -- is then a contiguous range of the sorted
order (every token starting with ``s``), and the tokens *equal* to ``s`` come
first in it. So the mass a next-token distribution gives to "the next token
starts with ``s``" is one range sum over the sorted probabilities, and the
next-byte masses below a node are the range sums of its children, which
partition the node's range after its equal tokens (`brf.bytes.masses`).

Text tokens are the tokens with non-empty bytes (`brf.align.vocab`). Control
tokens (BOS, EOS, PAD, chat markers, unused slots: empty bytes) are not in the
trie; `brf.bytes.masses` explains what happens to their mass.

Nodes are numbered breadth first (root 0, then depth 1, depth 2, ...), each
depth in sorted order, so the children of a node are consecutive node ids.
Built once per vocabulary (vectorised per depth, about a second for Gemma's
262,144 tokens), kept in memory and optionally cached as .npz beside the union
tables (`brf.align.union.default_cache_dir`).
"""

from __future__ import annotations

import os

import numpy as np

from brf import cachefiles
from brf.align.vocab import TokenTable
from brf.errors import UserError

ROOT = 0
TRIE_VERSION = 1


class UnexpressibleByteError(UserError):
    """Text holding a byte (at a place) that no token sequence of a vocabulary can produce."""


class ByteTrie:
    """The token-byte trie of one vocabulary (see the module docstring).

    Attributes:
        kind: the TokenTable's kind (byte-level BPE or SentencePiece).
        digest: the TokenTable's digest (keys caches).
        vocab_size: V of the token table.
        sorted_ids: int32 [Vt]: text token ids in byte order (duplicates by id).
        token_len: int32 [Vt]: their byte lengths.
        node_lo, node_hi: int32 [Nn]: each node's range of the sorted order.
        node_eq: int32 [Nn]: how many tokens of the range equal the node's bytes
            (they come first; more than one where several ids decode to the
            same bytes, e.g. Gemma's 'a' and '<0x61>').
        node_depth: int32 [Nn]: the node's byte length.
        node_byte: uint8 [Nn]: the node's last byte (0 for the root).
        child_start: int32 [Nn]: the id of the node's first child.
        child_count: int32 [Nn]: how many children it has (<= 256).
    """

    _ARRAYS = ("sorted_ids", "token_len", "node_lo", "node_hi", "node_eq", "node_depth",
               "node_byte", "child_start", "child_count")

    def __init__(self, kind: str, digest: str, vocab_size: int, **arrays: np.ndarray):
        self.kind, self.digest, self.vocab_size = kind, digest, int(vocab_size)
        for name in self._ARRAYS:
            setattr(self, name, np.ascontiguousarray(arrays[name]))
        # Host-side lookups run once per byte and hypothesis: plain bytes and
        # lists answer them several times faster than NumPy scalars.
        self._child_bytes = self.node_byte.tobytes()

    @property
    def n_nodes(self) -> int:
        return int(self.node_lo.shape[0])

    @property
    def n_text(self) -> int:
        """Vt, the number of text tokens."""
        return int(self.sorted_ids.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.token_len.max()) if self.n_text else 0

    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return sum(getattr(self, name).nbytes for name in self._ARRAYS)

    def child(self, node: int, byte: int) -> int:
        """The child of ``node`` along ``byte``, or -1."""
        s = int(self.child_start[node])
        i = self._child_bytes.find(bytes((byte,)), s, s + int(self.child_count[node]))
        return i

    def children(self, node: int) -> np.ndarray:
        """Node ids of the children of ``node`` (in byte order)."""
        s = int(self.child_start[node])
        return np.arange(s, s + int(self.child_count[node]))

    def equal_tokens(self, node: int) -> np.ndarray:
        """Token ids whose bytes equal the node's bytes."""
        lo = int(self.node_lo[node])
        return self.sorted_ids[lo:lo + int(self.node_eq[node])]

    def find(self, data: bytes) -> int:
        """The node of a byte string, or -1 when no token starts with it."""
        node = ROOT
        for b in data:
            node = self.child(node, b)
            if node < 0:
                return -1
        return node

    def first_bytes(self) -> frozenset[int]:
        """The bytes some token starts with."""
        return frozenset(self._child_bytes[i] for i in self.children(ROOT))

    def check_text(self, data: bytes) -> None:
        """Raises UnexpressibleByteError naming the first byte no token can start.

        Every byte of a text the vocabulary can express begins some token of
        some tokenization only if a token starts with it; SmolLM2, for one, has
        no token starting with 0x04 or 0xC0.
        """
        first = self.first_bytes()
        for i, b in enumerate(data):
            if b not in first:
                raise UnexpressibleByteError(
                    f"byte {b:#04x} at offset {i} cannot be produced by this vocabulary "
                    f"({self.kind}, {self.vocab_size} tokens): no token starts with it")


def build_trie(table: TokenTable) -> ByteTrie:
    """Builds the trie of a TokenTable (no cache).

    Args:
        table: the vocabulary's exact token bytes.

    Returns:
        The ByteTrie.
    """
    ids = [i for i, (b, c) in enumerate(zip(table.token_bytes, table.control_V)) if b and not c]
    ids.sort(key=lambda i: table.token_bytes[i])  # stable: duplicates stay in id order
    keys = [table.token_bytes[i] for i in ids]
    vt = len(ids)
    length = np.fromiter((len(k) for k in keys), np.int32, count=vt)
    width = int(length.max()) if vt else 0
    mat = np.full((vt, width + 1), -1, np.int16)  # -1 pads past a token's end
    flat = np.frombuffer(b"".join(keys), np.uint8)
    rows = np.repeat(np.arange(vt), length)
    cols = np.arange(flat.shape[0]) - np.repeat(np.cumsum(length) - length, length)
    mat[rows, cols] = flat
    # lcp[i]: common prefix length of sorted tokens i - 1 and i (lcp[0] = 0).
    lcp = np.zeros(vt, np.int32)
    if vt > 1:
        differ = mat[1:] != mat[:-1]
        differ[:, -1] = True
        lcp[1:] = np.argmax(differ, axis=1)
    lo_d, hi_d, eq_d, byte_d, parent_d = [[0]], [[vt]], [[0]], [[0]], [[-1]]
    starts_prev, offset_prev = np.zeros(1, np.int64), 0
    offsets = [0]
    for d in range(1, width + 1):
        breaks = lcp < d  # a node of depth d starts wherever the d-prefix changes
        starts = np.flatnonzero(breaks & (length >= d))
        if starts.size == 0:
            break
        bpos = np.append(np.flatnonzero(breaks), vt)
        ends = bpos[np.searchsorted(bpos, starts, side="right")]
        # Equal tokens lead the range; more than one only for duplicate bytes.
        eq = np.zeros(starts.shape, np.int32)
        run = np.ones(starts.shape, bool)
        while True:
            at = np.minimum(starts + eq, vt - 1)
            run &= (starts + eq < ends) & (length[at] == d)
            if not run.any():
                break
            eq += run
        parent = offset_prev + np.searchsorted(starts_prev, starts, side="right") - 1
        offsets.append(offsets[-1] + len(lo_d[-1]))
        lo_d.append(starts)
        hi_d.append(ends)
        eq_d.append(eq)
        byte_d.append(mat[starts, d - 1])
        parent_d.append(parent)
        starts_prev, offset_prev = starts, offsets[-1]
    node_lo = np.concatenate(lo_d).astype(np.int32)
    parent = np.concatenate(parent_d).astype(np.int64)
    n = node_lo.shape[0]
    depth = np.concatenate([np.full(len(x), d, np.int32) for d, x in enumerate(lo_d)])
    count = np.bincount(parent[1:], minlength=n).astype(np.int32)
    # Children of a node are consecutive ids (BFS order); the first one's id is
    # the first index whose parent is it.
    first = np.searchsorted(parent[1:], np.arange(n)) + 1
    return ByteTrie(table.kind, table.digest, table.size,
                    sorted_ids=np.asarray(ids, np.int32), token_len=length,
                    node_lo=node_lo, node_hi=np.concatenate(hi_d).astype(np.int32),
                    node_eq=np.concatenate(eq_d).astype(np.int32), node_depth=depth,
                    node_byte=np.concatenate(byte_d).astype(np.uint8),
                    child_start=np.where(count > 0, first, 0).astype(np.int32),
                    child_count=count)


def save_trie(path: str | os.PathLike, trie: ByteTrie) -> None:
    """Writes a trie to .npz, atomically (temp file + rename)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    try:
        np.savez(tmp, **{name: getattr(trie, name) for name in ByteTrie._ARRAYS},
                 _kind=np.asarray(trie.kind), _digest=np.asarray(trie.digest),
                 _vocab_size=np.asarray(trie.vocab_size), _version=np.asarray(TRIE_VERSION))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a write that failed (a full disk) leaves nothing
            os.remove(tmp)


def load_trie(path: str | os.PathLike) -> ByteTrie | None:
    """Reads a trie written by `save_trie`; None when of another version.

    Raises:
        OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile: the file
            cannot be read back (truncated, not an .npz, arrays missing).
    """
    with np.load(os.fspath(path)) as z:
        if int(z["_version"]) != TRIE_VERSION:
            return None
        return ByteTrie(str(z["_kind"]), str(z["_digest"]), int(z["_vocab_size"]),
                        **{name: z[name] for name in ByteTrie._ARRAYS})


_MEMORY: dict[str, ByteTrie] = {}


def byte_trie(table: TokenTable, cache_dir: str | os.PathLike | None = None) -> ByteTrie:
    """The trie of a vocabulary, built once per process (and per cache directory).

    Args:
        table: the vocabulary's TokenTable.
        cache_dir: if given, also read / write ``<cache_dir>/trie-<digest>.npz``
            (a file of another vocabulary or version is rebuilt; one that cannot
            be read back is named in a warning and rebuilt; where the folder
            cannot be written the trie stays in memory: brf.cachefiles).

    Returns:
        The ByteTrie (the same object on every call in this process).
    """
    if table.digest in _MEMORY:
        return _MEMORY[table.digest]
    path = None if cache_dir is None else os.path.join(os.fspath(cache_dir),
                                                       f"trie-{table.digest[:24]}.npz")
    trie = None if path is None else cachefiles.read_entry(path, load_trie, "the byte trie")
    if trie is not None and trie.digest != table.digest:
        trie = None
    if trie is None:
        trie = build_trie(table)
        if path is not None:
            cachefiles.write_entry(path, lambda p: save_trie(p, trie),
                                   os.path.dirname(os.fspath(cache_dir)))
    _MEMORY[table.digest] = trie
    return trie


def clear_memory_cache() -> None:
    """Forgets the in-memory tries (tests use it to exercise the disk cache)."""
    _MEMORY.clear()


__all__ = ["ROOT", "ByteTrie", "UnexpressibleByteError", "build_trie", "byte_trie",
           "clear_memory_cache", "load_trie", "save_trie"]
