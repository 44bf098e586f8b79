"""One event table, analysed: every method fitted and tested, the paper's tests run.

:func:`analyse` splits the table (calibration / test, by segment), fits every
method spec of the plan on calibration (cached in the run directory), then the
controls of the best per-token BRF row of each variant (:mod:`brf.eval.controls`),
evaluates them on test, and runs the Phase Coherence and Cross-Term
Discrimination tests, the paired comparison of the best BRF setting with the best
baseline within each variant, the fair summary (the best BRF row against the best
of every other row, controls included, with free-parameter counts), the
forking-token analysis and the sweep. It returns an
:class:`AnalysisResult`; :meth:`AnalysisResult.section` is the JSON report
section (``brf.eval.report`` renders it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import numpy as np
from tqdm.auto import tqdm

from brf.eval import controls as controls_lib
from brf.eval import forking, hypotheses, stats
from brf.eval.caches import FitCache
from brf.event_table import EventTable
from brf.eval.fitting import (NLL_CAP, FitSettings, Fitted, MethodSpec, evaluate, fit_method,
                              precompile)
from brf.eval.plan import Plan, SweepCurve, split
from brf.fusion import PHASE_MAPS, phase_map


@dataclasses.dataclass
class MethodResult:
    """A method fitted on calibration and evaluated on test."""
    spec: MethodSpec
    fitted: Fitted
    test: dict            # metrics on the test split (see :func:`metrics`)
    test_nll: np.ndarray  # [P_test] per-position NLL (nats)

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def variant(self) -> str:
        return self.spec.variant

    @property
    def calib_nll(self) -> float:
        return self.fitted.calib_nll

    def row(self) -> dict:
        """The method's row in the report."""
        return {"label": self.label, "method": self.fitted.method, "variant": self.variant,
                "role": self.role, "params": self.fitted.params,
                "weights": np.asarray(self.fitted.weights).tolist(),
                "calib_nll": self.calib_nll, "fit": dict(self.fitted.info), "test": self.test}


class Difference(NamedTuple):
    """A paired difference of per-position test NLLs, row a minus row b (< 0: a is
    better): the mean, its 95% CI and p-value from a paired circular block bootstrap
    (:func:`brf.eval.hypotheses.nll_difference`) over ``n`` positions in blocks of
    ``block``."""
    mean_difference: float
    ci: tuple[float, float]
    p_value: float
    block: int
    n: int

    @classmethod
    def of(cls, nll_a: np.ndarray, nll_b: np.ndarray, *, n_boot: int, seed: int
           ) -> "Difference":
        d = hypotheses.nll_difference(nll_a, nll_b, n_boot=n_boot, seed=seed)
        return cls(d["mean_difference"], tuple(d["ci"]), d["p_value"], d["block"], d["n"])

    def as_dict(self) -> dict:
        return {**self._asdict(), "ci": list(self.ci)}


class Comparison(NamedTuple):
    """One variant's best BRF row against its best baseline (both chosen on
    calibration NLL), compared on test."""
    brf: str
    baseline: str
    difference: Difference

    @property
    def mean_difference(self) -> float:
        return self.difference.mean_difference

    @property
    def ci(self) -> tuple[float, float]:
        return self.difference.ci

    def as_dict(self) -> dict:
        """The report's ``nll_comparison[variant]``."""
        return {"brf": self.brf, "baseline": self.baseline, **self.difference.as_dict()}


class FairRow(NamedTuple):
    """A row of the fair summary: a fitted method with its free-parameter count."""
    label: str
    role: str
    method: str
    free_parameters: int
    calib_nll: float
    test_nll: float

    def as_dict(self) -> dict:
        return self._asdict()


class ControlComparison(NamedTuple):
    """The per-token BRF row against one of its controls."""
    control: FairRow
    difference: Difference

    def as_dict(self) -> dict:
        return {**self.control.as_dict(), **self.difference.as_dict()}


