"""Files a run keeps in its directory (score stores, fit and bottleneck caches).

Written atomically (a temporary file in the same folder, then renamed over
the target), so an interrupted run never leaves half a file at the final
path. Read back tolerantly: a file that is there but damaged (a flipped byte,
cut short by a full disk, edited) is reported with a warning that names it
and treated as absent, so the run recomputes what it held instead of
crashing or using damaged numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

from absl import logging


def warn_damaged(path: str, what: str, reason: Any, action: str = "recomputing it") -> None:
    """Logs (absl WARNING: shown by the mains, which keep only INFO quiet) that the
    file at ``path`` is damaged and what the run does instead."""
    logging.warning("%s: damaged %s (%s: %s); %s", path, what, type(reason).__name__,
                    reason, action)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """A temporary path next to ``path``; renamed onto it when the block ends
    without an exception, removed otherwise.

    Args:
      path: the final file (its folder is created if missing).
      suffix: the temporary name's ending, for writers that append one
        (``np.savez`` adds ``.npz`` to a name without it).
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}{suffix}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, obj: Any, *, indent: int | None = None) -> None:
    """Writes ``obj`` as JSON to ``path`` atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)


def read_json(path: str, what: str, expect: type = dict) -> Any | None:
    """The JSON value in ``path``; None when there is no file, and None with a
    warning (:func:`warn_damaged`) when it cannot be read, is not JSON (a cut
    or flipped byte) or is not an ``expect``."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        warn_damaged(path, what, e)
        return None
    if not isinstance(value, expect):
        warn_damaged(path, what, TypeError(f"a JSON {type(value).__name__}, not a "
                                           f"{expect.__name__}"))
        return None
    return value


__all__ = ["atomic_path", "read_json", "warn_damaged", "write_json"]
