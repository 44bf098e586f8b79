"""The stability check: do an analysis's verdicts survive a refit under other last bits?

Every calibrated row of an analysis that a verdict could choose (within the plan's
reach of a choice, :data:`brf.eval.plan.STABILITY_REACH`; controls included) is fitted
again, the whole fit as the study runs it, under a perturbation that changes only the
last bits of the objective (:data:`brf.eval.fitting.PERTURBATIONS`: the positions
summed in another order, the table moved by an ulp or two, Born's sin and cos from XLA
instead of brf's polynomial). A fit that finds its optimum lands within
:data:`~brf.eval.fitting.FIT_TOLERANCE` of where it landed before; a verdict that rests
on which optimum a fit happened to stop in, or on which of two nearly tied rows came
first, can move. The check refits, evaluates the refitted rows on test, recomputes
every verdict of the refitted variants from them (the comparisons, the fair summary,
the controls' answer, the cross-term test, forking tokens) and reports how many moved
(the goal is none) and the largest move of a row's calibration NLL, as the byte level's
precision check reports how far its views are from the reference. Each verdict's answer
from the refitted rows stands beside the run's wherever the report's verdicts are read
(:meth:`brf.eval.compare.Answer.with_refit`): a verdict the check moved is reported
fragile, as one that a choice among tied rows moves is.

The study-level verdicts (pooled over corpora, the prompt study's changes) are checked
the same way from the refitted analyses (:func:`study_moves`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import NamedTuple, Sequence

from brf.eval import compare, study_report
from brf.eval.analysis import (AnalysisResult, MethodResult, _per_token, comparisons,
                               cross_terms, fair_summary, fit_all, forking_tokens, tied)
from brf.eval.compare import Answer
from brf.eval.fitting import FIT_TOLERANCE, perturbations
from brf.eval.plan import Plan


class RowMove(NamedTuple):
    """One refitted row's calibration NLL before and after (nats; after - before)."""
    label: str
    before: float
    after: float

    @property
    def move(self) -> float:
        return self.after - self.before


class Check(NamedTuple):
    """The stability check of one analysis (:func:`check`)."""
    perturbation: str
    rows: tuple[RowMove, ...]
    verdicts: dict[str, tuple[Answer, Answer]]   # key -> (the run's answer, the refit's)
    perturbed: AnalysisResult
    result: AnalysisResult   # the run's analysis, its ties widened by the rows' moves
    seconds: float
    reach: float = math.inf  # rows further above every choice were not refitted
    left_out: tuple[str, ...] = ()  # those rows
    unchecked: tuple[str, ...] = ()  # the analysis's variants not refitted ('proposed')

    @property
    def moved(self) -> list[str]:
        return [k for k, (a, b) in self.verdicts.items() if a.differs(b)]

    @property
    def moved_untied(self) -> list[str]:
        """Moved verdicts no tied row had made fragile (the report makes every moved
        verdict fragile: the refit's answer stands beside the run's,
        :meth:`brf.eval.compare.Answer.with_refit`)."""
        return [k for k in self.moved if not self.verdicts[k][0].fragile]

    def largest(self) -> RowMove | None:
        finite = [r for r in self.rows if math.isfinite(r.move)]
        return max(finite, key=lambda r: abs(r.move)) if finite else None

    def as_dict(self) -> dict:
        """The analysis report's ``stability``."""
        top = self.largest()
        return {
            "perturbation": self.perturbation,
            "tolerance": FIT_TOLERANCE,
            "refitted_rows": len(self.rows),
            "reach": self.reach if math.isfinite(self.reach) else None,
            "not_refitted": list(self.left_out),
            "variants_not_refitted": list(self.unchecked),
            "largest_row_move": (None if top is None else
                                 {"label": top.label, "before": top.before,
                                  "after": top.after, "move": top.move}),
            "rows_over_tolerance": [{"label": r.label, "move": r.move} for r in self.rows
                                    if not abs(r.move) <= FIT_TOLERANCE],
            "verdicts": len(self.verdicts), "moved": self.moved,
            "moved_untied": self.moved_untied,
            "answers": {k: {"run": a.answer, "refit": b.answer, "tied_fragile": a.fragile}
                        for k, (a, b) in self.verdicts.items()},
            "seconds": self.seconds}


def refitted_variants(variants: Sequence[str]) -> list[str]:
    """The variants whose rows the check refits: every one but 'proposed'."""
    return [v for v in variants if v != "proposed"]


def perturbed_cache(cache_path: str) -> str:
    """The fit cache of the check's refits, beside the analysis's own (its key differs:
    one file per key)."""
    root, ext = os.path.splitext(cache_path)
    return f"{root}.stability{ext}"


