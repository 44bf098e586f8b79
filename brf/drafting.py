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
* the break-even rule (`KSchedule`): a drafted token costs a share of a plain fused
  step (``cost``; measured defaults in `DRAFT_COST`), so drafting pays only while
  the drafts' acceptance is above that share. Below it the loop stops drafting and
  each round is a plain step; it drafts again once the acceptance it still observes
  (the n-gram drafter's would-be drafts, checked for free against what is emitted;
  a one-token probe every `PROBE_EVERY` paused rounds for the member drafter) climbs
  back above it;
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
        cost: a drafted token's cost as a share of one plain fused step (verifying it,
            and drafting it for the member drafter): drafting pauses while the
            acceptance is below it (`KSchedule`). None: the level's measured default
            (`DRAFT_COST`); 0: never pause.
        text: the spec as given (for reports).
    """
    kind: str
    k: int
    index: int | None = None
    n: int = 3
    min_n: int = 1
    adaptive: bool = False
    cost: float | None = None
    text: str = ""

    def within(self, limit: int) -> "DraftSpec":
        """This drafter with k at most ``limit``, what a round can use (a generation's
        max_new_tokens or max_bytes: no round emits more, and a round's last drafted
        token is never verified past it). A larger k drafts nothing more; the
        schedule (`KSchedule`) and a compiled round's shapes grow with k, so
        ``ngram(k=1000000000000)`` would never end its first round."""
        return dataclasses.replace(self, k=max(1, min(self.k, int(limit))))


# The most tokens (bytes) one round may draft. A round verifies its drafts in one
# forward pass and accepts the i-th only after the i - 1 before it, so beyond a few
# dozen nothing more is accepted, while the schedule's choice of k (`KSchedule`)
# costs k^2 a round: k=1000 already took twice k=6; k=100000 never finished.
MAX_K = 1024

_PARAMS = {"member": {"k", "index", "adaptive", "cost"},
           "ngram": {"k", "n", "min_n", "adaptive", "cost"}}
_DEFAULT_K = {"member": 4, "ngram": 6}


def _int_param(spec: str, key: str, value, least: int, most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise DrafterError(f"speculative drafter {spec!r}: {key} must be an integer "
                           f">= {least}; got {value!r}")
    if most is not None and value > most:
        raise DrafterError(f"speculative drafter {spec!r}: {key} must be an integer "
                           f"<= {most} (what a round can use); got {value!r}")
    return value


def parse_drafter(spec: str | DraftSpec | None) -> DraftSpec | None:
    """A drafter from its spec string: ``'member(k=4)'``, ``'member(index=1, k=6,
    adaptive=True)'``, ``'ngram(n=3, k=6)'``; '' or None: no speculation.

    Raises:
        DrafterError: an unknown drafter or parameter, k outside [1, MAX_K], n < 1,
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
    k = _int_param(spec, "k", params.get("k", _DEFAULT_K[name]), 1, MAX_K)
    adaptive = params.get("adaptive", False)
    if not isinstance(adaptive, bool):
        raise DrafterError(f"speculative drafter {spec!r}: adaptive must be True or "
                                 f"False; got {adaptive!r}")
    cost = params.get("cost")
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                             or not 0 <= cost < 1):
        raise DrafterError(f"speculative drafter {spec!r}: cost must be a number in "
                           f"[0, 1) (a drafted token's share of a plain step; 0: never "
                           f"pause); got {cost!r}")
    cost = None if cost is None else float(cost)
    if name == "member":
        index = params.get("index")
        if index is not None:
            index = _int_param(spec, "index", index, 0)
        return DraftSpec("member", k, index=index, adaptive=adaptive, cost=cost,
                         text=spec.strip())
    n = _int_param(spec, "n", params.get("n", 3), 1)
    min_n = _int_param(spec, "min_n", params.get("min_n", 1), 1)
    if min_n > n:
        raise DrafterError(f"speculative drafter {spec!r}: min_n ({min_n}) must be at "
                                 f"most n ({n})")
    return DraftSpec("ngram", k, n=n, min_n=min_n, adaptive=adaptive, cost=cost,
                     text=spec.strip())


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


# What a round costs, in plain fused steps (DraftSpec.cost's defaults), by level:
# (the round's own overhead over a plain step, each drafted token's verification).
# A round of k drafted tokens costs about 1 + overhead + k * per token. Measured on the
# 2-core CPU with experiments/bench_speculative.py against plain decoding (BENCHMARKS.md,
# "Speculative decoding that pauses"): on tokens a round runs on the host (about 0.2 of a
# compiled plain step more) and verifying a drafted token costs 0.16-0.26 of a step; on
# bytes a drafted byte costs 0.97-1.23 plain byte steps (the tree calls of its look-ahead),
# so there no draft can pay and the default never drafts (a spec's cost= overrides).
# A member drafter adds its own step's share (its parameters over the models').
DRAFT_COST = {"tokens": (0.2, 0.25), "bytes": (0.1, 1.0)}
# Counts of accepted and rejected draft tokens fade by this factor each round, so the
# acceptance followed is that of the last ten rounds or so.
DECAY = 0.9
# The counts a generation starts from (acceptance 1/2, worth one round): drafting starts
# on, and a drafter whose first drafts are rejected pauses within a round or two.
PRIOR = (0.5, 0.5)
# While paused, a drafter that cannot be checked for free (the member drafter: its
# drafts cost its steps) drafts one token after PROBE_EVERY plain steps, and after twice
# as many each time a probe leaves it paused.
PROBE_EVERY = 32


