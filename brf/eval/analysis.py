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
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from tqdm.auto import tqdm

from brf.eval import controls as controls_lib
from brf.eval import forking, hypotheses, stats
from brf.eval.caches import FitCache
from brf.event_table import EventTable
from brf.eval.fitting import (FIT_NEAR, FIT_TOLERANCE, NLL_CAP, FitSettings, Fitted, MethodSpec,
                              evaluate, fit_method, precompile, split_phase)
from brf.eval.plan import Plan, SweepCurve, split
from brf.fusion import PHASE_MAPS, phase_map
from brf.fusion import phase as phase_lib


# Rows chosen on calibration NLL (BRF's best row, its rival, the per-token row the
# controls are built from, the cross-term test's setting) are reported with every row
# whose calibration NLL lies within TIE_MARGIN of the chosen one: each row's fit repeats
# to FIT_TOLERANCE whatever the last bits (brf.eval.fitting), so two rows closer than
# twice that may swap places under an unrelated change. A verdict *stands* when every
# tied row gives the same answer, and is *fragile* otherwise.
TIE_MARGIN = 2 * FIT_TOLERANCE


def side(ci) -> str:
    """'lower' / 'higher' / 'undecided': where a CI lies relative to 0."""
    return "lower" if ci[1] < 0 else "higher" if ci[0] > 0 else "undecided"


def tied(rows: Sequence[Any], margin: float = TIE_MARGIN,
         slack: Mapping[str, float] | None = None) -> list:
    """The rows (MethodResults or Fitted) whose calibration NLL lies within ``margin`` of
    the lowest, lowest first (the first of equal rows as listed: the row :func:`_best`
    chooses comes first). ``slack`` (label -> nats) widens the margin between two rows
    by both rows' slack: how far the stability check saw each row's fit move
    (:mod:`brf.eval.stability`), so that two rows a refit could reorder count as tied."""
    if not rows:
        return []
    slack = slack or {}
    low = min(rows, key=lambda r: r.calib_nll)
    s0 = slack.get(low.label, 0.0)
    return sorted((r for r in rows
                   if r.calib_nll <= low.calib_nll + margin + s0 + slack.get(r.label, 0.0)),
                  key=lambda r: r.calib_nll)


@dataclasses.dataclass
class MethodResult:
    """A method fitted on calibration and evaluated on test."""
    spec: MethodSpec
    fitted: Fitted
    test: dict            # metrics on the test split (see :func:`metrics`)
    test_nll: np.ndarray  # [P_test] per-position NLL (nats)
    # how far the row's mean test NLL lies from the fit's at the other ends its fit
    # reached within FIT_NEAR on calibration (:func:`fit_spread`; 0: none)
    spread: float = 0.0

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
                "calib_nll": self.calib_nll, "fit": dict(self.fitted.info), "test": self.test,
                "fit_spread": self.spread}


class Difference(NamedTuple):
    """A paired difference of per-position test NLLs, row a minus row b (< 0: a is
    better): the mean, its 95% CI and p-value from a paired circular block bootstrap
    (:func:`brf.eval.hypotheses.nll_difference`) over ``n`` positions in blocks of
    ``block``, the CI widened on each side by ``fit_spread``, the two rows' fit spreads
    (:func:`fit_spread`): a difference is called only where it clears both the
    statistical interval and the places the fits could as well have ended
    (``statistical_ci``: the bootstrap's interval alone)."""
    mean_difference: float
    ci: tuple[float, float]
    p_value: float
    block: int
    n: int
    fit_spread: float = 0.0
    statistical_ci: tuple[float, float] | None = None

    @classmethod
    def of(cls, nll_a: np.ndarray, nll_b: np.ndarray, *, n_boot: int, seed: int,
           spread: float = 0.0) -> "Difference":
        d = hypotheses.nll_difference(nll_a, nll_b, n_boot=n_boot, seed=seed)
        lo, hi = d["ci"]
        return cls(d["mean_difference"], (lo - spread, hi + spread), d["p_value"],
                   d["block"], d["n"], float(spread), (lo, hi))

    def as_dict(self) -> dict:
        return {**self._asdict(), "ci": list(self.ci),
                "statistical_ci": list(self.statistical_ci or self.ci)}


