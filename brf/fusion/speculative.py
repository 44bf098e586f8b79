"""The accept / resample step of speculative sampling, for any target distribution.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a drafter proposes
``x_1 .. x_m``, each ``x_i`` drawn from a draft distribution ``p_i`` that may depend
on everything before it; the target's distributions ``q_1 .. q_{m+1}`` at those
positions are computed in one go. Then, in order, ``x_i`` is accepted with
probability ``min(1, q_i(x_i) / p_i(x_i))``; at the first rejection a replacement
is drawn from ``norm(max(0, q_i - p_i))`` and the round ends; if every draft is
accepted, one more event is drawn from ``q_{m+1}``. Each emitted event is then
distributed exactly as ``q`` at its position, whatever the drafter does: the
drafter only changes how many events a round emits.

Here ``q`` is whatever the caller samples: in brf the *sampler's* distribution of
the fused one (temperature, top-k, top-p, min-p applied to the fusion), so the
emitted text follows exactly the law plain fused decoding samples.

* A deterministic drafter (n-gram lookup) has ``p_i`` one-hot: acceptance is
  ``q_i(x_i)`` and the residual is ``q_i`` without ``x_i``.
* Greedy decoding (``q_i`` one-hot at the fused argmax): a draft is accepted iff
  it is the argmax, and the replacement is the argmax: the greedy sequence,
  unchanged (:func:`verify_greedy`).

Everything here is host-side float64 NumPy on probabilities; randomness comes
from a ``numpy.random.Generator`` the caller owns.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class Verdict(NamedTuple):
    """What one round's verification decided.

    Attributes:
        accepted: how many drafted events were accepted (0 .. m).
        event: the event emitted after them (the replacement at the first
            rejection, or the bonus event drawn from ``q_{m+1}``).
    """
    accepted: int
    event: int


def draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """One event from non-negative weights ``probs`` (need not sum to 1), by inverse CDF."""
    c = np.cumsum(probs, dtype=np.float64)
    total = c[-1]
    if not total > 0:
        raise ValueError("cannot sample from a distribution without mass")
    i = int(np.searchsorted(c, rng.random() * total, side="right"))
    if i >= len(c) or probs[i] <= 0:  # rounding at the top end: the last event with mass
        i = int(np.flatnonzero(probs > 0)[-1])
    return i


def verify(rng: np.random.Generator, q_rows, draft: Sequence[int],
           p_rows: np.ndarray | None = None) -> Verdict:
    """The accept / resample step (module docstring).

    Args:
        rng: the random generator (one uniform per examined draft, one per draw).
        q_rows: float64 [m + 1, E] target probabilities at the m drafted positions
            and the one after them (rows sum to 1); or a function ``i -> row``,
            called in order and only as far as the round gets (an exception it
            raises at position i comes after ``draft[:i]`` was accepted).
        draft: the m drafted events.
        p_rows: float64 [m, E] the draft distributions the events were drawn from;
            None: a deterministic drafter (each ``p_i`` one-hot at ``x_i``).

    Returns:
        Verdict(accepted, event): the emitted events are ``draft[:accepted] + [event]``.
    """
    m = len(draft)
    q_at = q_rows if callable(q_rows) else q_rows.__getitem__
    if not callable(q_rows) and q_rows.shape[0] < m + 1:
        raise ValueError(f"{m} drafted events need {m + 1} target rows; got {q_rows.shape[0]}")
    for i, x in enumerate(draft):
        q = q_at(i)
        px = 1.0 if p_rows is None else float(p_rows[i][x])
        if px > 0 and rng.random() * px < q[x]:
            continue
        if p_rows is None:
            residual = q.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(q - p_rows[i], 0.0)
        if not residual.sum() > 0:  # q <= p everywhere yet x rejected: only by rounding
            residual = q
        return Verdict(i, draw(rng, residual))
    return Verdict(m, draw(rng, q_at(m)))


def verify_greedy(argmax, draft: Sequence[int]) -> Verdict:
    """Greedy verification: drafts are accepted while they equal the target's argmax
    at their position; the emitted event is the argmax where they stop.

    Args:
        argmax: the target's argmax at the m + 1 positions (a sequence, or a
            function ``i -> argmax`` called in order, as in :func:`verify`).
        draft: the m drafted events.
    """
    top = argmax if callable(argmax) else argmax.__getitem__
    for i, x in enumerate(draft):
        t = int(top(i))
        if int(x) != t:
            return Verdict(i, t)
    return Verdict(len(draft), int(top(len(draft))))


def emitted_law(q_rows: np.ndarray, draft: Sequence[int],
                p_rows: np.ndarray | None = None) -> list[tuple[int, np.ndarray]]:
    """The exact law of :func:`verify`'s outcome, for tests and checks.

    Returns:
        per i in 0..m, (i, w_i): ``w_i[e]`` is the probability that exactly i
        drafts are accepted and event e is emitted after them, given the draft.
        Summed over the drafts' own law, the first emitted event is ``q_1``.
    """
    out, reach = [], 1.0
    for i, x in enumerate(draft):
        q = q_rows[i]
        px = 1.0 if p_rows is None else float(p_rows[i, x])
        acc = min(1.0, q[x] / px) if px > 0 else 0.0
        if p_rows is None:
            residual = q.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(q - p_rows[i], 0.0)
        if not residual.sum() > 0:
            residual = q
        out.append((i, reach * (1.0 - acc) * residual / residual.sum()))
        reach *= acc
    out.append((len(draft), reach * q_rows[len(draft)]))
    return out


__all__ = ["Verdict", "draw", "emitted_law", "verify", "verify_greedy"]
