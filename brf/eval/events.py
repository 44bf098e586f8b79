"""Scoring semantics across tokenizers: co-aligned positions and event tables.

Members with different tokenizers cut the same text at different byte
offsets. brf scores fusion at **co-aligned positions**: byte offsets o of a
segment where *every* member is at a token boundary and every member's next
token is the *same byte string* g (so each member assigns g a probability of
its own, from the same context). At such a position:

* **Event space** — byte strings: the gold string g, every member's top-K
  next-token strings (special tokens excluded), and one ``OTHER`` event for
  the rest of the continuation space. Each member's distribution over these
  events sums to 1.
* **How members' mass is mapped** — a member's top-K tokens and the gold
  token carry their exact probabilities (tokens that decode to the same bytes
  are summed). A listed string outside the member's top-K that the member
  *can* express as one token gets an equal share of the member's tail mass
  ``(1 - listed mass) / (V - K)`` (the stored summaries do not keep the tail);
  a string the member cannot express as one token gets probability 0 from
  that member. Whatever mass is left goes to ``OTHER``.
* **Gold event** — g, always event 0. NLL is per co-aligned position; bits
  per byte divide the summed NLL (in bits) by the bytes of the gold strings.
* **Coverage** — the fraction of positions and of text bytes that are
  co-aligned is reported. Positions where the tokenizers disagree (rarer
  words, whitespace runs) are excluded, so scores describe the co-aligned
  subset, which is easier than the average token: compare methods with each
  other on it, not with numbers from elsewhere.

With one member, or members sharing a tokenizer, every position is
co-aligned and all members' distributions are exact up to the tail rule.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from brf.eval.fitting import EventTable
from brf.eval.scoring import MemberScores

OTHER = b"\x00<OTHER>"


class Coverage(NamedTuple):
    positions: int             # co-aligned positions
    member_positions: tuple    # scored positions of each member
    bytes_covered: int         # gold bytes at co-aligned positions
    bytes_total: int           # text bytes

    def as_dict(self) -> dict:
        return {"positions": self.positions, "member_positions": list(self.member_positions),
                "bytes_covered": self.bytes_covered, "bytes_total": self.bytes_total,
                "fraction_of_bytes": self.bytes_covered / max(1, self.bytes_total),
                "fraction_of_member_positions": [self.positions / max(1, m)
                                                 for m in self.member_positions]}


def _segment_rows(scores: MemberScores, tb: Sequence[bytes | None], s: int,
                  text: bytes) -> dict[int, tuple[int, bytes]]:
    """offset -> (row, gold bytes) for one member and segment."""
    ids = scores.token_ids[scores.tok_starts[s]:scores.tok_starts[s + 1]]
    pieces = [tb[i] or b"" for i in ids]
    joined = b"".join(pieces)
    if joined != text:
        raise ValueError(
            f"segment {s}: a member's tokens decode to {len(joined)} bytes that differ "
            f"from the segment's {len(text)} bytes; the tokenizer is not byte-faithful "
            f"on this text (normalisation?), so positions cannot be aligned")
    ends = np.cumsum([len(p) for p in pieces])
    row0 = scores.row_starts[s]
    out = {}
    for r in range(len(ids) - 1):
        nxt = tb[ids[r + 1]]
        if nxt:  # skip special / empty next tokens
            out[int(ends[r])] = (int(row0 + r), nxt)
    return out


def fill_member_events(logp_E: np.ndarray, events: dict, mass: dict, vocab_size: int,
                       expressible=None) -> None:
    """One member's log-probs over a position's events, in place (the module's rule).

    Args:
        logp_E: the member's row, -inf where it has no mass; OTHER is column
            ``len(events)``.
        events: event key -> column, in order.
        mass: the member's listed events (its top-k and the gold) -> exact log-prob.
        vocab_size: V of the member.
        expressible: the keys the member can express as one token (None: all);
            an unlisted key it can express gets an equal share of its tail mass,
            one it cannot gets 0.
    """
    listed = np.exp(np.array(list(mass.values()), np.float64)).sum()
    tail = max(0.0, 1.0 - listed)
    missing = [key for key in events if key not in mass
               and (expressible is None or key in expressible)]
    share = tail / max(1, vocab_size - len(mass)) if missing else 0.0
    for key, lp in mass.items():
        logp_E[events[key]] = lp
    for key in missing:
        logp_E[events[key]] = np.log(share) if share > 0 else -np.inf
    logp_E[len(events)] = np.log(max(tail - share * len(missing), 1e-30))


def build_event_table(scores: Sequence[MemberScores],
                      token_bytes: Sequence[Sequence[bytes | None]],
                      segments: Sequence[str]) -> tuple[EventTable, Coverage]:
    """Event table over the co-aligned positions of all segments.

    Args:
      scores: each member's MemberScores (same segments, same order).
      token_bytes: each member's id -> decoded bytes (None for special tokens).
      segments: the segment texts.

    Returns:
      (EventTable, Coverage).
    """
    n = len(scores)
    k = scores[0].topk_ids.shape[1]
    vocab = [{b for b in tb if b} for tb in token_bytes]
    rows, golds, segs = [], [], []
    for s, text in enumerate(segments):
        raw = text.encode("utf-8")
        maps = [_segment_rows(sc, tb, s, raw) for sc, tb in zip(scores, token_bytes)]
        for off in sorted(set.intersection(*(set(m) for m in maps))):
            g = maps[0][off][1]
            if all(m[off][1] == g for m in maps):
                rows.append([m[off][0] for m in maps])
                golds.append(g)
                segs.append(s)
    p = len(rows)
    if p == 0:
        raise ValueError("no co-aligned positions: the members never predict the same "
                         "next string from the same offset")
    e_max = 2 + n * k
    logp = np.full((p, n, e_max), -np.inf, np.float32)
    gap = np.zeros((p, n), np.float32)
    for q, (row_ids, g) in enumerate(zip(rows, golds)):
        events = {g: 0}
        lists = []
        for i, (sc, tb) in enumerate(zip(scores, token_bytes)):
            r = row_ids[i]
            mass = {}
            for tid, lp in zip(sc.topk_ids[r], sc.topk_logp[r]):
                b = tb[tid]
                if b:
                    mass[b] = np.logaddexp(mass.get(b, -np.inf), lp)
            if g not in mass:
                mass[g] = sc.gold_logp[r]
            lists.append(mass)
            for b in mass:
                events.setdefault(b, len(events))
        for i, (sc, mass) in enumerate(zip(scores, lists)):
            fill_member_events(logp[q, i], events, mass, sc.vocab_size, vocab[i])
            gap[q, i] = sc.gap[row_ids[i]]
    used = int(np.isfinite(logp).any(axis=(0, 1)).nonzero()[0].max()) + 1
    table = EventTable(logp[:, :, :used], np.zeros(p, np.int64), gap,
                       np.array([len(g) for g in golds], np.int64), np.array(segs, np.int64))
    cov = Coverage(p, tuple(int(sc.row_starts[-1]) for sc in scores),
                   int(table.gold_bytes.sum()),
                   sum(len(t.encode("utf-8")) for t in segments))
    return table, cov
