"""Ensemble decoding throughput: every member each step (linear, BRF) vs mixture sampling.

Every row runs the same decoding loop (:func:`brf.ensemble.generate`) on the
same prompts in one process: each single member alone (its cost per step c_i),
the full ensemble with the linear pool and with BRF, and mixture sampling
(ME). Each row is run once to compile (same seed, so the same catch-up
shapes) and then timed.

ME's expected speedup over running every member each step is
``sum_i c_i / sum_i w_i c_i`` (DESIGN.md section 5); the table reports the
measured speedup against the linear-pool row and its fraction of that.
"""

from __future__ import annotations

import time
from typing import Sequence

from brf.benchmark import markdown_table
from brf.ensemble.decode import generate
from brf.ensemble.member import Member


def time_generate(members: Sequence[Member], prompts: Sequence[str], *, repeats: int = 1,
                  **kwargs) -> tuple[float, int]:
    """(best seconds, events) of generate(...) after one untimed compile run."""
    generate(members, prompts, **kwargs)
    best, events = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = generate(members, prompts, **kwargs)
        dt = time.perf_counter() - t0
        if dt < best:
            best, events = dt, sum(g.n_events for g in res)
    return best, events


def bench(members: Sequence[Member], prompts: Sequence[str], weights: Sequence[float], *,
          aligner: str, max_new_tokens: int = 32, seed: int = 0, repeats: int = 1,
          born_phase: str = "tanh(rate=0.5, offset=[0, 0.5])") -> tuple[str, dict]:
    """Runs every row; returns (markdown table, numbers)."""
    common = dict(max_new_tokens=max_new_tokens, seed=seed, repeats=repeats)
    rows, tps = [], {}
    for m in members:
        s, e = time_generate([m], prompts, mode="mixture_exact", aligner="identity", **common)
        tps[m.name] = e / s
        rows.append([f"single: {m.name}", e, s, e / s, "", ""])
    cost = [1.0 / tps[m.name] for m in members]
    expected = sum(cost) / sum(w * c for w, c in zip(weights, cost))
    configs = [("all members, linear pool", dict(mode="fuse", method="linear")),
               ("all members, BRF", dict(mode="fuse", method="born",
                                         method_params={"phase": born_phase})),
               ("ME (mixture_exact, shared pick)", dict(mode="mixture_exact", choice="shared"))]
    for label, kw in configs:
        s, e = time_generate(members, prompts, weights=weights, aligner=aligner, **kw,
                             **common)
        tps[label] = e / s
        rows.append([label, e, s, e / s, "", ""])
    lin, brf_, me = (tps[label] for label, _ in configs)
    rows[-2][4] = f"{(lin / brf_ - 1) * 100:+.1f}% time vs linear"
    speedup = me / lin
    rows[-1][4] = f"speedup {speedup:.2f}x vs linear (expected {expected:.2f}x)"
    rows[-1][5] = f"{100 * speedup / expected:.0f}% of expected"
    table = markdown_table(["run", "tokens", "seconds", "tokens/s", "vs linear", "ME goal"],
                           rows)
    return table, dict(tps=tps, expected=expected, speedup=speedup,
                       me_fraction=speedup / expected, brf_overhead=lin / brf_ - 1)
