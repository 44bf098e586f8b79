"""Comparisons across analyses: pooled over corpora, prefix effects, the event-space check,
and which verdicts move between levels.

Every function takes :class:`~brf.eval.analysis.AnalysisResult` s (or, across levels,
the report sections) and returns a typed result whose ``as_dict()`` is its entry in
report.json (``brf.eval.study_report`` states them in words).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

import numpy as np

from brf.eval import stats
from brf.eval.analysis import AnalysisResult, Comparison, controls_answer, side
from brf.eval.report import fit_undecided

ALPHA = 0.05  # a phase map "links" the members when its permutation p is below this


class Change(NamedTuple):
    """An estimated change with its 95% CI."""
    estimate: float
    ci: tuple[float, float]


def rbar_change(diff_a: np.ndarray, diff_b: np.ndarray, *, n_boot: int, block: int = 32,
                seed: int = 0) -> Change:
    """R̄(b) - R̄(a) for phase differences at the same positions, with a paired circular
    block-bootstrap 95% CI (positions resampled in blocks, jointly for a and b)."""
    n = len(diff_a)
    if len(diff_b) != n or n < 2:
        raise ValueError(f"rbar_change: need two equal-length arrays; got {n}, {len(diff_b)}")
    L = max(1, min(block, n // 4))
    rng = np.random.default_rng(seed)
    n_blocks = -(-n // L)
    boots = np.empty(n_boot)
    ca, sa, cb, sb = np.cos(diff_a), np.sin(diff_a), np.cos(diff_b), np.sin(diff_b)
    for b in range(n_boot):
        starts = rng.integers(0, n, n_blocks)
        idx = ((starts[:, None] + np.arange(L)[None]) % n).reshape(-1)[:n]
        boots[b] = np.hypot(cb[idx].mean(), sb[idx].mean()) - np.hypot(ca[idx].mean(),
                                                                       sa[idx].mean())
    est = _rbar(diff_b) - _rbar(diff_a)
    lo, hi = np.quantile(boots, [0.025, 0.975])
    return Change(est, (float(lo), float(hi)))


def paired_diffs(a: dict, b: dict) -> tuple[np.ndarray, np.ndarray]:
    """The phase differences of two coherence rows (of tables with the same positions)
    at the rows both were taken at: a per-token map is read only where the gold is
    listed, and a prefix can change which golds a member lists."""
    _, ia, ib = np.intersect1d(a["positions"], b["positions"], assume_unique=True,
                               return_indices=True)
    return np.asarray(a["diffs"])[ia], np.asarray(b["diffs"])[ib]


def _rbar(d: np.ndarray) -> float:
    return float(np.hypot(np.cos(d).mean(), np.sin(d).mean()))


def _same_positions(a: AnalysisResult, b: AnalysisResult) -> bool:
    ta, tb = a.test, b.test
    return (ta.n_positions == tb.n_positions and np.array_equal(ta.gold_bytes, tb.gold_bytes)
            and np.array_equal(ta.segment, tb.segment))


class PhaseChange(NamedTuple):
    """How a prefix changes one phase map's concentration for one pair of members."""
    phase_map: str
    pair: list
    rbar_plain: float
    rbar_prefix: float
    n_paired: int                       # positions where both analyses read the phases
    rbar_change: float                  # on the paired positions
    rbar_change_ci: tuple[float, float]
    excess_plain: float                 # R̄ minus its permutation null's mean
    excess_prefix: float
    excess_change: float                # on the paired positions, like its CI
    excess_change_ci: tuple[float, float]

    def as_dict(self) -> dict:
        return {**self._asdict(), "rbar_change_ci": list(self.rbar_change_ci),
                "excess_change_ci": list(self.excess_change_ci)}


