"""How brf meets its cache ($BRF_CACHE) damaged, moved or read-only.

The cache holds what can always be made again: converted checkpoints
(``checkpoints/``), the Gemma GGUF assembled from its packages (``sources/``),
alignment tables and byte tries (``align/``) and JAX's compiled programs
(``jax_cache/``). So:

- an entry that cannot be read back (truncated, empty, not what it claims to
  be) is named in one warning line and made again, never used;
- a cache that cannot be written (a read-only file system, a full disk) is
  used for what it holds; what would be added is kept in memory instead,
  with one warning line per process (:func:`warn_unwritable`); only an entry
  that must be written for the run to go on (a model that was never
  converted) ends the run, in one line naming the cache.

Checks that are cheap are made before reading (sizes recorded when an entry
was written); anything a reader still refuses is caught as it is read.
"""

from __future__ import annotations

import errno
import os
import tempfile
import zipfile
from typing import Any, Callable, TypeVar

from absl import logging

T = TypeVar("T")
_warned: set[str] = set()
# What a cache that cannot take new files raises (a read-only file system, no
# permission, a full disk or quota).
_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def warn_damaged(what: str, path: str, reason: Any, action: str = "it is made again") -> None:
    """One warning line: ``what`` at ``path`` cannot be read (``reason``); ``action``."""
    why = reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}"
    why = " ".join(str(why).split())[:300]  # one line, whatever the reader said
    logging.warning("%s %s cannot be read (%s); %s", what, path, why, action)


def unwritable(folder: str) -> str | None:
    """Why ``folder`` (created if missing) cannot take a new file, or None when it can.

    Tried, not inferred from permission bits: root writes through them, and a
    read-only mount refuses root too.
    """
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def warn_unwritable(root: str, reason: str) -> None:
    """One warning line per cache root and process: what the cache holds is used,
    nothing new is stored there."""
    if root in _warned:
        return
    _warned.add(root)
    logging.warning("the cache %s cannot be written (%s): what it holds is used, nothing "
                    "new is stored in it", root, reason)


def read_entry(path: str, load: Callable[[str], T], what: str) -> T | None:
    """``load(path)``; None when there is no file, or (with one warning line naming
    it) when it cannot be read back: the caller then makes it again."""
    if not os.path.isfile(path):
        return None
    try:
        return load(path)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        warn_damaged(what, path, e)
        return None


def write_entry(path: str, save: Callable[[str], None], root: str) -> bool:
    """``save(path)``; where the cache cannot be written, one warning line per
    ``root`` (the cache folder) and False: the caller keeps what it made in memory."""
    try:
        save(path)
    except OSError as e:
        if e.errno not in _UNWRITABLE:
            raise
        warn_unwritable(root, e.strerror or str(e))
        return False
    return True


__all__ = ["read_entry", "unwritable", "warn_damaged", "warn_unwritable", "write_entry"]
