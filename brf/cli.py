"""What every experiment main shares: user errors as one line, quiet libraries.

Usage, at the bottom of a main::

    if __name__ == "__main__":
        cli.run(main)

``run`` is ``absl.app.run`` with these additions:

- a :class:`brf.errors.UserError` raised anywhere under ``main`` (an unknown
  model, method or phase map, a bad file, a bad value) ends the program with one
  line ``<program>: error: <message>`` on stderr and exit status 2, no
  traceback. Any other exception is a bug and keeps its traceback;
- absl and orbax INFO logging is turned off (set ``BRF_VERBOSE=1`` to keep it);
- a bad ``--config`` override or flag value (absl's flag parser refuses it)
  also ends in one line and exit status 2;
- an interrupt (Ctrl-C, SIGINT) ends the program with one line
  ``<program>: interrupted`` on stderr and exit status 130 (128 + SIGINT, as a
  shell reports a program killed by it), no traceback, wherever it lands
  (:mod:`brf.interrupts` says how);
- a closed standard output (``main | head -1``) ends the program quietly, at
  once, with exit status 141 (128 + SIGPIPE), as a Unix tool killed by SIGPIPE
  ends: nothing more is computed for a reader that has gone.

Mains call :func:`check_writable` on what they will write before the
expensive work (loading a model, scoring, analysing), so a wrong output path
costs nothing.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import select
import stat
import sys
import tempfile
import traceback
from typing import Callable

from absl import app, flags, logging

from brf import interrupts
from brf.errors import UserError

# transformers, imported without PyTorch (brf uses its tokenizers, never its models),
# advises at import that "PyTorch was not found": no concern of brf's mains, so its
# advisory warnings stay off unless BRF_VERBOSE is set (set here, before any main
# imports transformers; an explicit TRANSFORMERS_NO_ADVISORY_WARNINGS wins).
if not os.environ.get("BRF_VERBOSE"):
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def quiet() -> None:
    """Turns absl (and orbax, which logs through absl) INFO chatter off."""
    if not os.environ.get("BRF_VERBOSE"):
        logging.set_verbosity(logging.WARNING)
        import logging as pylogging

        for name in ("absl", "orbax", "jax._src.xla_bridge"):
            pylogging.getLogger(name).setLevel(pylogging.WARNING)


def fail(message: str, prog: str | None = None) -> None:
    """Prints one error line naming the program and exits with status 2."""
    prog = prog or os.path.basename(sys.argv[0] or "brf")
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_writable(path: str, what: str, *, directory: bool = False) -> None:
    """Refuses an output path that cannot be written, as a :class:`UserError`.

    Checked by trying: the directory (``path`` itself, or a file's parent) is
    created if missing, as the writer would, and a temporary file is made and
    removed in it; an existing file must open for appending (nothing in it
    changes).

    Args:
      path: the file or directory the main will write.
      what: how the user gave it (``config.output``), for the message.
      directory: ``path`` is a directory (else a file).

    Raises:
      UserError: one line naming ``what``, the path and the reason.
    """
    kind = "directory" if directory else "file"
    if not path:
        raise UserError(f"{what} is empty; give the {kind} to write")
    folder = os.path.abspath(path) if directory else os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file, not a directory")
        if not directory and os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "it is a directory, not a file")
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
        if not directory and os.path.exists(path):
            with open(path, "ab"):
                pass
    except OSError as e:
        raise UserError(f"{what}={path!r} cannot be written: {e.strerror or e}") from None


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_config(name: str) -> str:
    """The absolute path of ``configs/<name>`` in this checkout: a main's default
    ``--config``, so that the main runs from any directory (a relative default
    is read against the current directory)."""
    return os.path.join(REPO_ROOT, "configs", name)


def _reason(message: str) -> str:
    """The last line of a traceback ml_collections folded into a flag error, without
    its exception's module path: what get_config (or the loader) said."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    last = lines[-1] if lines else message
    return re.sub(r"^[A-Za-z_][\w.]*(Error|Exception|Warning)?: ", "", last)


def _config_file_error(value, name: str, argv: list[str]) -> str | None:
    """The reason a config flag's file could not be loaded (ml_collections keeps a
    missing file's error inside the flag's value until it is read), else None."""
    if type(value).__name__ != "_ErrorConfig":
        return None
    return _file_error_line(str(object.__getattribute__(value, "_error")), name, argv)


def _file_error_line(error: str, name: str, argv: list[str]) -> str:
    """One line naming config flag ``name``'s file and why it could not be loaded."""
    reason = _reason(error)
    path = next((a.split("=", 1)[1] for a in argv[1:]
                 if a.startswith(f"--{name}=")), None)
    hint = ""
    if path and not os.path.isabs(path.split(":", 1)[0]):
        hint = (f" (a relative path is read from the current directory, {os.getcwd()}; "
                f"this checkout's configs are in {os.path.join(REPO_ROOT, 'configs')})")
    return f"flag --{name}{'=' + path if path else ''}: cannot load the config file: {reason}{hint}"


def _help_printed() -> None:
    """Ends the program after absl printed the usage (--help, --helpfull), which it
    ends with status 1 and whose EPIPE it swallows: status 0, or 141 (quietly) when
    the reader of stdout has gone (``--helpfull | head``), as the mains end otherwise."""
    try:
        sys.stdout.flush()
    except OSError as e:
        if e.errno == errno.EPIPE:
            _end_closed_stdout()
        raise
    if _stdout_closed():
        _end_closed_stdout()
    sys.exit(0)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        rest = flags.FLAGS(argv)
    except SystemExit:
        if any(a.split("=")[0] in ("--help", "-h", "--helpfull", "--helpshort", "-?")
               for a in argv[1:]):
            _help_printed()
        raise
    except flags.Error as e:
        text = str(e)
        first = text.splitlines()[0] if text else type(e).__name__
        if "Error whilst parsing config file" in first:
            # get_config refused its argument: the reason is the traceback's last line.
            first = first.replace("Error whilst parsing config file:", _reason(text))
        fail(first)
    except UserError as e:  # a config file's get_config refusing its argument
        fail(str(e))
    except (SyntaxError, OSError) as e:  # a config file that is not Python, or unreadable
        # A missing file read by an override (--config=x.py --config.a=1): the file's
        # own error, kept in the flag's value, names it; else the first line.
        if "failure to load" in str(e):  # ml_collections' words for a missing file
            fail(_file_error_line(str(e), "config", argv))
        fail(f"cannot load the config file: {type(e).__name__}: "
             f"{str(e).splitlines()[0] if str(e) else ''}")
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        # ml_collections' config overrides: an unknown field or a value of the
        # wrong type, raised while absl parses --config.<field>=<value>.
        args = " ".join(a for a in argv[1:] if a.startswith("--config"))
        fail(f"bad --config override ({args}): {type(e).__name__}: {e}")
    reason = _first_config_file_error(argv)
    if reason:
        fail(reason)
    return rest


def _first_config_file_error(argv: list[str]) -> str | None:
    """The first config flag whose file could not be loaded, said in one line."""
    for name in list(flags.FLAGS):
        try:
            value = flags.FLAGS[name].value
        except Exception:  # noqa: BLE001 -- a flag whose value cannot be read is not ours
            continue
        reason = _config_file_error(value, name, argv)
        if reason:
            return reason
    return None


INTERRUPTED = interrupts.STATUS  # exit status after Ctrl-C: 128 + SIGINT
CLOSED_STDOUT = 141  # exit status when the reader of stdout has gone: 128 + SIGPIPE


def interrupted(prog: str | None = None) -> None:
    """Prints one line saying the program was interrupted and ends it with status 130."""
    if prog:
        interrupts.install(prog)
    interrupts.exit_interrupted()


def _stdout_closed() -> bool:
    """Whether standard output is a pipe or socket whose reader has gone."""
    try:
        fd = sys.stdout.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))


