"""L-BFGS for the study's small fits: a few parameters, a float32 objective, float64 steps.

The objective is a jit-compiled float32 mean NLL and its gradient over every
calibration position; the iteration runs on the host in float64 (the vectors
have a handful of entries). It differs from textbook L-BFGS in three ways that
the fits need:

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
             pairs: Pairs | None = None) -> Result:
    """Minimises ``fun(x) -> (value, gradient)`` from ``x0``.

    Stops when an iteration lowers the value by less than ``ftol`` (relative) twice
    running, when every gradient component is below ``gtol``, when no step along
    the search direction lowers the value (float32 resolution), or after
    ``max_iter`` iterations. A non-finite value counts as no decrease (the step is
    shortened); non-finite gradient entries count as 0.

    Args:
      fun: the objective and its gradient (float64 arrays in and out).
      x0: the start.
      max_iter, ftol, gtol: the budget and convergence test.
      history: curvature pairs kept.
      max_step: the largest change of any coordinate in one step.
      pairs: curvature pairs to start from (e.g. from a fit on a subsample).

    Returns:
      Result; ``converged`` is True when the ftol or gtol test ended the run.
    """
    evals = 0

    def f_and_g(x):
        nonlocal evals
        evals += 1
        v, g = fun(x)
        return float(v), np.where(np.isfinite(g), g, 0.0)

    x = np.asarray(x0, np.float64)
    f, g = f_and_g(x)
    pairs = list(pairs or [])
    if not math.isfinite(f):
        return Result(x, f, pairs, 0, evals, False)
    converged, quiet, it = False, 0, 0
    for it in range(1, max_iter + 1):
        if np.max(np.abs(g), initial=0.0) < gtol:
            converged = True
            break
        d = -two_loop(g, pairs)
        slope = float(g @ d)
        if slope >= 0:  # not a descent direction: restart from steepest descent
            pairs.clear()
            d, slope = -g, -float(g @ g)
        step = min(1.0, max_step / max(float(np.max(np.abs(d))), 1e-12))
        for _ in range(10):
            x_new = x + step * d
            f_new, g_new = f_and_g(x_new)
            if math.isfinite(f_new) and f_new <= f + 1e-4 * step * slope + NOISE * abs(f):
                break
            step *= 0.2
        else:
            break  # no decrease along d within float32 resolution
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
    converged = converged or bool(np.max(np.abs(g), initial=0.0) < gtol)
    return Result(x, f, pairs, it, evals, bool(converged))


def two_loop(g: np.ndarray, pairs: Pairs) -> np.ndarray:
    """H g for the L-BFGS inverse-Hessian estimate from the curvature pairs."""
    q = g.copy()
    alphas = []
    for s, y, rho in reversed(pairs):
        a = rho * float(s @ q)
        alphas.append(a)
        q -= a * y
    if pairs:
        s, y, _ = pairs[-1]
        q *= float(s @ y) / float(y @ y)
    for (s, y, rho), a in zip(pairs, reversed(alphas)):
        q += (a - rho * float(y @ q)) * s
    return q