class FairComparison(NamedTuple):
    """One variant's best BRF row against the best of every other row (baselines,
    controls, single members and the rest), and the per-token BRF row the controls
    were built from against each control."""
    brf: FairRow
    rival: FairRow
    difference: Difference
    brf_candidates: int
    rival_candidates: int
    per_token: FairRow | None = None
    controls: tuple[ControlComparison, ...] = ()

    def pair(self) -> Comparison:
        """The best BRF row against the best other row, as a comparison (the other row
        in the baseline's place)."""
        return Comparison(self.brf.label, self.rival.label, self.difference)

    def as_dict(self) -> dict:
        """The report's ``fair_summary[variant]``."""
        out = {"brf": self.brf.as_dict(), "rival": self.rival.as_dict(),
               **self.difference.as_dict(), "brf_candidates": self.brf_candidates,
               "rival_candidates": self.rival_candidates}
        if self.per_token is not None:
            out["per_token"] = self.per_token.as_dict()
            out["controls"] = [c.as_dict() for c in self.controls]
        return out


@dataclasses.dataclass
class AnalysisResult:
    """What :func:`analyse` found on one event table."""
    calib: EventTable
    test: EventTable
    methods: list[MethodResult]
    coherence: list[dict]       # per (phase map, pair), with the phase differences ("diffs")
    cross: dict                 # the cross-term test, with the per-event scores ("scores")
    comparisons: dict[str, Comparison]     # per variant
    fair: dict[str, FairComparison]        # per variant
    forking: dict
    sweep: list[dict]
    left_out: list[str]

    def rows(self, variant: str, roles: Sequence[str] | None = None) -> list[MethodResult]:
        return [m for m in self.methods if m.variant == variant
                and (roles is None or m.role in roles)]

    def best(self, variant: str, roles: Sequence[str]) -> MethodResult | None:
        """The row of ``variant`` with one of ``roles`` and the lowest calibration NLL."""
        return _best(self.rows(variant, roles))

    def by_label(self, label: str) -> MethodResult:
        return next(m for m in self.methods if m.label == label)

    def section(self) -> dict:
        """The JSON report section of this analysis."""
        return {
            "phase_maps_left_out": self.left_out,
            "split": {"calibration_positions": int(self.calib.n_positions),
                      "test_positions": int(self.test.n_positions),
                      "test_gold_in_other": int(np.sum(~self.test.gold_listed))},
            "methods": [m.row() for m in self.methods],
            "phase_coherence": hypotheses.coherence_summary(self.coherence),
            "cross_term": {k: v for k, v in self.cross.items() if k != "scores"},
            "nll_comparison": {v: c.as_dict() for v, c in self.comparisons.items()},
            "fair_summary": {v: c.as_dict() for v, c in self.fair.items()},
            "forking": self.forking,
            "sweep": self.sweep,
        }


def _best(rows: Sequence[Any]) -> Any:
    """The row (a MethodResult or a Fitted) with the lowest calibration NLL; None for
    no rows."""
    return min(rows, key=lambda m: m.calib_nll) if rows else None


def metrics(ev: dict, gold_bytes: np.ndarray, *, n_boot: int, seed: int) -> dict:
    """Test-split metrics of one method from its per-position evaluation."""
    nll = ev["nll"]
    mean, ci = hypotheses.mean_ci(nll, n_boot=n_boot, seed=seed)
    return {"nll": float(mean), "nll_ci": ci, "perplexity": float(math.exp(mean)),
            "floored_positions": int(ev["floored"].sum()),
            "bits_per_byte": float(nll.sum() / math.log(2) / gold_bytes.sum()),
            "top1_accuracy": float(ev["top1_credit"].mean()),
            # float32 rounding can put a near-certain top event a hair above 1 (bytes
            # inside a word often are)
            "ece": float(stats.expected_calibration_error(np.minimum(ev["confidence"], 1.0),
                                                          ev["top1_credit"]))}


def fit_all(plan: Plan, specs: Sequence[MethodSpec], calib: EventTable, test: EventTable,
            *, cache_path: str, desc: str = "fitting methods",
            before: Sequence[MethodResult] = ()) -> list[MethodResult]:
    """Fits every spec on calibration (reusing cached fits) and evaluates it on test."""
    fits = fit_specs(specs, calib, plan.fit, cache=FitCache(cache_path, calib, plan.fit),
                     desc=desc, before=before)
    out = []
    for spec, f in zip(specs, fits):
        ev = evaluate(f, test)
        out.append(MethodResult(spec, f, metrics(ev, test.gold_bytes, n_boot=plan.stats.n_boot,
                                                 seed=plan.stats.seed), ev["nll"]))
    return out