def fit_spread(fitted: Fitted, test: EventTable, test_nll: np.ndarray) -> float:
    """A row's fit spread on test: the largest distance of its mean test NLL at another
    end its fit reached within FIT_NEAR on calibration (``info["near"]``,
    :func:`brf.eval.fitting.fit_method`'s census) from the fit's own (0 without one).

    Those ends are places a refit under other last bits could as well have ended; a
    difference between two rows smaller than their spreads turns on which one it was
    (two ends equal on calibration can lie far apart on test)."""
    out = 0.0
    for e in fitted.info.get("near") or ():
        other = dataclasses.replace(fitted, params=e["params"],
                                    weights=np.asarray(e["weights"], np.float64),
                                    calib_nll=float(e["calib_nll"]), info={})
        out = max(out, abs(float(np.mean(evaluate(other, test)["nll"]))
                           - float(np.mean(test_nll))))
    return out


def _paired(plan: Plan) -> Callable[["MethodResult", "MethodResult"], Difference]:
    """Row a minus row b on test, the CI widened by both rows' fit spreads."""
    st = plan.stats
    return lambda a, b: Difference.of(a.test_nll, b.test_nll, n_boot=st.n_boot, seed=st.seed,
                                      spread=a.spread + b.spread)


class Alternative(NamedTuple):
    """A chosen comparison redone with other rows among the tied ones (:data:`TIE_MARGIN`):
    BRF's row, the other row, their difference on test."""
    brf: str
    other: str
    difference: Difference

    def as_dict(self, other_key: str) -> dict:
        return {"brf": self.brf, other_key: self.other, **self.difference.as_dict()}


def _stands(ci, alternatives: Sequence[Alternative]) -> bool:
    return all(side(a.difference.ci) == side(ci) for a in alternatives)


class Comparison(NamedTuple):
    """One variant's best BRF row against its best baseline (both chosen on
    calibration NLL), compared on test; with the rows tied with each choice
    (:data:`TIE_MARGIN`; the chosen one first) and the comparison for every other
    pair of tied rows."""
    brf: str
    baseline: str
    difference: Difference
    tied: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    alternatives: tuple[Alternative, ...] = ()

    @property
    def mean_difference(self) -> float:
        return self.difference.mean_difference

    @property
    def ci(self) -> tuple[float, float]:
        return self.difference.ci

    @property
    def stands(self) -> bool:
        """Whether every pair of tied rows puts the CI on the same side of 0."""
        return _stands(self.ci, self.alternatives)

    def as_dict(self) -> dict:
        """The report's ``nll_comparison[variant]``."""
        return {"brf": self.brf, "baseline": self.baseline, **self.difference.as_dict(),
                **_ties_dict(self.tied, ("brf", "baseline"), self.alternatives, "baseline",
                             self.stands)}


def _ties_dict(tied, names, alternatives: Sequence[Alternative], other_key: str,
               stands: bool) -> dict:
    return {"tied": {k: list(t) for k, t in zip(names, tied)},
            "alternatives": [a.as_dict(other_key) for a in alternatives], "stands": stands}


def _alternatives(a_rows: Sequence["MethodResult"], b_rows: Sequence["MethodResult"],
                  diff: Callable[["MethodResult", "MethodResult"], Difference]
                  ) -> tuple[Alternative, ...]:
    """The comparison of every pair of tied rows (one of ``a_rows``, one of ``b_rows``)
    but the chosen pair (both rows first)."""
    return tuple(Alternative(a.label, b.label, diff(a, b))
                 for i, a in enumerate(a_rows) for j, b in enumerate(b_rows) if i or j)


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