def check(plan: Plan, result: AnalysisResult, variants: Sequence[str], *, cache_path: str,
          n: int) -> Check | None:
    """Refits ``result``'s rows of the refitted variants under ``plan.stability`` and
    compares every verdict that rests on them; None when the plan turns the check off or
    no variant is refitted.

    The rows refitted are those within ``plan.stability_reach``
    (:data:`~brf.eval.plan.STABILITY_REACH` by default) of the best row of some set a
    verdict chooses from (:func:`in_reach`; every control), the reach widened to twice
    the largest move seen while a refit moves a row by more than half of it (math.inf:
    every row). The others keep their run's fits in the refitted analysis.

    Each row's move widens the tie margin between it and the others
    (:func:`brf.eval.analysis.tied`'s ``slack``): rows a refit could reorder count as
    tied, so a verdict that rests on which of them came first is reported as fragile.
    The check's ``result`` is the analysis with its ties so widened (the run reports
    it); the verdicts compared are that result's and the refit's, with the same ties."""
    todo = refitted_variants(variants)
    if not plan.stability or not todo:
        return None
    perturbations(plan.stability)  # a bad name fails here, before any fit
    t0 = time.time()
    settings = dataclasses.replace(plan.fit, perturb=plan.stability)
    old = [m for m in result.methods if m.variant in todo]
    before = [m for m in result.methods if m.variant not in todo]
    plan_p = dataclasses.replace(plan, fit=settings)
    refit, reach = refit_in_reach(
        old, todo, plan.stability_reach,
        lambda batch, earlier: fit_all(plan_p, [m.spec for m in batch], result.calib,
                                       result.test, cache_path=perturbed_cache(cache_path),
                                       desc="stability check", before=before + earlier))
    rows = tuple(RowMove(m.label, m.calib_nll, refit[m.label].calib_nll) for m in old
                 if m.label in refit)
    left_out = tuple(m.label for m in old if m.label not in refit)
    slack = {r.label: abs(r.move) for r in rows if math.isfinite(r.move) and r.move != 0.0}
    main = (_recomputed(plan, result, result.methods, variants, n, slack)
            if _ties(result.methods, variants, slack) != _ties(result.methods, variants, {})
            else dataclasses.replace(result, slack=slack))
    methods = [refit.get(m.label, m) for m in result.methods]
    perturbed = _recomputed(plan, result, methods, variants, n, slack)
    verdicts = _paired(_answers(main, todo), _answers(perturbed, todo))
    return Check(plan.stability, rows, verdicts, perturbed, main, time.time() - t0, reach,
                 left_out, tuple(v for v in variants if v not in todo))


def refit_in_reach(old: Sequence[MethodResult], variants: Sequence[str], reach: float,
                   fit) -> tuple[dict[str, MethodResult], float]:
    """Refits the rows of ``old`` within ``reach`` of a choice (:func:`in_reach`), then,
    while a refit moved some row by more than half the reach, widens it to twice that
    move and refits the rows it brings in.

    Args:
      old: the run's rows of the refitted variants.
      variants: those variants.
      reach: the first reach (nats).
      fit: ``fit(batch, earlier)`` -> the rows of ``batch`` refitted, in order;
        ``earlier`` are the rows refitted so far and the rows left out (as run) for its
        second pass's pool.

    Returns:
      (label -> refitted row, the reach reached).
    """
    refit: dict[str, MethodResult] = {}
    while True:
        near = in_reach(old, variants, reach)
        batch = [m for m in old if m.label in near and m.label not in refit]
        if not batch:
            return refit, reach
        # the rows not refitted (yet) join the second pass's pool as they are: far up,
        # they seldom rank among its best starts
        rest = [m for m in old if m.label not in near]
        refit.update((m.label, m) for m in fit(batch, list(refit.values()) + rest))
        moves = [abs(refit[m.label].calib_nll - m.calib_nll) for m in old
                 if m.label in refit]
        top = max((x for x in moves if math.isfinite(x)), default=0.0)
        if not 2.0 * top > reach:
            return refit, reach
        reach = 2.0 * top


def in_reach(methods: Sequence[MethodResult], variants: Sequence[str], reach: float) -> set:
    """The labels of the rows of ``variants`` within ``reach`` nats of calibration NLL of
    the best row of a set some verdict chooses from (BRF rows, baselines, every row
    but BRF's, single members, per-token BRF rows), and every control."""
    out = set()
    for v in variants:
        rows = [m for m in methods if m.variant == v]
        for pick in _PICKS:
            out |= {m.label for m in tied([m for m in rows if pick(m)], margin=reach)}
        out |= {m.label for m in rows if m.role == "control"}
    return out