def fit_specs(specs: Sequence[MethodSpec], calib: EventTable, settings: FitSettings, *,
              cache: FitCache | None = None, desc: str = "fitting methods",
              before: Sequence[MethodResult] = ()) -> list[Fitted]:
    """Fits every spec on calibration, each once (``cache`` keeps them).

    A spec in a variant other than 'proposed' starts from the proposed fit of the
    same row (the last one listed before it), and from the temperatures and weights
    of the best such fit listed before it (the calibrated objectives have local
    optima); ``before`` are rows fitted earlier on the same table, which count as
    listed before. The fits run in the order of :func:`_schedule` (the same fits as
    in the listed order), beside the compilation of the programs they need.
    """
    proposed, calibrated = {}, []
    for m in before:
        if m.variant == "proposed":
            proposed[_row_key(m.spec)] = m.fitted
        elif m.role != "member":
            calibrated.append(m.fitted)
    order, warm_of = _schedule(specs)
    cached = {i: cache.get(specs[i]) for i in order} if cache is not None else {}
    precompile([specs[i] for i in order if cached.get(i) is None
                and not _nothing_to_fit(specs[i])], calib, settings)
    fits: dict[int, Fitted] = {}

    def own_proposed(i: int) -> Fitted | None:
        """Spec i's row fitted as proposed: earlier in this call (its fit runs first), or
        in ``before``."""
        return fits[warm_of[i]] if warm_of[i] is not None else proposed.get(_row_key(specs[i]))

    for i in tqdm(order, desc=desc, unit="method", dynamic_ncols=True):
        spec, f = specs[i], cached.get(i)
        if f is None:
            others = sorted(calibrated, key=lambda g: g.calib_nll)[:1]
            f = fit_spec(spec, calib, settings, warm=own_proposed(i),
                         starts=others if spec.variant != "proposed" else ())
            if cache is not None:
                cache.put(spec, f)
        if spec.variant != "proposed" and spec.role != "member":
            calibrated.append(f)
        fits[i] = f
    out = [fits[i] for i in range(len(specs))]
    return _second_round(specs, out, calibrated, calib, settings, cache,
                         {i: own_proposed(i) for i in range(len(specs))})


def _schedule(specs: Sequence[MethodSpec]) -> tuple[list[int], list[int | None]]:
    """(an order to fit ``specs`` in, the index of the proposed spec each one starts
    from or None). Each spec starts from the last proposed spec of its row listed
    before it, and a non-proposed one from the non-proposed ones listed before it:
    proposed specs keep their order, non-proposed ones theirs, and each
    non-proposed one runs as soon as the proposed one it starts from has run (a
    table's calibrated rows then alternate with its proposed rows, and fitting
    overlaps the compilation of the programs that later rows need)."""
    warm_of, last = [], {}
    for i, spec in enumerate(specs):
        warm_of.append(last.get(_row_key(spec)))
        if spec.variant == "proposed":
            last[_row_key(spec)] = i
    waiting = [i for i, s in enumerate(specs) if s.variant != "proposed"]
    order, done, j = [], set(), 0
    for i in [None] + [i for i, s in enumerate(specs) if s.variant == "proposed"]:
        if i is not None:
            order.append(i)
            done.add(i)
        while j < len(waiting) and (warm_of[waiting[j]] is None or warm_of[waiting[j]] in done):
            order.append(waiting[j])
            done.add(waiting[j])
            j += 1
    return order, warm_of


# The second round's version: cached fits refined by an earlier rule are refined again.
# 3: it also refits each row from the row's own proposed fit.
_SECOND_ROUND = 3