class CrossTermChange(NamedTuple):
    """How a prefix changes the cross-term test's AUROC."""
    setting_plain: str
    setting_prefix: str
    auroc_plain: float
    auroc_prefix: float
    auroc_change: float
    auroc_change_ci: tuple[float, float]
    # the same change for every other pair of tied settings (brf.eval.analysis.TIE_MARGIN)
    alternatives: tuple["CrossTermChange", ...] = ()

    CI_METHOD = ("normal approximation from the two bootstrap CIs, treated as independent "
                 "(conservative for paired positions)")

    @classmethod
    def of(cls, plain: dict, prefixed: dict) -> "CrossTermChange":
        """The change between two cross-term tests (each ``{"setting", "rel"}``)."""
        c0, c1 = plain["rel"], prefixed["rel"]
        se = math.hypot((c0["ci"][1] - c0["ci"][0]) / 3.92, (c1["ci"][1] - c1["ci"][0]) / 3.92)
        d = c1["auroc"] - c0["auroc"]
        return cls(plain["setting"], prefixed["setting"], c0["auroc"], c1["auroc"], d,
                   (d - 1.96 * se, d + 1.96 * se))

    def as_dict(self) -> dict:
        out = {**self._asdict(), "auroc_change_ci": list(self.auroc_change_ci),
               "ci_method": self.CI_METHOD}
        out["alternatives"] = [{k: v for k, v in a.as_dict().items()
                                if k not in ("alternatives", "ci_method")}
                               for a in self.alternatives]
        return out


class GapChange(NamedTuple):
    """How a prefix changes BRF's NLL gap to the best baseline in one variant (each
    analysis's own best rows), paired per position."""
    gap_plain: float
    gap_prefix: float
    change: float
    ci: tuple[float, float]
    brf_plain: str
    brf_prefix: str
    baseline_plain: str
    baseline_prefix: str
    # the same change for every other choice among tied rows (TIE_MARGIN) in either analysis
    alternatives: tuple["GapChange", ...] = ()

    def as_dict(self) -> dict:
        out = {**self._asdict(), "ci": list(self.ci)}
        out["alternatives"] = [{k: v for k, v in a.as_dict().items() if k != "alternatives"}
                               for a in self.alternatives]
        return out


class PrefixEffect(NamedTuple):
    """What a steadying prefix on each member changes (:func:`prefix_effect`)."""
    paired: bool                            # same positions in both analyses
    phase_concentration: tuple[PhaseChange, ...]
    cross_term: CrossTermChange
    nll_gap: dict[str, GapChange]           # per variant

    def as_dict(self) -> dict:
        """The report's ``prompts[corpus]["effect"]``."""
        return {"phase_concentration": [r.as_dict() for r in self.phase_concentration],
                "cross_term": self.cross_term.as_dict(),
                "nll_gap": {v: g.as_dict() for v, g in self.nll_gap.items()},
                "paired": self.paired}


