"""Every main ends a user's mistake in one stderr line naming it, exit status 2.

Each case runs the real program in a subprocess (as a user would) and stops
before any model is scored, so the whole file takes about a minute.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args, tmp_path, timeout=180):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("BRF_VERBOSE", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (d / "notjson").mkdir()
    (d / "notjson" / "config.json").write_text("{not json")
    (d / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 2000)
    return d


V = ["experiments/validate.py", "--config=configs/validate.py:short"]
G = ["experiments/generate.py", "--config=configs/generate.py:tiny"]
CASES = [
    # validate: methods, phase maps, members, values, files, flags
    (V + ["--config.methods=linear, nope(x=1)"], "unknown fusion method 'nope'"),
    (V + ["--config.methods=loglinear(temprature=fit(1.0))"], "temprature"),
    (V + ["--config.methods=loglinear(temperature=fit(1.0)"], "missing ')'"),
    (V + ["--config.phase_maps=tanh(rate=0.5), spiral"], "unknown phase map 'spiral'"),
    (V + ["--config.phase_maps=tanh(rat=0.5)"], "rat"),
    (V + ["--config.members=smollm2-135m-instruct, no-such-model"], "no-such-model"),
    (V + ["--config.members=smollm2-135m-instruct(prefx='a'), gemma3-270m"], "prefx"),
    (V + ["--config.scoring.calibration_fraction=1.5"], "must lie in (0, 1)"),
    (V + ["--config.scoring.calibration_fraction=abc"], "calibration_fraction"),
    (V + ["--config.no_such_field=1"], "no_such_field"),
    (V + ["--config.bytes.beam=0"], "config.bytes.beam must be an integer >= 1; got 0"),
    (V + ["--config.bytes.threshold=1.0", "--config.bytes.enabled=True"],
     "config.bytes.threshold must lie in [0, 1); got 1.0"),
    (V + ["--config.corpora={d}/missing.txt"], "missing.txt': neither a registered corpus"),
    (V + ["--config.corpora={d}/latin1.txt"], "not valid UTF-8"),
    (["experiments/validate.py", "--config=configs/validate.py:bogus"], "bogus"),
    # generate: model, method, phase map, sampler, weighting, member fields
    (G + ["--config.members=no-such-model, random:smollm2-135m-instruct:1"], "no-such-model"),
    (G + ["--config.method=nope"], "unknown fusion method 'nope'"),
    (G + ["--config.method=loglinear(temprature=0.8)"], "temprature"),
    (G + ["--config.phase=spiral(rate=1)"], "unknown phase map 'spiral'"),
    (G + ["--config.sampler=temprature=0.8"], "temprature"),
    (G + ["--config.weighting=perplexity(temperature=-1)"], "temperature must be > 0"),
    (G + ["--config.members=random:smollm2-135m-instruct:0(colour=1)"], "colour"),
    (G + ["--config.max_new_tokens=0"], "max_new_tokens"),
    (G + ["--config.method=born(phase=\"tanh(rate=1)\")"],
     "'phase' is given twice: in config.method 'born(phase=\"tanh(rate=1)\")' and in "
     "config.phase (set config.phase='' to use the method's)"),
    (G + ["--config.prompts_file={d}/missing.txt"], "missing.txt"),
    # convert: bad files and names
    (["experiments/convert.py", "--source={d}/junk.gguf", "--out={d}/o1"], "junk.gguf"),
    (["experiments/convert.py", "--source={d}/hf", "--out={d}/o2"], "config.json"),
    (["experiments/convert.py", "--source={d}/notjson", "--out={d}/o3"], "not valid JSON"),
    (["experiments/convert.py", "--source=no-such-model", "--out={d}/o4"], "no-such-model"),
    # outputs that cannot be written: refused before any model loads or analysis runs
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output={d}/latin1.txt/x.csv", "--config.compilation_cache=False"],
     "config.output='{d}/latin1.txt/x.csv' cannot be written: {d}/latin1.txt is a file"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output=", "--config.compilation_cache=False"], "config.output is empty"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output={d}/seg.csv", "--config.segment_tokens=1",
      "--config.compilation_cache=False"], "segment_tokens=1 must be at least 2"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output={d}", "--config.compilation_cache=False"], "is a directory, not a file"),
    (["experiments/analyze_csv.py", "--config=configs/analyze_csv.py:tiny",
      "--config.csvs={d}/a.csv,{d}/b.csv", "--config.out_dir={d}/latin1.txt"],
     "config.out_dir='{d}/latin1.txt' cannot be written: {d}/latin1.txt is a file, not a "
     "directory"),
    (G + ["--config.output={d}/latin1.txt/g.jsonl"], "config.output='{d}/latin1.txt/g.jsonl'"),
    (V + ["--config.out_dir={d}/latin1.txt/run"], "config.out_dir='{d}/latin1.txt/run'"),
    (["experiments/convert.py", "--source={d}/junk.gguf", "--out={d}/latin1.txt/ck"],
     "the folder of --out='{d}/latin1.txt' cannot be written"),
    # benchmarks and the demo
    (["experiments/bench_fusion.py", "--methods=nope"], "nope"),
    (["experiments/demo.py", "--config=configs/demo.py", "--config.weights=abc"], "weights"),
]


@pytest.mark.parametrize("args,needle", CASES, ids=[" ".join(a[1:])[:60] for a, _ in CASES])
def test_user_error_is_one_line_and_exit_2(args, needle, bad_files, tmp_path):
    args = [a.format(d=bad_files) for a in args]
    needle = needle.format(d=bad_files)
    res = _run(args, tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert needle in lines[0], lines[0]
    prog = os.path.basename(args[0])
    assert lines[0].startswith(f"{prog}: error: ") or lines[0].startswith("FATAL Flags"), lines[0]


def test_a_bug_keeps_its_traceback(tmp_path):
    """A non-user exception is not swallowed into one line."""
    code = ("from brf import cli\n"
            "def main(argv):\n    raise RuntimeError('a bug')\n"
            "cli.run(main)\n")
    res = _run(["-c", code], tmp_path)
    assert res.returncode == 1 and "Traceback" in res.stderr and "a bug" in res.stderr


def test_library_info_chatter_stays_quiet(tmp_path):
    """A successful main prints no absl/orbax INFO lines unless BRF_VERBOSE is set."""
    res = _run(["experiments/demo.py", "--config=configs/demo.py"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not [ln for ln in res.stderr.splitlines() if ln.startswith("I")], res.stderr
