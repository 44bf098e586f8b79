"""Process-level JAX settings shared by the experiment mains."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import re
import warnings

import jax

from brf import cachefiles
from brf.checkpoints.registry import cache_dir
from brf.errors import UserError


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache (every executable is kept).

    A second run of the same job then loads its executables instead of
    compiling them again (the models' prefill and decode, the scoring chunks,
    the fusion fits).

    Args:
        path: cache directory (default ``$BRF_CACHE/jax_cache``).

    Returns:
        The directory used; None when the default one cannot be made (the run
        compiles without a persistent cache).

    Raises:
        UserError: ``path`` was given and cannot be written (one line, naming it).

    The default directory inside a cache that cannot be written (a read-only
    file system) is read, not written: the programs it holds are used, new ones
    are not stored (``jax_persistent_cache_min_compile_time_secs`` set out of
    reach), with one warning line (:mod:`brf.cachefiles`).
    """
    given = path is not None
    path = os.path.abspath(os.path.expanduser(path or os.path.join(cache_dir(), "jax_cache")))
    reason = cachefiles.unwritable(path)
    if reason and given:
        raise UserError(f"the compilation cache folder {path} cannot be written ({reason}); "
                        "give a writable one, or none for $BRF_CACHE/jax_cache")
    if reason and not os.path.isdir(path):
        return None  # nothing to read either; a cache that lacks the models ends the run
    if reason:
        cachefiles.warn_unwritable(cache_dir(), reason)
    _watch_damaged_entries(path, writable=not reason)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float("inf") if reason else 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


# JAX's words when a stored program cannot be read back (jax/_src/compiler.py): the
# module's name, or the entry's key (the module's name and a hash).
_UNREADABLE = re.compile(r"Error reading persistent compilation cache entry for '([^']+)': "
                         r"(.*)", re.S)


def _watch_damaged_entries(path: str, writable: bool) -> None:
    """A compiled program that cannot be read back (a file cut short) is named in one
    warning line and its entries are removed, so that JAX stores the program it now
    compiles (it never replaces an existing entry: left alone, the same two-line
    warning came back on every run). Other warnings are shown as before."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        m = _UNREADABLE.match(str(message))
        if m is None:
            return previous(message, category, filename, lineno, file, line)
        name, why = m.groups()
        entry = re.compile(re.escape(name) + r"(-[0-9a-f]+)?-cache")
        action = "it is compiled again"
        if writable:
            try:
                for f in os.listdir(path):
                    if entry.fullmatch(f):
                        os.remove(os.path.join(path, f))
                action += " and stored anew"
            except OSError:
                pass
        cachefiles.warn_damaged("the compiled program", os.path.join(path, f"{name}-*"),
                                why, action)

    warnings.showwarning = show


# Below this much resident memory the study's releases are skipped: a program that
# `release_compiled` drops is traced and lowered again when next called, and a
# `release_memory` collection in a process of many objects takes most of a second (a
# study on tiny models spent half its time on both after every analysis). They pay
# only where there is memory worth having back.
RELEASE_ABOVE = 3 << 30


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (None where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _holds_less(above: int) -> bool:
    """Whether this process provably holds less than ``above`` bytes (0: never)."""
    rss = resident_bytes() if above else None
    return rss is not None and rss < above


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None without one), looked up on first use: nothing at
    import, where every main pays for it."""
    if os.name != "posix":
        return None
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols


def release_memory(above: int = 0) -> bool:
    """Collects garbage and hands freed heap memory back to the system, when the
    process holds at least ``above`` bytes (always, where that cannot be read; a
    collection in a process of many objects takes a good part of a second). Returns
    whether it did.

    glibc keeps what a process frees for reuse, so a long job that builds and drops
    large host buffers (byte-level scoring, a model in float64) stays at its
    high-water mark; ``malloc_trim`` returns the free pages. A no-op beyond the
    collection where the C library has no ``malloc_trim``.
    """
    if _holds_less(above):
        return False
    gc.collect()
    trim_heap()
    return True


def trim_heap() -> None:
    """Hands the C heap's free pages back to the system (glibc's ``malloc_trim``) without
    collecting garbage first: cheap enough to call after every request of a long job. A
    no-op where the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_compiled(above: int = RELEASE_ABOVE) -> bool:
    """Drops JAX's compiled programs, then hands freed memory back (`release_memory`),
    when the process holds at least ``above`` bytes (always, where that cannot be
    read). Returns whether it did.

    A long job that compiles programs of many shapes (the byte walk's tree calls, each
    analysis's fits) keeps every one: in the study, memory rose stage by stage to 15
    GB. A program needed again is recompiled, or read from the persistent
    compilation cache when one is on (`enable_compilation_cache`)."""
    if _holds_less(above):
        return False
    jax.clear_caches()
    release_memory()
    return True