class KSchedule:
    """How many tokens (bytes) the next round drafts: ``k``, read once a round.

    * The break-even rule. A round that drafts k tokens accepted each with
      probability a emits 1 + a + .. + a^k tokens on average and costs about
      1 + o + c k plain steps (o, c: the level's :data:`DRAFT_COST`, c raised by a
      member drafter's share). The schedule follows a, the rate at which a draft
      token is accepted given that the ones before it were (accepted / (accepted +
      rejections), counts fading by :data:`DECAY` each round from :data:`PRIOR`),
      drafts the k (at most ``size``) with the most tokens per unit of cost, and
      drafts nothing (``k = 0``: plain steps) while no k beats a plain step
      (``cost=0`` in the spec: never pauses). Paused, it keeps observing: the loop
      reports would-be drafts checked against the emitted token (:meth:`observe`; the
      n-gram drafter, free), or, when it cannot (``free_checks=False``), a round
      drafts one token after :data:`PROBE_EVERY` plain steps (twice as many after
      each probe that leaves it paused). A round with nothing to draft (no n-gram
      match) counts as a rejection: it costs a round's overhead for a plain step. A
      drafter whose rounds cost more than they emit even when every draft is
      accepted (a member drafter about as large as the members) never drafts.
    * ``adaptive``: while drafting, a round whose drafts were all accepted drafts two
      more next time, one with a rejection one fewer (at least 1, at most the spec's k).

    Every decision reads only the accept / reject outcomes, never a clock, so the
    same seed gives the same text.
    """

    def __init__(self, spec: DraftSpec, *, unit: str = "tokens", drafter_share: float = 0.0,
                 free_checks: bool | None = None):
        self.k_max, self.adaptive = spec.k, spec.adaptive
        self.size = spec.k if not spec.adaptive else min(spec.k, 2)
        self.overhead, per_token = DRAFT_COST[unit]
        self.cost = (per_token if spec.cost is None else spec.cost) + drafter_share
        self.never_pause = spec.cost == 0
        self.free_checks = spec.kind == "ngram" if free_checks is None else free_checks
        self.hits, self.misses = PRIOR
        self.paused_steps, self.probe_every = 0, PROBE_EVERY
        self.probing = False  # the round being decided for is a paused drafter's probe
        # a drafter that cannot pay even when every draft is accepted never drafts
        self.can_pay = self.never_pause or max(
            self.gain(k, 1.0) for k in range(1, self.size + 1)) > 1
        self.k = (self.best_k() or 1) if self.can_pay else 0  # the first round drafts

    @property
    def acceptance(self) -> float:
        """The followed per-token acceptance (see the class docstring)."""
        return self.hits / (self.hits + self.misses)

    def gain(self, k: int, a: float | None = None) -> float:
        """Tokens a round drafting k emits per plain step's cost, at acceptance ``a``
        (default: the followed one): (1 + a + .. + a^k) / (1 + overhead + k cost)."""
        a = self.acceptance if a is None else a
        return sum(a ** j for j in range(k + 1)) / (1 + self.overhead + k * self.cost)

    def best_k(self) -> int:
        """The k in 1..size with the largest gain, or 0 when none beats a plain step."""
        if self.never_pause:
            return self.size
        if not self.can_pay:
            return 0
        k = max(range(1, self.size + 1), key=self.gain)
        return k if self.gain(k) > 1 else 0

    def update(self, drafted: int, accepted: int, rejected: int | None = None, *,
               steps: int = 1) -> None:
        """After a round that drafted ``drafted`` tokens and accepted ``accepted``, in
        ``rejected`` sequences cutting a draft short or drafting nothing in a drafting
        round (default: one if any was not accepted); ``steps``: the plain steps a
        paused round ran (a block of them)."""
        if rejected is None:
            rejected = int(accepted < drafted)
        self.observe(accepted, rejected)
        if drafted and self.adaptive:
            self.size = (min(self.k_max, self.size + 2) if accepted == drafted
                         else max(1, self.size - 1))
        self._decide(steps)

    def observe(self, accepted: int, rejected: int) -> None:
        """Counts ``accepted`` draft tokens and ``rejected`` drafts cut short; the loop
        calls it itself, before the round's :meth:`update`, for would-be drafts checked
        while paused against the tokens emitted after them."""
        if accepted or rejected:
            self.hits = DECAY * self.hits + accepted
            self.misses = DECAY * self.misses + rejected

    def _decide(self, steps: int) -> None:
        k = self.best_k()
        if k:
            self.paused_steps, self.probe_every, self.probing = 0, PROBE_EVERY, False
            self.k = k
            return
        if self.probing:
            self.probe_every *= 2  # a probe that did not resume drafting: probe less often
        self.paused_steps += steps
        self.probing = (not self.free_checks and self.can_pay
                        and self.paused_steps >= self.probe_every)
        if self.probing:
            self.paused_steps = 0
        self.k = 1 if self.probing else 0


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
        """JSON-ready: acceptance rate (accepted / drafted), mean accepted per round, and
        ``paused``: the rounds that drafted nothing because drafting did not pay (plain
        steps; `KSchedule`)."""
        return dict(drafter=self.drafter, unit=self.unit, rounds=self.rounds,
                    drafted=self.drafted,
                    accepted=self.accepted, emitted=self.emitted,
                    acceptance=round(self.accepted / self.drafted, 4) if self.drafted else None,
                    mean_accepted=round(self.accepted / self.rounds, 3) if self.rounds else None,
                    per_round=round(self.emitted / self.rounds, 3) if self.rounds else None,
                    paused=self.by_k.get(0, [0])[0],
                    by_k={str(k): dict(rounds=v[0], drafted=v[1], accepted=v[2])
                          for k, v in sorted(self.by_k.items())})


__all__ = ["DRAFTERS", "MAX_K", "DraftSpec", "DrafterError", "KSchedule", "SpecStats", "drafter_index",
           "ngram_draft", "param_count", "parse_drafter"]
