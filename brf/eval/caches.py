"""What a run keeps in its run directory so that a resumed run recomputes nothing.

Score stores live with the scoring (:mod:`brf.eval.scoring`; written with
:func:`atomic_path`, a damaged one reported with :func:`warn_unreadable`); this
module keeps the JSON caches: fitted parameters per event table
(:class:`FitCache`) and whole results keyed on their inputs (:func:`cached_json`). Keys include the bytes of
the source files that compute a result, so a result made by other code is never
reused. Files are written atomically (a crash leaves the old file or the new
one, never half of one); a file that cannot be read back (truncated, not JSON,
another key) is recomputed with a warning that names it, never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pathlib
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from absl import logging

from brf.event_table import EventTable
from brf.eval.fitting import FitSettings, Fitted, MethodSpec


def jsonable(x):
    """``x`` with NumPy values as Python ones and non-finite floats as None (JSON)."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def warn_unreadable(what: str, path: str, reason: Any,
                    action: str = "it is recomputed") -> None:
    """Logs (absl WARNING, which the mains show) that a stored file cannot be read
    back, naming it, and what the run does instead of using it."""
    logging.warning("%s %s cannot be read (%s: %s); %s", what, path, type(reason).__name__,
                    reason, action)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """A temporary path next to ``path``, renamed onto it when the block ends without
    an exception and removed otherwise: a crash leaves the old file or the new one.

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


def write_json(path: str, data: Any, *, indent: int | None = None) -> None:
    """Writes ``data`` as JSON to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(jsonable(data), f, indent=indent)


def read_json(path: str, *, what: str = "cache") -> Any | None:
    """The JSON in ``path``; None when there is none, or (with a warning naming the
    file) when it cannot be read back (truncated, not JSON, not UTF-8)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        warn_unreadable(what, path, e)
        return None


def source_hash(modules: Iterable[Any], *parts: Any) -> str:
    """A short key from the source files of ``modules`` (packages: every .py in
    them; a path: that file) and the reprs of ``parts``."""
    h = hashlib.sha256()
    for mod in modules:
        path = pathlib.Path(mod) if isinstance(mod, (str, os.PathLike)) else pathlib.Path(mod.__file__)
        files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
        for f in files:
            h.update(f.read_bytes())
    for p in parts:
        h.update(repr(p).encode())
    return h.hexdigest()[:16]


def cached_json(path: str, compute: Callable[[], Any], *, what: str) -> Any:
    """The result stored in ``path`` (JSON), or ``compute()`` stored there first."""
    data = read_json(path, what=what)
    if data is not None:
        return data
    out = jsonable(compute())
    write_json(path, out)
    return out


# brf.fusion modules that no fitted method reads (their changes keep fits valid).
_NOT_FITTED = ("bottleneck.py", "sampling.py", "mixture.py")


def _fit_sources() -> list[pathlib.Path]:
    import brf.eval.fitting
    import brf.eval.lbfgs
    import brf.fusion
    fusion = sorted(p for p in pathlib.Path(brf.fusion.__file__).parent.glob("*.py")
                    if p.name not in _NOT_FITTED)
    return fusion + [pathlib.Path(brf.eval.fitting.__file__),
                     pathlib.Path(brf.eval.lbfgs.__file__)]


class FitCache:
    """Fitted parameters of one event table, stored in the run directory.

    The key covers the calibration table's bytes, the fit settings and the source
    of what a fit runs (brf.eval.fitting, brf.eval.lbfgs and brf.fusion but for
    the modules no fitted method reads: the bottleneck solvers, sampling and
    mixture sampling): fits made by other code, on other data or with another
    optimiser budget are not reused.
    """

    def __init__(self, path: str, calib: EventTable, settings: FitSettings):
        self.path = path
        self.key = source_hash(_fit_sources(),
                               hashlib.sha256(np.ascontiguousarray(calib.logp)).hexdigest(),
                               calib.gold.tolist(), calib.offset.tolist(), settings.key())
        data = read_json(path, what="fit cache")
        shaped = isinstance(data, dict) and isinstance(data.get("entries"), dict)
        if data is not None and not shaped:
            warn_unreadable("fit cache", path, TypeError("not an object with 'entries'"))
        self.entries = data["entries"] if shaped and data.get("key") == self.key else {}

    def get(self, spec: MethodSpec) -> Fitted | None:
        e = self.entries.get(spec.key())
        if e is None:
            return None
        try:
            return Fitted(e["label"], e["method"], e["params"], np.asarray(e["weights"]),
                          float(e["calib_nll"]), e.get("info", {}))
        except (KeyError, TypeError, ValueError):
            logging.warning("fit cache %s: the entry of %r is damaged; it is refitted",
                            self.path, spec.label)
            return None

    def put(self, spec: MethodSpec, f: Fitted) -> None:
        self.entries[spec.key()] = {
            "label": f.label, "method": f.method, "params": jsonable(f.params),
            "weights": np.asarray(f.weights).tolist(), "calib_nll": f.calib_nll,
            "info": jsonable(dict(f.info))}
        write_json(self.path, {"key": self.key, "entries": self.entries})