class ControlSet(NamedTuple):
    """A per-token BRF row against each of its controls."""
    per_token: FairRow
    controls: tuple[ControlComparison, ...]

    def as_dict(self) -> dict:
        return {"per_token": self.per_token.as_dict(),
                "controls": [c.as_dict() for c in self.controls]}


def controls_answer(controls: Sequence[ControlComparison | dict]) -> str:
    """What a per-token row's controls say, in words that compare across runs: how many it
    beats and whether shuffling its phases costs (the phase link carries its fit)."""
    rows = [c.as_dict() if isinstance(c, ControlComparison) else c for c in controls]
    if not rows:
        return "controls not fitted"
    beaten = sum(r["ci"][1] < 0 for r in rows)
    shuffled = [r for r in rows if r["method"] == "born_shuffled"]
    link = ("; shuffling its phases costs" if shuffled and shuffled[0]["ci"][1] < 0 else
            "; shuffling its phases costs nothing shown" if shuffled else "")
    return f"beats {beaten} of {len(rows)} controls{link}"


class FairComparison(NamedTuple):
    """One variant's best BRF row against the best of every other row (baselines,
    controls, single members and the rest), and the per-token BRF row the controls
    were built from against each control; with the rows tied with each choice
    (:data:`TIE_MARGIN`) and the same comparisons for the other tied rows."""
    brf: FairRow
    rival: FairRow
    difference: Difference
    brf_candidates: int
    rival_candidates: int
    per_token: FairRow | None = None
    controls: tuple[ControlComparison, ...] = ()
    tied: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    alternatives: tuple[Alternative, ...] = ()
    per_token_tied: tuple[str, ...] = ()
    per_token_alternatives: tuple[ControlSet, ...] = ()

    def pair(self) -> Comparison:
        """The best BRF row against the best other row, as a comparison (the other row
        in the baseline's place, the alternatives with it)."""
        return Comparison(self.brf.label, self.rival.label, self.difference, self.tied,
                          self.alternatives)

    @property
    def stands(self) -> bool:
        return _stands(self.difference.ci, self.alternatives)

    @property
    def controls_stand(self) -> bool:
        """Whether every tied per-token row gets the same answer from its controls."""
        main = controls_answer(self.controls)
        return all(controls_answer(a.controls) == main for a in self.per_token_alternatives)

    def as_dict(self) -> dict:
        """The report's ``fair_summary[variant]``."""
        out = {"brf": self.brf.as_dict(), "rival": self.rival.as_dict(),
               **self.difference.as_dict(), "brf_candidates": self.brf_candidates,
               "rival_candidates": self.rival_candidates,
               **_ties_dict(self.tied, ("brf", "rival"), self.alternatives, "rival",
                            self.stands)}
        if self.per_token is not None:
            out["per_token"] = self.per_token.as_dict()
            out["controls"] = [c.as_dict() for c in self.controls]
            out["per_token_tied"] = list(self.per_token_tied)
            out["per_token_alternatives"] = [a.as_dict() for a in self.per_token_alternatives]
            out["controls_stand"] = self.controls_stand
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
    # label -> nats each row's fit moved in the stability check, which widens the tie
    # margin between rows (tied); empty before the check
    slack: dict = dataclasses.field(default_factory=dict)

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
            "ties": {"margin": TIE_MARGIN, "slack": dict(self.slack)},
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
                                                 seed=plan.stats.seed), ev["nll"],
                                fit_spread(f, test, ev["nll"])))
    return out