def _end_closed_stdout() -> None:
    """Ends the program quietly with status 141, as SIGPIPE would end it: what is
    still buffered for stdout has no reader, so nothing is flushed there."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(CLOSED_STDOUT)


def run(main: Callable[[list[str]], object], argv: list[str] | None = None) -> None:
    """``absl.app.run(main)`` with user errors as one line (exit 2), an interrupt as
    one line (exit 130), a closed stdout as a quiet end (exit 141) and quiet logs."""
    interrupts.install(os.path.basename(sys.argv[0] or "brf"))
    interrupts.set_phase("start")

    def wrapped(args):
        quiet()
        interrupts.set_phase("main")
        try:
            status = main(args)
            sys.stdout.flush()  # a reader that has gone shows here at the latest
        except UserError as e:
            fail(str(e))
        interrupts.set_phase("end")
        return status

    try:
        app.run(wrapped, argv=argv, flags_parser=_parse_flags)
    except KeyboardInterrupt as e:  # Ctrl-C while running main
        # What the interrupted frames held (a progress bar, a file being written)
        # is closed now, so that its last redraw comes before the line.
        traceback.clear_frames(e.__traceback__)
        gc.collect()
        interrupts.exit_interrupted()
    except OSError as e:
        if e.errno == errno.EPIPE and _stdout_closed():
            _end_closed_stdout()
        raise
