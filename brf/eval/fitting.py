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

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.eval import lbfgs
from brf.fusion import fuse, get_method, phase_map

PROB_FLOOR = 1e-10
NLL_CAP = -math.log(PROB_FLOOR)
# Events whose fused log-probability lies within this many nats of the top one
# (probabilities within a relative 1e-5) tie for top-1: float32 rounding of a
# fused value is ~1e-7 nats, far below it, and no real preference is that small.
TIE_TOL = 1e-5
_POSITIVE = {"temperature", "threshold", "beta", "phase.rate", "phase.scale",
             "calib.temperature", "calib.member_temperature", "weighting.temperature"}
VARIANTS = ("proposed", "calibrated")


class EventTable(NamedTuple):
    """Member log-probs over a shared event space, one row per position.

    Attributes:
      logp: [P, n, E] float32 log-probabilities (-inf: the member gives the
        event no mass; padding events are -inf for every member).
      gold: [P] int index of the gold event.
      gap: [P, n] each member's true top-1 minus top-2 logit gap.
      gold_bytes: [P] UTF-8 bytes of the gold event (for bits per byte).
      segment: [P] corpus segment of each position.
      gold_offset: [P] float64 log-probability added to the gold event's to score
        the gold string: 0 where the gold is an event of its own, the log of its
        share of OTHER where it is one of the strings OTHER stands for
        (:mod:`brf.eval.events`); None: 0 everywhere. The same for every method,
        so no fit sees it; such positions give no top-1 credit.
    """
    logp: np.ndarray
    gold: np.ndarray
    gap: np.ndarray
    gold_bytes: np.ndarray
    segment: np.ndarray
    gold_offset: np.ndarray | None = None

    def take(self, idx) -> "EventTable":
        return EventTable(*(None if a is None else np.asarray(a)[idx] for a in self))

    @property
    def offset(self) -> np.ndarray:
        """[P] float64 gold offsets (zeros when the table has none)."""
        if self.gold_offset is None:
            return np.zeros(self.n_positions)
        return np.asarray(self.gold_offset, np.float64)

    @property
    def gold_listed(self) -> np.ndarray:
        """[P] bool: the gold is an event of its own (not folded into OTHER)."""
        return self.offset == 0.0

    @property
    def n_positions(self) -> int:
        return int(self.logp.shape[0])


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
               phase_name: str | None = None):
    """log q [P, E] of a method with (possibly traced) parameter values.

    Calibration parameters (the *calibrated* variant of a method) wrap the
    method: ``calib.member_temperature`` [n] tempers each member before fusion,
    ``log p_i <- log_softmax(log p_i / T_i)`` over the events, and
    ``calib.temperature`` tempers the fused distribution, ``q <- q^(1/T) / Z``.
    ``weights`` may be [n] or per position [P, n].
    """
    plain, phase = split_phase(params)
    member_t = plain.pop("calib.member_temperature", None)
    post_t = plain.pop("calib.temperature", None)
    plain.pop("weighting.temperature", None)
    if member_t is not None:
        logp_PxNxE = _tempered(logp_PxNxE, jnp.asarray(member_t, logp_PxNxE.dtype)[:, None])
    if phase_name is not None:
        plain["phase"] = phase_map(phase_name, **phase)
    lq = fuse(method, logp_PxNxE, weights, validate=False, **plain)
    if post_t is not None:
        lq = _tempered(lq, jnp.asarray(post_t, lq.dtype))
    return lq


def _tempered(logp, temperature):
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


def _to_free(name, v, calib_range: float):
    """A parameter value -> the unconstrained coordinate it is fitted in: log space for
    positive parameters; for the calibration temperatures, when bounded to
    [1/calib_range, calib_range], a tanh-squashed log space."""
    v = jnp.asarray(v, jnp.float32)
    if name in _BOUNDED and calib_range:
        r = math.log(calib_range)
        return jnp.arctanh(jnp.clip(jnp.log(v) / r, -0.999, 0.999))
    return jnp.log(v) if name in _POSITIVE else v


def _from_free(name, v, calib_range: float):
    """The inverse of :func:`_to_free`."""
    if name in _BOUNDED and calib_range:
        return jnp.exp(math.log(calib_range) * jnp.tanh(v))
    return jnp.exp(v) if name in _POSITIVE else v