def fit_specs(specs: Sequence[MethodSpec], calib: EventTable, settings: FitSettings, *,
              cache: FitCache | None = None, desc: str = "fitting methods",
              before: Sequence[MethodResult] = ()) -> list[Fitted]:
    """Fits every spec on calibration, each once (``cache`` keeps them), in two passes.

    First each spec on its own (:func:`brf.eval.fitting.fit_method`: its initial values
    and random starts; a spec in a variant other than 'proposed' also from the proposed
    fit of the same row, the last one listed before it or in ``before``, rows fitted
    earlier on the same table). Then every calibrated row (not a single member) again
    from its own first fit and from the temperatures and weights of the
    :data:`POOL_STARTS` best calibrated rows of the table's first pass (``before``'s
    included), keeping the lower: the calibrated objectives have basins that random
    starts seldom reach (members tempered far from 1) and that another method found.
    Last, a calibrated born row that ended above a row whose map its own contains is
    fitted again from that row's fit (:func:`_nesting_pass`). The second pass reads the
    first pass's results only, the last step the second's, so no fit depends on the
    order of the rows, and a refit under other last bits runs the same passes. The first
    pass runs in the order of :func:`_schedule`, beside the compilation of the programs
    it needs.
    """
    proposed = {_row_key(m.spec): m.fitted for m in before if m.variant == "proposed"}
    order, warm_of = _schedule(specs)
    cached = {i: cache.get(specs[i]) for i in order} if cache is not None else {}
    precompile([specs[i] for i in order if cached.get(i) is None
                and not _nothing_to_fit(specs[i])], calib, settings)
    fits: dict[int, Fitted] = {}

    def own_proposed(i: int) -> Fitted | None:
        """Spec i's row fitted as proposed: earlier in this call (its fit runs first), or
        in ``before``."""
        if specs[i].variant == "proposed":
            return None
        return fits[warm_of[i]] if warm_of[i] is not None else proposed.get(_row_key(specs[i]))

    for i in tqdm(order, desc=desc, unit="method", dynamic_ncols=True):
        f = cached.get(i)
        if f is None:
            f = fit_spec(specs[i], calib, settings, warm=own_proposed(i))
            if cache is not None:
                cache.put(specs[i], f)
        fits[i] = f
    out = [fits[i] for i in range(len(specs))]
    earlier = [m for m in before if m.variant != "proposed" and m.role != "member"]
    out = _pooled_pass(specs, out, calib, settings, cache,
                       [first_pass(m.fitted) for m in earlier])
    return _nesting_pass(specs, out, calib, settings, cache, [m.fitted for m in earlier])


# How many of the table's best calibrated first-pass fits start each calibrated row
# in the second pass; the pass's version (a cached fit of another version is refitted:
# 3 added the nesting step).
POOL_STARTS = 4
_POOLED = 3


def first_pass(f: Fitted) -> Fitted:
    """The first-pass fit a fit came from (itself, before the second pass)."""
    fp = f.info.get("first_pass")
    if not fp:
        return f
    return dataclasses.replace(f, params=fp["params"], weights=np.asarray(fp["weights"]),
                               calib_nll=float(fp["calib_nll"]), info={})


def _second_pass_rows(specs: Sequence[MethodSpec]) -> list[int]:
    """The rows the second pass and the nesting step refit: calibrated, not a member
    alone, with something to fit."""
    return [i for i, s in enumerate(specs) if s.variant != "proposed" and s.role != "member"
            and not _nothing_to_fit(s)]


def _pooled_pass(specs: Sequence[MethodSpec], fits: list[Fitted], calib: EventTable,
                 settings: FitSettings, cache: FitCache | None,
                 earlier: Sequence[Fitted]) -> list[Fitted]:
    """The second pass of :func:`fit_specs` (``earlier``: first-pass fits of rows fitted
    before on the same table, in the pool too)."""
    rows = _second_pass_rows(specs)
    pool = sorted([first_pass(fits[i]) for i in rows] + list(earlier),
                  key=lambda f: (f.calib_nll, f.label))
    todo = [i for i in rows if fits[i].info.get("pooled") != _POOLED]
    out = list(fits)
    again = dataclasses.replace(settings, starts=0)
    for i in tqdm(todo, desc="second pass", unit="method", dynamic_ncols=True,
                  disable=not todo):
        f = first_pass(fits[i])
        others = [g for g in pool if g.label != f.label][:POOL_STARTS]
        others += [g for g in (_nested_start(specs[i], h) for h in pool
                               if h.label != f.label) if g is not None]
        g = fit_spec(specs[i], calib, again, warm=f, starts=others)
        keep = g if g.calib_nll < f.calib_nll else fits[i]
        out[i] = dataclasses.replace(keep, info={
            **dict(keep.info), "pooled": _POOLED, "nested": None,
            "first_pass": {"params": f.params, "weights": np.asarray(f.weights).tolist(),
                           "calib_nll": f.calib_nll}})
        if cache is not None:
            cache.put(specs[i], out[i])
    return out


