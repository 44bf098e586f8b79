"""brf on several devices (brf.sharding): meshes, sharded scoring and fusion, hosts.

Multi-device checks run in their own process with 8 virtual CPU devices
(tests/sharded_checks.py); the multi-process check joins two processes with
``jax.distributed.initialize`` over loopback (tests/multihost_worker.py).
"""

import json
import os
import socket
import subprocess
import sys
import pathlib

import numpy as np
import pytest

from brf import sharding

TESTS = pathlib.Path(__file__).parent


def _env(devices: int = 8) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _run_check(call: str, timeout: int = 300) -> str:
    proc = subprocess.run([sys.executable, "-c", f"import sharded_checks as s; s.{call}"],
                          env=_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=TESTS.parent)
    assert proc.returncode == 0, f"{call} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


# Each check (tests/sharded_checks.py) runs with 8 virtual devices and compares with
# one device; the id says what it shows. All of them run in one process.
SHARDED_CHECKS = {
    "scoring_over_data": "scoring('data')",
    "scoring_over_model": "scoring('model')",
    "scoring_over_data_and_model": "scoring('mixed')",
    "fusion_on_a_split_vocabulary_without_gathering_it": "fusion('mixed')",
    "generation_with_model_sharded_members": "generation()",
    "generation_with_prompts_over_data": "generation_data_parallel()",
    "checkpoint_read_straight_onto_a_mesh": "checkpoint_on_mesh()",
    "logit_dump_with_the_weights_split": "dump_on_mesh()",
    "members_apart_generate": "generation_apart()",
    "members_apart_scored_at_once": "scoring_apart()",
    "speculative_rounds_with_prompts_over_data": "speculative_data_parallel()",
    "speculative_with_members_apart": "speculative_apart()",
}


