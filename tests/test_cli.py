"""Every main ends a user's mistake in one stderr line naming it, exit status 2.

Each case runs the real program's main through brf.cli.run, as a user's command
line would, and stops before any model is scored.
"""

import json
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
    (d / "blank.txt").write_text("\n  \n")
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
    # generate: speculative decoding (issue 40): drafter, mode, vocabularies
    (G + ["--config.speculative=member(k=0)"], "k must be an integer >= 1; got 0"),
    (G + ["--config.speculative=lookup(k=3)"], "unknown speculative drafter 'lookup'"),
    (G + ["--config.speculative=ngram(n=2, k=4)", "--config.mode=mixture_exact",
          "--config.method=linear", "--config.sampler="], "mode 'fuse'"),
    (G + ["--config.speculative=member(k=2)",
          "--config.members=random:smollm2-135m-instruct:0, random:gemma3-270m:1"],
     "must share one vocabulary"),
    # generate: where the steps run
    (G + ["--config.engine=gpu"], "config.engine must be one of"),
    (G + ["--config.level=bytes", "--config.engine=device"],
     "config.engine='device' is token-level only"),
    (G + ["--config.engine=device", "--config.mode=mixture_exact", "--config.method=linear",
          "--config.sampler=", "--config.aligner=union",
          "--config.members=random:smollm2-135m-instruct:0, random:gemma3-270m:1"],
     "engine='device' runs mode 'fuse', or a mixture mode in a shared vocabulary"),
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
    # issue 37: argv bytes that are not UTF-8, an empty prompts file, a key given
    # twice, a fusion method in the mixture modes
    (G + ["--config.prompts=Tell me about caf\udcc3"],
     "config.prompts: prompt 1 is not valid UTF-8 text (at character 17): "
     "b'Tell me about caf\\xc3'"),
    (G + ["--config.prompts_file={d}/blank.txt"], "prompts_file {d}/blank.txt holds no prompts"),
    (G + ['--config.method=born(phase="tanh", phase="linear")'], "'phase' is given twice"),
    (G + ["--config.members=random:smollm2-135m-instruct:0(weight=0.5, weight=1.0)"],
     "'weight' is given twice"),
    (["experiments/generate.py", "--config=configs/generate.py:tiny,me",
      "--config.method=loglinear(temperature=0.3)"],
     "config.method='loglinear(temperature=0.3)' is not used in mode 'mixture_exact'"),
    (["experiments/generate.py", "--config=configs/generate.py:tiny,bytes,me",
      "--config.method=loglinear(temperature=0.3)"],
     "config.method='loglinear(temperature=0.3)' is not used in mode 'mixture_exact'"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny,generate",
      "--config.output={d}/gen.csv", "--config.prompts_file={d}/blank.txt",
      "--config.compilation_cache=False"], "prompts_file {d}/blank.txt holds no prompts"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny,generate",
      "--config.output={d}/gen.csv", "--config.prompts=caf\udcc3",
      "--config.compilation_cache=False"], "config.prompts, line 1 is not valid UTF-8"),
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
      "--config.compilation_cache=False"], "config.segment_tokens must be an integer >= 2; got 1"),
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
    (["experiments/compare_fits.py", "--old={d}", "--new={d}"],
     "no per-analysis reports (*/report-*.json) under '{d}'"),
    # benchmarks and the demo
    (["experiments/bench_fusion.py", "--methods=nope"], "nope"),
    (["experiments/bench_fit_repeat.py", "--table=tiny_study", "--keep=0"],
     "the fitter's stages: positions >= 0, keep, polish and screen_iter >= 1"),
    (["experiments/bench_fit_repeat.py", "--starts=-1"],
     "--starts: each at least 0 (0: the structured starts alone)"),
    (["experiments/demo.py", "--config=configs/demo.py", "--config.weights=abc"], "weights"),
    # issue 54: tracebacks, hangs and wrong results, now one line naming the key
    (G + ["--config.seed=1180591620717411303424"], "config.seed must be an integer <= "
                                                   "4294967295"),
    (G + ["--config.dtype=int8"], "config.dtype must be one of 'float32', 'bfloat16', "
                                  "'float16'; got 'int8'"),
    (G + ["--config.aligner=topk_union", "--config.aligner_params.k=0"],
     "config.aligner_params.k must be an integer >= 1; got 0"),
    (G + ["--config.stop=123"], "config.stop: item 1 must be a string; got 123"),
    (G + ["--config.members=random:smollm2-135m-instruct:0(template='{{bogus}} {{prompt}}'), "
          "random:smollm2-135m-instruct:1"], "names unknown field(s) {{bogus}}"),
    (G + ["--config.members=random:smollm2-135m-instruct:0(template='Say hi.'), "
          "random:smollm2-135m-instruct:1"], "has no {{prompt}} field"),
    (G + ['--config.prompts=("", "hi")'], "config.prompts: prompt 1 is empty"),
    (G + ["--config.speculative=ngram(n=2, k=9**9**9)"], "'9**9**9' is too large a number"),
    (G + ["--config.speculative=ngram(n=2, cost=1)"], "cost must be a number in [0, 1)"),
    (G + ["--config.method=loglinear(temperature=1e999)"], "'1e999' is not a finite number"),
    (G + ["--config.weighting=perplexity(temperature=1e999)"], "'1e999' is not a finite"),
    (G + ["--config.members=random:smollm2-135m-instruct:0"],
     "config.phase='tanh(rate=0.5, offset=[0, 0.5])' gives 2 phase offsets (one per member) "
     "but config.members names 1 member"),
    (V + ["--config.nll_baselines=nope"], "config.nll_baselines: unknown fusion method 'nope'"),
    (V + ["--config.bottleneck.top_k=-1"], "config.bottleneck.top_k must be an integer >= 0"),
    (V + ["--config.stats.seed=-1"], "config.stats.seed must be an integer >= 0"),
    (V + ["--config.scoring.chunk=0"], "config.scoring.chunk must be an integer >= 1; got 0"),
    (V + ["--config.phase_maps="], "config.phase_maps='': names no phase map"),
    (V + ["--config.methods="], "config.methods='' holds none of config.nll_baselines"),
    (V + ["--config.stats.n_boot=100000000"], "config.stats.n_boot must be an integer <= "
                                              "100000; got 100000000"),
    (V + ["--config.members=smollm2-135m-instruct, smollm2-135m-instruct"],
     "config.members lists 'smollm2-135m-instruct' twice"),
    (V + ["--config.corpora=hamlet(prefix=123)"], "prefix must be a string (quoted); got 123"),
    (V + ["--config.corpora=hamlet(max_chars=-5)"], "max_chars must be an integer >= 0"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output={d}/c.csv", "--config.chunk=0"], "config.chunk must be an integer >= 1"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output={d}/c.csv", "--config.max_positions=-1"],
     "config.max_positions must be an integer >= 0 (0: all); got -1"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output={d}/c.csv", "--config.k=100000"], "config.k must be an integer <= 1024"),
    # issue 71: '-' was written as a file named '-' (generate.py prints to stdout)
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny",
      "--config.output=-"], "config.output='-' would be a file named '-'"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny,generate",
      "--config.output={d}/c.csv", "--config.seed=1180591620717411303424"],
     "config.seed must be an integer <= 4294967295"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:tiny,generate",
      "--config.output={d}/c.csv", "--config.template={{bogus}} {{prompt}}"],
     "names unknown field(s) {{bogus}}"),
    (["experiments/analyze_csv.py", "--config=configs/analyze_csv.py:tiny",
      "--config.csvs={d}/a.csv,{d}/b.csv", "--config.n_perm=0"],
     "config.n_perm must be an integer >= 1; got 0"),
    (["experiments/analyze_csv.py", "--config=configs/analyze_csv.py:tiny",
      "--config.csvs={d}/a.csv,{d}/b.csv", "--config.n_boot=0"],
     "config.n_boot must be an integer >= 2; got 0"),
    (["experiments/analyze_csv.py", "--config=configs/analyze_csv.py:tiny",
      "--config.csvs={d}/a.csv,{d}/b.csv", "--config.fusion_methods=bottleneck_lsq"],
     "fusion method 'bottleneck_lsq' needs the members' unembeddings"),
    (["experiments/demo.py", "--config=configs/demo.py", '--config.tokens=("a", "b")'],
     "config.tokens: 2 labels for 6 logits per member"),
    # a config argument that get_config refuses: its reason, not a cut-off line
    (["experiments/generate.py", "--config=configs/generate.py:tiny,bigly"],
     "flag --config=configs/generate.py:tiny,bigly: unknown config argument(s) ['bigly']"),
    (["experiments/validate.py", "--config=configs/validate.py:bigly"],
     "unknown config arg 'bigly'; use '', 'full' or 'short'"),
    (["experiments/dump_logits.py", "--config=configs/dump_logits.py:bigly"],
     "unknown config argument(s) ['bigly']; use generate, tiny"),
    (["experiments/analyze_csv.py", "--config=configs/analyze_csv.py:bigly"],
     "unknown config arg 'bigly'; use '' or 'tiny'"),
    (["experiments/demo.py", "--config=configs/no_such_config.py"],
     "cannot load the config file: [Errno 2] No such file or directory"),
    # issue 71: with an override too, ml_collections' internals were printed
    (["experiments/demo.py", "--config=configs/no_such_config.py", "--config.seed=1"],
     "flag --config=configs/no_such_config.py: cannot load the config file: [Errno 2] No "
     "such file or directory"),
]