def _second_round(specs: Sequence[MethodSpec], fits: list[Fitted], calibrated: list[Fitted],
                  calib: EventTable, settings: FitSettings, cache: FitCache | None,
                  own_proposed: dict[int, Fitted | None] | None = None) -> list[Fitted]:
    """Each calibrated row refitted once more, twice: from its own fit, and from its
    own proposed fit (``own_proposed[i]``, where the row has one), each also from the
    best calibrated fit of the table and from the best calibrated fit of the same
    method (their temperatures and weights; a method's own parameters too); the best
    is kept (its info says ``second_round``, so a cached fit is not refined again).

    The calibrated objectives have poor local optima (every member tempered towards
    the bound, the fused distribution sharpened to make up for it): a row fitted
    before a good fit of its family was found can sit in one (Hamlet: eight BRF rows
    at 3.2828 nats while born token_tanh found 3.2476). From its own fit such a row
    keeps that basin's values of its own parameters, which the better temperatures
    alone may not get it out of; its proposed fit starts it afresh (the code corpus:
    born token_tanh [calibrated] stayed at 2.0561 from its own fit and reached 2.0534
    from its proposed fit with born token_log1p's temperatures).
    """
    if not calibrated:
        return fits
    best = _best(calibrated)
    out = list(fits)
    todo = [i for i, s in enumerate(specs) if s.variant != "proposed" and s.role != "member"
            and fits[i].info.get("second_round") != _SECOND_ROUND]
    for i in tqdm(todo, desc="second round", unit="method", dynamic_ncols=True,
                  disable=not todo):
        f = fits[i]
        kin = _best([g for g in calibrated if g.method == f.method and g is not f])
        starts = [g for g in (best, kin) if g is not None and g is not f]
        keep = f
        if starts:
            runs = [dict(warm=f, refine=True)]
            p = (own_proposed or {}).get(i)
            if p is not None:
                runs.append(dict(warm=p))
            for kw in runs:
                g = fit_spec(specs[i], calib, settings, starts=starts, **kw)
                if g.calib_nll < keep.calib_nll:
                    keep = g
        out[i] = dataclasses.replace(keep, info={**dict(keep.info),
                                                 "second_round": _SECOND_ROUND,
                                                 "first_round_nll": f.calib_nll})
        if cache is not None:
            cache.put(specs[i], out[i])
    return out


def _row_key(spec: MethodSpec) -> str:
    return dataclasses.replace(spec, label="", variant="proposed").key()


def _nothing_to_fit(spec: MethodSpec) -> bool:
    return spec.fixed_weights is not None and spec.variant == "proposed"


def fit_spec(spec: MethodSpec, calib: EventTable, settings: FitSettings, *,
             warm: Fitted | None = None, starts: Sequence[Fitted] = (),
             refine: bool = False) -> Fitted:
    """One spec fitted (:func:`brf.eval.fitting.fit_method`); a single member as proposed
    has nothing to fit."""
    if _nothing_to_fit(spec):
        w = np.asarray(spec.fixed_weights, np.float64)
        f = Fitted(spec.label, spec.method, {}, w, float("nan"))
        if spec.method == "linear" and np.sum(w == 1.0) == 1 and np.sum(w == 0.0) == len(w) - 1:
            nll = member_nll(calib, int(np.argmax(w)))  # one member alone
        else:
            nll = evaluate(f, calib)["nll"]
        return dataclasses.replace(f, calib_nll=float(np.mean(nll)))
    return fit_method(spec, calib, settings=settings, warm=warm, starts=starts,
                      refine=refine)


def member_nll(table: EventTable, i: int) -> np.ndarray:
    """[P] member i's NLL of the gold strings (float64; as :func:`evaluate` gives it for
    the linear pool with all the weight on member i)."""
    lp = np.asarray(table.logp[:, i, :], np.float64)
    top = np.max(lp, axis=-1, keepdims=True)
    lse = top[:, 0] + np.log(np.sum(np.exp(lp - top), axis=-1))
    nll = lse - lp[np.arange(len(lp)), np.asarray(table.gold, np.int64)]
    return np.where(nll <= NLL_CAP, nll, NLL_CAP) - table.offset


