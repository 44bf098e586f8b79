"""Scoring semantics across tokenizers: co-aligned positions and event tables.

Members with different tokenizers cut the same text at different byte
offsets. brf scores fusion at **co-aligned positions**: byte offsets o of a
segment where *every* member is at a token boundary and every member's next
token is the *same byte string* g (so each member assigns g a probability of
its own, from the same context). At such a position:

* **Event space** — byte strings: every member's top-K next-token strings
  (special tokens excluded) and one ``OTHER`` event for the rest of the
  continuation space. The gold string does not add an event: which events a
  position has must not depend on the answer (a method that favours events
  outside the members' lists would otherwise find the gold among them). Each
  member's distribution over these events sums to 1.
* **How members' mass is mapped** — a member's top-K tokens carry their exact
  probabilities (tokens that decode to the same bytes are summed). A listed
  string outside the member's top-K that the member *can* express as one token
  gets an equal share of the member's tail mass ``(1 - top-K mass) / (V - K)``
  (the stored summaries keep no more of the tail; the gold is no exception);
  a string the member cannot express as one token gets probability 0 from
  that member. Whatever mass is left goes to ``OTHER``.
* **Gold event** — g's column when some member lists it. Otherwise g is one of
  the strings ``OTHER`` stands for: the gold event is ``OTHER`` and the fused
  probability of g is ``q(OTHER) * s`` with ``s`` the members' mean share of g
  in their tails, ``mean_i p_i(g) / (1 - top-K mass of i)`` (at most 1, and
  summing to at most 1 over the unlisted strings, so the scores stay proper).
  ``s`` is the same for every method, so it moves no comparison; it is the
  table's ``gold_offset`` (``log s``, 0 where the gold is listed), added to
  every NLL so that absolute numbers are per string, and such a position gives
  no top-1 credit. NLL is per co-aligned position; bits per byte divide the
  summed NLL (in bits) by the bytes of the gold strings.
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

from brf.event_table import EventTable
from brf.eval.fitting import NLL_CAP
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
        mass: the member's listed events (its top-k) -> exact log-prob.
        vocab_size: V of the member.
        expressible: the keys the member can express as one token (None: all);
            an unlisted key it can express gets an equal share of its tail mass,
            one it cannot gets 0.
    """
    tail = tail_mass(mass)
    missing = [key for key in events if key not in mass
               and (expressible is None or key in expressible)]
    share = tail / max(1, vocab_size - len(mass)) if missing else 0.0
    for key, lp in mass.items():
        logp_E[events[key]] = lp
    for key in missing:
        logp_E[events[key]] = np.log(share) if share > 0 else -np.inf
    logp_E[len(events)] = np.log(max(tail - share * len(missing), 1e-30))


def tail_mass(mass: dict) -> float:
    """1 minus the probability of a member's listed events (at least 0)."""
    return max(0.0, 1.0 - float(np.exp(np.array(list(mass.values()), np.float64)).sum()))


def fill_position(logp_NxE: np.ndarray, gold, lists: Sequence[dict],
                  gold_logp: Sequence[float], vocab_sizes: Sequence[int],
                  expressible: Sequence | None = None) -> tuple[int, float]:
    """One position's rows of an event table, in place; the module's rules.

    Args:
      logp_NxE: the position's [n, E] rows (-inf filled).
      gold: the gold key (a byte string, or a token id for same-tokenizer tables).
      lists: each member's top-k keys -> exact log-prob.
      gold_logp: each member's exact log-prob of the gold (used only when no member
        lists it, for the gold's share of OTHER).
      vocab_sizes: each member's V.
      expressible: each member's one-token keys (None: every key, every member).

    Returns:
      (the gold event's column, the gold offset: 0 when the gold is listed, else the
      log of its share ``s`` of OTHER, strictly negative).
    """
    events: dict = {}
    for mass in lists:
        for key in mass:
            events.setdefault(key, len(events))
    for i, mass in enumerate(lists):
        fill_member_events(logp_NxE[i], events, mass, vocab_sizes[i],
                           None if expressible is None else expressible[i])
    if gold in events:
        return events[gold], 0.0
    shares = [min(1.0, float(np.exp(lp)) / t) if t > 0 else 0.0
              for lp, t in zip(gold_logp, (tail_mass(m) for m in lists))]
    s = float(np.mean(shares))
    return len(events), min(float(np.log(s)), -1e-12) if s > 0 else -NLL_CAP


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
    e_max = 1 + n * k
    logp = np.full((p, n, e_max), -np.inf, np.float32)
    gap = np.zeros((p, n), np.float32)
    gold_col = np.zeros(p, np.int64)
    offset = np.zeros(p, np.float64)
    for q, (row_ids, g) in enumerate(zip(rows, golds)):
        lists = []
        for sc, tb, r in zip(scores, token_bytes, row_ids):
            mass = {}
            for tid, lp in zip(sc.topk_ids[r], sc.topk_logp[r]):
                b = tb[tid]
                if b:
                    mass[b] = np.logaddexp(mass.get(b, -np.inf), lp)
            lists.append(mass)
        gold_col[q], offset[q] = fill_position(
            logp[q], g, lists, [sc.gold_logp[r] for sc, r in zip(scores, row_ids)],
            [sc.vocab_size for sc in scores], vocab)
        gap[q] = [sc.gap[r] for sc, r in zip(scores, row_ids)]
    used = int(np.isfinite(logp).any(axis=(0, 1)).nonzero()[0].max()) + 1
    table = EventTable(logp[:, :, :used], gold_col, gap,
                       np.array([len(g) for g in golds], np.int64), np.array(segs, np.int64),
                       offset)
    cov = Coverage(p, tuple(int(sc.row_starts[-1]) for sc in scores),
                   int(table.gold_bytes.sum()),
                   sum(len(t.encode("utf-8")) for t in segments))
    return table, cov
