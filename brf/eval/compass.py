"""Compass search: a derivative-free local minimiser for objectives with jumps.

Some fitted methods are piecewise in their parameters: routing picks a member by a
confidence that a member temperature changes, entropy-gated fusion gates on an entropy
that one does, contrastive decoding keeps the tokens above a threshold of the tempered
expert. Their calibration NLL jumps where a decision flips, and its gradient (zero
across the jump) says nothing about it, so L-BFGS stops wherever a line search first
straddles a jump, and a change in the last bits moves where that is. Compass search
compares values only, at the points of a lattice that halves its spacing when no
neighbour is lower: its path depends on which of two lattice points is lower, which
the last bits change only when they tie within float32 noise.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from brf.eval.lbfgs import NOISE, Result


def minimize(fun: Callable[[np.ndarray], tuple[float, np.ndarray]], x0: np.ndarray, *,
             step: float = 0.5, min_step: float = 1e-3, max_evals: int = 400,
             lower: np.ndarray | None = None, upper: np.ndarray | None = None) -> Result:
    """Minimises ``fun(x) -> (value, gradient)`` (the gradient is not read) from ``x0``
    within ``[lower, upper]``.

    Each iteration polls x +- s e_i for every coordinate i in turn and moves to the
    first point lower than the current value by more than float32 noise (a relative
    :data:`brf.eval.lbfgs.NOISE`); when no point is, s halves. The run ends when s falls
    below ``min_step`` (converged) or after ``max_evals`` evaluations.

    Returns:
      :class:`brf.eval.lbfgs.Result` (no curvature pairs).
    """
    n = np.size(x0)
    lo = np.full(n, -np.inf) if lower is None else np.asarray(lower, np.float64)
    hi = np.full(n, np.inf) if upper is None else np.asarray(upper, np.float64)
    x = np.clip(np.asarray(x0, np.float64), lo, hi)
    evals = 1
    f = float(fun(x)[0])
    it = 0
    if not math.isfinite(f) or n == 0:
        return Result(x, f, [], 0, evals, n == 0)
    s = float(step)
    while s >= min_step and evals < max_evals:
        it += 1
        moved = False
        for i in range(n):
            for sign in (1.0, -1.0):
                y = x.copy()
                y[i] = min(max(y[i] + sign * s, lo[i]), hi[i])
                if y[i] == x[i]:
                    continue
                v = float(fun(y)[0])
                evals += 1
                if math.isfinite(v) and v < f - NOISE * abs(f):
                    x, f, moved = y, v, True
                    break
            if evals >= max_evals:
                break
        if not moved:
            s *= 0.5
    return Result(x, f, [], it, evals, s < min_step)


__all__ = ["minimize"]
