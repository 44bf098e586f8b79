"""Ctrl-C in brf's mains: one line on stderr and exit status 130, every time.

Python turns SIGINT into ``KeyboardInterrupt`` at the next bytecode the main
thread runs. In a JAX program that goes wrong three ways (each seen with
``experiments/generate.py``):

- **swallowed**: when that bytecode belongs to a gc callback (JAX registers
  ``_xla_gc_callback``, which runs at every collection), a finalizer or a
  weakref callback, the exception has nowhere to go: Python prints ``Exception
  ignored in ...`` and carries on, and the run went on to exit 0;
- **late**: while the main thread is inside one long C++ call (XLA compiling
  or running a program, a checkpoint being read) no bytecode runs, so nothing
  happens until the call returns;
- **at exit**: unwinding ends in the interpreter's finalisation, which waits
  for the threads still compiling and tears down modules under XLA's own
  threads (a run ended in a segmentation fault).

So, in a process :func:`install` has set up:

- a SIGINT handler raises ``KeyboardInterrupt`` once, so that ``with`` blocks,
  atomic writes and progress bars unwind as usual; before the main has started
  (imports, flag parsing: nothing to clean up) it ends the process at once;
- ``sys.unraisablehook`` notices a ``KeyboardInterrupt`` that was swallowed and
  delivers it again at the next bytecode (``_thread.interrupt_main``);
- a watcher thread is woken by the signal itself (``signal.set_wakeup_fd``: the
  C-level handler writes to it even while the main thread is in C++): a second
  Ctrl-C, or the process still running :data:`GRACE` seconds after the first,
  ends it at once;
- every end is :func:`exit_interrupted`: the one line, the standard streams
  flushed, ``os._exit(130)`` (no finalisation to hang or crash in).

brf's own mains (``experiments/*.py``) are set up when they first import
``brf`` (:func:`install_for_main`), before JAX loads; ``brf.cli.run`` sets up
any other program that calls it.
"""

from __future__ import annotations

import _thread
import gc
import os
import signal
import sys
import threading
import time

STATUS = 130  # 128 + SIGINT, what a shell reports for a program SIGINT ended
GRACE = 5.0  # seconds the unwinding gets before the watcher ends the process

_lock = threading.Lock()
_state = dict(installed=False, phase="start", prog=None, raised=False, redeliveries=0,
              announced=False, previous_hook=None, stderr=None)


def _prog() -> str:
    return _state["prog"] or os.path.basename(sys.argv[0] or "brf")


def _mute() -> None:
    """From now on, stderr (file descriptor 2) goes nowhere; the line that ends the
    program goes to where it went. While the main thread unwinds, other threads
    (orbax's readers, XLA's) meet what it closed and print tracebacks of no use to
    someone who pressed Ctrl-C."""
    with _lock:
        if _state["stderr"] is not None:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
        try:
            _state["stderr"] = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)
        except OSError:
            pass


def exit_interrupted() -> None:
    """Prints ``<program>: interrupted`` on stderr (once) and ends the process
    with status 130, without finalising the interpreter."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # what the program printed comes before the line
        except (OSError, ValueError, AttributeError):
            pass
    with _lock:
        if not _state["announced"]:
            _state["announced"] = True
            fd = 2 if _state["stderr"] is None else _state["stderr"]
            try:
                # On a new line: Ctrl-C often lands in the middle of a progress bar.
                os.write(fd, f"\n{_prog()}: interrupted\n".encode(errors="replace"))
            except OSError:
                pass
    os._exit(STATUS)


def _swallows(frame) -> bool:
    """Whether an exception raised in ``frame`` would be swallowed: it runs inside
    a gc callback (JAX's ``_xla_gc_callback`` among them) or a finalizer."""
    codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    for _ in range(64):
        if frame is None:
            return False
        if frame.f_code in codes or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum, frame):
    if _state["phase"] != "main":
        exit_interrupted()  # imports, flags or the end: nothing to unwind
    if _swallows(frame):
        _request_redelivery()  # raised in a moment, outside the callback
        return
    with _lock:
        if _state["raised"]:
            return  # raised already and unwinding: a second Ctrl-C is the watcher's
        _state["raised"] = True
    _mute()
    raise KeyboardInterrupt


# Held while no redelivery is asked for; releasing it wakes the redelivering thread.
_asked = _thread.allocate_lock()
_asked.acquire()


def _request_redelivery() -> None:
    try:
        _asked.release()  # never blocks: safe inside a handler or a hook
    except RuntimeError:
        pass  # asked already


def _redeliver() -> None:
    while True:
        _asked.acquire()
        time.sleep(0.002)  # let the callback that swallowed it return
        with _lock:
            _state["raised"] = False
            _state["redeliveries"] += 1
        _thread.interrupt_main(signal.SIGINT)  # the handler runs at the next bytecode


def _unraisable(info) -> None:
    if issubclass(info.exc_type, KeyboardInterrupt) and _state["phase"] == "main":
        _request_redelivery()  # swallowed where it was raised (a weakref callback...)
        return
    (_state["previous_hook"] or sys.__unraisablehook__)(info)


def _watch(fd: int) -> None:
    signals = 0
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        for byte in data:
            if byte != signal.SIGINT:
                continue
            with _lock:
                if _state["redeliveries"] > 0:  # our own redelivery, not the user's
                    _state["redeliveries"] -= 1
                    continue
            signals += 1
            if signals >= 2:
                exit_interrupted()
            _mute()
            threading.Thread(target=_deadline, daemon=True).start()


def _deadline() -> None:
    time.sleep(GRACE)
    exit_interrupted()


def install(prog: str | None = None) -> bool:
    """Sets this process up as the module docstring says (once; later calls only
    update the program's name). Returns False where it is not: not the main
    thread, or SIGINT ignored (as Python itself leaves it then)."""
    if prog:
        _state["prog"] = prog
    if _state["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return False  # started with SIGINT ignored (a shell's background job): so it stays
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGINT, _on_sigint)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _state["previous_hook"] = sys.unraisablehook
    sys.unraisablehook = _unraisable
    threading.Thread(target=_watch, args=(read,), name="brf-interrupts", daemon=True).start()
    threading.Thread(target=_redeliver, name="brf-redeliver", daemon=True).start()
    _state["installed"] = True
    return True


def install_for_main() -> None:
    """:func:`install`, when the program being run is one of brf's mains
    (``experiments/*.py`` beside this package): called as ``brf`` is first
    imported, before JAX loads, so an interrupt during the imports counts too.
    Any other program (a notebook, a test, a user's script) is left alone."""
    main = sys.argv[0] if sys.argv else ""
    if not main.endswith(".py"):
        return
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if os.path.dirname(os.path.realpath(main)) == os.path.join(here, "experiments"):
        install()


def set_phase(phase: str) -> None:
    """'start' (before the main: an interrupt ends the process at once), 'main'
    (it raises KeyboardInterrupt to unwind) or 'end' (at once again)."""
    _state["phase"] = phase


__all__ = ["GRACE", "STATUS", "exit_interrupted", "install", "install_for_main", "set_phase"]
