"""experiments/bench_gpu.py at toy sizes on the CPU: every part runs and reports
figures consistent with each other (CI runs the GPU benchmark's code path)."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_gpu", os.path.join(ROOT, "experiments", "bench_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_covers_every_part():
    bench = _bench()
    out = bench.run(["gemma-3-270m"], list(bench.PARTS),
                    ["llama-3.1-8b", "llama-3.2-1b"], True, bench.settings(True))
    json.dumps(out)  # one JSON
    assert out["tiny"] and out["bandwidth_bytes_per_s"] > 0
    score = out["models"]["gemma-3-270m"]["score"]
    assert score["tokens_per_s"] == pytest.approx(score["batch"] * score["length"]
                                                  / score["seconds"])
    for row in out["models"]["gemma-3-270m"]["decode"]:
        for key in ("host_loop_steps_per_s", "host_loop_bounded_reads_steps_per_s",
                    "device_loop_steps_per_s", "roofline_steps_per_s"):
            assert row[key] > 0
        assert row["device_loop_of_roofline"] == pytest.approx(
            row["device_loop_steps_per_s"] / row["roofline_steps_per_s"])
    run = out["pair"]["runs"][0]
    assert run["same_text"]  # both engines generate the same text
    assert run["host_s"] > 0 and run["device_s"] > 0
    for key in ("speculative", "speculative_member"):  # n-gram and member drafters
        spec = out["pair"][key]
        assert spec["host_same_text"] and spec["device_same_text"]  # greedy: plain's text
        assert spec["host_acceptance"] == spec["device_acceptance"]  # the same rounds
        assert spec["device_of_host"] == pytest.approx(spec["host_s"] / spec["device_s"])
    assert out["fuse"]["python"] > 0 and out["fuse"]["inside_jit"] > 0
    for row in out["models"]["gemma-3-270m"]["attention"]:
        assert row["prompt_max_abs_diff"] < 1e-4  # the library call computes the same
        assert row["decode_brf_s"] > 0 and row["decode_library_s"] > 0
