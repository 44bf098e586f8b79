"""Filling a params pytree tensor by tensor, and what a checkpoint needs in memory.

Both readers (`brf.checkpoints.hf`, `brf.checkpoints.gguf`) map a file's tensors
onto the params pytree of notes/MODEL_CONTRACT.md through a declarative table.
They hand each converted tensor to an :class:`Assembler`, which writes it
straight into its slot of the stacked [L, ...] array, allocated once in the
target dtype: the peak is the model in that dtype plus the tensor being
converted, not a list of per-layer copies and their stack (twice the model).

Large checkpoints load in bfloat16 unless asked otherwise (`default_dtype`:
above `BF16_ABOVE` parameters a float32 copy costs more memory than the
weights' own precision is worth; every checkpoint of that size is published in
bfloat16). `check_fits` refuses, in one line, a checkpoint whose parameters
would not fit in the memory this host has available.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import ml_dtypes
import numpy as np

from brf.errors import UserError
from brf.models.config import ModelConfig
from brf.models.transformer import param_shapes

# Models with more parameters than this load in bfloat16 by default.
BF16_ABOVE = 1_000_000_000
# The host memory a load may use besides the parameters themselves: a tensor
# being converted, the tokenizer, the runtime (the measured peaks stay below
# 1.3x the parameters, BENCHMARKS.md "Large checkpoints").
HEADROOM = 1.3


# A transform maps one stored tensor (rows = output features in both formats) to
# the array of its path, or to a tuple of arrays, one per path of a fused entry;
# a reader's table is a tuple of entries (tensor-name regex whose group captures
# the layer index, our path(s), transform).
Transform = Callable[[np.ndarray, ModelConfig], "np.ndarray | tuple[np.ndarray, ...]"]
Entry = tuple[str, "str | tuple[str, ...]", Transform]


def same(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w


def kernel(w_OxI: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w_OxI.T  # stored [out, in]; we use [in, out] (copied on writing)


def split_qkv(w_OxI: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, ...]:
    """A fused projection (Phi-3's), rows [q (H*E) | k (K*E) | v (K*E)] -> wq, wk, wv
    as [in, out]."""
    q, k = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return w_OxI[:q].T, w_OxI[q:q + k].T, w_OxI[q + k:].T


def split_gate_up(w_OxI: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, ...]:
    """A fused MLP input (Phi-3's), rows [gate (F) | up (F)] -> w_gate, w_up as [in, out]."""
    return w_OxI[:cfg.d_ff].T, w_OxI[cfg.d_ff:].T


class CheckpointTooLargeError(UserError, MemoryError):
    """A checkpoint whose parameters do not fit in the host's available memory."""


def n_params(cfg: ModelConfig) -> int:
    """The number of parameters of `cfg`'s params pytree."""
    shapes = param_shapes(cfg)
    layers = shapes.pop("layers")
    return sum(math.prod(s) for s in [*shapes.values(), *layers.values()])


def default_dtype(cfg: ModelConfig) -> np.dtype:
    """float32, or bfloat16 for a model of more than `BF16_ABOVE` parameters."""
    return np.dtype(ml_dtypes.bfloat16 if n_params(cfg) > BF16_ABOVE else np.float32)


def available_memory() -> int | None:
    """Bytes of memory this host can give a new allocation (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(cfg: ModelConfig, dtype, what: str, available: int | None = None) -> None:
    """Refuses to load `what` when its parameters in `dtype` would not fit in memory.

    Args:
        cfg: the model's config (its parameter count).
        dtype: the dtype the parameters would be held in.
        what: the checkpoint, as the message should name it.
        available: bytes available (default: `available_memory()`; None there
            skips the check).

    Raises:
        CheckpointTooLargeError: one line with the model's size in `dtype` and in
            bfloat16, what the load needs (`HEADROOM` times that) and what the
            host has.
    """
    available = available_memory() if available is None else available
    if available is None:
        return
    dtype = np.dtype(dtype)
    count = n_params(cfg)
    size = count * dtype.itemsize
    need = HEADROOM * size
    if need <= available:
        return
    smaller = ""
    if dtype.itemsize > 2:
        bf16 = count * 2
        smaller = (f"; in bfloat16 it is {_gb(bf16)} and needs {_gb(HEADROOM * bf16)}"
                   + (" (dtype=bfloat16)" if HEADROOM * bf16 <= available else ""))
    raise CheckpointTooLargeError(
        f"{what} ({cfg.arch}, {count / 1e9:.2f}B parameters) is {_gb(size)} in {dtype.name} and "
        f"needs about {_gb(need)} of memory to load; this host has {_gb(available)} "
        f"available{smaller}")


class Assembler:
    """The params pytree of one config, filled tensor by tensor in one dtype.

    Args:
        cfg: the architecture (the expected paths and shapes).
        dtype: the dtype of every parameter; None keeps the dtype of the first
            tensor written to each parameter.
        error: the exception class to raise (the reader's own).
        where: how messages name the file (e.g. 'checkpoint', 'GGUF file').
    """

    def __init__(self, cfg: ModelConfig, dtype, error: type[Exception], where: str):
        self.cfg, self.error, self.where = cfg, error, where
        self.dtype = None if dtype is None else np.dtype(dtype)
        shapes = param_shapes(cfg)
        layers = shapes.pop("layers")
        self.shapes = {**shapes, **{f"layers/{k}": v for k, v in layers.items()}}
        self.arrays: dict[str, np.ndarray] = {}
        self.filled: dict[str, np.ndarray] = {}

    def put(self, path: str, layer: int | None, value: Any, name: str) -> None:
        """Writes one converted tensor (cast to the dtype) into `path` (at `layer`).

        Raises:
            error: a path the config does not have, a layer out of range or
                written twice, a shape that disagrees with the config, or a
                NaN / inf among the values (each message names the source
                tensor `name`).
        """
        shape = self.shapes.get(path)
        if shape is None:
            raise self.error(f"tensor {name!r} maps to {path}, which a {self.cfg.arch} model "
                             "with this config does not have")
        layered = path.startswith("layers/")
        if layered != (layer is not None):
            raise self.error(f"tensor {name!r}: {path} is {'per layer' if layered else 'global'}")
        want = shape[1:] if layered else shape
        if tuple(np.shape(value)) != tuple(want):
            raise self.error(f"tensor {name!r} ({path}): shape {tuple(np.shape(value))}, the "
                             f"config expects {tuple(want)}")
        if path not in self.arrays:
            dtype = self.dtype or np.asarray(value).dtype
            self.arrays[path] = np.empty(shape, dtype)
            self.filled[path] = np.zeros(shape[0] if layered else 1, bool)
        slot = layer if layered else 0
        if layered and not 0 <= layer < shape[0]:
            raise self.error(f"tensor {name!r}: layer {layer} out of range (n_layers="
                             f"{shape[0]})")
        if self.filled[path][slot]:
            raise self.error(f"tensor {name!r}: {path}" + (f" layer {layer}" if layered else "")
                             + " written twice (duplicated tensor)")
        if layered:
            self.arrays[path][layer] = value
        else:
            self.arrays[path][...] = value
        written = self.arrays[path][layer] if layered else self.arrays[path]
        finite = np.isfinite(written)
        if not finite.all():  # a model with NaN weights generates nothing, silently
            bad = written[~finite]
            what = "NaN" if np.isnan(bad).any() else "inf"
            first = tuple(int(i) for i in np.argwhere(~finite)[0])
            raise self.error(f"tensor {name!r} ({path}" + (f" layer {layer}" if layered else "")
                             + f") holds {what}: {int(bad.size)} of {written.size} values are "
                             f"non-finite (first at index {first}); the {self.where} is "
                             "damaged or was written wrongly, and brf does not convert it")
        self.filled[path][slot] = True

    def finish(self) -> dict:
        """The params pytree (stacked layers).

        Raises:
            error: a parameter (or a layer of one) that no tensor filled.
        """
        for path in self.shapes:
            done = self.filled.get(path)
            if done is None or not done.all():
                missing = "" if done is None else f" (layers {np.flatnonzero(~done).tolist()})"
                raise self.error(f"{self.where} lacks tensors for {path}{missing}")
        params: dict = {"layers": {}}
        for path, a in self.arrays.items():
            if path.startswith("layers/"):
                params["layers"][path[len("layers/"):]] = a
            else:
                params[path] = a
        return params


__all__ = ["Assembler", "BF16_ABOVE", "CheckpointTooLargeError", "Entry", "HEADROOM", "Transform",
           "available_memory", "check_fits", "default_dtype", "kernel", "n_params", "same",
           "split_gate_up", "split_qkv"]
