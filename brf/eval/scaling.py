"""Scoring throughput on meshes of several devices (experiments/bench_sharding.py).

One process per device count: XLA fixes the number of (virtual) CPU devices
when JAX starts, so :func:`spawn` runs :func:`measure` in a child process
with ``--xla_force_host_platform_device_count=N`` in its environment. Inside a
process, every row (the one-device path and each mesh) scores the
same segments, once untimed (compilation) and then in turn for a few rounds
(best kept), so a shared machine's drift hits every row alike and the ratios
between rows are measured side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Sequence

import jax
import numpy as np

from brf import sharding
from brf.eval.scoring import score_segments


def synthetic_model(n_layers: int = 4, seed: int = 0):
    """A random model of SmolLM2-135M's width and vocabulary (d 576, 9 heads of
    64, 3 kv heads, d_ff 1536, V 49152) with ``n_layers`` layers, per-layer layout."""
    from brf.models import ModelConfig, init_params
    from brf.models.transformer import unstack_layers
    cfg = ModelConfig(arch="llama", vocab_size=49152, d_model=576, n_layers=n_layers,
                      n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, norm_eps=1e-5,
                      rope_theta=10000.0, max_seq_len=2048, tie_embeddings=True, bos_id=1)
    return cfg, unstack_layers(init_params(cfg, jax.random.PRNGKey(seed)))


def load_model(source: str):
    """('synthetic' | 'synthetic:<layers>' | a brf.checkpoints source) -> (cfg, params)."""
    if source.startswith("synthetic"):
        _, _, layers = source.partition(":")
        return synthetic_model(int(layers or 4))
    from brf.checkpoints import registry
    m = registry.load(source, progress=False)
    return m.cfg, m.params


def measure(source: str, meshes: Sequence[dict], *, n_segments: int, seg_len: int,
            chunk: int, repeats: int, top_k: int = 64) -> list[dict]:
    """Tokens/s of teacher-forced scoring: the one-device path (no mesh) and each mesh.

    Returns:
      One dict per row: label, mesh (None for the one-device path), seconds, tokens_per_s.
    """
    cfg, params = load_model(source)
    rng = np.random.default_rng(0)
    segs = [rng.integers(3, cfg.vocab_size, size=seg_len).astype(np.int32)
            for _ in range(n_segments)]
    rows = [("one device (no mesh)", None, params, None)]
    for spec in meshes:
        mesh = sharding.make_mesh(spec)
        rows.append((f"mesh data={spec['data']} model={spec['model']}", spec,
                     sharding.shard_params(params, mesh), mesh))
    n_tok = sum(len(s) - 1 for s in segs)
    import contextlib
    import io

    def once(p, mesh):
        with contextlib.redirect_stderr(io.StringIO()):  # no progress bars here
            score_segments(p, cfg, segs, top_k=top_k, chunk=chunk, mesh=mesh)

    for _, _, p, mesh in rows:
        once(p, mesh)
    best = {}
    for _ in range(repeats):
        for label, _, p, mesh in rows:
            t0 = time.perf_counter()
            once(p, mesh)
            dt = time.perf_counter() - t0
            best[label] = min(best.get(label, dt), dt)
    return [dict(label=label, mesh=spec, seconds=best[label], tokens_per_s=n_tok / best[label])
            for label, spec, _, _ in rows]


def measure_members(source: str, n_members: int, *, n_segments: int, seg_len: int,
                    chunk: int, repeats: int, top_k: int = 64) -> list[dict]:
    """Tokens/s of scoring an ensemble: every member on every device, one member
    after another ('shared'), against each member on its own devices, all at once
    ('apart', :func:`brf.sharding.member_meshes`); the one-device path (one device, one
    member after another) is the baseline. Every member runs ``source``'s weights
    (each member's copy placed where it runs).

    Returns:
      One dict per row: label, mesh, seconds, tokens_per_s (all members' tokens).
    """
    import contextlib
    import io
    cfg, params = load_model(source)
    members = [params] * n_members  # the same weights: the work, not the values, matters
    rng = np.random.default_rng(0)
    segs = [rng.integers(3, cfg.vocab_size, size=seg_len).astype(np.int32)
            for _ in range(n_segments)]
    rows = [("one device (no mesh), members in turn", None, [None] * n_members)]
    for placement in ("shared", "apart"):
        spec = dict(data=-1, model=1, placement=placement)
        rows.append((f"{placement}: data=-1 model=1", spec,
                     sharding.member_meshes(spec, n_members)))
    placed = {label: [sharding.shard_params(p, m) for p, m in zip(members, ms)]
              for label, _, ms in rows}

    def once(label, meshes):
        def one(j):
            with contextlib.redirect_stderr(io.StringIO()):
                score_segments(placed[label][j], cfg, segs, top_k=top_k, chunk=chunk,
                               mesh=meshes[j])
        sharding.per_device_group(meshes, one)

    for label, _, ms in rows:
        once(label, ms)
    best = {}
    for _ in range(repeats):
        for label, _, ms in rows:
            t0 = time.perf_counter()
            once(label, ms)
            dt = time.perf_counter() - t0
            best[label] = min(best.get(label, dt), dt)
    n_tok = n_members * sum(len(s) - 1 for s in segs)
    return [dict(label=label, mesh=spec, seconds=best[label], tokens_per_s=n_tok / best[label])
            for label, spec, _ in rows]


def spawn(script: str, n_devices: int, argv: Sequence[str], timeout: float = 1800) -> list[dict]:
    """Runs ``script --worker_devices=N argv`` with N virtual CPU devices; its rows."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={n_devices}").strip()
    out = subprocess.run([sys.executable, script, f"--worker_devices={n_devices}", *argv],
                         env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"worker with {n_devices} devices failed:\n{out.stderr[-4000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("ROWS ")][-1]
    return json.loads(line[5:])


def default_meshes(n_devices: int) -> list[dict]:
    """Rows for N devices: data-parallel, and for N > 1 model- and mixed-parallel."""
    out = [dict(data=n_devices, model=1)]
    if n_devices > 1:
        out.append(dict(data=1, model=n_devices))
    if n_devices >= 4:
        out.append(dict(data=n_devices // 2, model=2))
    return out