def prefix_effect(plain: AnalysisResult, prefixed: AnalysisResult, *, n_boot: int,
                  seed: int) -> PrefixEffect:
    """How a steadying prefix on each member changes the paper's quantities.

    Both analyses cover the same corpus, split and positions (a prefix does not move
    token boundaries), so the changes are paired per position. A per-token map's
    phases exist only where the gold is listed, which can differ between the two
    analyses: its R̄ change is taken on the positions where both list the gold
    (``n_paired``), while ``rbar_plain`` and ``rbar_prefix`` are each analysis's own.
    When the positions differ, only the cross-term change is given.
    """
    same = _same_positions(plain, prefixed)
    concentration, gaps = [], {}
    by1 = {(r["phase_map"], tuple(r["pair"])): r for r in prefixed.coherence}
    for r0 in plain.coherence:
        r1 = by1.get((r0["phase_map"], tuple(r0["pair"])))
        if r1 is None or not same:
            continue
        d0, d1 = paired_diffs(r0, r1)
        ch = rbar_change(d0, d1, n_boot=min(n_boot, 1000), seed=seed)
        dnull = r1["null_mean_resultant_length"] - r0["null_mean_resultant_length"]
        # the permutation nulls are treated as fixed: the excess change's CI is the
        # R̄ change's CI shifted by the change of the null's mean.
        concentration.append(PhaseChange(
            r0["phase_map"], r0["pair"], r0["mean_resultant_length"],
            r1["mean_resultant_length"], len(d0), ch.estimate, ch.ci,
            r0["mean_resultant_length"] - r0["null_mean_resultant_length"],
            r1["mean_resultant_length"] - r1["null_mean_resultant_length"],
            ch.estimate - dnull, (ch.ci[0] - dnull, ch.ci[1] - dnull)))
    crosses = [[{"setting": c["setting"], "rel": c["rel"]}, *c.get("alternatives", [])]
               for c in (plain.cross, prefixed.cross)]
    pairs = list(itertools.product(*crosses))
    cross = CrossTermChange.of(*pairs[0])._replace(
        alternatives=tuple(CrossTermChange.of(a, b) for a, b in pairs[1:]))

    def gap(res: AnalysisResult, brf: str, base: str) -> np.ndarray:
        return res.by_label(brf).test_nll - res.by_label(base).test_nll

    for v, a in plain.comparisons.items():
        b = prefixed.comparisons.get(v)
        if not b or not same:
            continue
        changes = []
        for (b0, a0), (b1, a1) in itertools.product(_pairs(a), _pairs(b)):
            gap0, gap1 = gap(plain, b0, a0), gap(prefixed, b1, a1)
            ci = stats.paired_bootstrap_ci(gap1, gap0, n_boot=n_boot,
                                           rng=np.random.default_rng(seed),
                                           block_size=min(32, max(1, len(gap0) // 4)))
            changes.append(GapChange(float(gap0.mean()), float(gap1.mean()), ci.estimate,
                                     (ci.ci_low, ci.ci_high), b0, b1, a0, a1))
        gaps[v] = changes[0]._replace(alternatives=tuple(changes[1:]))
    return PrefixEffect(bool(same), tuple(concentration), cross, gaps)


class PooledCorpus(NamedTuple):
    """One corpus's pair in a pooled comparison."""
    corpus: str
    brf: str
    baseline: str
    mean_difference: float
    ci: tuple[float, float]

    def as_dict(self) -> dict:
        return {**self._asdict(), "ci": list(self.ci)}


class PooledAlternative(NamedTuple):
    """The pooled difference with other tied rows chosen in some corpora."""
    pairs: tuple[tuple[str, str, str], ...]   # (corpus, BRF row, other row) per corpus
    mean_difference: float
    ci: tuple[float, float]
    p_value: float

    def as_dict(self) -> dict:
        return {"pairs": [list(p) for p in self.pairs], "mean_difference":
                self.mean_difference, "ci": list(self.ci), "p_value": self.p_value}


class Pooled(NamedTuple):
    """A BRF-minus-other NLL difference pooled over corpora (:func:`pooled`)."""
    mean_difference: float
    ci: tuple[float, float]
    p_value: float
    corpora: tuple[PooledCorpus, ...]
    alternatives: tuple[PooledAlternative, ...] = ()

    WEIGHTING = ("equal weight per corpus; stratified circular block bootstrap (blocks of "
                 "32 positions within each corpus), the CI widened by the mean of the "
                 "corpora's fit spreads")

    @property
    def stands(self) -> bool:
        return all(side(a.ci) == side(self.ci) for a in self.alternatives)

    def as_dict(self) -> dict:
        """The report's ``pooled[variant]`` (or ``pooled_fair[variant]``)."""
        return {"mean_difference": self.mean_difference, "ci": list(self.ci),
                "p_value": self.p_value, "corpora": [c.as_dict() for c in self.corpora],
                "weighting": self.WEIGHTING,
                "alternatives": [a.as_dict() for a in self.alternatives],
                "stands": self.stands}


# The most choices of tied rows a pooled comparison is redone for: beyond it, each corpus's
# other choices are taken one corpus at a time (the others at their chosen rows).
MAX_POOLED_CHOICES = 64


def _choices(options: Sequence[Sequence]) -> list[tuple]:
    """Index tuples into each corpus's options: every combination (the chosen one, all
    zeros, first) or, beyond MAX_POOLED_CHOICES, one corpus changed at a time."""
    if math.prod(len(o) for o in options) <= MAX_POOLED_CHOICES:
        return list(itertools.product(*(range(len(o)) for o in options)))
    out = [tuple(0 for _ in options)]
    for i, o in enumerate(options):
        out += [tuple(j if k == i else 0 for k in range(len(options))) for j in range(1, len(o))]
    return out


def pooled(per_corpus: Sequence[tuple[str, AnalysisResult]], variants: Sequence[str], *,
           n_boot: int, seed: int, fair: bool = False) -> dict[str, Pooled]:
    """Per variant: the BRF-minus-baseline NLL difference pooled over corpora (the
    variants no corpus compares are left out); redone for the other choices among each
    corpus's tied rows (``alternatives``).

    With ``fair``, the fair summary's pair instead: the best BRF row minus the best
    of every other row (controls included)."""
    out = {}
    for v in variants:
        used, options, results = [], [], []
        for label, res in per_corpus:
            c = _fair_pair(res, v) if fair else _baseline_pair(res, v)
            if c is None:
                continue
            used.append(PooledCorpus(label, c.brf, c.baseline, c.mean_difference, c.ci))
            options.append(_pairs(c))
            results.append((label, res))
        if not used:
            continue
        found = []
        for choice in _choices(options):
            chosen = [o[j] for o, j in zip(options, choice)]
            rows = [(res.by_label(b), res.by_label(a)) for (_, res), (b, a) in zip(results, chosen)]
            pairs = [(rb.test_nll, ra.test_nll) for rb, ra in rows]
            ci = stats.pooled_paired_bootstrap_ci(pairs, n_boot=n_boot,
                                                  rng=np.random.default_rng(seed),
                                                  block_size=32)
            # the corpora weigh equally: the pooled difference's fit spread is the mean of
            # each corpus's two rows' spreads (brf.eval.analysis.fit_spread)
            spread = float(np.mean([rb.spread + ra.spread for rb, ra in rows]))
            found.append(PooledAlternative(
                tuple((label, b, a) for (label, _), (b, a) in zip(results, chosen)),
                ci.estimate, (ci.ci_low - spread, ci.ci_high + spread), ci.p_value))
        main = found[0]
        out[v] = Pooled(main.mean_difference, main.ci, main.p_value, tuple(used),
                        tuple(found[1:]))
    return out


def _pairs(c: Comparison) -> list[tuple[str, str]]:
    """The (BRF row, other row) pairs of a comparison: the chosen pair, then every other
    pair of tied rows."""
    return [(c.brf, c.baseline)] + [(a.brf, a.other) for a in c.alternatives]


def _baseline_pair(res: AnalysisResult, v: str) -> Comparison | None:
    return res.comparisons.get(v)


def _fair_pair(res: AnalysisResult, v: str) -> Comparison | None:
    """The fair summary's pair of ``v`` as a comparison (the rival as the baseline)."""
    c = res.fair.get(v)
    return c.pair() if c else None


class DifferenceMove(NamedTuple):
    """A comparison's side of 0 (``side``) in analyses a and b, its differences and
    the pairs compared."""
    a: str
    b: str
    a_difference: float
    b_difference: float
    a_pair: list
    b_pair: list


class AurocMove(NamedTuple):
    """The cross-term test's side of 0.5 in analyses a and b, and its AUROCs."""
    a: str
    b: str
    a_auroc: float
    b_auroc: float


class CountMove(NamedTuple):
    """A count in analyses a and b (the phase maps that link the members)."""
    a: int
    b: int


class VerdictMoves(NamedTuple):
    """Which verdicts of two analyses of the same corpus differ (:func:`topk_moves`)."""
    rows: dict[str, DifferenceMove | AurocMove | CountMove]

    @property
    def moved(self) -> list[str]:
        return [k for k, r in self.rows.items() if r.a != r.b]

    def as_dict(self) -> dict:
        """The event-space check's ``rows`` and ``moved``."""
        return {"rows": {k: r._asdict() for k, r in self.rows.items()}, "moved": self.moved}


def topk_moves(a: AnalysisResult, b: AnalysisResult) -> VerdictMoves:
    """Whether the verdicts of two analyses of the same corpus differ (event-space check):
    BRF against the named baselines (``nll[variant]``) and against every other row,
    controls included (``fair[variant]``), per variant; the cross-term test; the count
    of phase maps that link the members."""
    rows: dict[str, DifferenceMove | AurocMove | CountMove] = {}
    pairs = ((f"nll[{v}]", ca, b.comparisons.get(v)) for v, ca in a.comparisons.items())
    fair = ((f"fair[{v}]", _fair_pair(a, v), _fair_pair(b, v)) for v in a.fair)
    for key, ca, cb in (*pairs, *fair):
        if cb:
            rows[key] = DifferenceMove(side(ca.ci), side(cb.ci), ca.mean_difference,
                                       cb.mean_difference, [ca.brf, ca.baseline],
                                       [cb.brf, cb.baseline])
    ra, rb = a.cross["rel"], b.cross["rel"]
    rows["cross_term"] = AurocMove(side([x - 0.5 for x in ra["ci"]]),
                                   side([x - 0.5 for x in rb["ci"]]), ra["auroc"], rb["auroc"])
    rows["phase_coherence"] = CountMove(sum(r["permutation_p"] < ALPHA for r in a.coherence),
                                        sum(r["permutation_p"] < ALPHA for r in b.coherence))
    return VerdictMoves(rows)


# ----------------------------------------------------------------- levels, runs


def same_call(a: str, b: str) -> bool:
    """Whether two answers call the same verdict: "not distinguishable (fit)" (the
    bootstrap alone would call a difference, the rows' fit spreads do not) is the same
    call as "not distinguishable", its reason said beside it."""
    return a.removesuffix(" (fit)") == b.removesuffix(" (fit)")


class Answer(NamedTuple):
    """One verdict as an answer that compares across levels and runs: the words, the
    number behind them and, for a difference, its 95% CI (the forking answer: the
    share of the gain at the top-entropy positions)."""
    answer: str
    value: float
    ci: tuple[float, float] | None = None
    top_share: float | None = None
    # the fitted rows the answer rests on: a difference's (BRF's, the other's); the
    # cross-term test's setting; a prefix effect's rows without and with the prefix
    rows: tuple[str, ...] | None = None
    # the same verdict with the other rows tied with the chosen ones (TIE_MARGIN), and
    # as the run's stability check answered it from its refitted rows (with_refit)
    alternatives: tuple["Answer", ...] = ()

    def differs(self, other: "Answer") -> bool:
        """Whether ``other`` calls another verdict (:func:`same_call`)."""
        return not same_call(self.answer, other.answer)

    @property
    def fragile(self) -> bool:
        """Whether some choice among tied rows, or the stability check's refit of them,
        gives another answer."""
        return any(self.differs(a) for a in self.alternatives)

    def with_alternatives(self, alternatives) -> "Answer":
        return self._replace(alternatives=tuple(alternatives))

    def with_refit(self, words: str | None) -> "Answer":
        """The answer with the stability check's answer from the refitted rows beside it
        (``words``; None: not checked): the fits' other end is a place they could as well
        have stopped, so a verdict the check moved is fragile in the run that made it."""
        if words is None:
            return self
        return self.with_alternatives(self.alternatives + (Answer(words, math.nan,
                                                                  rows=(REFIT,)),))


# The rows of a verdict's alternative that the stability check's refit answered.
REFIT = "the stability check's refit"


class Move(NamedTuple):
    """One verdict at both levels (``*_fragile``: another choice among tied rows gives
    another answer at that level)."""
    tokens: str
    bytes: str
    tokens_value: float
    bytes_value: float
    tokens_fragile: bool = False
    bytes_fragile: bool = False

    @property
    def moved(self) -> bool:
        return not same_call(self.tokens, self.bytes)

    def as_dict(self) -> dict:
        return {**self._asdict(), "moved": self.moved}


class LevelMoves(NamedTuple):
    """Which verdicts move from co-aligned positions to every byte (:func:`level_moves`)."""
    rows: dict[str, Move]

    UNITS = ("values in each level's units (nats per co-aligned position; nats per byte): "
             "compare their signs and CIs, not their sizes")

    @property
    def moved(self) -> list[str]:
        return [k for k, r in self.rows.items() if r.moved]

    def as_dict(self) -> dict:
        """report.json's ``moved``."""
        return {"rows": {k: r.as_dict() for k, r in self.rows.items()}, "moved": self.moved,
                "units": self.UNITS}


def _ci_answer(ci, value, low: str, high: str, neither: str = "not distinguishable",
               rows: tuple[str, ...] | None = None) -> Answer:
    return Answer({"lower": low, "higher": high, "undecided": neither}[side(ci)],
                  float(value), (float(ci[0]), float(ci[1])), rows=rows)


def _difference_answers(c: dict, other_key: str, low: str, high: str) -> Answer:
    """A comparison's answer (``c``: an ``nll_comparison`` or ``fair_summary`` entry),
    with the answers of its tied rows' comparisons."""
    def one(x: dict) -> Answer:
        b = x["brf"]["label"] if isinstance(x["brf"], dict) else x["brf"]
        o = x[other_key]["label"] if isinstance(x[other_key], dict) else x[other_key]
        return _ci_answer(x["ci"], x["mean_difference"], low, high,
                          "not distinguishable (fit)" if fit_undecided(x)
                          else "not distinguishable", rows=(b, o))
    return one(c).with_alternatives(one(a) for a in c.get("alternatives", []))


def _forking_answer(f: dict) -> Answer | None:
    """The forking verdict of one variant (its gated BRF row's gain over the reference
    member), with the answers of the tied BRF rows and tied reference members."""
    g = f.get("gated", {}).get("brf")
    if not g:
        return None

    def one(r: dict, label: str) -> Answer:
        where = "mostly at" if r["top_share"] > 0.5 else "less than half at"
        return Answer((f"gain over the best member, {where} the top-entropy positions"
                       if r["total_gain"] > 0 else "no gain over the best member"),
                      # the mean gain per position (the deciles are of equal size)
                      float(np.mean(r["mean_gain"])), top_share=float(r["top_share"]),
                      rows=(label,))

    main = one(f["by_method"][g["method"]], g["method"])
    alts = [one(f["by_method"][m], m) for m in g.get("tied", [])[1:] if m in f["by_method"]]
    for ref, rows in f.get("reference_alternatives", {}).items():
        alts += [one(r, m)._replace(rows=(m, ref)) for m, r in rows.items()]
    return main.with_alternatives(alts)


def answers(brief: dict) -> dict[str, Answer]:
    """The verdicts of one analysis (its brief report, ``study_report.brief``) as
    answers that can be compared across levels: key -> {"answer": words, "value":
    the number behind it}. A difference's answer is where its 95% CI lies
    (sign and significance); the controls' answer how many controls the per-token BRF
    row beats and whether shuffling its phases costs; the coherence answer counts the
    phase maps that reject the permutation null; the forking answer says whether the
    best BRF setting gains over the best single member and whether most of the gain
    lies at the top-entropy positions (its value is the mean gain per position). Each
    answer that rests on a choice of rows carries the answers of the rows tied with
    the chosen ones (``alternatives``; ``fragile`` when one differs), and the answer the
    analysis's stability check gave from its refitted rows (the brief's
    ``refit_answers``, :meth:`Answer.with_refit`)."""
    out = {}
    refits = brief.get("refit_answers") or {}
    for v, c in brief.get("nll_comparison", {}).items():
        out[f"nll [{v}]"] = _difference_answers(c, "baseline",
                                                "BRF better than the best baseline",
                                                "BRF worse than the best baseline")
    for v, c in brief.get("fair_summary", {}).items():
        out[f"fair [{v}]"] = _difference_answers(c, "rival", "BRF better than every other row",
                                                 "BRF worse than the best other row")
        if c.get("per_token") is not None:
            # controls == []: the chosen per-token row's controls were not fitted (a
            # refit chose a row the run had not tied): an answer no one can read off
            beaten = (sum(x["ci"][1] < 0 for x in c["controls"]) if c["controls"]
                      else math.nan)
            alts = [Answer(controls_answer(a["controls"]),
                           float(sum(x["ci"][1] < 0 for x in a["controls"])),
                           rows=(a["per_token"]["label"],))
                    for a in c.get("per_token_alternatives", [])]
            done = {c["per_token"]["label"]} | {a.rows[0] for a in alts}
            # a tied per-token row whose controls were not fitted (tied only through the
            # stability check's moves): its answer is unknown, so the verdict cannot stand
            alts += [Answer("controls not fitted", math.nan, rows=(label,))
                     for label in c.get("per_token_tied", []) if label not in done]
            out[f"controls [{v}]"] = Answer(controls_answer(c["controls"]), float(beaten),
                                            rows=(c["per_token"]["label"],)
                                            ).with_alternatives(alts)
    if brief.get("cross_term"):
        ct = brief["cross_term"]

        def cross(x: dict) -> Answer:
            rel = x["rel"]
            return _ci_answer([v - 0.5 for v in rel["ci"]], rel["auroc"],
                              "ranks gold below competitors",
                              "separates gold from competitors", "does not separate gold",
                              rows=(x["setting"],))
        out["cross-term"] = cross(ct).with_alternatives(
            cross(a) for a in ct.get("alternatives", []))
    if brief.get("phase_coherence") is not None:
        pc = brief["phase_coherence"]
        k = sum(r["permutation_p"] < ALPHA for r in pc)
        out["phase coherence"] = Answer(f"{k} of {len(pc)} linked", float(k))
    for v, f in brief.get("forking", {}).items():
        a = _forking_answer(f)
        if a is not None:
            out[f"forking [{v}]"] = a
    return {k: a.with_refit(refits.get(k)) for k, a in out.items()}


def effect_answers(effect: dict) -> dict[str, Answer]:
    """The prefix effect (:func:`prefix_effect`) as comparable answers."""
    out = {}
    pcs = effect.get("phase_concentration", [])
    if pcs:
        up = sum(r["rbar_change_ci"][0] > 0 for r in pcs)
        down = sum(r["rbar_change_ci"][1] < 0 for r in pcs)
        out["phase concentration"] = Answer(f"{up} tightened, {down} loosened of {len(pcs)}",
                                            float(up - down))
    ct = effect.get("cross_term")
    if ct:
        def cross(x: dict) -> Answer:
            return _ci_answer(x["auroc_change_ci"], x["auroc_change"], "falls", "rises",
                              "no change shown", rows=(x["setting_plain"], x["setting_prefix"]))
        out["cross-term AUROC change"] = cross(ct).with_alternatives(
            cross(a) for a in ct.get("alternatives", []))
    for v, g in effect.get("nll_gap", {}).items():
        def gap(x: dict) -> Answer:
            return _ci_answer(x["ci"], x["change"], "narrows", "widens", "no change shown",
                              rows=(x["brf_plain"], x["baseline_plain"], x["brf_prefix"],
                                    x["baseline_prefix"]))
        out[f"BRF's NLL gap change [{v}]"] = gap(g).with_alternatives(
            gap(a) for a in g.get("alternatives", []))
    return out


def paired_answers(a: dict, b: dict) -> dict[str, tuple[Answer, Answer]]:
    """The verdicts two report sections both give, as (a's answer, b's answer).

    Args:
      a, b: sections of study reports (``per_corpus``, ``pooled``, ``pooled_fair``,
        ``prompts``): the two levels of one report, or one level of two runs.

    Returns:
      ``"<where>: <verdict>"`` -> the two answers, in ``b``'s order.
    """
    rows: dict[str, tuple[Answer, Answer]] = {}
    # the study-level verdicts' answers from the refitted analyses (each analysis's own
    # are in its brief report)
    ra, rb = ({k: x["refit"] for k, x in ((s.get("stability") or {}).get("study")
                                          or {}).items()} for s in (a, b))

    def add(where: str, x: dict[str, Answer], y: dict[str, Answer]) -> None:
        for k, ry in y.items():
            rx, key = x.get(k), f"{where}: {k}"
            if rx is not None:
                rows[key] = (rx.with_refit(ra.get(key)), ry.with_refit(rb.get(key)))

    def pooled_answers(section: dict, key: str, what: str) -> dict[str, Answer]:
        def one(p: dict) -> Answer:
            return _ci_answer(p["ci"], p["mean_difference"], "BRF better", "BRF worse")
        return {f"{what} [{v}]": one(p).with_alternatives(
            one(a) for a in p.get("alternatives", []))
            for v, p in section.get(key, {}).items()}

    for label, r in b.get("per_corpus", {}).items():
        if label in a.get("per_corpus", {}):
            add(label, answers(a["per_corpus"][label]), answers(r))
    for key, what in (("pooled", "nll"), ("pooled_fair", "fair")):
        add("pooled", pooled_answers(a, key, what), pooled_answers(b, key, what))
    for label, pb in b.get("prompts", {}).items():
        pa = a.get("prompts", {}).get(label)
        if not pa:
            continue
        add(f"prompts: {label}", effect_answers(pa["effect"]), effect_answers(pb["effect"]))
        for key, what in (("with_prefix", "+ prefix"), ("same_model", "same model"),
                          ("swarm", "swarm")):
            if key in pa and key in pb:
                add(f"{label} {what}", answers(pa[key]), answers(pb[key]))
    return rows


def level_moves(tokens: dict, by_bytes: dict) -> LevelMoves:
    """Which verdicts move from co-aligned positions to every byte.

    Args:
      tokens: the study's report (``per_corpus``, ``pooled``, ``pooled_fair``,
        ``prompts``) on co-aligned positions.
      by_bytes: the same sections on every byte.

    Returns:
      One :class:`Move` per verdict both levels give (``as_dict()``: report.json's
      ``moved``). Values are in each level's units (nats per co-aligned position;
      nats per byte), so only their signs and CIs compare; the answers say where
      each CI lies.
    """
    return LevelMoves({k: Move(a.answer, b.answer, a.value, b.value, a.fragile, b.fragile)
                       for k, (a, b) in paired_answers(tokens, by_bytes).items()})


class RunMove(NamedTuple):
    """One verdict in two runs of the study, and the rows each compared (for a
    difference: BRF's row and the other's, chosen on calibration in each run)."""
    before: Answer
    after: Answer

    @property
    def moved(self) -> bool:
        return self.before.differs(self.after)

    @property
    def rows_changed(self) -> bool:
        return self.before.rows != self.after.rows


def run_moves(before: dict, after: dict) -> dict[str, RunMove]:
    """Which verdicts differ between two runs of the study (two report.json files, each
    read as a dict), at every level both ran: ``"<level>: <where>: <verdict>"`` ->
    :class:`RunMove`, the co-aligned level's first, then every byte's (values in each
    level's units, the same in both runs)."""
    out = {}
    for level, a, b in (("co-aligned", before, after),
                        ("every byte", before.get("bytes"), after.get("bytes"))):
        if a and b:
            out.update({f"{level}: {k}": RunMove(x, y)
                        for k, (x, y) in paired_answers(a, b).items()})
    return out


def analysis_moves(before: dict[str, dict], after: dict[str, dict]) -> dict[str, RunMove]:
    """Which verdicts differ between two runs, read off their per-analysis reports
    (name -> brief report, ``study_report.brief``) where a study report is missing (a
    run stopped part way): ``"<name>: <verdict>"`` -> :class:`RunMove` for every
    analysis both have. The pooled and prompt-study verdicts live only in the study
    report, so they are not compared."""
    out = {}
    for name in sorted(before.keys() & after.keys()):
        a, b = answers(before[name]), answers(after[name])
        out.update({f"{name}: {k}": RunMove(a[k], b[k]) for k in a if k in b})
    return out