def _nesting_pass(specs: Sequence[MethodSpec], fits: list[Fitted], calib: EventTable,
                  settings: FitSettings, cache: FitCache | None,
                  earlier: Sequence[Fitted]) -> list[Fitted]:
    """The last step of :func:`fit_specs`: a calibrated born row whose phase map contains
    the map of another calibrated row that ended lower (``earlier`` included) is fitted
    again from the lowest such row's fit transcribed into its map (:func:`_nested_start`),
    keeping the lower. So no row ends above a row its map contains (up to the
    transcription, exact from ``constant``): on the swarm at 4330fdc born token_tanh
    [calibrated] ended at 3.712881, 1.1e-3 above born constant (fitted offset)'s 3.711789,
    which its map holds at scale 0. It reads the second pass's results only (no row's
    depends on the order of the rows), and a refit under other last bits runs it too.
    Where the nested fit wins, the row's own end joins its census (``near``) when within
    FIT_NEAR of it."""
    rows = _second_pass_rows(specs)
    pool = [fits[j] for j in rows] + list(earlier)
    out = list(fits)
    again = dataclasses.replace(settings, starts=0)
    for i in rows:
        f = fits[i]
        if specs[i].method != "born" or f.info.get("nested", "") is not None:
            continue  # not a born row, or its nesting step ran (a cached fit)
        below = sorted((h.calib_nll, h.label, g) for h in pool
                       if h.label != f.label and h.calib_nll < f.calib_nll
                       and (g := _nested_start(specs[i], h)) is not None)
        keep, source = f, ""
        if below:
            g = fit_spec(specs[i], calib, again, warm=below[0][2])
            if g.calib_nll < f.calib_nll:
                keep, source = g, below[0][1]
        info = {**dict(keep.info), "nested": source,
                **{k: f.info[k] for k in ("pooled", "first_pass") if k in f.info}}
        if keep is not f:
            own = [{"calib_nll": f.calib_nll, "params": f.params,
                    "weights": np.asarray(f.weights).tolist()}] + list(f.info.get("near") or ())
            info["near"] = list(keep.info.get("near") or ()) + [
                e for e in own if float(e["calib_nll"]) - keep.calib_nll <= FIT_NEAR]
            info["ends"] = sorted(set(keep.info.get("ends") or ()) | set(f.info.get("ends") or ()))
        out[i] = dataclasses.replace(keep, info=info)
        if cache is not None:
            cache.put(specs[i], out[i])
    return out


def _nested_start(spec: MethodSpec, fit: Fitted) -> Fitted | None:
    """``fit`` (a born row's) as a start of the born row ``spec`` whose phase map
    contains its map (:func:`brf.fusion.phase.embed`), its phase parameters
    transcribed and its temperatures and weights kept; None for other pairs."""
    source = fit.params.get("phase")
    if (spec.method != "born" or fit.method != "born" or not spec.phase or not source
            or source == spec.phase):
        return None
    kept, given = split_phase(fit.params)
    params = phase_lib.embed(source, given, spec.phase)
    if params is None:
        return None
    shape = np.shape(spec.fit.get("phase.offset", spec.fixed.get("phase.offset", 0.0)))
    params["offset"] = np.broadcast_to(np.asarray(params["offset"], np.float64), shape)
    return dataclasses.replace(fit, params={**kept, "phase": spec.phase,
                                            **{f"phase.{k}": v for k, v in params.items()}})