def comparisons(plan: Plan, variants: Sequence[str], result_methods: list[MethodResult]
                ) -> dict[str, Comparison]:
    """Per variant: the best BRF setting vs the best baseline, both chosen on calibration
    NLL among rows of that variant (like with like); paired block bootstrap on test."""
    out = {}
    for v in variants:
        rows = [m for m in result_methods if m.variant == v]
        born = [m for m in rows if m.role == "brf"]
        base = [m for m in rows if m.role == "baseline"]
        if not born or not base:
            continue
        b, a = _best(born), _best(base)
        out[v] = Comparison(b.label, a.label, Difference.of(
            b.test_nll, a.test_nll, n_boot=plan.stats.n_boot, seed=plan.stats.seed))
    return out


def control_specs(methods: Sequence[MethodResult], n: int, variants: Sequence[str], *,
                  seed: int) -> list[MethodSpec]:
    """Per variant, the controls (:func:`brf.eval.controls.controls_for`) of the BRF row
    with a per-token phase map and the lowest calibration NLL of that variant."""
    out = []
    for v in variants:
        b = _best([m for m in methods if m.variant == v and _per_token(m)])
        if b is not None:
            out += list(controls_lib.controls_for(b.spec, n, seed=seed).values())
    return out


def _per_token(m: MethodResult) -> bool:
    return m.role == "brf" and bool(m.spec.phase) and PHASE_MAPS.get(m.spec.phase).kind == "token"


def fair_summary(plan: Plan, variants: Sequence[str], methods: Sequence[MethodResult],
                 n: int) -> dict[str, FairComparison]:
    """Per variant: the best BRF row against the best of every other row of the variant
    (baselines, controls, single members and the rest; both chosen on calibration NLL),
    with their free-parameter counts, and the per-token BRF row the controls were built
    from against each of its controls. Differences are BRF minus the other row on test
    (paired block bootstrap); < 0 means BRF is better."""
    st, out = plan.stats, {}

    def row(m: MethodResult) -> FairRow:
        return FairRow(m.label, m.role, m.spec.method,
                       controls_lib.free_parameters(m.spec, n).total, m.calib_nll,
                       m.test["nll"])

    def diff(a: MethodResult, b: MethodResult) -> Difference:
        return Difference.of(a.test_nll, b.test_nll, n_boot=st.n_boot, seed=st.seed)

    for v in variants:
        rows = [m for m in methods if m.variant == v]
        born = _best([m for m in rows if m.role == "brf"])
        rival = _best([m for m in rows if m.role != "brf"])
        if born is None or rival is None:
            continue
        controls = [m for m in rows if m.role == "control"]
        token = _best([m for m in rows if _per_token(m)])
        per_token = token is not None and bool(controls)
        out[v] = FairComparison(
            row(born), row(rival), diff(born, rival),
            brf_candidates=sum(m.role == "brf" for m in rows),
            rival_candidates=sum(m.role != "brf" for m in rows),
            per_token=row(token) if per_token else None,
            controls=tuple(ControlComparison(row(c), diff(token, c))
                           for c in controls) if per_token else ())
    return out


def forking_tokens(plan: Plan, variants: Sequence[str], result_methods: list[MethodResult],
                   calib: EventTable, test: EventTable) -> dict:
    """Per variant: every method's gain over the best single member by the members' mean
    entropy (deciles, top fraction), and entropy-gated fusion that runs the other
    members only at the primary member's top-fraction entropy positions
    (:mod:`brf.eval.forking`)."""
    ent_test = forking.member_entropy(test)
    ent_cal = forking.member_entropy(calib)
    n = test.logp.shape[1]
    top = plan.stats.forking_top_fraction
    out = {}
    for v in variants:
        rows = [m for m in result_methods if m.variant == v]
        singles = [m for m in rows if m.role == "member"]
        if not singles:
            continue
        ref = _best(singles)
        primary = int(np.argmax(ref.fitted.weights))
        primary_nll = next(m.test_nll for m in singles
                           if int(np.argmax(m.fitted.weights)) == primary)
        per_method = {m.label: forking.gain_by_entropy(
            m.test_nll, ref.test_nll, ent_test.mean(1), top_fraction=top,
            n_boot=min(plan.stats.n_boot, 500), seed=plan.stats.seed)
            for m in rows if m.role != "member"}
        thr = float(np.quantile(ent_cal[:, primary], 1 - top))
        gated = {}
        for kind, roles in (("brf", ("brf",)), ("baseline", ("baseline",))):
            cands = [m for m in rows if m.role in roles]
            if cands:
                best = _best(cands)
                gated[kind] = {"method": best.label, **forking.gated_fusion(
                    best.test_nll, primary_nll, ref.test_nll, ent_test[:, primary], thr, n)}
        out[v] = {"reference": ref.label, "primary_member": primary, "top_fraction": top,
                  "by_method": per_method, "gated": gated}
    return out