# The first case of each main runs in a process of its own, as a user would run it
# (so what the main prints while it starts counts too); the others of the same main
# run one after another in one process (tests/cli_cases.py: the same brf.cli.run,
# absl's flags reset in between), which spares forty starts of Python and JAX.
FIRST = {i for i, (a, _) in enumerate(CASES)
         if i == min(j for j, (b, _) in enumerate(CASES) if b[0] == a[0])}


@pytest.fixture(scope="module")
def batched(bad_files, tmp_path_factory) -> dict:
    """{case index: (status, stderr)} of every case not in FIRST, one process per main."""
    d = tmp_path_factory.mktemp("cases")
    by_main: dict[str, list[int]] = {}
    for i, (args, _) in enumerate(CASES):
        if i not in FIRST:
            by_main.setdefault(args[0], []).append(i)
    out = {}
    for main, idx in by_main.items():
        path = d / f"{len(out)}.json"
        path.write_text(json.dumps([[a.format(d=bad_files) for a in CASES[i][0]]
                                    for i in idx]))
        res = _run([str(ROOT / "tests" / "cli_cases.py"), main, str(path)], d, timeout=600)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("CASES ")]
        assert res.returncode == 0 and line, (main, res.stdout[-2000:], res.stderr[-3000:])
        for i, got in zip(idx, json.loads(line[-1][len("CASES "):])):
            out[i] = got["status"], got["stderr"]
    return out


