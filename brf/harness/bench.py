"""The harness model's token-level loglikelihood throughput beside brf's own forward
passes on the same tokens (what experiments/bench_harness.py prints).

Both sides score the same requests (a shipped task's multiple-choice continuations):

* **harness**: `brf.harness.lm.BRFLM.loglikelihood` on the harness's request objects
  (tokenizing, sorting by length, batching, each member's forward pass, the fusion, the
  continuation's log-probability and greediness, back to the harness's order);
* **forward**: the same batches, tokenized and padded beforehand and already on the
  device, through the members' forward passes and the fusion
  (`Ensemble.run_token_arrays`, what the harness model runs per batch), the fused
  log-probabilities at the continuations' positions read back: the work any brf
  scoring of those tokens must do.

The ratio harness / forward is what the harness model adds. Each side runs once untimed
(compiling), then ``repeats`` times; the best is kept.
"""

from __future__ import annotations

import json
import time
from typing import Sequence

import jax.numpy as jnp

from brf.harness.ensemble import token_order
from brf.runtime import resident_bytes


def task_pairs(path: str, n_docs: int) -> list[tuple[str, str]]:
    """(context, continuation) of every choice of the first ``n_docs`` documents of a
    multiple-choice task file (tasks/data/*.jsonl with 'context' and 'choices')."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in list(f)[:n_docs]:
            doc = json.loads(line)
            out += [(doc["context"], c) for c in doc["choices"]]
    return out


def forward_pass(e, batches) -> None:
    """Every batch (per member's device arrays, gold) through the members' forward passes
    and the fusion, the gold tokens' fused log-probabilities read back to the host."""
    for per, gold in batches:
        e.run_token_arrays(per, gold)


def bench(lm, pairs: Sequence[tuple[str, str]], repeats: int = 3) -> dict:
    """Seconds (best of ``repeats``) of the harness model's loglikelihood on ``pairs`` and
    of the forward passes on the same tokens; tokens run, ratio."""
    class _Request:  # what the harness hands over: .args
        def __init__(self, args):
            self.args = args
    reqs = [_Request(p) for p in pairs]
    e = lm.ensemble
    requests = e.token_requests(pairs)
    order = token_order(requests)
    batches = []
    for s in range(0, len(order), e.batch_size):
        per, gold = e.token_arrays([requests[i] for i in order[s:s + e.batch_size]])
        batches.append(([tuple(jnp.asarray(a) for a in arrays) for arrays in per],
                        jnp.asarray(gold)))
    tokens = sum(int(t.shape[0] * t.shape[1]) for per, _ in batches for t, _, _ in per)
    lm.loglikelihood(reqs, disable_tqdm=True)  # compiles every shape
    forward_pass(e, batches)
    times = {"harness": [], "forward": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        lm.loglikelihood(reqs, disable_tqdm=True)
        times["harness"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        forward_pass(e, batches)
        times["forward"].append(time.perf_counter() - t0)
    h, f = min(times["harness"]), min(times["forward"])
    return dict(requests=len(pairs), padded_tokens=tokens, harness_s=h, forward_s=f,
                ratio=h / f, harness_tokens_per_s=tokens / h, forward_tokens_per_s=tokens / f)


def byte_memory(ensemble, pairs, *, trim: bool, warm: int = 8) -> dict:
    """Byte-level scoring of ``pairs`` (after ``warm`` untimed ones) with or without
    trimming the C heap after each request: seconds and this process's RSS after
    (run one mode per process: freed memory is not given back otherwise)."""
    keep, ensemble.trim = ensemble.trim, trim
    try:
        ensemble.score_bytes(pairs[:warm])
        t0 = time.perf_counter()
        ensemble.score_bytes(pairs[warm:])
        return dict(requests=len(pairs) - warm, seconds=time.perf_counter() - t0,
                    rss_gb=resident_bytes() / 1e9, trim=trim)
    finally:
        ensemble.trim = keep


__all__ = ["bench", "byte_memory", "forward_pass", "task_pairs"]