def _schedule(specs: Sequence[MethodSpec]) -> tuple[list[int], list[int | None]]:
    """(an order to fit ``specs`` in, the index of the proposed spec each one starts
    from or None). Each spec starts from the last proposed spec of its row listed
    before it: proposed specs keep their order, non-proposed ones theirs, and each
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


def _row_key(spec: MethodSpec) -> str:
    return dataclasses.replace(spec, label="", variant="proposed").key()


def _nothing_to_fit(spec: MethodSpec) -> bool:
    return spec.fixed_weights is not None and spec.variant == "proposed"


def fit_spec(spec: MethodSpec, calib: EventTable, settings: FitSettings, *,
             warm: Fitted | None = None, starts: Sequence[Fitted] = ()) -> Fitted:
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
    return fit_method(spec, calib, settings=settings, warm=warm, starts=starts)


def member_nll(table: EventTable, i: int) -> np.ndarray:
    """[P] member i's NLL of the gold strings (float64; as :func:`evaluate` gives it for
    the linear pool with all the weight on member i)."""
    lp = np.asarray(table.logp[:, i, :], np.float64)
    top = np.max(lp, axis=-1, keepdims=True)
    lse = top[:, 0] + np.log(np.sum(np.exp(lp - top), axis=-1))
    nll = lse - lp[np.arange(len(lp)), np.asarray(table.gold, np.int64)]
    return np.where(nll <= NLL_CAP, nll, NLL_CAP) - table.offset


def comparisons(plan: Plan, variants: Sequence[str], result_methods: list[MethodResult],
                slack: Mapping[str, float] | None = None) -> dict[str, Comparison]:
    """Per variant: the best BRF setting vs the best baseline, both chosen on calibration
    NLL among rows of that variant (like with like); paired block bootstrap on test. The
    rows tied with either choice (:data:`TIE_MARGIN`) are compared too."""
    out, diff = {}, _paired(plan)
    for v in variants:
        rows = [m for m in result_methods if m.variant == v]
        born = tied([m for m in rows if m.role == "brf"], slack=slack)
        base = tied([m for m in rows if m.role == "baseline"], slack=slack)
        if not born or not base:
            continue
        b, a = born[0], base[0]
        out[v] = Comparison(b.label, a.label, diff(b, a),
                            (tuple(m.label for m in born), tuple(m.label for m in base)),
                            _alternatives(born, base, diff))
    return out


def control_specs(methods: Sequence[MethodResult], n: int, variants: Sequence[str], *,
                  seed: int, slack: Mapping[str, float] | None = None) -> list[MethodSpec]:
    """Per variant, the controls (:func:`brf.eval.controls.controls_for`) of the BRF row
    with a per-token phase map and the lowest calibration NLL of that variant, and of
    every per-token row tied with it (:data:`TIE_MARGIN`).

    A control is one row per label: tied rows share some (every per-token row's
    capacity pool is the same spec; a linear map borrows the tanh curve, so its
    reshaping controls are token_tanh's with another starting rate), and a shared one
    is fitted once, from the spec of the best of the rows that share it. Two rows
    under one label would be one row to a reader and to every choice made by label."""
    out, seen = [], set()
    for v in variants:
        for b in tied([m for m in methods if m.variant == v and _per_token(m)], slack=slack):
            for c in controls_lib.controls_for(b.spec, n, seed=seed).values():
                if c.label not in seen:
                    seen.add(c.label)
                    out.append(c)
    return out


def _per_token(m: MethodResult) -> bool:
    return m.role == "brf" and bool(m.spec.phase) and PHASE_MAPS.get(m.spec.phase).kind == "token"


def fair_summary(plan: Plan, variants: Sequence[str], methods: Sequence[MethodResult],
                 n: int, slack: Mapping[str, float] | None = None) -> dict[str, FairComparison]:
    """Per variant: the best BRF row against the best of every other row of the variant
    (baselines, controls, single members and the rest; both chosen on calibration NLL),
    with their free-parameter counts, and the per-token BRF row the controls were built
    from against each of its controls. Differences are BRF minus the other row on test
    (paired block bootstrap); < 0 means BRF is better. The rows tied with each choice
    (:data:`TIE_MARGIN`) get the same comparisons (a tied per-token row against its own
    controls, where they were fitted)."""
    st, out = plan.stats, {}

    def row(m: MethodResult) -> FairRow:
        return FairRow(m.label, m.role, m.spec.method,
                       controls_lib.free_parameters(m.spec, n).total, m.calib_nll,
                       m.test["nll"])

    diff = _paired(plan)

    def control_set(token: MethodResult, rows: Sequence[MethodResult]) -> ControlSet | None:
        """``token`` against its controls; None unless every one of them was fitted (a
        row tied only through the stability check's moves, or chosen by its refit, may
        share some controls with the fitted rows and not others: its answer is not
        known, and must not be read off the ones it shares)."""
        labels = [c.label for c in controls_lib.controls_for(token.spec, n,
                                                              seed=st.seed).values()]
        fitted = {m.label: m for m in rows if m.role == "control"}
        if not all(label in fitted for label in labels):
            return None
        return ControlSet(row(token), tuple(ControlComparison(row(fitted[label]),
                                                              diff(token, fitted[label]))
                                            for label in labels))

    for v in variants:
        rows = [m for m in methods if m.variant == v]
        born = tied([m for m in rows if m.role == "brf"], slack=slack)
        rival = tied([m for m in rows if m.role != "brf"], slack=slack)
        if not born or not rival:
            continue
        tokens = tied([m for m in rows if _per_token(m)], slack=slack)
        sets = [control_set(t, rows) for t in tokens]
        main = sets[0] if sets else None
        if main is None and tokens and any(m.role == "control" for m in rows):
            # the controls ran, but not the chosen row's: its answer is "not fitted"
            main = ControlSet(row(tokens[0]), ())
        out[v] = FairComparison(
            row(born[0]), row(rival[0]), diff(born[0], rival[0]),
            brf_candidates=sum(m.role == "brf" for m in rows),
            rival_candidates=sum(m.role != "brf" for m in rows),
            per_token=main.per_token if main else None,
            controls=main.controls if main else (),
            tied=(tuple(m.label for m in born), tuple(m.label for m in rival)),
            alternatives=_alternatives(born, rival, diff),
            per_token_tied=tuple(t.label for t in tokens) if main else (),
            per_token_alternatives=tuple(c for c in sets[1:] if c is not None) if main else ())
    return out


def forking_tokens(plan: Plan, variants: Sequence[str], result_methods: list[MethodResult],
                   calib: EventTable, test: EventTable,
                   slack: Mapping[str, float] | None = None) -> dict:
    """Per variant: every method's gain over the best single member by the members' mean
    entropy (deciles, top fraction), and entropy-gated fusion that runs the other
    members only at the primary member's top-fraction entropy positions
    (:mod:`brf.eval.forking`). The rows tied with the gated BRF row and baseline and
    with the reference member (:data:`TIE_MARGIN`) are named (``tied``,
    ``reference_tied``), and the tied BRF rows' gains over each tied reference given
    (``reference_alternatives``)."""
    ent_test = forking.member_entropy(test)
    ent_cal = forking.member_entropy(calib)
    n = test.logp.shape[1]
    top = plan.stats.forking_top_fraction
    gain = lambda m, ref: forking.gain_by_entropy(
        m.test_nll, ref.test_nll, ent_test.mean(1), top_fraction=top,
        n_boot=min(plan.stats.n_boot, 500), seed=plan.stats.seed)
    out = {}
    for v in variants:
        rows = [m for m in result_methods if m.variant == v]
        singles = tied([m for m in rows if m.role == "member"], slack=slack)
        if not singles:
            continue
        ref = singles[0]
        primary = int(np.argmax(ref.fitted.weights))
        primary_nll = next(m.test_nll for m in rows if m.role == "member"
                           and int(np.argmax(m.fitted.weights)) == primary)
        per_method = {m.label: gain(m, ref) for m in rows if m.role != "member"}
        thr = float(np.quantile(ent_cal[:, primary], 1 - top))
        gated = {}
        for kind, roles in (("brf", ("brf",)), ("baseline", ("baseline",))):
            cands = tied([m for m in rows if m.role in roles], slack=slack)
            if cands:
                best = cands[0]
                gated[kind] = {"method": best.label, **forking.gated_fusion(
                    best.test_nll, primary_nll, ref.test_nll, ent_test[:, primary], thr, n),
                    "tied": [m.label for m in cands]}
        born = tied([m for m in rows if m.role == "brf"], slack=slack)
        out[v] = {"reference": ref.label, "primary_member": primary, "top_fraction": top,
                  "by_method": per_method, "gated": gated,
                  "reference_tied": [m.label for m in singles],
                  "reference_alternatives": {r.label: {m.label: gain(m, r) for m in born}
                                             for r in singles[1:]}}
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
    labels = [m.label for m in methods]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:  # every choice, tie and report line names a row by its label
        raise ValueError(f"two rows share the label {twice[0]!r}; labels must be unique")
    # The cross-term test reads the best BRF setting's weights and phase map; from the
    # calibrated variant when it runs (its temperatures do not enter the test). Every BRF
    # row tied with it (TIE_MARGIN) is tested too.
    v_cross = "calibrated" if "calibrated" in variants else variants[0]
    st = plan.stats
    cross = cross_terms(test, [m for m in methods if m.role == "brf" and m.variant == v_cross],
                        n_boot=st.n_boot, seed=st.seed)
    # The coherence test reads each phase map as configured (a property of the
    # map, not of a fit); maps that ignore the logits (constant) are left out.
    usable = plan.phase_maps_for(n)
    phase_specs = {e.label: e.spec for e in usable if phase_map(e.spec).name != "constant"}
    return AnalysisResult(
        calib=calib, test=test, methods=methods,
        coherence=hypotheses.phase_coherence(test, phase_specs, n_perm=st.n_perm,
                                             seed=st.seed),
        cross=cross,
        comparisons=comparisons(plan, variants, methods),
        fair=fair_summary(plan, variants, methods, n),
        forking=forking_tokens(plan, variants, methods, calib, test),
        sweep=sweep(plan.sweep, calib, test) if with_sweep else [],
        left_out=sorted({e.label for e in plan.phase_maps} - {e.label for e in usable}))


def cross_terms(test: EventTable, born: Sequence[MethodResult], *, n_boot: int,
                seed: int, slack: Mapping[str, float] | None = None) -> dict:
    """The cross-term test (:func:`brf.eval.hypotheses.cross_term_test`) of the BRF row
    with the lowest calibration NLL of ``born``, with ``tied`` (that row and every row
    within :data:`TIE_MARGIN` of it) and ``alternatives`` (the test's ``rel`` AUROC with
    each other tied row)."""
    rows = tied(born, slack=slack)
    out = hypotheses.cross_term_test(test, rows[0].fitted, n_boot=n_boot, seed=seed)
    alternatives = []
    for m in rows[1:]:
        r = hypotheses.cross_term_test(test, m.fitted, n_boot=n_boot, seed=seed,
                                       keys=("rel",))
        alternatives.append({"setting": r["setting"], "rel": r["rel"]})
    return {**out, "tied": [m.label for m in rows], "alternatives": alternatives}


__all__ = ["TIE_MARGIN", "Alternative", "AnalysisResult", "Comparison", "ControlComparison",
           "ControlSet", "Difference", "FairComparison", "FairRow", "MethodResult", "analyse",
           "control_specs", "controls_answer", "cross_terms", "fair_summary", "fit_all",
           "fit_spec", "fit_specs", "metrics", "side", "tied"]