@pytest.mark.parametrize("i", range(len(CASES)), ids=[" ".join(a[1:])[:60] for a, _ in CASES])
def test_user_error_is_one_line_and_exit_2(i, bad_files, batched, tmp_path):
    args = [a.format(d=bad_files) for a in CASES[i][0]]
    needle = CASES[i][1].format(d=bad_files)
    if i in FIRST:
        res = _run(args, tmp_path)
        status, stderr = res.returncode, res.stderr
    else:
        status, stderr = batched[i]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert status == 2, (status, stderr[-2000:])
    assert len(lines) == 1, stderr[-2000:]
    assert "Traceback" not in stderr
    assert needle in lines[0], lines[0]
    prog = os.path.basename(args[0])
    assert lines[0].startswith(f"{prog}: error: ") or lines[0].startswith("FATAL Flags"), lines[0]


def test_distributed_without_a_coordinator_is_one_line(tmp_path):
    """Issue 71: multi-host on with no coordinator and no cluster to detect one from
    ended in JAX's traceback (a case of its own: it needs a process whose JAX has not
    started, which the batched cases' process is not)."""
    res = _run(V + ["--config.distributed.enabled=True"], tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith("validate.py: error: config.distributed.enabled=True, but no "
                               "coordinator_address is given"), lines[0]


def test_mains_run_from_another_directory(tmp_path):
    """Issue 54: the default --config was a relative path, so every main run from
    outside the repository failed to load it (OSError, traceback)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "demo.py")],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "born, phase diff pi" in res.stdout


def test_generate_prints_each_prompts_assembled_text(tmp_path):
    """Issue 54: generate.py printed one token per line, interleaved across prompts, and
    never the text; it prints each prompt with its text now (streaming is an option,
    JSON rows go to --config.output, '-' for stdout)."""
    args = ["experiments/generate.py", "--config=configs/generate.py:tiny",
            "--config.max_new_tokens=3", '--config.prompts=("hi", "sea")',
            "--config.sampler=greedy"]
    shown = _run(args, tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = _run(args + ["--config.output=-"], tmp_path)
    assert rows.returncode == 0, rows.stderr[-2000:]
    rows = [json.loads(ln) for ln in rows.stdout.splitlines()]
    expected = "".join(f"{'' if b == 0 else chr(10)}[{b + 1}/2] prompt: {r['prompt']}\n"
                       f"{r['text']}\n[{r['finish_reason']}: {r['n_events']} tokens]\n"
                       for b, r in enumerate(rows))
    assert [r["prompt"] for r in rows] == ["hi", "sea"]
    assert shown.stdout == expected


def test_generate_runs_on_either_engine(tmp_path):
    """Greedy speculative generation gives the same rows with its rounds on the host
    and compiled on the device (config.engine, reported in each row)."""
    args = ["experiments/generate.py", "--config=configs/generate.py:tiny",
            "--config.max_new_tokens=6", "--config.sampler=greedy", "--config.output=-",
            "--config.speculative=member(index=1, k=3, cost=0)"]
    texts = {}
    for engine in ("host", "device"):
        res = _run(args + [f"--config.engine={engine}"], tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
        assert [r["speculative"]["engine"] for r in rows] == [engine] * 2
        texts[engine] = [(r["text"], r["n_events"], r["speculative"]["drafted"]) for r in rows]
    assert texts["host"] == texts["device"] and len(texts["host"]) == 2
    assert sum(d for _, _, d in texts["host"]) > 0  # it drafted


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



class _Started:
    """A main started as from a terminal, its stderr read as it comes (progress bars
    redraw with carriage returns, no newlines). SIGINT is at its default in the child,
    so Python turns it into KeyboardInterrupt wherever the test runs."""

    def __init__(self, args):
        import signal
        import threading
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("BRF_VERBOSE", None)
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.err = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for chunk in iter(lambda: self.proc.stderr.read(1), ""):
            self.err.append(chunk)

    def wait_for(self, needle, where="stdout", timeout=300):
        import time
        deadline = time.monotonic() + timeout
        if where == "stdout":
            assert self.proc.stdout.readline().strip() == needle
            return
        while needle not in "".join(self.err):
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                "".join(self.err)[-3000:]
            time.sleep(0.2)

    def interrupt(self, prog):
        """Sends SIGINT; checks one line naming the program, exit status 130, no
        traceback; returns stderr's lines (each as a terminal leaves it)."""
        import signal
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=120)
        self.reader.join(timeout=30)
        err = "".join(self.err)
        lines = [ln.rsplit("\r", 1)[-1] for ln in err.splitlines()]
        lines = [ln for ln in lines if ln.strip()]
        assert self.proc.returncode == 130, (self.proc.returncode, err[-3000:])
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
        assert lines[-1] == f"{prog}: interrupted", err[-3000:]
        assert sum("interrupted" in ln for ln in lines) == 1, err[-3000:]
        return lines


