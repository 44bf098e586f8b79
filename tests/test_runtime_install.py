"""The runtime install alone (``bash install.sh``, no test extras) runs every documented main.

The rest of the suite runs where ``install.sh --test`` also installed the test
extras (torch, pytest, nbclient, ...), and they pull in more than they name: a
runtime dependency that only an extra brought (jinja2, for the chat templates:
issue 37) passes every other test and fails for a user. This file builds a fresh
virtual environment, runs README's runtime install in it, checks that no test
extra is there, and runs each main README.md and docs/ document on tiny settings
with that environment's python: the study (``:short``, shrunk), generation on
tokens and on bytes, a logit dump with and without a system prompt, their CSV
analysis, and the demo (tests/test_docs.py parses every command the pages show). Converted checkpoints and compiled programs are shared with the
rest of the suite through ``$BRF_CACHE`` and the JAX compilation cache.

It takes minutes, half of them the install (a fresh environment of jax, scipy,
transformers, ...): 4:17 on one worker of the 2-core VM under load, 2:10 the
install (issue 37).
"""

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The test extras (setup.cfg's [test]) and what only they bring: none may be
# importable in the runtime environment, or the mains would be tested with them.
TEST_ONLY = ("pytest", "xdist", "hypothesis", "torch", "astropy", "sentencepiece",
             "nbformat", "nbclient", "ipykernel")


def _env(venv: pathlib.Path) -> dict:
    """The environment of a shell where ``venv`` is activated (as README's commands
    are run), with this run's caches."""
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "JAX_PLATFORMS": "cpu",
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in ("PYTHONPATH", "PYTHONHOME", "BRF_VERBOSE"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """A fresh virtual environment with README's runtime install: (python, env)."""
    venv = tmp_path_factory.mktemp("runtime") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _env(venv)
    try:
        # PIP_NO_COMPILE: pip byte-compiles nothing up front (every installed module,
        # most never imported here); Python compiles what the mains import as they run.
        res = subprocess.run(["bash", "install.sh"], cwd=ROOT, env={**env, "PIP_NO_COMPILE": "1"},
                             capture_output=True, text=True, timeout=1200)
        assert res.returncode == 0, res.stderr[-4000:]
        yield str(venv / "bin" / "python"), env
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 1.4 GB; pytest keeps its last 3 tmp dirs


def _main(runtime, *args, timeout=600) -> subprocess.CompletedProcess:
    """Runs a main with the runtime environment's python; it must end with status 0."""
    python, env = runtime
    res = subprocess.run([python, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, (" ".join(args), res.stderr[-4000:])
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    # transformers' advice at import (no PyTorch here) is library chatter (brf.cli).
    assert "PyTorch was not found" not in res.stderr, res.stderr[-4000:]
    return res


MAINS = ("validate", "generate", "dump_logits", "analyze_csv", "demo", "convert")
# What only an optional extra brings (setup.cfg's [harness]: lm-eval): brf imports it only
# when asked (brf.harness.lm), so the runtime environment need not have it.
EXTRAS_ONLY = ("lm_eval",)


def _imported_packages() -> set[str]:
    """Every package brf's code and its documented mains and configs import, at any
    depth (imports inside functions too), but the standard library."""
    files = [*(ROOT / "brf").rglob("*.py"), *(ROOT / "configs").glob("*.py"),
             *(ROOT / "experiments" / f"{m}.py" for m in MAINS)]
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - set(EXTRAS_ONLY)


def test_runtime_environment_has_brf_and_no_test_extra(runtime):
    """brf is installed (editable, from this checkout), every package its code imports
    is there, and no test extra is."""
    python, env = runtime
    needed = sorted(_imported_packages())
    assert {"brf", "jax", "transformers"} <= set(needed), needed
    code = ("import importlib.util, brf\n"
            "print(brf.__file__)\n"
            f"print(','.join(m for m in {needed!r} if not importlib.util.find_spec(m)))\n"
            f"print(','.join(m for m in {TEST_ONLY!r} if importlib.util.find_spec(m)))\n")
    res = subprocess.run([python, "-c", code], cwd="/", env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    where, missing, extras = res.stdout.split("\n")[:3]
    assert pathlib.Path(where).resolve().parent == ROOT / "brf", where
    assert missing == "", f"imported by brf, not in the runtime environment: {missing}"
    assert extras == "", f"test-only packages in the runtime environment: {extras}"


def test_demo(runtime):
    res = _main(runtime, "experiments/demo.py", "--config=configs/demo.py")
    assert "born, phase diff pi" in res.stdout, res.stdout


def test_validate_short(runtime, tmp_path):
    """The CI slice of the study on the real pair, shrunk to one short text."""
    out = tmp_path / "validate"
    _main(runtime, "experiments/validate.py", "--config=configs/validate.py:short",
          "--config.corpora=hamlet(max_chars=2500)", "--config.scoring.segment_chars=1300",
          "--config.methods=linear", "--config.phase_maps=tanh", "--config.controls=False",
          "--config.topk_sensitivity=0", "--config.bottleneck.positions=0",
          "--config.stats.n_boot=50", "--config.stats.n_perm=50", f"--config.out_dir={out}")
    report = json.loads((out / "report.json").read_text())
    assert list(report["per_corpus"]) == ["hamlet"]
    assert (out / "report.md").stat().st_size > 0


@pytest.mark.parametrize("level", ["tokens", "bytes"])
def test_generate(runtime, tmp_path, level):
    """Generation on tokens and on bytes, tiny members with SmolLM2's tokenizer and
    its chat template (the jinja2 import), decoded speculatively (README's command)."""
    out = tmp_path / "gen.jsonl"
    arg = "tiny" if level == "tokens" else "tiny,bytes"
    drafter = "ngram(n=3, k=6)" if level == "tokens" else "member(k=4)"
    _main(runtime, "experiments/generate.py", f"--config=configs/generate.py:{arg}",
          "--config.max_new_tokens=4", "--config.max_new_bytes=8", f"--config.output={out}",
          f"--config.speculative={drafter}")
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["finish_reason"] for r in rows), rows
    assert all((r.get("level") == "bytes") == (level == "bytes") for r in rows), rows
    assert all(r["speculative"]["drafter"] == drafter and r["speculative"]["rounds"] >= 1
               for r in rows), rows


def test_dump_logits_and_analyze_csv(runtime, tmp_path):
    """README's logit-CSV commands, shortened: SmolLM2 with and without a system
    prompt, then the analysis of the two CSVs."""
    csvs = []
    for name, extra in (("plain", []), ("pirate", ["--config.system=You are a pirate."])):
        csvs.append(tmp_path / f"{name}.csv")
        _main(runtime, "experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
              "--config.max_positions=64", f"--config.output={csvs[-1]}", *extra)
    lines = csvs[1].read_text().splitlines()
    assert lines[0] == "# brf-logit-csv 1"
    assert json.loads(lines[1][2:])["system"] == "You are a pirate."
    assert len([ln for ln in lines if not ln.startswith("#")]) == 1 + 64  # header + rows
    out = tmp_path / "analysis"
    _main(runtime, "experiments/analyze_csv.py", "--config=configs/analyze_csv.py:tiny",
          f"--config.csvs={csvs[0]},{csvs[1]}", f"--config.out_dir={out}")
    assert json.loads((out / "analysis.json").read_text())["positions"] == 64
    for name in ("analysis.md", "phase_differences.png", "fusion_nll.png"):
        assert (out / name).stat().st_size > 0, name
