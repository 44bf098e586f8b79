"""The union event space of several vocabularies, and its cached tables.

**Event space.** Event 0 is CONTROL: "the member emits a control token" (EOS,
end-of-turn, BOS, PAD, UNK, unused slots, chat markers -- every special token,
see `brf.align.vocab`). Events 1..U-1 are the distinct non-empty byte strings
that some member's text token decodes to, in sorted byte order (so the table
of members (A, B) has the same event ids as (B, A)). A member token maps to
the event of its bytes; tokens that decode to the same bytes (Gemma's '\\n' and
'<0x0A>') and all control tokens of a member share one event, and their mass
is summed. Every member token maps to exactly one event, so a member's aligned
distribution sums to 1 with no renormalisation; strings a member has no token
for get probability 0 (log-prob -inf) from it. Generation treats CONTROL as
"stop": pooling the members' control tokens is what makes "end of text" a
shared event between vocabularies whose EOS tokens differ.

**Anchors** (used by the top-k union's backoff rule, `brf.align.aligners`):
for member i and event u, `anchor_nU[i, u]` is u itself when member i has a
token for u; otherwise the event of member i's *longest token that is a proper
prefix of u's bytes* (the longest piece of u the member can emit in one step),
or -1 when no prefix of u is one of its tokens. CONTROL anchors to itself.

Tables are built once per ordered member set (keyed by the members' token
table digests), kept in memory, and optionally saved as .npz.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from typing import NamedTuple, Sequence

import numpy as np

from brf import cachefiles
from brf.align.vocab import TokenTable

CONTROL = 0


class UnionTable(NamedTuple):
    """Alignment tables of n members onto their union event space.

    Attributes:
        strings: event id -> bytes (event 0, CONTROL, is b"").
        index: per member, int32 [V_i]: token id -> event id.
        anchor_nU: int32 [n, U]: backoff anchor event per member and event (-1: none).
        has_nU: bool [n, U]: member i has a token (or, for CONTROL, a control
            token) for event u.
        digests: the members' TokenTable digests, in member order.
    """

    strings: tuple[bytes, ...]
    index: tuple[np.ndarray, ...]
    anchor_nU: np.ndarray
    has_nU: np.ndarray
    digests: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.strings)

    @property
    def n_members(self) -> int:
        return len(self.index)

    def event_id(self, data: bytes) -> int:
        """The event id of a byte string (KeyError if no member has it)."""
        i = bisect.bisect_left(self.strings, data, lo=1)  # strings[1:] are sorted
        if not data or i >= self.size or self.strings[i] != data:
            raise KeyError(data)
        return i

    def stats(self) -> dict:
        """Sizes: events, text strings shared by all members, only in each member."""
        text = self.has_nU[:, 1:]
        count = text.sum(0)
        return {"events": self.size, "text_strings": self.size - 1,
                "shared_by_all": int((count == self.n_members).sum()),
                "only_in": [int((text[i] & (count == 1)).sum()) for i in range(self.n_members)],
                "member_strings": [int(t.sum()) for t in text],
                "member_vocab": [len(ix) for ix in self.index]}


def _anchors(strings: Sequence[bytes], has_U: np.ndarray, event_of: dict[bytes, int],
             max_len: int) -> np.ndarray:
    """Member anchors: u itself if the member has it, else its longest proper-prefix token."""
    anchor = np.where(has_U, np.arange(len(strings)), -1).astype(np.int32)
    for u in np.flatnonzero(~has_U):
        s = strings[u]
        if u == CONTROL:
            continue
        for n in range(min(len(s) - 1, max_len), 0, -1):
            e = event_of.get(s[:n])
            if e is not None and has_U[e]:
                anchor[u] = e
                break
    return anchor


def build_union(tables: Sequence[TokenTable]) -> UnionTable:
    """Builds the union event space of members' token tables (no cache).

    Args:
        tables: one TokenTable per member, in member order.

    Returns:
        The UnionTable.
    """
    text = sorted({b for t in tables for b, c in zip(t.token_bytes, t.control_V)
                   if not c and b})
    strings = (b"",) + tuple(text)
    event_of = {s: u for u, s in enumerate(strings) if u != CONTROL}
    index, has, anchors = [], [], []
    for t in tables:
        ix = np.fromiter((CONTROL if (c or not b) else event_of[b]
                          for b, c in zip(t.token_bytes, t.control_V)),
                         np.int32, count=t.size)
        has_U = np.zeros(len(strings), bool)
        has_U[ix] = True
        max_len = max(len(b) for b in t.token_bytes)
        index.append(ix)
        has.append(has_U)
        anchors.append(_anchors(strings, has_U, event_of, max_len))
    return UnionTable(strings, tuple(index), np.stack(anchors), np.stack(has),
                      tuple(t.digest for t in tables))


def table_key(tables: Sequence[TokenTable]) -> str:
    """Cache key of an ordered member set: hash of the members' digests."""
    return hashlib.sha256("/".join(t.digest for t in tables).encode()).hexdigest()[:24]


