"""Drafters for speculative fused decoding: their settings, their drafts, their record.

Speculative fused decoding (`brf.ensemble.speculative` on tokens,
`brf.bytes.speculative` on bytes) lets a *drafter* propose up to k tokens (or
bytes) that every member then verifies at once; the accept / resample rule
(`brf.fusion.speculative`) keeps the text's law that of plain fused decoding.
This module holds what both levels share, below them in the layering:

* a drafter's spec (`parse_drafter`): ``member(k=4, index=i)`` (a member's own
  model drafts; default the one with the fewest parameters) or ``ngram(n=3, k=6,
  min_n=1)`` (no model: the continuation of the latest earlier occurrence of the
  context's last n items, `ngram_draft`); ``adaptive=True`` lets k move between
  rounds (`KSchedule`);
* the acceptance statistics of a generation (`SpecStats`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from brf.errors import UserError
from brf.specs import SpecError, parse_spec


class DrafterError(UserError):
    """A speculative drafter's spec or setting is invalid (a user error)."""


DRAFTERS = ("member", "ngram")


# ----------------------------------------------------------------------------- drafter specs

@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """A drafter (module docstring).

    Attributes:
        kind: 'member' or 'ngram'.
        k: the most tokens (bytes) a round drafts (>= 1).
        index: member drafter: which member drafts (None: the smallest).
        n, min_n: n-gram drafter: the longest and shortest suffix matched.
        adaptive: adapt k between rounds (at most ``k``).
        text: the spec as given (for reports).
    """
    kind: str
    k: int
    index: int | None = None
    n: int = 3
    min_n: int = 1
    adaptive: bool = False
    text: str = ""


_PARAMS = {"member": {"k", "index", "adaptive"}, "ngram": {"k", "n", "min_n", "adaptive"}}
_DEFAULT_K = {"member": 4, "ngram": 6}