# The sets of rows verdicts choose from (the best of each, and the rows tied with it).
_PICKS = (lambda m: m.role == "brf", lambda m: m.role == "baseline",
          lambda m: m.role != "brf", lambda m: m.role == "member", _per_token)


def _ties(methods: Sequence[MethodResult], variants: Sequence[str], slack) -> tuple:
    """Every choice of rows a verdict rests on, as the tied labels (for: does ``slack``
    change any?)."""
    out = []
    for v in variants:
        rows = [m for m in methods if m.variant == v]
        for pick in _PICKS:
            out.append(tuple(m.label for m in tied([m for m in rows if pick(m)], slack=slack)))
    return tuple(out)


def _recomputed(plan: Plan, result: AnalysisResult, methods: list[MethodResult],
                variants: Sequence[str], n: int, slack: dict) -> AnalysisResult:
    """``result`` with ``methods`` in place of its rows and ``slack`` widening its ties:
    every verdict that reads the fits recomputed (the coherence test and the sweep read
    none)."""
    st = plan.stats
    v_cross = "calibrated" if "calibrated" in variants else variants[0]
    return dataclasses.replace(
        result, methods=methods, slack=dict(slack),
        cross=cross_terms(result.test, [m for m in methods if m.role == "brf"
                                        and m.variant == v_cross],
                          n_boot=st.n_boot, seed=st.seed, slack=slack),
        comparisons=comparisons(plan, variants, methods, slack),
        fair=fair_summary(plan, variants, methods, n, slack),
        forking=forking_tokens(plan, variants, methods, result.calib, result.test, slack))


def _answers(result: AnalysisResult, variants: Sequence[str]) -> dict[str, Answer]:
    """The analysis's verdicts (:func:`brf.eval.compare.answers`) that rest on the rows of
    ``variants`` (and the cross-term test, which reads the calibrated rows)."""
    sec = {k: v for k, v in result.section().items() if k != "methods"}
    sec["methods"] = []
    out = compare.answers(study_report.brief(sec))
    keep = tuple(f"[{v}]" for v in variants)
    return {k: a for k, a in out.items() if k.endswith(keep) or k == "cross-term"}


def _paired(a: dict[str, Answer], b: dict[str, Answer]) -> dict[str, tuple[Answer, Answer]]:
    return {k: (a[k], b[k]) for k in a if k in b}


def study_moves(plan: Plan, per_corpus: Sequence[tuple[str, AnalysisResult, AnalysisResult]],
                prompts: Sequence[tuple[str, AnalysisResult, AnalysisResult, AnalysisResult,
                                        AnalysisResult]]) -> dict[str, tuple[Answer, Answer]]:
    """The study-level verdicts that rest on fits (pooled over corpora; each prompt
    study's prefix effect), in the run and recomputed from the refitted analyses.

    Args:
      per_corpus: (corpus label, the run's analysis, the refitted analysis).
      prompts: (corpus label, plain analysis, refitted plain, prefixed analysis,
        refitted prefixed).

    Returns:
      ``"<where>: <verdict>"`` -> (the run's answer, the refit's).
    """
    st = plan.stats
    todo = refitted_variants(plan.variants)
    out = {}
    for which in (0, 1):
        runs = [(label, pair[which]) for label, *pair in per_corpus]
        for key, fair in (("nll", False), ("fair", True)):
            pooled = compare.pooled(runs, todo, n_boot=st.n_boot, seed=st.seed, fair=fair)
            for v, p in pooled.items():
                d = p.as_dict()
                a = compare._ci_answer(d["ci"], d["mean_difference"], "BRF better",
                                       "BRF worse").with_alternatives(
                    compare._ci_answer(x["ci"], x["mean_difference"], "BRF better",
                                       "BRF worse") for x in d["alternatives"])
                out.setdefault(f"pooled: {key} [{v}]", [None, None])[which] = a
        for label, plain, plain_p, prefixed, prefixed_p in prompts:
            args = (plain, prefixed) if which == 0 else (plain_p, prefixed_p)
            effect = compare.prefix_effect(*args, n_boot=st.n_boot, seed=st.seed).as_dict()
            for k, a in compare.effect_answers(effect).items():
                if k.endswith(tuple(f"[{v}]" for v in todo)) or k == "cross-term AUROC change":
                    out.setdefault(f"prompts: {label}: {k}", [None, None])[which] = a
    return {k: (a, b) for k, (a, b) in out.items() if a is not None and b is not None}


__all__ = ["Check", "RowMove", "check", "in_reach", "perturbed_cache",
           "refit_in_reach", "refitted_variants", "study_moves"]