def test_an_interrupt_is_one_line_and_exit_130():
    """Ctrl-C (SIGINT) while a main works ends it with one line on stderr and exit
    status 130 (it ended in a KeyboardInterrupt traceback, issue 37)."""
    code = ("import time\nfrom brf import cli\n"
            "def main(argv):\n    print('working', flush=True)\n"
            "    while True:\n        time.sleep(0.01)\n"
            "cli.run(main)\n")
    run = _Started(["-c", code])
    run.wait_for("working")
    assert run.interrupt("-c") == ["-c: interrupted"]


def test_an_interrupt_while_scoring_is_one_line_and_exit_130(tmp_path):
    """The same for a real main in the middle of scoring (dump_logits over the whole
    default text, minutes of work), its progress bar left above the line."""
    run = _Started(["experiments/dump_logits.py", "--config=configs/dump_logits.py",
                    f"--config.output={tmp_path}/d.csv"])
    run.wait_for("pos/s]", where="stderr")
    lines = run.interrupt("dump_logits.py")
    assert any(ln.startswith("dumping ") for ln in lines[:-1]), lines


def test_help_piped_into_a_reader_that_has_gone_ends_141():
    """Issue 71: `--helpfull | head` exited 1 (absl's status after the usage, its
    EPIPE swallowed) where README promises 141. The usage into a pipe whose reader
    has gone ends quietly with 141; read whole, with 0."""
    import os
    import subprocess
    import sys
    main = [sys.executable, "experiments/compare_fits.py", "--helpfull"]
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(main, stdout=write, stderr=subprocess.PIPE, cwd=ROOT, timeout=300)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == b"", r.stderr
    r = subprocess.run(main, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "--tolerance" in r.stdout, r.stderr
