"""L-BFGS for the study's small fits: a few parameters, a float32 objective, float64 steps.

The objective is a compiled float32 mean NLL and its gradient over every
calibration position; the iteration runs on the host in float64 (the vectors
have a handful of entries). It differs from textbook L-BFGS in four ways that
the fits need:

* coordinates may have bounds (the calibration temperatures' box): a step is
  projected onto the box, and a coordinate at a bound that the gradient pushes
  out of the box is held there (its gradient and search direction count as 0),
  so an optimum on the boundary is reached exactly instead of crept towards;
* the backtracking (Armijo) line search tries the quasi-Newton step first, so an
  iteration costs about one evaluation once the curvature pairs are in, and it
  treats a change below float32 resolution as no change;
* every step is capped in each coordinate (``max_step``), so a fit stays in the
  basin it starts in instead of jumping across the objective's flat regions;
* the curvature pairs are returned and accepted, so a fit on a subsample can
  hand its inverse-Hessian estimate to the fit on all positions, whose first
  steps are then nearly Newton steps.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

NOISE = 2e-7  # relative resolution of a float32 mean over thousands of positions

Pairs = list  # [(s, y, 1 / s.y)], oldest first


class Result(NamedTuple):
    x: np.ndarray
    value: float
    pairs: Pairs
    iterations: int
    evaluations: int
    converged: bool


def minimize(fun: Callable[[np.ndarray], tuple[float, np.ndarray]], x0: np.ndarray, *,
             max_iter: int, ftol: float, gtol: float, history: int, max_step: float,
             pairs: Pairs | None = None, lower: np.ndarray | None = None,
             upper: np.ndarray | None = None, hessian: np.ndarray | None = None,
             noise: float = NOISE) -> Result:
    """Minimises ``fun(x) -> (value, gradient)`` from ``x0`` within ``[lower, upper]``.

    Stops when an iteration lowers the value by less than ``ftol`` (relative) twice
    running, when every component of the projected gradient (0 where a bound holds
    the coordinate) is below ``gtol``, when no step along the search direction
    lowers the value (float32 resolution), or after ``max_iter`` iterations. A
    non-finite value counts as no decrease (the step is shortened); non-finite
    gradient entries count as 0.

    Args:
      fun: the objective and its gradient (float64 arrays in and out).
      x0: the start (projected onto the box).
      max_iter, ftol, gtol: the budget and convergence test.
      history: curvature pairs kept.
      max_step: the largest change of any coordinate in one step.
      pairs: curvature pairs to start from (e.g. from a fit on a subsample).
      lower, upper: bounds per coordinate (None or +-inf: none).
      hessian: a symmetric positive definite estimate of the Hessian (e.g. the
        empirical Fisher information of an NLL): the two-loop recursion starts from
        its inverse instead of a scaled identity, so the first steps are nearly
        Newton steps and parameters of very different scales need no tuning; the
        curvature pairs refine it as usual.
      noise: the objective's relative resolution: the line search accepts a step that
        raises the value by less than this (default :data:`NOISE`, float32's; a
        float64 objective can take about 1e-13).

    Returns:
      Result; ``converged`` is True when the ftol or gtol test ended the run.
    """
    evals = 0
    n = np.size(x0)
    lo = np.full(n, -np.inf) if lower is None else np.asarray(lower, np.float64)
    hi = np.full(n, np.inf) if upper is None else np.asarray(upper, np.float64)

    def f_and_g(x):
        nonlocal evals
        evals += 1
        v, g = fun(x)
        return float(v), np.where(np.isfinite(g), g, 0.0)

    def held(x, g):  # coordinates a bound holds: at it, and the gradient points out
        return ((x <= lo) & (g > 0)) | ((x >= hi) & (g < 0))

    x = np.clip(np.asarray(x0, np.float64), lo, hi)
    f, g = f_and_g(x)
    pairs = list(pairs or [])
    if not math.isfinite(f):
        return Result(x, f, pairs, 0, evals, False)
    converged, quiet, it = False, 0, 0
    for it in range(1, max_iter + 1):
        fixed = held(x, g)
        pg = np.where(fixed, 0.0, g)
        if np.max(np.abs(pg), initial=0.0) < gtol:
            converged = True
            break
        d = np.where(fixed, 0.0, -two_loop(pg, pairs, hessian, fixed))
        if float(pg @ d) >= 0:  # not a descent direction: restart from steepest descent
            pairs.clear()
            d = -pg
        step = min(1.0, max_step / max(float(np.max(np.abs(d))), 1e-12))
        for _ in range(10):
            x_new = np.clip(x + step * d, lo, hi)
            slope = float(g @ (x_new - x))
            f_new, g_new = f_and_g(x_new)
            if math.isfinite(f_new) and f_new <= f + 1e-4 * slope + noise * abs(f):
                break
            step *= 0.2
        else:
            break  # no decrease along d within the objective's resolution (noise)
        s, y = x_new - x, g_new - g
        sy = float(s @ y)
        if sy > 1e-12 * float(y @ y):
            pairs.append((s, y, 1.0 / sy))
            del pairs[:-history]
        quiet = quiet + 1 if f - f_new <= ftol * max(abs(f), 1.0) else 0
        x, f, g = x_new, f_new, g_new
        if quiet >= 2:
            converged = True
            break
    pg = np.where(held(x, g), 0.0, g)
    converged = converged or bool(np.max(np.abs(pg), initial=0.0) < gtol)
    return Result(x, f, pairs, it, evals, bool(converged))


def two_loop(g: np.ndarray, pairs: Pairs, hessian: np.ndarray | None = None,
             fixed: np.ndarray | None = None) -> np.ndarray:
    """H g for the L-BFGS inverse-Hessian estimate from the curvature pairs, starting
    from ``hessian``'s inverse on the coordinates not ``fixed`` (None: the scaled
    identity of the newest pair)."""
    q = g.copy()
    alphas = []
    for s, y, rho in reversed(pairs):
        a = rho * float(s @ q)
        alphas.append(a)
        q -= a * y
    if hessian is not None:
        free = np.ones(q.shape, bool) if fixed is None else ~fixed
        r = np.zeros_like(q)
        r[free] = np.linalg.solve(hessian[np.ix_(free, free)], q[free])
        q = r
    elif pairs:
        s, y, _ = pairs[-1]
        q *= float(s @ y) / float(y @ y)
    for (s, y, rho), a in zip(pairs, reversed(alphas)):
        q += (a - rho * float(y @ q)) * s
    return q
