"""Process-level JAX settings shared by the experiment mains."""

from __future__ import annotations

import ctypes
import functools
import gc
import os

import jax

from brf.checkpoints.registry import cache_dir


def enable_compilation_cache(path: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache (every executable is kept).

    A second run of the same job then loads its executables instead of
    compiling them again (the models' prefill and decode, the scoring chunks,
    the fusion fits).

    Args:
        path: cache directory (default ``$BRF_CACHE/jax_cache``).

    Returns:
        The directory used.
    """
    path = os.path.abspath(os.path.expanduser(path or os.path.join(cache_dir(), "jax_cache")))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None without one), looked up on first use: nothing at
    import, where every main pays for it."""
    if os.name != "posix":
        return None
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols


def release_memory() -> None:
    """Collects garbage and hands freed heap memory back to the system.

    glibc keeps what a process frees for reuse, so a long job that builds and drops
    large host buffers (byte-level scoring, a model in float64) stays at its
    high-water mark; ``malloc_trim`` returns the free pages. A no-op beyond the
    collection where the C library has no ``malloc_trim``.
    """
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_compiled() -> None:
    """Drops JAX's compiled programs, then hands freed memory back (`release_memory`).

    A long job that compiles programs of many shapes (the byte walk's tree calls, each
    analysis's fits) keeps every one: in the study, memory rose stage by stage to 15
    GB. A program needed again is recompiled, or read from the persistent
    compilation cache when one is on (`enable_compilation_cache`)."""
    jax.clear_caches()
    release_memory()
