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


@pytest.mark.parametrize("mesh", ["data", "model", "mixed"])
def test_sharded_scoring_equals_one_device(mesh):
    assert "ok" in _run_check(f"scoring({mesh!r})")


def test_vocab_sharded_fusion_equals_one_device_without_gathering_the_vocabulary():
    assert "ok" in _run_check("fusion('mixed')")


def test_generation_with_model_sharded_members_equals_one_device():
    assert "ok" in _run_check("generation()")


def test_generation_with_prompts_over_data_equals_one_device():
    assert "ok" in _run_check("generation_data_parallel()")


def test_members_apart_on_their_own_devices_generate_as_one_device():
    assert "ok" in _run_check("generation_apart()")


def test_members_apart_are_scored_at_once_and_equal_one_device():
    assert "ok" in _run_check("scoring_apart()")


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


def test_two_processes_score_halves_and_the_merged_report_equals_one_process(tmp_path):
    """Two processes joined by jax.distributed over loopback score halves of the
    corpus; process 0 merges the stores and reports. Store and report equal
    those of one process."""
    worker = str(TESTS / "multihost_worker.py")
    env = _env(devices=1)

    def launch(out, *args):
        return subprocess.Popen([sys.executable, worker, str(tmp_path), out, *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=TESTS.parent)

    def finish(p):
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-6000:]
        return out

    finish(launch("single"))
    port = _free_port()
    procs = [launch("multi", f"127.0.0.1:{port}", "2", str(i)) for i in range(2)]
    outs = [finish(p) for p in procs]
    assert "report written" in outs[0] and "share scored" in outs[1], outs
    single, multi = tmp_path / "single", tmp_path / "multi"
    # Each process wrote its share; process 0 merged them into the usual store.
    for name in ("tiny-a", "tiny-b"):
        parts = sorted(p.name for p in multi.glob(f"scores-{name}.part*of2.npz"))
        assert parts == [f"scores-{name}.part0of2.npz", f"scores-{name}.part1of2.npz"]
        with np.load(single / f"scores-{name}.npz") as a, \
                np.load(multi / f"scores-{name}.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for k in a.files:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name} {k}")
        with np.load(multi / f"scores-{name}.part0of2.npz") as p0, \
                np.load(multi / f"scores-{name}.part1of2.npz") as p1:
            n0, n1 = len(p0["row_starts"]) - 1, len(p1["row_starts"]) - 1
            assert n0 > 0 and n1 > 0 and abs(n0 - n1) <= 1
    rep_a = json.loads((single / "report.json").read_text())
    rep_b = json.loads((multi / "report.json").read_text())
    for rep in (rep_a, rep_b):
        rep.pop("seconds")
        rep["config"].pop("out_dir")
        rep["config"].pop("distributed")
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
