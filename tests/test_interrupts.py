"""Ctrl-C ends every main in one line, exit status 130, wherever it lands
(brf/interrupts.py); a closed stdout ends it quietly, exit status 141 (brf/cli.py).

Each case starts a program as a terminal would and sends SIGINT where it used to go
wrong: inside a gc callback (the interrupt was swallowed and the program went on),
while XLA runs a program (the interpreter's exit then waited for it), and at
several points of a real main, its imports included.
"""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("BRF_VERBOSE", None)
    return env


class _Run:
    """A program started with SIGINT at its default (as from a terminal), stdout
    read line by line, stderr collected as it comes."""

    def __init__(self, args, stdin=None):
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=_env(), stdin=stdin,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.err = []
        self.reader = threading.Thread(
            target=lambda: self.err.extend(iter(lambda: self.proc.stderr.read(1), "")),
            daemon=True)
        self.reader.start()

    def wait_for_line(self, needle: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            assert line, ("no more output", "".join(self.err)[-3000:])
            if needle in line:
                return
        raise AssertionError(f"no line with {needle!r}")

    def interrupt(self, prog: str, within: float = 60) -> list[str]:
        """SIGINT; the program must end within ``within`` seconds with exit status 130
        and one line naming it, no traceback. Returns stderr's lines."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running {within} s after SIGINT: "
                                 + "".join(self.err)[-3000:]) from None
        self.reader.join(timeout=30)
        err = "".join(self.err)
        lines = [ln.rsplit("\r", 1)[-1] for ln in err.splitlines()]
        lines = [ln for ln in lines if ln.strip()]
        assert self.proc.returncode == 130, (self.proc.returncode, err[-3000:])
        for bad in ("Traceback", "KeyboardInterrupt", "Exception ignored", "Fatal Python"):
            assert bad not in err, err[-3000:]
        assert lines and lines[-1] == f"{prog}: interrupted", err[-3000:]
        assert sum("interrupted" in ln for ln in lines) == 1, err[-3000:]
        return lines


GC_CALLBACK = textwrap.dedent("""
    import gc, time
    from brf import cli

    def slow_callback(phase, info):  # where most of the time goes, as JAX's can
        t = time.monotonic()
        while time.monotonic() - t < 0.02:
            pass

    def main(argv):
        gc.callbacks.append(slow_callback)
        print("working", flush=True)
        t = time.monotonic()
        while time.monotonic() - t < 60:
            gc.collect()
        print("went on to the end")

    cli.run(main)
""")

XLA_RUNNING = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax import lax
    from brf import cli

    def main(argv):
        spin = jax.jit(lambda x: lax.while_loop(
            lambda c: c[0] < 2**31 - 1, lambda c: (c[0] + 1, jnp.sin(c[1]) + 1.0), (0, x))[1])
        y = spin(jnp.ones(1000))  # hours of work, on XLA's threads
        print("working", flush=True)
        y.block_until_ready()

    cli.run(main)
""")


@pytest.mark.parametrize("where", ["gc callback", "XLA running"])
def test_an_interrupt_ends_the_program_wherever_it_lands(where):
    """In a gc callback Python swallows the KeyboardInterrupt (the program went on to
    exit 0); while XLA runs, the exit waited for the computation (hours). Both end
    now, in one line, within seconds."""
    run = _Run(["-c", GC_CALLBACK if where == "gc callback" else XLA_RUNNING])
    run.wait_for_line("working")
    time.sleep(0.5)
    run.interrupt("-c", within=30)


def test_a_main_interrupted_at_several_points():
    """generate.py (tiny members, streaming) interrupted while Python starts and
    imports, while it loads and compiles, and while it streams tokens."""
    args = ["experiments/generate.py", "--config=configs/generate.py:tiny",
            "--config.max_new_tokens=2000", "--config.stream=True"]
    for delay in (0.3, 2.5):
        run = _Run(args)
        time.sleep(delay)
        run.interrupt("generate.py")
    run = _Run(args)
    run.wait_for_line("[0]")
    run.interrupt("generate.py")


def _closed_after_first_line(args, stdin=None):
    """Runs ``args``, reads one line of its stdout and closes the pipe; returns
    (exit status, stderr)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first, proc.stderr.read()[-3000:]
    proc.stdout.close()
    if proc.stdin:
        proc.stdin.close()  # the program goes on only now, its reader gone
    err = proc.stderr.read()
    return proc.wait(timeout=300), err


WRITER = textwrap.dedent("""
    import sys
    from brf import cli

    def main(argv):
        print("first", flush=True)
        sys.stdin.read()  # until the test has closed stdout
        for i in range(int(argv[1])):
            print("x" * 100)

    cli.run(main)
""")


@pytest.mark.parametrize("lines", [100000, 10])
def test_a_closed_stdout_ends_quietly(lines):
    """Printing on (100000 lines) or only what is buffered at the end (10 lines):
    exit status 141, nothing on stderr (it was BrokenPipeError, exit 1)."""
    status, err = _closed_after_first_line(["-c", WRITER, str(lines)], stdin=subprocess.PIPE)
    assert status == 141 and err == "", (status, err[-3000:])


def test_a_broken_pipe_of_the_programs_own_is_a_bug():
    """Writing to a pipe of its own whose reader has gone is not a closed stdout."""
    code = textwrap.dedent("""
        import subprocess
        from brf import cli

        def main(argv):
            p = subprocess.Popen(["true"], stdin=subprocess.PIPE)
            p.wait()
            p.stdin.write(b"x" * 1000000)
            p.stdin.flush()

        cli.run(main)
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "BrokenPipeError" in res.stderr, res.stderr[-3000:]


def test_a_main_piped_to_head_ends_quietly():
    """README's `... | head -1` on a streaming generation."""
    status, err = _closed_after_first_line(
        ["experiments/generate.py", "--config=configs/generate.py:tiny",
         "--config.max_new_tokens=2000", "--config.stream=True"])
    assert status == 141, (status, err[-3000:])
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
