"""Tune every fusion method on a calibration split, evaluate it on a test split.

Inputs are event tables (:class:`EventTable`): per position, each member's
log-probabilities over one shared event space, the gold event, and each
member's true top-1 minus top-2 logit gap (the per-position phase maps read
it). A *method spec* names a registered fusion method and says which of its
parameters are fitted:

* ``fit``: continuous parameters fitted by full-batch L-BFGS on the mean
  calibration NLL from the given initial values. Member weights are
  always fitted (softmax-parameterised) unless ``fit_weights=False``.
* ``grid``: parameters searched exhaustively (non-differentiable ones, e.g. a
  hard entropy gate or the routing criterion).
* ``fixed``: parameters held at the given value.

Positive parameters (temperatures, rates, thresholds) are fitted in log
space. Phase-map parameters are fitted like any other (``phase.*`` names).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import math
import os
import threading
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.eval import compass, lbfgs
from brf.event_table import EventTable
from brf.fusion import fuse, get_method, phase_map
from brf.fusion.born import DEFAULT_Z_MIN, born_from_phases
from brf.fusion.born import xla_sincos as _xla_sincos
from brf.fusion.controls import born_from_sources, shuffle_sources
from brf.fusion.phase import PHASE_MAPS, position_gap, token_gap

PROB_FLOOR = 1e-10
NLL_CAP = -math.log(PROB_FLOOR)
# Events whose fused log-probability lies within this many nats of the top one
# (probabilities within a relative 1e-5) tie for top-1: float32 rounding of a
# fused value is ~1e-7 nats, far below it, and no real preference is that small.
TIE_TOL = 1e-5
_POSITIVE = {"temperature", "threshold", "beta", "phase.rate", "phase.scale",
             "calib.temperature", "calib.member_temperature", "weighting.temperature"}
VARIANTS = ("proposed", "calibrated")


@dataclasses.dataclass(frozen=True)
class Fitted:
    """A method spec with its fitted parameter values."""
    label: str
    method: str
    params: Mapping[str, Any]
    weights: np.ndarray
    calib_nll: float
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


ROLES = ("brf", "baseline", "member", "control", "other")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One method of a study: a registered fusion method and how it is tuned.

    Attributes:
      label: the row's name in reports (unique within an analysis).
      method: a registered fusion method (``brf.fusion.METHODS``).
      fit: parameter -> initial value, fitted on the calibration split.
      grid: parameter -> candidate values, searched exhaustively.
      fixed: parameter -> value, held.
      phase: the phase-map name of a ``born`` row (its parameters are
        ``phase.*`` entries of fit / fixed).
      fit_weights: fit the member weights (softmax-parameterised).
      fixed_weights: held member weights (a single member alone: one-hot).
      variant: 'proposed' (the method as published) or 'calibrated' (plus a
        fitted post-fusion temperature and per-member temperatures).
      weighting: None or 'perplexity' (PackLLM: per-position weights from each
        member's NLL on the segment so far, with a fitted temperature).
      role: what the row is in comparisons: 'brf', 'baseline' (the methods BRF
        is compared with), 'member' (one member alone), 'control' or 'other'.
    """
    label: str
    method: str
    fit: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    grid: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    phase: str | None = None
    fit_weights: bool = True
    fixed_weights: tuple[float, ...] | None = None
    variant: str = "proposed"
    weighting: str | None = None
    role: str = "other"

    @classmethod
    def coerce(cls, spec: "MethodSpec | Mapping[str, Any]") -> "MethodSpec":
        """A MethodSpec from itself or from the dict form (keys = the field names)."""
        if isinstance(spec, MethodSpec):
            return spec
        d = dict(spec)
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"method spec {d.get('label', d.get('method'))!r}: unknown "
                             f"key(s) {unknown}")
        if d.get("fixed_weights") is not None:
            d["fixed_weights"] = tuple(float(x) for x in d["fixed_weights"])
        d.setdefault("label", d.get("method"))
        return cls(**d)

    def in_variant(self, variant: str) -> "MethodSpec":
        """This spec in another variant (the label says which: ``label [calibrated]``)."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown method variant {variant!r}; use one of {VARIANTS}")
        label = self.label if variant == "proposed" else f"{self.label} [{variant}]"
        return dataclasses.replace(self, label=label, variant=variant)

    def key(self) -> str:
        """A stable text naming everything that determines the fit (for caches)."""
        return repr([(f.name, _canonical(getattr(self, f.name)))
                     for f in dataclasses.fields(self) if f.name != "role"])


def _canonical(v):
    if isinstance(v, Mapping):
        return sorted((k, _canonical(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return [_canonical(x) for x in v]
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


def split_phase(params: Mapping[str, Any]):
    """(plain params, phase-map params): ``phase.k`` keys go to the second, unprefixed."""
    out, phase = {}, {}
    for k, v in params.items():
        if k.startswith("phase."):
            phase[k[6:]] = v
        else:
            out[k] = v
    return out, phase


def fused_logq(method: str, params: Mapping[str, Any], weights, logp_PxNxE,
               phase_name: str | tuple[str, ...] | None = None, phase_index=None,
               sources=None):
    """log q [P, E] of a method with (possibly traced) parameter values.

    Calibration parameters (the *calibrated* variant of a method) wrap the
    method: ``calib.member_temperature`` [n] tempers each member before fusion,
    ``log p_i <- log_softmax(log p_i / T_i)`` over the events, and
    ``calib.temperature`` tempers the fused distribution, ``q <- q^(1/T) / Z``.
    ``weights`` may be [n] or per position [P, n].

    For ``born``, ``phase_name`` may be a tuple of phase-map names of one kind and
    ``phase_index`` a (traced) index into it: one program then serves every map of
    the tuple, each taking the ``phase.*`` parameters it declares.

    For ``born_shuffled``, ``sources`` may give the phase shuffle's permutation
    (:func:`shuffle_sources` of the untempered rows): it depends only on the
    members' rankings of the events, which tempering keeps, so a fit computes it
    once per table instead of sorting every event at every evaluation.
    """
    plain, phase = split_phase(params)
    member_t = plain.pop("calib.member_temperature", None)
    post_t = plain.pop("calib.temperature", None)
    plain.pop("weighting.temperature", None)
    if member_t is not None:
        logp_PxNxE = log_tempered(logp_PxNxE, jnp.asarray(member_t, logp_PxNxE.dtype)[:, None])
    if sources is not None:
        if method != "born_shuffled":
            raise ValueError(f"a phase shuffle's sources are for 'born_shuffled'; got "
                             f"{method!r}")
        lq = born_from_sources(logp_PxNxE, weights, sources,
                               phase=(phase_map(phase_name, **phase) if phase_name is not None
                                      else None),
                               z_min=plain.get("z_min", DEFAULT_Z_MIN))[0]
    elif isinstance(phase_name, tuple):
        if method != "born":
            raise ValueError(f"a choice of phase maps is for 'born'; got {method!r}")
        lq = _born_of_maps(logp_PxNxE, weights, phase, phase_name, phase_index, **plain)
    else:
        if phase_name is not None:
            plain["phase"] = phase_map(phase_name, **phase)
        lq = fuse(method, logp_PxNxE, weights, validate=False, **plain)
    if post_t is not None:
        lq = log_tempered(lq, jnp.asarray(post_t, lq.dtype))
    return lq


def _born_of_maps(logits, weights, phase_params, names, index, z_min=DEFAULT_Z_MIN):
    """Born fusion (as :func:`brf.fusion.born.born`) with the phase map ``names[index]``."""
    kinds = {PHASE_MAPS.get(n).kind for n in names}
    if len(kinds) != 1:
        raise ValueError(f"phase maps of one kind only; got {names}")
    if kinds == {"token"}:
        top1 = jnp.max(logits, axis=-1)
        x, axis = token_gap(logits, top1), -2
    else:
        top1, x = position_gap(logits)
        axis = -1

    def branch(name):
        keys = set(PHASE_MAPS.get(name).defaults) | {"offset"}
        return lambda p: phase_map(name, **{k: v for k, v in p.items() if k in keys})(
            x, member_axis=axis)

    phi = jax.lax.switch(index, [branch(n) for n in names], dict(phase_params))
    return born_from_phases(logits, jnp.asarray(weights, logits.dtype), top1, phi,
                            z_min=z_min)[0]


def log_tempered(logp, temperature):
    """log_softmax(logp / T) over the last axis, with -inf (no mass) kept at -inf.

    Events a distribution gives no mass stay at -inf without a NaN gradient
    (-inf / T would give one, and a NaN-zeroed gradient never moves T).
    """
    ok = jnp.isfinite(logp)
    x = jnp.where(ok, jnp.where(ok, logp, 0.0) / temperature, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def context_nll(table: "EventTable") -> np.ndarray:
    """[P, n] each member's mean NLL of the gold events at the earlier positions of the
    same segment (0 at a segment's first position): the perplexity PackLLM weighs by.

    Rows must be in text order within each segment (as the event table builds them).
    """
    P, n = table.logp.shape[:2]
    gold = np.take_along_axis(table.logp, table.gold[:, None, None].astype(np.int64),
                              axis=2)[:, :, 0].astype(np.float64)
    nll = np.minimum(-gold, NLL_CAP)
    out = np.zeros((P, n))
    seg = np.asarray(table.segment)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    ends = np.r_[starts[1:], P]
    for a, b in zip(starts, ends):
        c = np.cumsum(nll[a:b], axis=0)
        k = np.arange(1, b - a)[:, None]
        out[a + 1:b] = c[:-1] / k
    return out


def perplexity_weights_for(table: "EventTable", temperature) -> jax.Array:
    """[P, n] PackLLM weights softmax(-context NLL / temperature) per position."""
    return jax.nn.softmax(-jnp.asarray(context_nll(table), jnp.float32)
                          / jnp.asarray(temperature, jnp.float32), axis=-1)


def gold_nll(logq_PxE, gold_P):
    return -jnp.take_along_axis(logq_PxE, gold_P[:, None], axis=-1)[:, 0]


# The smallest value a positive parameter starts from: float32's smallest normal. A
# fit whose coordinate ran off towards -inf (the optimum at the parameter's 0) reports
# exp of it rounded to 0 in float32; started from that fit, log(0) = -inf would make
# every step NaN and waste the start. Floored, it starts from the same function.
POSITIVE_FLOOR = float(np.finfo(np.float32).tiny)


def _to_free(name, v, box: float, xp=jnp):
    """A parameter value -> the coordinate it is fitted in: log space for positive
    parameters, floored at log(POSITIVE_FLOOR) and, within a box [1/box, box] (box > 0,
    see :func:`_box`), clipped to it. ``xp``: jnp (traced) or np (float64 on the
    host)."""
    v = xp.asarray(v, xp.float32 if xp is jnp else xp.float64)
    if name not in _POSITIVE:
        return v
    log_v = xp.log(xp.maximum(v, POSITIVE_FLOOR))
    if box:
        r = math.log(box)
        return xp.clip(log_v, -r, r)
    return log_v


def _from_free(name, v, xp=jnp):
    """The inverse of :func:`_to_free`."""
    return xp.exp(v) if name in _POSITIVE else v


_BOUNDED = {"calib.temperature", "calib.member_temperature"}
# The member weights' logits lie within +-log(WEIGHT_RANGE): a weight's ratio to another's
# can shrink to e^-30 (its member all but left out, as a fit may want) while exp stays
# finite. A fit that wants a member out ends where its weight no longer changes the
# NLL in float32, which happens long before this bound.
WEIGHT_RANGE = math.exp(30.0)


def _box(name: str, settings: "FitSettings") -> float:
    """r of a parameter's box, [1/r, r] for a positive one (its log coordinate in
    [-log r, log r]) and [-log r, log r] for the weight logits ``_w``; 0: unbounded.
    The calibration temperatures take ``calib_range``, every other positive parameter
    ``param_range``, the weight logits :data:`WEIGHT_RANGE`."""
    if name in _BOUNDED:
        return float(settings.calib_range)
    if name in _POSITIVE:
        return float(settings.param_range)
    if name == "_w":
        return WEIGHT_RANGE
    return 0.0


def _bounds(name: str, size: int, box: float) -> tuple[np.ndarray, np.ndarray]:
    """The box of a parameter's fitted coordinates: [-log r, log r] for r = ``box``
    (:func:`_box`), unbounded for 0."""
    r = math.log(box) if box else math.inf
    return np.full(size, -r), np.full(size, r)


# FitSettings.precondition's ridge on the Fisher information, relative to its mean
# and to each diagonal entry: directions the positions' gradients never span stay
# invertible.
FISHER_RIDGE = 1e-3


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """How :func:`fit_method` optimises (multi-start L-BFGS on the mean calibration NLL).

    A fit runs in up to three stages, each keeping fewer candidates: every start (the
    spec's initial values, the warm fit's, and ``starts`` random ones) is *screened* by
    ``screen_iter`` L-BFGS iterations on ``screen_positions`` positions; the ``keep``
    lowest distinct ends are fitted to convergence on ``subsample`` positions; the
    ``polish`` lowest distinct ends of those are fitted to convergence on every
    position, and the lowest is the fit. A stage whose positions would be more than
    half the table's (or 0) runs on all of them, and the middle stage is then skipped.
    Stages on sampled positions are cheaper but rank basins a few thousandths of a nat
    apart by the sample's landscape, not the table's, and a refit under other last bits
    then ends in another basin (on the study's four-member swarm, a calibrated Born row
    spread by 0.003 nats with 512/1024 sampled positions, 6e-6 with every position;
    BENCHMARKS.md, "Do the fits repeat?"). Every position is not the default yet: it
    costs about 1.3x, and on the tests' short study it moved the cross-term verdict
    under the stability check (that study's table has calibrated Born fits ending at
    a dozen values within 0.002 nats, far apart, whatever the stages:
    ``bench_fit_repeat.py --table=tiny_study``).

    Attributes:
      max_iter: L-BFGS iterations per run (of the second and third stages).
      ftol: a run stops when two iterations running lower the NLL by less than this,
        relative.
      gtol: a run stops when every gradient component is below this.
      history: L-BFGS memory (curvature pairs kept).
      max_step: the largest change of any free coordinate in one iteration.
      starts: random starts per grid point (besides the structured ones), drawn from a
        generator seeded by the spec alone, so a refit starts from the same points.
      screen_positions, screen_iter: the first stage's positions and iterations.
      keep: candidates fitted to convergence on ``subsample`` positions.
      subsample: the middle stage's positions (0: no middle stage).
      polish: candidates polished on every position.
      calib_range: the calibrated variant's temperatures lie in
        [1/calib_range, calib_range] (0: unbounded; the calibrated objectives then
        have no minimum, see docs/study.md, "Fits").
      param_range: every other positive parameter (a phase map's rate and scale, a
        temperature, a threshold) lies in [1/param_range, param_range] (0:
        unbounded). A fit whose
        infimum lies at 0 or infinity (a sigmoid's rate running off to a step, a
        scale shrinking to 0) then ends on the bound, where it repeats, instead of
        wherever a line search gave up along a flat valley.
      precondition: each run starts L-BFGS's inverse-Hessian estimate from the
        empirical Fisher information of its start (the outer products of every
        position's NLL gradient) instead of a scaled identity. Off in the study: on
        its swarm table it saved 13% of the evaluations and ended 9 of 24 rows in
        worse optima, up to 0.014 nats (BENCHMARKS.md, the fits' evaluations).
      perturb: run under perturbations of the last bits (:data:`PERTURBATIONS`,
        '+'-joined; '' for none): the stability check's refits.
    """
    max_iter: int = 200
    ftol: float = 1e-8
    gtol: float = 1e-5
    history: int = 10
    max_step: float = 1.0
    starts: int = 12
    screen_positions: int = 512
    screen_iter: int = 25
    keep: int = 4
    subsample: int = 1024
    polish: int = 2
    calib_range: float = 1000.0
    param_range: float = 1000.0
    precondition: bool = False
    perturb: str = ""

    def __post_init__(self):
        perturbations(self.perturb)  # checked here, so a bad name fails before any fit

    def key(self) -> tuple:
        return dataclasses.astuple(self)


# The perturbations a fit can run under (FitSettings.perturb, '+'-joined): each changes
# only the last bits of the objective, so a fit that finds its optimum ends within
# FIT_TOLERANCE of where it ends without it. The study's stability check refits every
# calibrated row under one (brf.eval.stability).
PERTURBATIONS = {
    "order": "the calibration positions in another (fixed random) order, so every sum "
             "is taken in another order",
    "ulp": "every finite log-probability of the table moved by -2 to +2 float32 ulps "
           "(fixed random)",
    "chunk": "chunks of half as many positions (other programs, other sums)",
    "sincos": "Born's sin and cos from XLA (jnp.sin, jnp.cos) instead of brf's "
              "polynomial (about two ulps apart)",
}
# How far apart two fits of one row may end in calibration NLL (nats) and still count
# as the same answer: the fits' repeatability goal (item 1 of the study's stability
# design; BENCHMARKS.md, the fits' stability).
FIT_TOLERANCE = 1e-4
# A fit's other ends within this many nats of its best one on calibration are places it
# could as well have ended (the census of the fits' ends counted the calibrated Born
# rows' ends within it: BENCHMARKS.md, "Where a row's fits end"); their test NLLs are
# the row's fit spread (brf.eval.analysis.fit_spread).
FIT_NEAR = 2e-3


def perturbations(spec: str) -> frozenset[str]:
    """The set of perturbations a '+'-joined spec names ('' -> none)."""
    names = frozenset(p.strip() for p in str(spec).split("+") if p.strip())
    bad = sorted(names - set(PERTURBATIONS))
    if bad:
        raise ValueError(f"unknown fit perturbation(s) {bad}; use "
                         f"{', '.join(PERTURBATIONS)} joined by '+'")
    return names


# Methods whose calibration NLL jumps where a decision flips at many positions (the member
# routed to, the plausibility cut): fitted by compass search (brf.eval.compass), which
# compares values only, instead of L-BFGS, which reads a gradient that sees no jump.
# (Entropy-gated fusion gates too, but on one member's entropy against a threshold the
# grid holds: L-BFGS fits its weights and temperatures better and as repeatably, measured
# on the swarm table.)
PIECEWISE = frozenset({"routing", "contrastive"})
# How many times a converged L-BFGS run is started again from its end (while it pays).
RESTARTS = 3
# Two ends of a stage at the same grid point are one candidate when no free coordinate
# differs by more than this (they lie in one basin).
_SAME_END = 0.05


class _Run(NamedTuple):
    """A candidate: its grid point's index, its coordinates, value and curvature pairs."""
    point: int
    x: np.ndarray
    value: float
    pairs: list
    converged: bool
    order: int          # its start's place in the list (ties keep it)


def fit_method(spec: MethodSpec | Mapping[str, Any], table: EventTable, *,
               settings: FitSettings = FitSettings(), warm: Fitted | None = None,
               starts: Sequence[Fitted] = ()) -> Fitted:
    """Fits one method spec on ``table`` (the calibration split).

    The mean calibration NLL of a spec's continuous parameters is a small problem with
    local optima (the calibrated variant's temperatures and weights interact; phase
    offsets are periodic), minimised by L-BFGS (:mod:`brf.eval.lbfgs`; compass search,
    :mod:`brf.eval.compass`, for the :data:`PIECEWISE` methods) on a compiled float32
    value and gradient, from many starts in stages (:class:`FitSettings`): every start
    at every grid point screened briefly on sampled positions, the lowest distinct ends
    fitted to convergence on more, the lowest of those polished on every position.
    The starts are the spec's initial values, ``warm``'s and ``starts``' values of its
    parameters, and random points drawn by a generator seeded by the spec alone: a fit
    depends on its spec, its table and its warm start, never on the order of other fits,
    and a refit under other last bits (:data:`PERTURBATIONS`) starts from the same
    points and ends within :data:`FIT_TOLERANCE` of the same optimum when it finds it.

    Every float (fixed, fitted or a float grid value) is an argument of one compiled
    program per (method, kind of phase map, static values, chunk shape), which
    evaluates one chunk of positions (:func:`chunk_positions`): specs that differ
    only in float values, both variants, the subsamples and all positions, and tables
    with the same chunk shape share it. :func:`precompile` compiles the programs of
    many specs ahead, beside the fits.

    Args:
      spec: the method and how it is tuned (:class:`MethodSpec`, or its dict form).
      table: calibration positions.
      settings: the optimiser's budget, convergence test, starts and stages.
      warm: a fit of the same method whose values start this one where they apply
        (e.g. the *proposed* fit starting its *calibrated* variant).
      starts: more fits (of any method) whose values of the shared parameters
        (temperatures, weights) are tried as starts too.

    Returns:
      Fitted, with the lowest calibration NLL over the grid, and in ``info`` the
      iterations and evaluations on all positions, the evaluations on subsamples, the
      number of starts, whether the final fit met its convergence test, and the
      runner-up: the lowest calibration NLL of another polished candidate.
    """
    problem = _Problem(MethodSpec.coerce(spec), table, settings)
    points = problem.grid_points()
    offset = float(np.mean(table.offset))
    full = problem.data()
    info = {"iterations": 0, "evaluations": 0, "subsample_evaluations": 0, "starts": 0,
            "converged": True}
    if problem.coords.size == 0:  # grid points only: each evaluated on every position
        scored = sorted((problem.value(p, problem.coords.to_x(problem.layout.initial), full), j)
                        for j, p in enumerate(points))
        runs = last = [_Run(j, problem.coords.to_x(problem.layout.initial), v, [], True, j)
                       for v, j in scored]
        info["evaluations"] = len(points)
    else:
        structured = problem.starts(warm, starts)
        cands = []
        for j in range(len(points)):
            xs = structured + problem.random_starts(settings.starts, j)
            cands += [(j, x) for x in xs]
        info["starts"] = len(cands)
        stages = problem.stages(settings)
        runs = [_Run(j, x, math.nan, [], False, i) for i, (j, x) in enumerate(cands)]
        if stages[0][0] is not full:
            # every start's value on every position, so that a stage on a subsample never
            # hands on a point worse than where its run began: a start in a basin of the
            # whole table that the subsample does not share (a fit of a nested row, say)
            # would otherwise be lost on the way
            runs = [r._replace(value=problem.value(points[r.point], r.x, full)) for r in runs]
            info["evaluations"] += len(runs)
        for s_i, (data, budget, keep) in enumerate(stages):
            last = s_i == len(stages) - 1
            out = []
            for r in runs:
                res = problem.minimize(points[r.point], r.x, data, budget, r.pairs, settings)
                info["evaluations" if last else "subsample_evaluations"] += res.evaluations
                value = res.value
                if last:
                    info["iterations"] += res.iterations
                elif data is not full:
                    # ranked on every position: on a few hundred positions two basins a
                    # few thousandths of a nat apart change places with the sample
                    value = problem.value(points[r.point], res.x, full)
                    info["evaluations"] += 1
                    if math.isfinite(r.value) and not value <= r.value:
                        # worse on every position than where it began: kept there
                        out.append(r._replace(pairs=[]))
                        continue
                out.append(_Run(r.point, problem.coords.wrap(res.x), value, list(res.pairs),
                                res.converged, r.order))
            runs = _carry_first(out, keep)
        last = out
    finite = [r for r in runs if math.isfinite(r.value)]
    if not finite:
        raise ValueError(f"{problem.spec.label}: no finite calibration NLL at any grid "
                         f"point (a method that truncates can give the gold event "
                         f"probability 0)")
    best = finite[0]
    info["converged"] = bool(best.converged)
    info["runner_up"] = (finite[1].value - offset) if len(finite) > 1 else None
    params, w = problem.result(points[best.point], best.x, table)
    info.update(_census(problem, points, last, best, offset))
    # The gold offsets are the same for every method: the fit never sees them, the
    # reported NLL is per string like the test NLL.
    return Fitted(problem.spec.label, problem.spec.method, params, w, best.value - offset,
                  info)


def _census(problem: "_Problem", points: list, last: Sequence[_Run], best: _Run,
            offset: float) -> dict:
    """What the fit's own starts say of its end: ``ends``, the calibration NLL of every
    distinct end its last stage reached (one per basin, lowest first), and ``near``, the
    parameters of those other than the fit within :data:`FIT_NEAR` of it (the places a
    refit under other last bits could as well have ended: verdicts read them,
    :func:`brf.eval.analysis.fit_spread`)."""
    ends = [r for r in _lowest_distinct(last, len(last)) if math.isfinite(r.value)]
    near = []
    for r in ends:
        if r is best or _same_basin(r, best) or r.value - best.value > FIT_NEAR:
            continue
        params, w = problem.result(points[r.point], r.x, problem.table)
        near.append({"calib_nll": r.value - offset, "params": params,
                     "weights": np.asarray(w).tolist()})
    return {"ends": [r.value - offset for r in ends], "near": near}


def _carry_first(out: Sequence[_Run], keep: int) -> list[_Run]:
    """The ``keep`` lowest distinct runs of ``out`` other than the first start's (the
    warm fit, or the spec's initial values, at the first grid point), and that run on
    top, lowest first, unless a kept run ends in its basin.

    A stage ranks runs part way (a brief screen, a sample), and a basin that ranks high
    there can end lowest: on Hamlet's default pair the screen dropped the basin of the
    as-proposed born token_tanh's own start, and the fit ended 7.2e-4 nats above where
    that start alone goes. Its run is the same whatever the other starts, so the fit
    ends no higher than that start alone would take it. In a slot of its own it pushes
    none of the runs ranked lowest out of a cut (where it took one of the ``keep``
    slots, a run it pushed out could have ended lower: on the swarm, born linear
    [calibrated] ended 3.1e-4 higher). That is not a guarantee against the same stages
    without the carry: the run it leaves room for at one cut can outrank another at
    the next."""
    first = [r for r in out if r.order == 0]
    kept = _lowest_distinct([r for r in out if r.order != 0], keep)
    if not first or any(_same_basin(q, first[0]) for q in kept):
        return kept  # a kept run ends in its basin
    return sorted(kept + first, key=_rank)


def _rank(r: _Run) -> tuple[float, int]:
    """A run's place in a cut: its value (non-finite last), ties in its start's order."""
    return (r.value if math.isfinite(r.value) else math.inf, r.order)


def _same_basin(a: _Run, b: _Run) -> bool:
    """Both runs at one grid point and within :data:`_SAME_END` in every coordinate."""
    return (a.point == b.point and bool(np.size(a.x))
            and float(np.max(np.abs(a.x - b.x))) <= _SAME_END)


def _lowest_distinct(runs: Sequence[_Run], k: int) -> list[_Run]:
    """The ``k`` lowest runs (non-finite last; ties in the order of their starts), one
    per basin: a run at the same grid point as a kept one and within :data:`_SAME_END`
    of it in every coordinate is dropped."""
    kept: list[_Run] = []
    for r in sorted(runs, key=_rank):
        if len(kept) >= k:
            break
        if any(_same_basin(q, r) for q in kept):
            continue
        kept.append(r)
    return kept


# Positions are evaluated in chunks of a fixed number of positions, each chunk one
# call of a compiled program: one chunk's arrays stay in the CPU's cache (a whole
# table in one piece runs several times slower per position), and one program per
# method serves the subsample and all positions, both variants and every table of
# the same chunk shape. Events are padded to the next size of a ladder spaced by a
# factor of about sqrt(2), each size a multiple of 8 just above a power of two or
# its sqrt(2) multiple (the k strings of each of n members plus OTHER fit a
# power-of-two k): the tables of a study share programs.
CHUNK_BYTES = 5 << 17  # float32 log-probabilities per chunk: 640 KiB
MIN_CHUNK, MAX_CHUNK = 64, 4096
_WEIGHT_MODES = ("given", "logits", "perplexity")


def padded_events(n_events: int) -> int:
    """The event count a table is padded to: the smallest 8 ceil((floor(2^(j/2)) + 1) / 8)
    (j = 0, 1, ...) that holds ``n_events`` (..., 96, 136, 184, 264, 368, ...)."""
    j = 0
    while True:
        e = 8 * -(-(math.floor(2 ** (j / 2)) + 1) // 8)
        if e >= n_events:
            return e
        j += 1


def chunk_positions(n_members: int, n_events: int) -> int:
    """Positions per chunk: the largest power of two whose log-probabilities fit
    CHUNK_BYTES (within [MIN_CHUNK, MAX_CHUNK])."""
    b = max(1, CHUNK_BYTES // (4 * n_members * padded_events(n_events)))
    return int(min(MAX_CHUNK, max(MIN_CHUNK, 1 << (b.bit_length() - 1))))


class _Data(NamedTuple):
    """Positions of a table on the device, in chunks: [(logp [B, n, E'], gold [B],
    context NLL [B, n], mask [B])]; padding positions are masked out. ``sources``:
    born_shuffled's permutation of each chunk, per seed (:meth:`_Problem.aux`)."""
    chunks: list
    n_positions: int
    sources: dict


_DATA: dict = {}  # (table arrays' ids, subset) -> (the arrays, _Data); a few recent
_NO_AUX = np.zeros(0, np.int32)
_SOURCES_LOCK = threading.Lock()


def _shuffle_seed(params: Mapping[str, Any]) -> int:
    """born_shuffled's seed in ``params`` (the method's default where none is given)."""
    return int(params.get("seed", get_method("born_shuffled").params["seed"].default))


def _chunk_size(n: int, E: int, perturb: frozenset = frozenset()) -> int:
    """Positions per chunk of a table with n members and E events (halved under the
    'chunk' perturbation)."""
    B = chunk_positions(n, E)
    return max(MIN_CHUNK // 2, B // 2) if "chunk" in perturb else B


def _nudged(logp: np.ndarray, seed: int) -> np.ndarray:
    """``logp`` with every finite entry moved by -2 to +2 float32 ulps (fixed random)."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(-2, 3, logp.shape)
    out = np.array(logp, np.float32)
    for k in (1, 2):
        for sign in (1, -1):
            sel = (steps * sign >= k) & np.isfinite(out)
            out[sel] = np.nextafter(out[sel], np.float32(sign * np.inf))
    return out


def _table_data(table: EventTable, subsample: int = 0,
                perturb: frozenset = frozenset()) -> _Data:
    """The positions of ``table`` (all, or a fixed random subset of ``subsample``) in
    chunks on the device, under the perturbations ``perturb`` (:data:`PERTURBATIONS`:
    'order', 'ulp' and 'chunk' act here); kept for the tables of the last few fits."""
    P, n, E = table.logp.shape
    B = _chunk_size(n, E, perturb)
    key = (id(table.logp), id(table.gold), id(table.segment), subsample, B,
           tuple(sorted(perturb)))
    hit = _DATA.get(key)
    if hit is not None and hit[0][0] is table.logp and hit[0][1] is table.gold:
        return hit[1]
    idx = (np.sort(np.random.default_rng(0).choice(P, subsample, replace=False))
           if subsample else np.arange(P))
    if "order" in perturb:  # the same positions, summed in another order
        idx = np.random.default_rng(1).permutation(idx)
    size = -(-len(idx) // B) * B
    pad = np.concatenate([idx, np.full(size - len(idx), idx[0])])
    logp = np.full((size, n, padded_events(E)), -np.inf,
                   np.float32)  # padding events: no member gives them mass
    logp[:, :, :E] = (_nudged(np.asarray(table.logp)[pad], 2) if "ulp" in perturb
                      else np.asarray(table.logp)[pad])
    gold = np.asarray(table.gold)[pad]
    # PackLLM's context NLL reads the positions in text order: computed before any
    # reordering, from the table as given
    ctx = np.asarray(context_nll(table), np.float32)[pad]
    mask = np.arange(size) < len(idx)
    chunks = [tuple(jnp.asarray(a[i:i + B]) for a in (logp, gold, ctx, mask))
              for i in range(0, size, B)]
    data = _Data(chunks, len(idx), {})
    while len(_DATA) >= 4:
        del _DATA[next(iter(_DATA))]
    _DATA[key] = ((table.logp, table.gold, table.segment), data)
    return data


class _Problem:
    """One spec's fitting problem on one table: which values are free, fixed,
    static; the weights' parameterisation; starts; objectives.

    Every dynamic value (fitted, fixed or a float grid value, in its free coordinate)
    is an entry of one float32 vector ``v`` that the compiled program takes; L-BFGS
    moves the entries of the fitted ones (``x``, float64). As proposed, the
    calibration temperatures are held at 1 (tempering by 1 changes nothing), so both
    variants run one program; the member weights' three parameterisations are one
    program too, and so are the ``born`` rows of every phase map of one kind.
    """

    def __init__(self, spec: MethodSpec, table: EventTable, settings: FitSettings):
        self.spec, self.table, self.settings = spec, table, settings
        self.perturb = perturbations(settings.perturb)
        declared = get_method(spec.method).params
        n = self.n = table.logp.shape[1]
        init = dict(spec.fit)
        if spec.variant not in VARIANTS:
            raise ValueError(f"unknown method variant {spec.variant!r}; use one of "
                             f"{VARIANTS}")
        if spec.variant == "calibrated":
            init.setdefault("calib.temperature", 1.0)
            if n > 1:
                init.setdefault("calib.member_temperature", [1.0] * n)
        if spec.weighting not in (None, "perplexity"):
            raise ValueError(f"unknown weighting {spec.weighting!r}; use 'perplexity'")
        if spec.weighting == "perplexity":
            init.setdefault("weighting.temperature", 1.0)
        fit_weights = (spec.fit_weights and n > 1 and spec.weighting is None
                       and spec.fixed_weights is None)
        self.mode = "perplexity" if spec.weighting else "logits" if fit_weights else "given"
        self.base_w = (np.full(n, 1.0 / n) if spec.fixed_weights is None
                       else np.asarray(spec.fixed_weights, np.float64))
        self.dynamic = lambda k: (k.startswith(("phase.", "calib.", "weighting."))
                                  or (k in declared and declared[k].kind == "float"))
        self.fixed = dict(spec.fixed)
        self.fixed_static = {k: v for k, v in self.fixed.items() if not self.dynamic(k)}
        self.keys = sorted(init)
        self.init = init
        values0 = {"calib.temperature": 1.0, "weighting.temperature": 1.0}
        if n > 1:
            values0["calib.member_temperature"] = [1.0] * n
        # born: every phase map of the spec's kind in one program (lax.switch); the
        # parameters a map does not declare are carried along unused.
        self.phases, self.phase_index = (spec.phase,) if spec.phase else None, 0
        if spec.method == "born" and spec.phase:
            kind = PHASE_MAPS.get(spec.phase).kind
            self.phases = tuple(sorted(m for m in PHASE_MAPS.names()
                                       if PHASE_MAPS.get(m).kind == kind))
            self.phase_index = self.phases.index(spec.phase)
            for m in self.phases[::-1]:
                values0.update({f"phase.{k}": v for k, v in PHASE_MAPS.get(m).defaults.items()})
            values0.update({f"phase.{k}": v
                            for k, v in PHASE_MAPS.get(spec.phase).defaults.items()})
            values0["phase.offset"] = 0.0
        values0.update({k: v for k, v in self.fixed.items() if self.dynamic(k)})
        values0.update({k: vals[0] for k, vals in spec.grid.items()  # (set per grid point)
                        if vals and self.dynamic(k)})
        values0.update(init)
        values0 = {k: self._free(k, v) for k, v in values0.items()}
        if (self.phases and len(self.phases) > 1 and "phase.offset" not in init):
            # a held scalar offset is the same on each member (a fitted one stays one value)
            values0["phase.offset"] = np.broadcast_to(values0["phase.offset"], (n,)).copy()
        if n > 1:  # weights softmax([0, z_1..z_{n-1}]): n - 1 logits
            values0["_w"] = np.zeros(n - 1)
        free = list(self.keys) + (["_w"] if self.mode == "logits" else [])
        self.values0 = values0
        self.all = _Layout(values0)
        self.layout = _Layout({k: values0[k] for k in free})
        self.free_idx = np.concatenate(
            [self.all.slice_of(k) for k in self.layout.keys] or [np.zeros(0, np.int64)])
        box = [_bounds(k, size, _box(k, self.settings))
               for k, size in zip(self.layout.keys, self.layout.sizes)]
        self.v_lower = np.concatenate([b[0] for b in box] or [np.zeros(0)])
        self.v_upper = np.concatenate([b[1] for b in box] or [np.zeros(0)])
        self.coords = _Coords(self.layout, self.v_lower, self.v_upper,
                              joint=spec.method not in PIECEWISE)
        self.lower, self.upper = self.coords.lower, self.coords.upper
        self.wmode = _WEIGHT_MODES.index(self.mode)
        self._consts = None  # (base_w, wmode, phase_index) on the device

    def _free(self, k, v):
        return _to_free(k, v, _box(k, self.settings), xp=np)

    def grid_points(self) -> list[dict]:
        grid = dict(self.spec.grid)
        return [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())]

    def starts(self, warm: Fitted | None, others: Sequence[Fitted]) -> list[np.ndarray]:
        """The warm fit's values of this spec's free parameters (or the initial values
        without one), then each other fit's (their other parameters at the initial
        values); duplicates dropped."""
        out = [] if warm is not None else [self._start(self.layout.initial)]
        for f in [warm, *others] if warm is not None else others:
            values = {k: self.values0[k] for k in self.layout.keys}
            for k in self.keys:
                if k in f.params and np.shape(f.params[k]) == np.shape(self.init[k]):
                    values[k] = self._free(k, f.params[k])
            if self.mode == "logits" and np.shape(f.weights) == (self.n,):
                logw = np.log(np.clip(np.asarray(f.weights, np.float64), 1e-6, None))
                values["_w"] = logw[1:] - logw[0]
            x = self._start(self.layout.flatten(values))
            if all(np.max(np.abs(x - y), initial=0.0) > 1e-6 for y in out):
                out.append(x)
        return out

    def data(self, subsample: int = 0) -> _Data:
        return _table_data(self.table, subsample, self.perturb)

    def random_starts(self, k: int, point: int) -> list[np.ndarray]:
        """``k`` random starts at grid point ``point``, from a generator seeded by the
        spec (and the point) alone, spread wide (basins far from the initial values are
        what they are for): weight logits ~ N(0, 1.5), phase offsets uniform on the
        circle, the calibrated variant's log temperatures uniform within 1.5 (members)
        and 1 (post-fusion) of their initial values, every other positive parameter's
        log uniform within 2.5 of its initial value's, the rest around their initial
        values by N(0, max(1, |x|)); each inside its box."""
        if k <= 0 or not self.coords.size:
            return []
        digest = hashlib.sha256(f"{self.spec.key()}|{point}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        base = self.layout.unflatten(self.layout.initial)
        out = []
        for _ in range(k):
            values = {}
            for key, shape in zip(self.layout.keys, self.layout.shapes):
                x0 = np.asarray(base[key], np.float64)
                if key == "_w":
                    v = rng.normal(0.0, 1.5, shape)
                elif key == "phase.offset":
                    v = rng.uniform(-math.pi, math.pi, shape)
                elif key == "calib.member_temperature":
                    v = x0 + rng.uniform(-1.5, 1.5, shape)
                elif key == "calib.temperature":
                    v = x0 + rng.uniform(-1.0, 1.0, shape)
                elif key in _POSITIVE:
                    v = x0 + rng.uniform(-2.5, 2.5, shape)
                else:
                    v = x0 + rng.normal(0.0, 1.0, shape) * np.maximum(1.0, np.abs(x0))
                values[key] = v
            out.append(self._start(self.layout.flatten(values)))
        return out

    def _start(self, v: np.ndarray) -> np.ndarray:
        """A start given in the parameters' own coordinates (``layout``), within their
        box, in the fitted coordinates (:class:`_Coords`)."""
        return self.coords.to_x(np.clip(v, self.v_lower, self.v_upper))

    def stages(self, settings: FitSettings) -> list[tuple[_Data, str, int]]:
        """The fit's stages (:class:`FitSettings`): (positions, 'screen' or 'converge',
        how many distinct ends go on). A stage on more than half the table's positions
        runs on all of them."""
        P = self.table.n_positions
        full = self.data()
        sub = lambda m: self.data(m) if m and P > 2 * m else None  # noqa: E731
        screen, middle = sub(settings.screen_positions), sub(settings.subsample)
        out = [(screen or full, "screen", settings.keep)]
        if middle is not None:
            out.append((middle, "converge", settings.polish))
        return out + [(full, "converge", settings.polish)]

    def minimize(self, point: dict, x: np.ndarray, data: _Data, budget: str, pairs: list,
                 settings: FitSettings):
        """One local run from x on ``data``: L-BFGS (compass search for the
        :data:`PIECEWISE` methods), briefly for a 'screen' budget, else to
        convergence."""
        fun = self.objective_x(point, data)
        screen = budget == "screen"
        if self.spec.method in PIECEWISE:
            return compass.minimize(fun, x, step=0.5 if screen else 0.125,
                                    min_step=0.05 if screen else 1e-3,
                                    max_evals=4 * settings.screen_iter if screen else 400,
                                    lower=self.lower, upper=self.upper)
        h = self.fisher(point, x, data) if settings.precondition else None
        args = self.lbfgs_args(settings)
        if screen:
            args["max_iter"] = settings.screen_iter
            return lbfgs.minimize(fun, x, pairs=list(pairs) or None, hessian=h, **args)
        r = lbfgs.minimize(fun, x, pairs=list(pairs) or None, hessian=h, **args)
        # L-BFGS can stop part way along a narrow curved valley, its curvature pairs
        # describing where it has been rather than where it is: started again from its
        # end with no pairs it often goes on. Restarted while that pays.
        evals, iters = r.evaluations, r.iterations
        for _ in range(RESTARTS):
            again = lbfgs.minimize(fun, r.x, **args)
            evals, iters = evals + again.evaluations, iters + again.iterations
            if not again.value < r.value - lbfgs.NOISE * abs(r.value):
                break
            r = again
        return r._replace(evaluations=evals, iterations=iters)

    def program_key(self, point: dict) -> tuple:
        """What the compiled program at a grid point depends on (see :func:`_compile`)."""
        static = _hashable({**self.fixed_static,
                            **{k: v for k, v in point.items() if not self.dynamic(k)}})
        _, n, E = self.table.logp.shape
        e = padded_events(E)
        return (self.spec.method, self.phases, static, self.all.signature,
                (_chunk_size(n, E, self.perturb), n, e), "sincos" in self.perturb)

    def _program(self, point: dict):
        """(the dynamic values at a grid point, its compiled program)."""
        v = self.all.flatten({**self.values0, **{k: self._free(k, x) for k, x in point.items()
                                                 if self.dynamic(k)}})
        return v, _compiled(self.program_key(point))

    def aux(self, data: _Data) -> list:
        """Each chunk's last program argument: for born_shuffled the phase shuffle's
        permutation (computed once per table and seed: it depends only on the
        members' rankings, which tempering keeps), else an empty array."""
        if self.spec.method != "born_shuffled":
            return [_NO_AUX] * len(data.chunks)
        seed = _shuffle_seed(self.fixed_static)
        with _SOURCES_LOCK:
            out = data.sources.get(seed)
            if out is None:
                out = data.sources[seed] = [shuffle_sources(c[0], seed) for c in data.chunks]
        return out

    def _chunks(self, v: np.ndarray, program, x: np.ndarray, data: _Data, aux=None) -> list:
        """``program``'s output on every chunk of ``data`` at x, on the host
        (``aux``: each chunk's last program argument; None: :meth:`aux`)."""
        v = v.astype(np.float32)
        v[self.free_idx] = x
        if self._consts is None:
            self._consts = (jnp.asarray(self.base_w, jnp.float32), jnp.int32(self.wmode),
                            jnp.int32(self.phase_index))
        run = lambda chunk, aux: jax.device_get(program(v, *self._consts, *chunk, aux))
        aux = self.aux(data) if aux is None else aux
        return (list(_evaluator().map(run, data.chunks, aux)) if len(data.chunks) > 1
                else [run(data.chunks[0], aux[0])])

    def _evaluate(self, v: np.ndarray, program, x: np.ndarray, data: _Data, aux=None):
        """(mean NLL, gradient over the free coordinates) at x: float64 on the host
        (``aux``: as :meth:`_chunks`)."""
        out = self._chunks(v, program, x, data, aux)
        value = math.fsum(float(s) for s, _ in out) / data.n_positions
        grad = np.sum([np.asarray(g, np.float64) for _, g in out], axis=0) / data.n_positions
        return value, grad[self.free_idx]

    def objective(self, point: dict, data: _Data, *, sort: bool = False,
                  float64: bool = False) -> Callable[[np.ndarray], tuple]:
        """x -> (mean NLL, gradient) on ``data`` at a grid point (float64 on the host).

        ``sort``: born_shuffled's kernel sorts every chunk at every evaluation instead
        of reading the permutation computed once (:meth:`aux`), as fits did before:
        for checks and benchmarks of that shortcut (its program compiles when called).
        ``float64``: the whole evaluation in float64 (the table's float32 values
        widened, Born's sin and cos from XLA), one chunk after another: a reference
        without float32 rounding, for diagnostics (``bench_fit_repeat.py --census``); about
        three times a float32 evaluation on a CPU, and not what the fits run.
        """
        v, program = self._program(point)
        if float64:
            return self._objective64(point, v, data)
        if not sort:
            return lambda x: self._evaluate(v, program, x, data)
        method, phases, static, layout, _, xla = self.program_key(point)
        sorting = functools.partial(_chunk_value_and_grad, method=method, phases=phases,
                                    static=static, layout=layout, xla_sincos=xla)
        return lambda x: self._evaluate(v, sorting, x, data, aux=[_NO_AUX] * len(data.chunks))

    def objective_x(self, point: dict, data: _Data, **kw) -> Callable[[np.ndarray], tuple]:
        """:meth:`objective` in the fitted coordinates (:class:`_Coords`)."""
        fun, c = self.objective(point, data, **kw), self.coords

        def fun_x(x):
            value, grad = fun(c.to_v(x))
            return value, c.M.T @ np.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
        return fun_x

    def _objective64(self, point: dict, v: np.ndarray, data: _Data):
        method, phases, static, layout, _, _ = self.program_key(point)
        program = functools.partial(_chunk_value_and_grad, method=method, phases=phases,
                                    static=static, layout=layout, xla_sincos=True)
        aux = self.aux(data)
        chunks = [tuple(np.asarray(a, np.float64 if a.dtype == jnp.float32 else a.dtype)
                        for a in c) for c in data.chunks]
        consts = (np.asarray(self.base_w, np.float64), np.int32(self.wmode),
                  np.int32(self.phase_index))

        def fun(x):
            w = np.asarray(v, np.float64).copy()
            w[self.free_idx] = x
            value, grad = 0.0, 0.0
            with jax.enable_x64(True):
                for chunk, a in zip(chunks, aux):
                    s, g = jax.device_get(program(w, *consts, *chunk, a))
                    value += float(s)
                    grad = grad + np.asarray(g, np.float64)
            return value / data.n_positions, (grad / data.n_positions)[self.free_idx]
        return fun

    def fisher(self, point: dict, x: np.ndarray, data: _Data) -> np.ndarray:
        """The empirical Fisher information of the mean NLL at x over the free
        coordinates (float64), regularised to be positive definite: a Hessian
        estimate for L-BFGS's first steps."""
        v, _ = self._program(point)
        x = self.coords.to_v(x)
        out = self._chunks(v, _compiled(("fisher",) + self.program_key(point)), x, data)
        f = (np.sum([np.asarray(o, np.float64) for o in out], axis=0)
             [np.ix_(self.free_idx, self.free_idx)] / data.n_positions)
        f = self.coords.M.T @ f @ self.coords.M
        d = np.diag(f)
        return f + np.diag(FISHER_RIDGE * max(float(d.mean()), 1e-12) + FISHER_RIDGE * d)

    def value(self, point: dict, x: np.ndarray, data: _Data) -> float:
        """The mean NLL at x (fitted coordinates) on ``data``."""
        v, program = self._program(point)
        return self._evaluate(v, program, self.coords.to_v(x), data)[0]

    def lbfgs_args(self, settings: FitSettings) -> dict:
        return dict(max_iter=settings.max_iter, ftol=settings.ftol, gtol=settings.gtol,
                    history=settings.history, max_step=settings.max_step,
                    lower=self.lower, upper=self.upper)

    def result(self, point: dict, x: np.ndarray, table: EventTable):
        """(parameter values as fitted, member weights) at ``x``."""
        found = {**self.values0, **self.layout.unflatten(self.coords.to_v(x))}
        params = {**self.fixed, **point,
                  **{k: _plain_value(_from_free(k, np.asarray(found[k], np.float32), xp=np))
                     for k in self.keys}}
        if self.mode == "logits":
            z = np.concatenate([[0.0], found["_w"]]).astype(np.float32)
            w = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        elif self.mode == "perplexity":  # per position; report their mean
            z = -context_nll(table) / params["weighting.temperature"]
            w = np.exp(z - z.max(-1, keepdims=True))
            w = (w / w.sum(-1, keepdims=True)).mean(0)
        else:
            w = self.base_w
        if self.spec.phase:
            params["phase"] = self.spec.phase
        return params, np.asarray(w, np.float64)


def _hashable(d: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def _plain_value(v):
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else a.tolist()


_EVALUATOR: list = []  # threads that run the chunks of one evaluation side by side


def _evaluator() -> concurrent.futures.ThreadPoolExecutor:
    if not _EVALUATOR:
        _EVALUATOR.append(concurrent.futures.ThreadPoolExecutor(
            min(8, os.cpu_count() or 1), thread_name_prefix="brf-fit-chunks"))
    return _EVALUATOR[0]


_PROGRAMS: dict = {}  # program key -> Future of the compiled program
_PROGRAMS_LOCK = threading.Lock()
_COMPILER: list = []  # the background compilers (a pool of threads), once started


def _compile(key: tuple):
    """The compiled value-and-gradient program of one chunk of positions (a key
    that starts with "fisher": the program of :func:`_chunk_fisher`)."""
    fisher = key[0] == "fisher"
    method, phases, static, layout, (B, n, e), xla = key[1:] if fisher else key
    size = sum(int(np.prod(shape)) for _, shape in layout)
    sds = jax.ShapeDtypeStruct
    args = (sds((size,), jnp.float32), sds((n,), jnp.float32), sds((), jnp.int32),
            sds((), jnp.int32), sds((B, n, e), jnp.float32), sds((B,), jnp.int32),
            sds((B, n), jnp.float32), sds((B,), jnp.bool_),
            sds((B, n, e) if method == "born_shuffled" else (0,), jnp.int32))
    program = _chunk_fisher if fisher else _chunk_value_and_grad
    return program.lower(*args, method=method, phases=phases, static=static,
                         layout=layout, xla_sincos=xla).compile()


def _compiled(key: tuple):
    """The compiled program of ``key``: compiled now, or waited for when
    :func:`precompile` has it under way."""
    with _PROGRAMS_LOCK:
        future = _PROGRAMS.get(key)
        mine = future is None
        if mine:
            future = _PROGRAMS[key] = concurrent.futures.Future()
    if mine:
        try:
            future.set_result(_compile(key))
        except BaseException as e:
            future.set_exception(e)
            with _PROGRAMS_LOCK:
                _PROGRAMS.pop(key, None)
            raise
    return future.result()


def precompile(specs: Sequence[MethodSpec | Mapping[str, Any]], table: EventTable,
               settings: FitSettings = FitSettings()) -> None:
    """Starts compiling, in background threads and in order, the programs that fitting
    ``specs`` on ``table`` will run (a fit waits for its program, if needed; fits
    run beside the compilations)."""
    keys = []
    for spec in specs:
        problem = _Problem(MethodSpec.coerce(spec), table, settings)
        keys += [problem.program_key(point) for point in problem.grid_points()]
    with _PROGRAMS_LOCK:
        todo = [k for k in dict.fromkeys(keys) if k not in _PROGRAMS]
        if todo and not _COMPILER:
            _COMPILER.append(concurrent.futures.ThreadPoolExecutor(
                min(2, os.cpu_count() or 1), thread_name_prefix="brf-fit-compile"))
        for key in todo:
            future = _PROGRAMS[key] = concurrent.futures.Future()
            _COMPILER[0].submit(_compile_into, key, future)


def _compile_into(key: tuple, future: concurrent.futures.Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(_compile(key))
    except BaseException as e:  # the fit that needs it raises it
        future.set_exception(e)


def clear_programs() -> None:
    """Forgets every compiled program (benchmarks: each fitter pays for its own)."""
    with _PROGRAMS_LOCK:
        for future in _PROGRAMS.values():
            future.cancel()
        _PROGRAMS.clear()


def _chunk_nll(v, base_w, wmode, phase_index, logp, gold, ctx, mask, aux, *, method, phases,
               static, layout, xla_sincos=False):
    """The summed NLL over the unmasked positions of a chunk, of a method with the
    dynamic values ``v`` (free coordinates, see :func:`_to_free`, laid out as
    ``layout``; ``_w`` the weight logits). ``wmode`` picks the member weights: the
    given ``base_w``, softmax of the logits, or PackLLM's perplexity weights.
    ``aux``: born_shuffled's permutation of the chunk (``sources`` of
    :func:`fused_logq`; empty: the kernel sorts), an empty array for every other
    method. ``xla_sincos``: Born's sin and cos from XLA (the 'sincos' perturbation)."""
    values = _Layout.unflatten_traced(v, layout)
    params = {**dict(static), **{k: _from_free(k, x) for k, x in values.items() if k != "_w"}}
    n = logp.shape[1]
    w = jnp.broadcast_to(base_w, (logp.shape[0], n))
    if "_w" in values:
        w = jnp.where(wmode == 1, jax.nn.softmax(jnp.concatenate([jnp.zeros(1), values["_w"]])),
                      w)
    w = jnp.where(wmode == 2, jax.nn.softmax(-ctx / params["weighting.temperature"], axis=-1),
                  w)
    phase_name = phases if phases is None or len(phases) > 1 else phases[0]
    sources = aux if method == "born_shuffled" and aux.shape[0] else None
    with _xla_sincos(xla_sincos):
        nll = gold_nll(fused_logq(method, params, w, logp, phase_name, phase_index,
                                  sources=sources), gold)
    return jnp.sum(jnp.where(mask, nll, 0.0))


_STATIC = ("method", "phases", "static", "layout", "xla_sincos")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _chunk_value_and_grad(v, base_w, wmode, phase_index, logp, gold, ctx, mask, aux, *,
                          method, phases, static, layout, xla_sincos=False):
    return jax.value_and_grad(_chunk_nll)(v, base_w, wmode, phase_index, logp, gold, ctx, mask,
                                          aux, method=method, phases=phases, static=static,
                                          layout=layout, xla_sincos=xla_sincos)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _chunk_fisher(v, base_w, wmode, phase_index, logp, gold, ctx, mask, aux, *,
                  method, phases, static, layout, xla_sincos=False):
    """The summed outer products of each position's NLL gradient over a chunk (the
    unnormalised empirical Fisher information of the dynamic values ``v``)."""
    def one(v, logp, gold, ctx, mask, aux):
        return _chunk_nll(v, base_w, wmode, phase_index, logp[None], gold[None], ctx[None],
                          mask[None], aux[None] if aux.ndim > 1 else aux, method=method,
                          phases=phases, static=static, layout=layout,
                          xla_sincos=xla_sincos)
    per = jax.vmap(jax.grad(one), in_axes=(None, 0, 0, 0, 0, 0 if aux.ndim > 1 else None))(
        v, logp, gold, ctx, mask, aux)
    per = jnp.where(jnp.isfinite(per), per, 0.0)
    return per.T @ per


class _Coords:
    """The coordinates a fit moves, and their box: the free parameters' own (``_Layout``:
    log space for positive ones) recombined where the objective cannot tell two of them
    apart, so that no two coordinates trade off along a ridge.

    * **A member's temperature times the fused one.** The calibrated variant tempers each
      member by T_i and the fused distribution by T; a common change of the T_i against
      T barely moves the fused distribution (for a log-linear pool not at all), so the
      fit moves log T_i + log T (each member's temperature all the way through) and
      log T.
    * **A map's slope instead of its rate.** ``scale * f(rate * x)`` near the linear limit
      depends on scale * rate alone, so the fit moves log(scale * rate) (the slope at
      0, up to f's constant) and log scale (the ceiling).
    * **Phase differences.** A phase common to every member cancels in |sum_i a_i|^2, so
      member 0's offset is held at 0 (a shared scalar offset is no parameter at all) and
      the others, on the circle, are reported in (-pi, pi].

    Each coordinate is a sum of the parameters' coordinates (``N``); ``M`` maps back.
    The box of a sum is the sum of the boxes, so every point of the parameters' box
    remains reachable. ``joint=False`` (the :data:`PIECEWISE` methods, whose pattern
    search steps along one coordinate at a time) keeps the temperatures as they are: a
    step of the fused temperature alone would move every member's through coordinate
    and flip decisions at once.
    """

    def __init__(self, layout: "_Layout", lower: np.ndarray, upper: np.ndarray, *,
                 joint: bool = True):
        at = {k: layout.slice_of(k) for k in layout.keys}
        joint = ({"calib.member_temperature": "calib.temperature", "phase.rate": "phase.scale"}
                 if joint else {"phase.rate": "phase.scale"})
        rows, circle = [], []
        for k in layout.keys:
            partner = at.get(joint.get(k, ""))
            for j, i in enumerate(at[k]):
                if k == "phase.offset":
                    if j == 0:
                        continue  # the common phase
                    circle.append(len(rows))
                rows.append([int(i)] + ([int(partner[0])] if partner is not None else []))
        self.N = np.zeros((len(rows), layout.size))
        for r, ids in enumerate(rows):
            self.N[r, ids] = 1.0
        self.M = np.linalg.pinv(self.N) if rows else np.zeros((layout.size, 0))
        self.lower = np.array([sum(lower[i] for i in ids) for ids in rows])
        self.upper = np.array([sum(upper[i] for i in ids) for ids in rows])
        self._offset = at.get("phase.offset")
        self._circle = np.asarray(circle, np.int64)

    @property
    def size(self) -> int:
        return self.N.shape[0]

    def to_x(self, v: np.ndarray) -> np.ndarray:
        """The parameters' coordinates -> the fitted ones (member 0's phase subtracted
        from every member's: the same fused distribution)."""
        v = np.array(v, np.float64)
        if self._offset is not None:
            v[self._offset] -= v[self._offset[0]]
        return self.wrap(self.N @ v)

    def to_v(self, x: np.ndarray) -> np.ndarray:
        return self.M @ np.asarray(x, np.float64)

    def wrap(self, x: np.ndarray) -> np.ndarray:
        """x with its phase differences in (-pi, pi] (the same function)."""
        if not self._circle.size:
            return x
        x = np.array(x, np.float64)
        x[self._circle] = -((np.pi - x[self._circle]) % (2 * np.pi)) + np.pi
        return x


class _Layout:
    """A dict of arrays <-> one float64 vector (what L-BFGS works on)."""

    def __init__(self, free: Mapping[str, Any]):
        self.keys = sorted(free)
        self.shapes = [np.shape(free[k]) for k in self.keys]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.size = sum(self.sizes)
        self.offsets = np.cumsum([0] + self.sizes)
        self.initial = self.flatten(free)

    @property
    def signature(self) -> tuple:
        """(key, shape) pairs: hashable, a compiled program's static argument."""
        return tuple(zip(self.keys, self.shapes))

    def slice_of(self, key: str) -> np.ndarray:
        i = self.keys.index(key)
        return np.arange(self.offsets[i], self.offsets[i + 1])

    def unflatten(self, x: np.ndarray) -> dict:
        return {k: np.reshape(x[a:a + size], shape) for k, shape, size, a
                in zip(self.keys, self.shapes, self.sizes, self.offsets)}

    @staticmethod
    def unflatten_traced(v, signature: tuple) -> dict:
        out, i = {}, 0
        for k, shape in signature:
            size = int(np.prod(shape))
            out[k] = jnp.reshape(v[i:i + size], shape)
            i += size
        return out

    def flatten(self, tree: Mapping[str, Any]) -> np.ndarray:
        if not self.keys:
            return np.zeros(0)
        return np.concatenate([np.ravel(np.asarray(tree[k], np.float64)) for k in self.keys])


def top1_credit(logq_PxE, gold_P, tol: float = TIE_TOL) -> np.ndarray:
    """[P] float64 top-1 credit: 1/m when the gold event is one of the m events tied
    for the top (within ``tol`` nats of the maximum), else 0.

    A tie is a fractional hit, the expected accuracy of breaking it uniformly at
    random: an argmax would always hand it to the event listed first (the gold,
    event 0 of an event table), so two identical uniform members over four events
    would score top-1 = 1 where chance is 1/4.
    """
    lq = np.asarray(logq_PxE, np.float64)
    top = lq.max(axis=-1, keepdims=True)
    tied = lq >= top - tol
    gold = np.asarray(gold_P, np.int64)
    hit = np.take_along_axis(tied, gold[:, None], axis=-1)[:, 0]
    return hit / tied.sum(axis=-1)


def evaluate(fitted: Fitted, table: EventTable) -> dict[str, np.ndarray]:
    """Per-position results of a fitted method on ``table``.

    Returns:
      {"nll": [P] gold NLL (nats, the gold event's floored at NLL_CAP, plus the
      table's gold offset), "top1_credit": [P] :func:`top1_credit` (its mean is
      the top-1 accuracy, ties shared; 0 where the gold is in OTHER),
      "confidence": [P] the top fused probability, "floored": [P] bool}.
    """
    params = {k: v for k, v in fitted.params.items() if k != "phase"}
    w = jnp.asarray(fitted.weights, jnp.float32)
    if "weighting.temperature" in params:
        w = perplexity_weights_for(table, params["weighting.temperature"])
    logp = jnp.asarray(table.logp)
    sources = (shuffle_sources(logp, _shuffle_seed(params))
               if fitted.method == "born_shuffled" else None)
    lq = fused_logq(fitted.method, params, w, logp, fitted.params.get("phase"),
                    sources=sources)
    nll = np.asarray(gold_nll(lq, jnp.asarray(table.gold)), np.float64)
    # Methods that truncate (contrastive, min pool) can give gold probability
    # 0; its log-loss is floored at -log(PROB_FLOOR) and the count reported.
    floored = ~(nll <= NLL_CAP)
    nll = np.where(floored, NLL_CAP, nll) - table.offset
    conf = np.exp(np.asarray(jnp.max(lq, axis=-1), np.float64))
    credit = np.where(table.gold_listed, top1_credit(lq, table.gold), 0.0)
    return {"nll": nll, "top1_credit": credit, "confidence": conf, "floored": floored}
