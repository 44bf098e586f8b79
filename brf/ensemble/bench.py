"""Ensemble decoding throughput: every member each step (linear, BRF) vs mixture sampling.

Every row runs the same decoding loop (:func:`brf.ensemble.generate`) on the
same prompts in one process: each single member alone (its cost per step c_i),
the full ensemble with the linear pool and with BRF, and mixture sampling
(ME). Each row is run once to compile (same seed, so the same catch-up
shapes), then all rows are timed in turn for a few rounds (best kept).

ME's expected speedup over running every member each step is
``sum_i c_i / sum_i w_i c_i`` (docs/design.md §5); the table reports the
measured speedup against the linear-pool row and its fraction of that.
"""

from __future__ import annotations

import time
from typing import Sequence

from brf.benchmark import markdown_table
from brf.ensemble.decode import generate
from brf.ensemble.member import Member


def time_rows(rows: Sequence[tuple[str, Sequence[Member], dict]], prompts: Sequence[str],
              repeats: int = 1) -> dict[str, tuple[float, int]]:
    """{label: (best seconds, events)} for generate(members, prompts, **kwargs) per row.

    Every row runs once untimed (compilation; the same seed gives the same
    catch-up shapes later), then the rows are timed in turn, ``repeats`` rounds,
    so slow drifts of a shared machine hit every row alike.
    """
    for _, members, kw in rows:
        generate(members, prompts, **kw)
    best: dict[str, tuple[float, int]] = {}
    for _ in range(repeats):
        for label, members, kw in rows:
            t0 = time.perf_counter()
            res = generate(members, prompts, **kw)
            dt = time.perf_counter() - t0
            if label not in best or dt < best[label][0]:
                best[label] = (dt, sum(g.n_events for g in res))
    return best


def bench(members: Sequence[Member], prompts: Sequence[str], weights: Sequence[float], *,
          aligner: str, max_new_tokens: int = 32, seed: int = 0, repeats: int = 1,
          born_phase: str = "tanh(rate=0.5, offset=[0, 0.5])") -> tuple[str, dict]:
    """Runs every row; returns (markdown table, numbers)."""
    common = dict(max_new_tokens=max_new_tokens, seed=seed)
    singles = [(f"single: {m.name}", [m], dict(mode="mixture_exact", aligner="identity",
                                               **common)) for m in members]
    ens = dict(weights=weights, aligner=aligner, **common)
    configs = [("all members, linear pool", members, dict(mode="fuse", method="linear", **ens)),
               ("all members, BRF", members, dict(mode="fuse", method="born",
                                                  method_params={"phase": born_phase}, **ens)),
               ("ME (mixture_exact, shared pick)", members,
                dict(mode="mixture_exact", choice="shared", **ens))]
    timed = time_rows(singles + configs, prompts, repeats)
    rows, tps = [], {}
    for label, _, _ in singles + configs:
        s, e = timed[label]
        tps[label] = e / s
        rows.append([label, e, s, e / s, "", ""])
    cost = [1.0 / tps[label] for label, _, _ in singles]
    expected = sum(cost) / sum(w * c for w, c in zip(weights, cost))
    lin, brf_, me = (tps[label] for label, _, _ in configs)
    rows[-2][4] = f"{(lin / brf_ - 1) * 100:+.1f}% time vs linear"
    speedup = me / lin
    rows[-1][4] = f"speedup {speedup:.2f}x vs linear (expected {expected:.2f}x)"
    rows[-1][5] = f"{100 * speedup / expected:.0f}% of expected"
    table = markdown_table(["run", "tokens", "seconds", "tokens/s", "vs linear", "ME goal"],
                           rows)
    return table, dict(tps=tps, expected=expected, speedup=speedup,
                       me_fraction=speedup / expected, brf_overhead=lin / brf_ - 1)


def _members_forward(members: Sequence[Member], prompts: Sequence[str], steps: int,
                     dtype=None) -> float:
    """Seconds for every member's own prompt prefill and ``steps`` greedy decoding
    steps (a plain loop over its jitted, cache-donating ``decode_step``, no fusion,
    no host sync until the end): the work a fused step cannot do without."""
    import jax
    import jax.numpy as jnp

    from brf.ensemble import catchup
    from brf.models import decode_step_donated
    dtype = jnp.dtype(dtype or jnp.float32)
    t0 = time.perf_counter()
    for m in members:
        ids = [m.prompt_ids(p) for p in prompts]
        st = catchup.start(m, ids, slots=catchup.bucket(max(map(len, ids)), 8) + 2 * steps,
                           dtype=dtype)
        cache, logits = st.cache, st.logits_BxV
        for _ in range(steps):
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, cache = decode_step_donated(m.params, m.cfg, token, cache, dtype=dtype)
        jax.block_until_ready(logits)
    return time.perf_counter() - t0


def bench_engines(members: Sequence[Member], prompts: Sequence[str], weights: Sequence[float],
                  *, aligner: str, max_new_tokens: int = 64, repeats: int = 1,
                  method: str = "born", method_params: dict | None = None,
                  sampler: str = "greedy", block_steps: int = 16, dtype=None
                  ) -> tuple[str, dict]:
    """Fused generation on the host loop and on the device engine, beside the
    members' own forward passes; every row run once to compile, then timed in
    turn ``repeats`` rounds (best kept). Returns (markdown table, numbers).

    Per-step host overhead is (a row's seconds - the members' own seconds) / steps:
    what the fused step costs beyond the members' forward passes. ``dtype`` is the
    compute dtype of every row (default float32).
    """
    import jax.numpy as jnp
    method_params = dict(method_params or {})
    dtype = jnp.dtype(dtype or jnp.float32)
    kw = dict(weights=weights, aligner=aligner, method=method, method_params=method_params,
              sampler=sampler, max_new_tokens=max_new_tokens, block_steps=block_steps,
              dtype=dtype)
    rows = [("fused, host loop (engine='host')", dict(kw, engine="host")),
            ("fused, compiled step (engine='device')", dict(kw, engine="device"))]
    texts = {}
    for label, k in rows:
        texts[label] = [g.text for g in generate(members, prompts, **k)]
    _members_forward(members, prompts, max_new_tokens, dtype)
    best: dict[str, float] = {}
    events: dict[str, int] = {}
    own = float("inf")
    for _ in range(repeats):
        for label, k in rows:
            t0 = time.perf_counter()
            res = generate(members, prompts, **k)
            dt = time.perf_counter() - t0
            best[label] = min(best.get(label, float("inf")), dt)
            events[label] = max(g.n_events for g in res)
        own = min(own, _members_forward(members, prompts, max_new_tokens, dtype))
    steps = max_new_tokens
    table_rows = [["members' own forward passes", steps, own, steps / own, 1.0, ""]]
    nums = {"members_s": own, "steps": steps}
    for label, _ in rows:
        s = best[label]
        table_rows.append([label, events[label], s, events[label] / s, own / s,
                           f"{(s - own) / steps * 1e3:.1f}"])
        nums[label] = s
    same = texts[rows[0][0]] == texts[rows[1][0]]
    table = markdown_table(["run", "steps", "seconds", "steps/s", "members / run",
                            "host overhead ms/step"], table_rows)
    return table, dict(nums, same_text=same)