def _int_param(spec: str, key: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise DrafterError(f"speculative drafter {spec!r}: {key} must be an integer "
                                 f">= {least}; got {value!r}")
    return value


def parse_drafter(spec: str | DraftSpec | None) -> DraftSpec | None:
    """A drafter from its spec string: ``'member(k=4)'``, ``'member(index=1, k=6,
    adaptive=True)'``, ``'ngram(n=3, k=6)'``; '' or None: no speculation.

    Raises:
        DrafterError: an unknown drafter or parameter, k < 1, n < 1,
            min_n outside [1, n], a negative index, adaptive not a bool.
    """
    if spec is None or isinstance(spec, DraftSpec):
        return spec
    if not isinstance(spec, str):
        raise DrafterError(f"a speculative drafter is a spec string such as "
                                 f"'member(k=4)' or 'ngram(n=3, k=6)'; got {spec!r}")
    if not spec.strip():
        return None
    try:
        name, params = parse_spec(spec, "speculative drafter")
    except SpecError as e:
        raise DrafterError(str(e)) from None
    if name not in DRAFTERS:
        raise DrafterError(f"unknown speculative drafter {name!r} in {spec!r}; use "
                                 "'member(k=4)' (a member drafts) or 'ngram(n=3, k=6)' "
                                 "(prompt lookup)")
    unknown = set(params) - _PARAMS[name]
    if unknown:
        raise DrafterError(f"speculative drafter {spec!r}: unknown parameter(s) "
                                 f"{sorted(unknown)}; {name} takes {sorted(_PARAMS[name])}")
    k = _int_param(spec, "k", params.get("k", _DEFAULT_K[name]), 1)
    adaptive = params.get("adaptive", False)
    if not isinstance(adaptive, bool):
        raise DrafterError(f"speculative drafter {spec!r}: adaptive must be True or "
                                 f"False; got {adaptive!r}")
    if name == "member":
        index = params.get("index")
        if index is not None:
            index = _int_param(spec, "index", index, 0)
        return DraftSpec("member", k, index=index, adaptive=adaptive, text=spec.strip())
    n = _int_param(spec, "n", params.get("n", 3), 1)
    min_n = _int_param(spec, "min_n", params.get("min_n", 1), 1)
    if min_n > n:
        raise DrafterError(f"speculative drafter {spec!r}: min_n ({min_n}) must be at "
                                 f"most n ({n})")
    return DraftSpec("ngram", k, n=n, min_n=min_n, adaptive=adaptive, text=spec.strip())


def drafter_index(spec: DraftSpec, sizes: Sequence[int], names: Sequence[str]) -> int:
    """The drafting member: ``spec.index``, else the one with the fewest parameters."""
    if spec.index is None:
        return int(np.argmin(sizes))
    if spec.index >= len(sizes):
        raise DrafterError(f"speculative drafter {spec.text!r}: index {spec.index} but "
                                 f"the ensemble has {len(sizes)} members ({list(names)})")
    return spec.index


def param_count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


class KSchedule:
    """How many tokens the next round drafts (``adaptive``: module docstring)."""

    def __init__(self, spec: DraftSpec):
        self.k_max, self.adaptive = spec.k, spec.adaptive
        self.k = spec.k if not spec.adaptive else min(spec.k, 2)

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(1, self.k - 1)


def ngram_draft(history: Sequence[int] | bytes, n: int, min_n: int, k: int) -> list[int]:
    """The up to k items that followed the most recent earlier occurrence of the
    last m items of ``history`` (m = n, n - 1, .., min_n; the longest that matches)."""
    if k < 1:
        return []
    h = np.frombuffer(history, np.uint8) if isinstance(history, (bytes, bytearray)) \
        else np.asarray(history, np.int64)
    L = len(h)
    for m in range(min(n, L - 1), min_n - 1, -1):
        if m < 1:
            break
        tail = h[L - m:]
        # windows ending before the tail itself: starts 0 .. L - m - 1
        win = np.lib.stride_tricks.sliding_window_view(h[:L - 1], m)
        hits = np.flatnonzero((win == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + m
            return [int(x) for x in h[start:start + k]]
    return []


@dataclasses.dataclass
class SpecStats:
    """Acceptance statistics of one sequence (or summed over several).

    Attributes:
        drafter: the drafter's spec.
        unit: 'tokens' or 'bytes'.
        rounds: verification rounds.
        drafted: draft tokens (bytes) proposed and examined.
        accepted: draft tokens accepted.
        emitted: tokens (bytes) emitted: accepted + one per round, less those past
            the end of the sequence (an EOS, a stop string or the length limit inside
            a round; :meth:`discard`).
        by_k: per k (the round's draft budget): [rounds, drafted, accepted].
    """
    drafter: str = ""
    unit: str = "tokens"
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    by_k: dict = dataclasses.field(default_factory=dict)

    def add(self, k: int, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        row = self.by_k.setdefault(int(k), [0, 0, 0])
        row[0] += 1
        row[1] += drafted
        row[2] += accepted

    def discard(self, n: int) -> None:
        """Takes back ``n`` tokens (bytes) a round verified past the sequence's end:
        they were never emitted (``emitted`` then equals the sequence's length)."""
        self.emitted -= n

    def merge(self, other: "SpecStats") -> "SpecStats":
        out = SpecStats(self.drafter or other.drafter, self.unit, self.rounds + other.rounds,
                        self.drafted + other.drafted, self.accepted + other.accepted,
                        self.emitted + other.emitted,
                        {k: list(v) for k, v in self.by_k.items()})
        for k, v in other.by_k.items():
            row = out.by_k.setdefault(k, [0, 0, 0])
            for j in range(3):
                row[j] += v[j]
        return out

    def summary(self) -> dict:
        """JSON-ready: acceptance rate (accepted / drafted) and mean accepted per round."""
        return dict(drafter=self.drafter, unit=self.unit, rounds=self.rounds,
                    drafted=self.drafted,
                    accepted=self.accepted, emitted=self.emitted,
                    acceptance=round(self.accepted / self.drafted, 4) if self.drafted else None,
                    mean_accepted=round(self.accepted / self.rounds, 3) if self.rounds else None,
                    per_round=round(self.emitted / self.rounds, 3) if self.rounds else None,
                    by_k={str(k): dict(rounds=v[0], drafted=v[1], accepted=v[2])
                          for k, v in sorted(self.by_k.items())})


__all__ = ["DRAFTERS", "DraftSpec", "DrafterError", "KSchedule", "SpecStats", "drafter_index",
           "ngram_draft", "param_count", "parse_drafter"]
