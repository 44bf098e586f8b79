"""Planted event tables: synthetic tables with a known structure, for the fits'
tests and benchmarks (``experiments/bench_fit_repeat.py``)."""

import numpy as np

from brf.event_table import EventTable


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log softmax over the last axis (float64 NumPy; rows of -inf stay -inf)."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def two_members(P: int = 1500, E: int = 12, seed: int = 0) -> EventTable:
    """Two members over E events, one sharp and one noisy, the gold drawn from a
    third distribution: the sharp member is the truth at twice its sharpness, the
    noisy one the truth plus unit Gaussian noise and lacks the last event (gold
    never falls on it). Segments of 50 positions."""
    rng = np.random.default_rng(seed)
    true = log_softmax(rng.normal(size=(P, E)) * 1.5)
    true[:, -1] = -np.inf  # gold is never the event member 1 lacks
    true = log_softmax(true)
    gold = np.array([rng.choice(E, p=np.exp(r)) for r in true])
    true[:, -1] = -8.0
    a = log_softmax(true * 2.0)
    b = log_softmax(true + rng.normal(size=(P, E)))
    b[:, -1] = -np.inf  # an event member 1 cannot express
    b = log_softmax(b)
    logp = np.stack([a, b], 1).astype(np.float32)
    return EventTable(logp, gold, np.ones((P, 2), np.float32), np.ones(P, np.int64),
                      np.arange(P) // 50)