_BOUNDED = {"calib.temperature", "calib.member_temperature"}


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """How :func:`fit_method` optimises (L-BFGS on the mean calibration NLL).

    Attributes:
      max_iter: L-BFGS iterations per run.
      ftol: a run stops when two iterations running lower the NLL by less than this,
        relative.
      gtol: a run stops when every gradient component is below this.
      history: L-BFGS memory (curvature pairs kept).
      max_step: the largest change of any free coordinate in one iteration.
      subsample: a fit with several starts or grid points, on a table with more than
        four times this many positions, is first fitted on this many (a fixed random
        subset), from every start and at every grid point; the best grid points are
        then polished on all positions (0: no subsample).
      polish: how many grid points are polished on all positions.
      calib_range: the calibrated variant's temperatures lie in
        [1/calib_range, calib_range] (0: unbounded; the calibrated objectives then
        have no minimum, see the README).
    """
    max_iter: int = 200
    ftol: float = 1e-8
    gtol: float = 1e-5
    history: int = 10
    max_step: float = 1.0
    subsample: int = 1024
    polish: int = 2
    calib_range: float = 10.0

    def key(self) -> tuple:
        return dataclasses.astuple(self)


def fit_method(spec: MethodSpec | Mapping[str, Any], table: EventTable, *,
               settings: FitSettings = FitSettings(), warm: Fitted | None = None,
               starts: Sequence[Fitted] = ()) -> Fitted:
    """Fits one method spec on ``table`` (the calibration split).

    The mean calibration NLL of a spec's continuous parameters is a small smooth
    problem, minimised by L-BFGS (:mod:`brf.eval.lbfgs`) on a jit-compiled float32
    value and gradient. On a large table every start and every grid combination is
    first fitted on a fixed random subsample of positions; the grid combinations
    with the lowest NLL on all positions are then polished on all positions,
    starting with the subsample's curvature estimate, so that the answer is the
    optimum of the whole calibration NLL. Several starts guard against the local
    optima of the calibrated variant (its temperatures and weights interact).

    Every float (fixed, fitted or a float grid value) is an argument of one
    compiled program per (method, phase map, static values, variant, table size
    bucket): specs that differ only in float values, and tables of similar size,
    share compilations.

    Args:
      spec: the method and how it is tuned (:class:`MethodSpec`, or its dict form).
      table: calibration positions.
      settings: the optimiser's budget, convergence test and subsample.
      warm: a fit of the same method whose values start this one where they apply
        (e.g. the *proposed* fit starting its *calibrated* variant).
      starts: more fits (of any method) whose values of the shared parameters
        (temperatures, weights) are tried as starts too.

    Returns:
      Fitted, with the lowest calibration NLL over the grid, and in ``info`` the
      iterations, evaluations (on the subsample and on all positions) and whether
      the final fit met its convergence test.
    """
    problem = _Problem(MethodSpec.coerce(spec), table, settings)
    # Only fits with several starts pay for a second compiled program on a subsample.
    several = warm is not None and bool(starts) or len(problem.grid_points()) > 1
    sub = problem.subsample(settings.subsample) if several else None
    full = problem.data()
    info = {"iterations": 0, "evaluations": 0, "subsample_evaluations": 0,
            "converged": True}
    x_starts = problem.starts(warm, starts)
    runs = []  # (grid point, x, curvature pairs)
    for point in problem.grid_points():
        fun_sub = problem.objective(point, sub if sub is not None else full)
        best = None
        for x0 in x_starts:
            if problem.layout.size == 0:
                best = (x0, [])
                break
            r = lbfgs.minimize(fun_sub, x0, **problem.lbfgs_args(settings))
            info["subsample_evaluations" if sub is not None else "evaluations"] += r.evaluations
            if sub is None:
                info["iterations"] += r.iterations
                info["converged"] &= r.converged
            if best is None or r.value < best[2]:
                best = (r.x, r.pairs, r.value)
        runs.append((point, best[0], best[1]))
        x_starts = [best[0]]  # later grid points start where this one ended
    scored = sorted((problem.value(point, x, full), i) for i, (point, x, _) in enumerate(runs))
    if sub is not None and problem.layout.size:
        polished = []
        for value, i in scored[:max(1, settings.polish)]:
            point, x, pairs = runs[i]
            r = lbfgs.minimize(problem.objective(point, full), x, pairs=pairs,
                               **problem.lbfgs_args(settings))
            info["evaluations"] += r.evaluations
            info["iterations"] += r.iterations
            polished.append((r.converged, i, r.x))
        info["converged"] = bool(polished[0][0]) if polished else True
        runs = [(runs[i][0], x, None) for _, i, x in polished]
        scored = sorted((problem.value(point, x, full), i) for i, (point, x, _) in enumerate(runs))
    finite = [(v, i) for v, i in scored if math.isfinite(v)]
    if not finite:
        raise ValueError(f"{problem.spec.label}: no finite calibration NLL at any grid "
                         f"point (a method that truncates can give the gold event "
                         f"probability 0)")
    value, i = finite[0]
    point, x, _ = runs[i]
    params, w = problem.result(point, x, table)
    # The gold offsets are the same for every method: the fit never sees them, the
    # reported NLL is per string like the test NLL.
    value = value - float(np.mean(table.offset))
    return Fitted(problem.spec.label, problem.spec.method, params, w, value, info)