def sweep(curves: Sequence[SweepCurve], calib: EventTable, test: EventTable) -> list[dict]:
    """Calibration and test NLL of BRF (uniform weights) along each sweep curve."""
    out = []
    n = calib.logp.shape[1]
    for curve in curves:
        c_nll, t_nll = [], []
        for v in curve.values:
            params = dict(curve.fixed)
            if curve.param == "offset_difference":
                params["offset"] = [0.0, float(v)] + [0.0] * (n - 2)
            else:
                params[curve.param] = float(v)
            f = Fitted(curve.label, "born", {"phase": curve.phase_map,
                                             **{f"phase.{k}": p for k, p in params.items()}},
                       np.full(n, 1.0 / n), float("nan"))
            c_nll.append(float(np.mean(evaluate(f, calib)["nll"])))
            t_nll.append(float(np.mean(evaluate(f, test)["nll"])))
        out.append({"phase_map": curve.label, "param": curve.param,
                    "values": list(curve.values), "calib_nll": c_nll, "test_nll": t_nll})
    return out


def analyse(plan: Plan, table: EventTable, n_segments: int, *, variants: Sequence[str],
            cache_path: str, with_sweep: bool = True) -> AnalysisResult:
    """Fits, evaluates and tests every method on one event table.

    Args:
      plan: the study's plan (method specs, fit and statistics settings).
      table: every position of the analysis, in text order.
      n_segments: the corpus's segment count (the split is by segment).
      variants: the method variants to fit.
      cache_path: the fit cache's file.
      with_sweep: compute the sweep curves.
    """
    calib, test = split(plan.scoring, table, n_segments)
    n = table.logp.shape[1]
    methods = fit_all(plan, plan.method_specs(n, variants), calib, test, cache_path=cache_path)
    if plan.controls:
        methods += fit_all(plan, control_specs(methods, n, variants, seed=plan.stats.seed),
                           calib, test, cache_path=cache_path, desc="fitting controls",
                           before=methods)
    # The cross-term test reads the best BRF setting's weights and phase map; from the
    # calibrated variant when it runs (its temperatures do not enter the test).
    v_cross = "calibrated" if "calibrated" in variants else variants[0]
    best_born = min((m for m in methods if m.role == "brf" and m.variant == v_cross),
                    key=lambda m: m.calib_nll).fitted
    # The coherence test reads each phase map as configured (a property of the
    # map, not of a fit); maps that ignore the logits (constant) are left out.
    usable = plan.phase_maps_for(n)
    phase_specs = {e.label: e.spec for e in usable if phase_map(e.spec).name != "constant"}
    st = plan.stats
    return AnalysisResult(
        calib=calib, test=test, methods=methods,
        coherence=hypotheses.phase_coherence(test, phase_specs, n_perm=st.n_perm,
                                             seed=st.seed),
        cross=hypotheses.cross_term_test(test, best_born, n_boot=st.n_boot, seed=st.seed),
        comparisons=comparisons(plan, variants, methods),
        fair=fair_summary(plan, variants, methods, n),
        forking=forking_tokens(plan, variants, methods, calib, test),
        sweep=sweep(plan.sweep, calib, test) if with_sweep else [],
        left_out=sorted({e.label for e in plan.phase_maps} - {e.label for e in usable}))


__all__ = ["AnalysisResult", "Comparison", "ControlComparison", "Difference", "FairComparison",
           "FairRow", "MethodResult", "analyse", "control_specs", "fair_summary",
           "fit_all", "fit_spec", "fit_specs", "metrics"]
