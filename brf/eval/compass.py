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
    within ``[lower, upper]`` by pattern search (Hooke and Jeeves).

    An exploration polls x +- s e_i for each coordinate i in turn, keeping each move
    that lowers the value by more than float32 noise (a relative
    :data:`brf.eval.lbfgs.NOISE`). After an exploration that moved, a pattern move
    jumps on by the same displacement and explores from there, kept when it ends lower
    (so a valley that no coordinate follows is walked along its diagonal); after one
    that did not, s halves. The run ends when s falls below ``min_step`` (converged)
    or after ``max_evals`` evaluations.

    Returns:
      :class:`brf.eval.lbfgs.Result` (no curvature pairs).
    """
    n = np.size(x0)
    lo = np.full(n, -np.inf) if lower is None else np.asarray(lower, np.float64)
    hi = np.full(n, np.inf) if upper is None else np.asarray(upper, np.float64)
    evals = 0

    def value(x):
        nonlocal evals
        evals += 1
        v = float(fun(x)[0])
        return v if math.isfinite(v) else math.inf

    def lower_than(v, f):
        return v < f - NOISE * abs(f)

    def explore(x, f, s):
        x = x.copy()
        for i in range(n):
            for sign in (1.0, -1.0):
                if evals >= max_evals:
                    return x, f
                y = x.copy()
                y[i] = min(max(y[i] + sign * s, lo[i]), hi[i])
                if y[i] == x[i]:
                    continue
                v = value(y)
                if lower_than(v, f):
                    x, f = y, v
                    break
        return x, f

    x = np.clip(np.asarray(x0, np.float64), lo, hi)
    f = value(x)
    it = 0
    if not math.isfinite(f) or n == 0:
        return Result(x, f, [], 0, evals, n == 0)
    s = float(step)
    while s >= min_step and evals < max_evals:
        it += 1
        y, g = explore(x, f, s)
        if not lower_than(g, f):
            s *= 0.5
            continue
        while evals < max_evals:  # pattern moves while they pay
            z = np.clip(y + (y - x), lo, hi)
            x, f = y, g
            vz = value(z)
            w, h = explore(z, vz, s)
            if not lower_than(h, f):
                break
            y, g = w, h
    return Result(x, f, [], it, evals, s < min_step)


__all__ = ["minimize"]
