"""Tune every fusion method on a calibration split, evaluate it on a test split.

Inputs are event tables (:class:`EventTable`): per position, each member's
log-probabilities over one shared event space, the gold event, and each
member's true top-1 minus top-2 logit gap (the per-position phase maps read
it). A *method spec* names a registered fusion method and says which of its
parameters are fitted:

* ``fit``: continuous parameters fitted by gradient descent (optax Adam on the
  mean calibration NLL) from the given initial values. Member weights are
  always fitted (softmax-parameterised) unless ``fit_weights=False``.
* ``grid``: parameters searched exhaustively (non-differentiable ones, e.g. a
  hard entropy gate or the routing criterion).
* ``fixed``: parameters held at the given value.

Positive parameters (temperatures, rates, thresholds) are fitted in log
space. Phase-map parameters are fitted like any other (``phase.*`` names).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
    """
    logp: np.ndarray
    gold: np.ndarray
    gap: np.ndarray
    gold_bytes: np.ndarray
    segment: np.ndarray

    def take(self, idx) -> "EventTable":
        return EventTable(*(np.asarray(a)[idx] for a in self))

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


def _to_free(name, v):
    v = jnp.asarray(v, jnp.float32)
    return jnp.log(v) if name in _POSITIVE else v


def _from_free(name, v):
    return jnp.exp(v) if name in _POSITIVE else v