def save_union(path: str | os.PathLike, table: UnionTable) -> None:
    """Writes a UnionTable to an .npz file (atomically: temp file + rename)."""
    lengths = np.asarray([len(s) for s in table.strings], np.int64)
    arrays = {"lengths": lengths,
              "blob": np.frombuffer(b"".join(table.strings), np.uint8),
              "anchor_nU": table.anchor_nU, "has_nU": table.has_nU,
              "digests": np.asarray(table.digests)}
    for i, ix in enumerate(table.index):
        arrays[f"index_{i}"] = ix
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a write that failed (a full disk) leaves nothing
            os.remove(tmp)


def load_union(path: str | os.PathLike) -> UnionTable:
    """Reads a UnionTable written by `save_union`."""
    with np.load(os.fspath(path)) as z:
        blob = z["blob"].tobytes()
        ends = np.cumsum(z["lengths"])
        starts = ends - z["lengths"]
        strings = tuple(blob[a:b] for a, b in zip(starts, ends))
        digests = tuple(str(d) for d in z["digests"])
        index = tuple(z[f"index_{i}"] for i in range(len(digests)))
        return UnionTable(strings, index, z["anchor_nU"], z["has_nU"], digests)


_MEMORY: dict[str, UnionTable] = {}


def default_cache_dir() -> str:
    """`$BRF_CACHE/align` (default ~/.cache/brf/align), beside the model cache."""
    from brf.checkpoints.registry import cache_dir
    return os.path.join(cache_dir(), "align")


def union_table(tables: Sequence[TokenTable], cache_dir: str | os.PathLike | None = None
                ) -> UnionTable:
    """The UnionTable of an ordered member set, built once and cached.

    Args:
        tables: one TokenTable per member.
        cache_dir: if given, also read / write `<cache_dir>/union-<key>.npz`
            (key from the members' digests; a file whose digests differ is rebuilt;
            one that cannot be read back is named in a warning and rebuilt; where
            the folder cannot be written the table stays in memory: brf.cachefiles).

    Returns:
        The UnionTable (the same object on every call in this process).
    """
    key = table_key(tables)
    if key in _MEMORY:
        return _MEMORY[key]
    digests = tuple(t.digest for t in tables)
    table = None
    path = None if cache_dir is None else os.path.join(os.fspath(cache_dir),
                                                       f"union-{key}.npz")
    loaded = None if path is None else cachefiles.read_entry(path, load_union,
                                                             "the union vocabulary table")
    if loaded is not None and loaded.digests == digests:
        table = loaded
    if table is None:
        table = build_union(tables)
        if path is not None:
            cachefiles.write_entry(path, lambda p: save_union(p, table),
                                   os.path.dirname(os.fspath(cache_dir)))
    _MEMORY[key] = table
    return table


def clear_memory_cache() -> None:
    """Forgets the in-memory tables (tests use it to exercise the disk cache)."""
    _MEMORY.clear()


__all__ = ["CONTROL", "UnionTable", "build_union", "clear_memory_cache", "default_cache_dir",
           "load_union",
           "save_union", "table_key", "union_table"]
