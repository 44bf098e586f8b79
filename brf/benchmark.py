"""Timing helpers shared by the benchmark scripts in experiments/.

Benchmarks compare side by side in one run (ratio to a peer or to the memory
bandwidth measured in the same run), since absolute times drift on shared
machines.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def time_call(fn: Callable[[], object], *, repeats: int = 10, warmup: int = 2,
              min_time: float = 0.0) -> float:
    """Median wall time (seconds) of ``fn()``, blocking on JAX results."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def memory_bandwidth(n_bytes: int = 1 << 28, repeats: int = 10) -> float:
    """Bytes/second of a large jitted float32 reduction (reads ``n_bytes``)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    return n_bytes / time_call(lambda: f(x), repeats=repeats)


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