def fit_method(spec: Mapping[str, Any], table: EventTable, *, steps: int = 150,
               learning_rate: float = 0.05, batch: int | None = None,
               seed: int = 0) -> Fitted:
    """Fits one method spec on ``table`` (the calibration split).

    Float-valued grid parameters are passed to one compiled step function as
    arguments, so a grid costs one compilation per combination of its
    non-float (static) values only.

    Args:
      spec: {"label", "method", optional "phase" (phase-map name), "fit",
        "grid", "fixed", "fit_weights", "fixed_weights" (held weights), "variant"
        ('proposed' | 'calibrated': adds a fitted post-fusion temperature and
        per-member temperatures, see :func:`fused_logq`), "weighting"
        ('perplexity': PackLLM weights per position from each member's NLL on the
        segment so far, with a fitted temperature, see :func:`context_nll`)}.
      table: calibration positions.
      steps: Adam steps per grid point.
      learning_rate: Adam step size.
      batch: positions per step (None: all).
      seed: minibatch order.

    Returns:
      Fitted, with the lowest calibration NLL over the grid.
    """
    method = spec["method"]
    declared = get_method(method).params
    n = table.logp.shape[1]
    phase_name = spec.get("phase")
    fixed = dict(spec.get("fixed", {}))
    init = dict(spec.get("fit", {}))
    variant = spec.get("variant", "proposed")
    if variant not in VARIANTS:
        raise ValueError(f"unknown method variant {variant!r}; use one of {VARIANTS}")
    if variant == "calibrated":
        init.setdefault("calib.temperature", 1.0)
        if n > 1:
            init.setdefault("calib.member_temperature", [1.0] * n)
    weighting = spec.get("weighting")
    if weighting not in (None, "perplexity"):
        raise ValueError(f"unknown weighting {weighting!r}; use 'perplexity'")
    ctx_nll = None
    if weighting == "perplexity":
        init.setdefault("weighting.temperature", 1.0)
        ctx_nll = np.asarray(context_nll(table), np.float32)
    fixed_w = spec.get("fixed_weights")
    fit_weights = (spec.get("fit_weights", True) and n > 1 and weighting is None
                   and fixed_w is None)
    base_w = (jnp.full((n,), 1.0 / n) if fixed_w is None
              else jnp.asarray(fixed_w, jnp.float32))
    grid = dict(spec.get("grid", {}))
    logp = jnp.asarray(table.logp)
    gold = jnp.asarray(table.gold)
    ctx = jnp.asarray(ctx_nll) if ctx_nll is not None else jnp.zeros((table.n_positions, n))
    keys = sorted(init)
    is_float = {k: k in declared and declared[k].kind == "float" for k in grid}
    opt = optax.adam(learning_rate)
    compiled = {}

    # The data are arguments, not captured constants: the compiled step then
    # depends only on shapes and the spec, so the persistent compilation cache
    # serves every table of the same shape (corpora, prompt pairs) after the first.
    def functions(static):
        if static in compiled:
            return compiled[static]

        def loss(free, dyn, logp_b, gold_b, ctx_b):
            params = {**fixed, **dict(static), **dyn,
                      **{k: _from_free(k, free[k]) for k in keys}}
            w = jax.nn.softmax(free["_w"]) if fit_weights else base_w
            if ctx_nll is not None:
                w = jax.nn.softmax(-ctx_b / params["weighting.temperature"], axis=-1)
            lq = fused_logq(method, params, w, logp_b, phase_name)
            return jnp.mean(gold_nll(lq, gold_b))

        @jax.jit
        def step(free, state, dyn, logp_b, gold_b, ctx_b):
            val, g = jax.value_and_grad(loss)(free, dyn, logp_b, gold_b, ctx_b)
            g = jax.tree_util.tree_map(lambda x: jnp.where(jnp.isfinite(x), x, 0.0), g)
            upd, state = opt.update(g, state, free)
            return optax.apply_updates(free, upd), state, val

        compiled[static] = (jax.jit(loss), step)
        return compiled[static]

    best = None
    for values in itertools.product(*grid.values()) if grid else [()]:
        point = dict(zip(grid.keys(), values))
        static = tuple(sorted((k, v) for k, v in point.items() if not is_float[k]))
        dyn = {k: jnp.float32(v) for k, v in point.items() if is_float[k]}
        loss, step = functions(static)
        free = {k: _to_free(k, init[k]) for k in keys}
        free["_w"] = jnp.zeros((n,), jnp.float32)
        if keys or fit_weights:
            state = opt.init(free)
            rng = np.random.default_rng(seed)
            for _ in range(steps):
                if batch is None or batch >= table.n_positions:
                    free, state, _ = step(free, state, dyn, logp, gold, ctx)
                else:
                    idx = jnp.asarray(rng.choice(table.n_positions, batch, replace=False))
                    free, state, _ = step(free, state, dyn, logp[idx], gold[idx], ctx[idx])
        value = float(loss(free, dyn, logp, gold, ctx))
        if not math.isfinite(value):
            continue
        if best is None or value < best[0]:
            params = {**fixed, **point,
                      **{k: float(_from_free(k, free[k])) if np.ndim(free[k]) == 0
                         else np.asarray(_from_free(k, free[k])).tolist() for k in keys}}
            w = (np.asarray(jax.nn.softmax(free["_w"])) if fit_weights
                 else np.asarray(base_w))
            if ctx_nll is not None:  # per position; report their mean
                w = np.asarray(perplexity_weights_for(table, params["weighting.temperature"])
                               ).mean(0)
            best = (value, params, w)
    if best is None:
        raise ValueError(f"{spec.get('label', method)}: no finite calibration NLL at any "
                         f"grid point (a method that truncates can give the gold event "
                         f"probability 0)")
    return Fitted(spec.get("label", method), method,
                  {**best[1], **({"phase": phase_name} if phase_name else {})},
                  best[2], best[0])


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
      {"nll": [P] gold NLL (nats, floored at NLL_CAP), "top1_credit": [P]
      :func:`top1_credit` (its mean is the top-1 accuracy, ties shared),
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
    nll = np.where(floored, NLL_CAP, nll)
    conf = np.exp(np.asarray(jnp.max(lq, axis=-1), np.float64))
    return {"nll": nll, "top1_credit": top1_credit(lq, table.gold), "confidence": conf,
            "floored": floored}
