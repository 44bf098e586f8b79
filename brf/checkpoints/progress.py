"""Progress bars for the conversion's stages that report no progress of their own.

A model's first conversion takes tens of seconds on a small CPU (Gemma 3 270M:
dequantizing its tensors, building its 262,144-token tokenizer, writing about a
GB of orbax checkpoint). Dequantizing counts tensors itself
(brf/checkpoints/gguf.py); building a tokenizer and writing a checkpoint are
single calls into other libraries, so their bars are redrawn from a thread: the
clock alone (:func:`clock`), or a count read from outside the call, such as the
bytes written to disk so far (:func:`watched`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator

from tqdm.auto import tqdm


@contextlib.contextmanager
def watched(desc: str, measure: Callable[[], int] | None = None, unit: str = "B",
            enabled: bool = True, interval: float = 0.5) -> Iterator[None]:
    """A bar for the ``with`` block, redrawn every ``interval`` seconds.

    Args:
      desc: what the stage does.
      measure: the stage's count so far (called from another thread); None shows
        the elapsed time alone.
      unit: the count's unit ('B' is shown scaled: kB, MB, GB, with a rate).
      enabled: False shows nothing.
      interval: seconds between redraws.
    """
    if not enabled:
        yield
        return
    fmt = ("{desc} [{elapsed}]" if measure is None else
           "{desc}: {n_fmt}" + ("B" if unit == "B" else f" {unit}") + " [{elapsed}, {rate_fmt}]")
    bar = tqdm(desc=desc, unit=unit, unit_scale=unit == "B", bar_format=fmt, dynamic_ncols=True)
    stop = threading.Event()

    def draw():
        if measure is not None:
            try:
                bar.update(max(0, measure() - bar.n))
            except OSError:  # a file renamed or removed while it was measured
                pass
        bar.refresh()

    def tick():
        while not stop.wait(interval):
            draw()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
        draw()
    finally:
        stop.set()
        thread.join()
        bar.close()


def clock(desc: str, enabled: bool = True) -> contextlib.AbstractContextManager:
    """A bar that shows only how long the ``with`` block has run."""
    return watched(desc, None, enabled=enabled)


def folder_bytes(path: str) -> int:
    """The bytes of every file under ``path`` now (0 while it does not exist)."""
    total = 0
    for parent, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(parent, name))
            except OSError:
                pass
    return total


__all__ = ["clock", "folder_bytes", "watched"]