# Tables are padded to a multiple of this many positions and events, so that the
# tables of different corpora share compiled programs.
POSITION_BUCKET = 512
EVENT_BUCKET = 16


class _Problem:
    """One spec's fitting problem on one table: which values are free, fixed,
    static; the weights' parameterisation; starts; objectives."""

    def __init__(self, spec: MethodSpec, table: EventTable, settings: FitSettings):
        self.spec, self.table, self.calib_range = spec, table, float(settings.calib_range)
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
        # Both variants run one compiled program: as proposed, the calibration
        # temperatures are held at 1 (tempering by 1 changes nothing).
        values0 = {"calib.temperature": self._free("calib.temperature", 1.0)}
        if n > 1:
            values0["calib.member_temperature"] = self._free("calib.member_temperature",
                                                             [1.0] * n)
        values0.update({k: self._free(k, v) for k, v in self.fixed.items() if self.dynamic(k)})
        values0.update({k: self._free(k, init[k]) for k in self.keys})
        free = list(self.keys)
        if self.mode == "logits":  # weights softmax([0, z_1..z_{n-1}]): n - 1 free logits
            values0["_w"] = jnp.zeros(n - 1, jnp.float32)
            free.append("_w")
        self.values0 = values0
        self.layout = _Layout({k: values0[k] for k in free})

    def _free(self, k, v):
        return _to_free(k, v, self.calib_range)

    def grid_points(self) -> list[dict]:
        grid = dict(self.spec.grid)
        return [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())]

    def starts(self, warm: Fitted | None, others: Sequence[Fitted]) -> list[np.ndarray]:
        """The warm fit's values of this spec's free parameters (or the initial values
        without one), then each other fit's (their other parameters at the initial
        values); duplicates dropped."""
        out = [] if warm is not None else [self.layout.initial]
        for f in [warm, *others] if warm is not None else others:
            values = {k: self.values0[k] for k in self.layout.keys}
            for k in self.keys:
                if k in f.params and np.shape(f.params[k]) == np.shape(self.init[k]):
                    values[k] = self._free(k, f.params[k])
            if self.mode == "logits" and np.shape(f.weights) == (self.n,):
                logw = np.log(np.clip(np.asarray(f.weights, np.float64), 1e-6, None))
                values["_w"] = jnp.asarray(logw[1:] - logw[0], jnp.float32)
            x = self.layout.flatten(values)
            if all(np.max(np.abs(x - y), initial=0.0) > 1e-6 for y in out):
                out.append(x)
        return out

    def data(self, idx: np.ndarray | None = None):
        """(logp, gold, context NLL, mask) of the positions ``idx`` (default all), padded
        to a bucket of positions (copies of the first, masked out)."""
        t = self.table if idx is None else self.table.take(idx)
        P, E = t.n_positions, t.logp.shape[2]
        size = -(-P // POSITION_BUCKET) * POSITION_BUCKET
        pad = np.concatenate([np.arange(P), np.zeros(size - P, np.int64)])
        logp = np.full((size, self.n, -(-E // EVENT_BUCKET) * EVENT_BUCKET), -np.inf,
                       np.float32)  # padding events: no member gives them mass
        logp[:, :, :E] = np.asarray(t.logp)[pad]
        ctx = (np.asarray(context_nll(self.table), np.float32) if self.mode == "perplexity"
               else np.zeros((self.table.n_positions, self.n), np.float32))
        if idx is not None:
            ctx = ctx[idx]
        return (jnp.asarray(logp), jnp.asarray(np.asarray(t.gold)[pad]),
                jnp.asarray(ctx[pad]), jnp.asarray(np.arange(size) < P))

    def subsample(self, m: int):
        """The data of a fixed random subset of m positions, or None when the table has
        at most 2 m positions (it is fitted on all of them directly)."""
        P = self.table.n_positions
        if not m or P <= 4 * m:
            return None
        idx = np.sort(np.random.default_rng(0).choice(P, m, replace=False))
        return self.data(idx)

    def _program(self, point: dict):
        static = _hashable({**self.fixed_static,
                            **{k: v for k, v in point.items() if not self.dynamic(k)}})
        values = {**self.values0,
                  **{k: self._free(k, v) for k, v in point.items() if self.dynamic(k)}}
        program = functools.partial(_value_and_grad, method=self.spec.method,
                                    phase_name=self.spec.phase, static=static, mode=self.mode,
                                    calib_range=self.calib_range)
        return values, program

    def objective(self, point: dict, data) -> Callable[[np.ndarray], tuple]:
        """x -> (mean NLL, gradient) on ``data`` at a grid point (float64 on the host)."""
        values, program = self._program(point)
        base_w = jnp.asarray(self.base_w, jnp.float32)

        def fun(x):
            v, g = program({**values, **self.layout.unflatten(x)}, base_w, *data)
            return float(v), self.layout.flatten(g)
        return fun

    def value(self, point: dict, x: np.ndarray, data) -> float:
        values, program = self._program(point)
        v, _ = program({**values, **self.layout.unflatten(x)},
                       jnp.asarray(self.base_w, jnp.float32), *data)
        return float(v)

    def lbfgs_args(self, settings: FitSettings) -> dict:
        return dict(max_iter=settings.max_iter, ftol=settings.ftol, gtol=settings.gtol,
                    history=settings.history, max_step=settings.max_step)

    def result(self, point: dict, x: np.ndarray, table: EventTable):
        """(parameter values as fitted, member weights) at ``x``."""
        found = {**self.values0, **self.layout.unflatten(x)}
        params = {**self.fixed, **point,
                  **{k: _plain_value(_from_free(k, found[k], self.calib_range))
                     for k in self.keys}}
        if self.mode == "logits":
            w = np.asarray(jax.nn.softmax(jnp.concatenate([jnp.zeros(1), found["_w"]])))
        elif self.mode == "perplexity":  # per position; report their mean
            w = np.asarray(perplexity_weights_for(table, params["weighting.temperature"])
                           ).mean(0)
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


def _mean_nll(values, base_w, logp, gold, ctx, mask, *, method, phase_name, static, mode,
              calib_range):
    """The mean NLL over the unmasked positions of a method with parameter ``values``
    (free coordinates, see :func:`_to_free`; ``_w`` the weight logits)."""
    params = {**dict(static), **{k: _from_free(k, v, calib_range)
                                 for k, v in values.items() if k != "_w"}}
    if mode == "logits":
        w = jax.nn.softmax(jnp.concatenate([jnp.zeros(1), values["_w"]]))
    elif mode == "perplexity":
        w = jax.nn.softmax(-ctx / params["weighting.temperature"], axis=-1)
    else:
        w = base_w
    nll = gold_nll(fused_logq(method, params, w, logp, phase_name), gold)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask)


@functools.partial(jax.jit, static_argnames=("method", "phase_name", "static", "mode",
                                             "calib_range"))
def _value_and_grad(values, base_w, logp, gold, ctx, mask, *, method, phase_name, static,
                    mode, calib_range):
    return jax.value_and_grad(_mean_nll)(values, base_w, logp, gold, ctx, mask, method=method,
                                         phase_name=phase_name, static=static, mode=mode,
                                         calib_range=calib_range)


class _Layout:
    """A dict of float32 arrays <-> one float64 vector (what L-BFGS works on)."""

    def __init__(self, free: Mapping[str, jax.Array]):
        self.keys = sorted(free)
        self.shapes = [np.shape(free[k]) for k in self.keys]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.size = sum(self.sizes)
        self.initial = self.flatten(free)

    def unflatten(self, x: np.ndarray) -> dict:
        out, i = {}, 0
        for k, shape, size in zip(self.keys, self.shapes, self.sizes):
            out[k] = jnp.asarray(np.reshape(x[i:i + size], shape), jnp.float32)
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
    lq = fused_logq(fitted.method, params, w, jnp.asarray(table.logp),
                    fitted.params.get("phase"))
    nll = np.asarray(gold_nll(lq, jnp.asarray(table.gold)), np.float64)
    # Methods that truncate (contrastive, min pool) can give gold probability
    # 0; its log-loss is floored at -log(PROB_FLOOR) and the count reported.
    floored = ~(nll <= NLL_CAP)
    nll = np.where(floored, NLL_CAP, nll) - table.offset
    conf = np.exp(np.asarray(jnp.max(lq, axis=-1), np.float64))
    credit = np.where(table.gold_listed, top1_credit(lq, table.gold), 0.0)
    return {"nll": nll, "top1_credit": credit, "confidence": conf, "floored": floored}