@pytest.fixture(scope="module")
def sharded_results() -> dict:
    """Every check's outcome, from one process that runs them all in turn."""
    out = _run_check(f"run_all({SHARDED_CHECKS!r})", timeout=900)
    line = [l for l in out.splitlines() if l.startswith("RESULTS ")]
    assert line, out[-3000:]
    return json.loads(line[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", list(SHARDED_CHECKS))
def test_on_eight_devices_equals_one_device(name, sharded_results):
    assert sharded_results[name] == "ok", f"{SHARDED_CHECKS[name]} failed:\n{sharded_results[name]}"


@pytest.mark.parametrize("spec,n,want", [
    (None, 8, (8, 1)), (dict(data=-1, model=2), 8, (4, 2)), (dict(data=2, model=-1), 8, (2, 4)),
    (dict(data=3, model=1), 8, (3, 1)), (dict(data=-1, model=1), 1, (1, 1)),
    (dict(data=-1, model=2, placement="apart"), 4, (2, 2)),
])
def test_mesh_shape(spec, n, want):
    assert sharding.mesh_shape(spec, n) == want


@pytest.mark.parametrize("spec,match", [
    (dict(data=4, model=4), "this process has 8"), (dict(data=-1, model=-1), "only one"),
    (dict(data=0), "must be >= 1"), (dict(data=1, tensor=2), "unknown axes"),
    (dict(placement="scattered"), "placement='scattered'"),
])
def test_bad_mesh_is_refused_by_name(spec, match):
    with pytest.raises(sharding.ShardingError, match=match):
        sharding.mesh_shape(spec, 8)


@pytest.mark.parametrize("n,count", [(0, 2), (5, 2), (7, 3), (2, 4), (100, 7)])
def test_process_shares_cover_every_item_once(n, count):
    shares = [sharding.process_share(n, i, count) for i in range(count)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_param_specs_follow_the_tensor_parallel_layout():
    P = sharding.P
    assert sharding.param_spec("layers/0/wqkv_t", (96, 32)) == P("model", None)
    assert sharding.param_spec("layers/0/wo_t", (32, 32)) == P(None, "model")
    assert sharding.param_spec("layers/wq", (2, 32, 32)) == P(None, None, "model")
    assert sharding.param_spec("layers/w_down", (2, 64, 32)) == P(None, "model", None)
    assert sharding.param_spec("embed", (512, 32)) == P("model", None)
    assert sharding.param_spec("layers/0/attn_norm", (32,)) == P()


def test_bad_distributed_config_is_refused():
    with pytest.raises(sharding.ShardingError, match="num_processes"):
        sharding.initialize_distributed(dict(enabled=True, coordinator_address="127.0.0.1:1"))
    assert sharding.initialize_distributed(dict(enabled=False)) is False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stores(run: pathlib.Path) -> list[str]:
    """Every member store of a study run (prefixed members' names carry a hash), by
    path under the run directory; the per-process parts left out."""
    return sorted(str(p.relative_to(run)) for p in run.glob("*/scores-*.npz")
                  if ".part" not in p.name)


def _timeless(rep: dict) -> dict:
    rep.pop("seconds")
    for key in ("out_dir", "distributed"):
        rep["config"].pop(key)
    return rep


def test_two_processes_score_halves_and_the_merged_report_equals_one_process(tmp_path):
    """The study (two pooled corpora, prefix pair, same-model pair, swarm, event-space
    check) in two processes joined by jax.distributed over loopback: each scoring is
    split in halves, process 0 merges every store and reports. Stores and reports
    equal those of one process."""
    worker = str(TESTS / "multihost_worker.py")
    env = _env(devices=2)  # members apart, one device each (tests/multihost_worker.py)

    def launch(out, *args):
        return subprocess.Popen([sys.executable, worker, str(tmp_path), out, *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=TESTS.parent)

    def finish(p):
        try:
            out, _ = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:  # e.g. processes stuck at different barriers
            for q in procs + [p]:
                q.kill()
            raise
        assert p.returncode == 0, out[-6000:]
        return out

    procs = []
    finish(launch("single"))
    port = _free_port()
    procs = [launch("multi", f"127.0.0.1:{port}", "2", str(i)) for i in range(2)]
    outs = [finish(p) for p in procs]
    assert "report written" in outs[0] and "share scored" in outs[1], outs
    single, multi = tmp_path / "single", tmp_path / "multi"
    stores = _stores(single)
    # plain pair on both corpora; prefix pair and the same-model pair's second
    # prefix on the first (the swarm reuses them)
    assert len(stores) == 7 and _stores(multi) == stores, (stores, _stores(multi))
    for rel in stores:
        # Each process wrote its share; process 0 merged them into the usual store.
        base = (multi / rel).name[:-len(".npz")]
        parts = sorted(p.name for p in (multi / rel).parent.glob(f"{base}.part*of2.npz"))
        assert parts == [f"{base}.part0of2.npz", f"{base}.part1of2.npz"], (rel, parts)
        # np.savez stamps every entry 1980-01-01, so equal stores are equal bytes
        assert (single / rel).read_bytes() == (multi / rel).read_bytes(), rel
        with np.load(single / rel) as a, np.load(multi / rel) as b:
            assert sorted(a.files) == sorted(b.files), rel
            for k in a.files:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"{rel} {k}")
        with np.load((multi / rel).parent / parts[0]) as p0, \
                np.load((multi / rel).parent / parts[1]) as p1:
            n0, n1 = len(p0["row_starts"]) - 1, len(p1["row_starts"]) - 1
            assert n0 > 0 and n1 > 0 and abs(n0 - n1) <= 1, (rel, n0, n1)
    # Each analysis's own report and fit cache (no timings in them) match byte for byte.
    own = sorted(str(p.relative_to(single)) for pat in ("*/report-*", "*/fits-*.json")
                 for p in single.glob(pat))
    assert len(own) == 18, own
    for rel in own:
        assert (single / rel).read_bytes() == (multi / rel).read_bytes(), rel
    rep_a = _timeless(json.loads((single / "report.json").read_text()))
    rep_b = _timeless(json.loads((multi / "report.json").read_text()))
    assert set(rep_a["prompts"]["first"]) >= {"effect", "same_model", "swarm"}
    assert rep_a["topk_sensitivity"] and len(rep_a["pooled"]) == 1
    assert rep_a == rep_b
    md = lambda d: (d / "report.md").read_text().split("\n")
    assert [l for l in md(single) if "seconds" not in l and " s)" not in l] == \
        [l for l in md(multi) if "seconds" not in l and " s)" not in l]


def test_merging_shares_refuses_a_missing_or_short_share(tmp_path):
    from brf.eval import scoring
    rng = np.random.default_rng(0)
    segs = [rng.integers(0, 50, size=n).astype(np.int32) for n in (5, 7, 4)]

    def rows(ids):
        n = len(ids) - 1
        return {"topk_ids": np.zeros((n, 2), np.int32), "topk_logp": np.zeros((n, 2)),
                **{k: rng.standard_normal(n) for k in ("gold_logp", "entropy", "gap",
                                                       "log_norm")}}

    store = str(tmp_path / "scores-m.npz")
    parts = [scoring.part_path(store, i, 2) for i in range(2)]
    assert parts[1].endswith("scores-m.part1of2.npz")
    meta = {"member": "m"}
    all_rows = [rows(s) for s in segs]
    scoring.save_partial(parts[0], segs[:1], all_rows[:1],
                         dict(meta, share=(0, 1, 2), top_k=2, n_segments=1), 50)
    with pytest.raises(ValueError, match="part1of2.npz: 0 of 2 segments"):
        scoring.merge_parts(store, parts, segs, meta, top_k=2, vocab_size=50)
    scoring.save_partial(parts[1], segs[1:], all_rows[1:],
                         dict(meta, share=(1, 3, 2), top_k=2, n_segments=2), 50)
    merged = scoring.merge_parts(store, parts, segs, meta, top_k=2, vocab_size=50)
    want = scoring.assemble(segs, all_rows, 50)
    for k in scoring.ROW_FIELDS + ("token_ids", "row_starts"):
        np.testing.assert_array_equal(getattr(merged, k), getattr(want, k))
    # The merged store is what one process would have written: it is reused as such.
    again = scoring.load_partial(store, dict(meta, top_k=2, n_segments=3))
    assert len(again) == 3
