"""Load a llama.cpp GGUF file into (ModelConfig, params). No torch.

Supported architectures: `ARCHS` ('llama' is also how llama.cpp writes Mistral).
Metadata keys under the architecture's prefix that this module does not
understand raise GGUFError naming the key; so do tensor types other than
SUPPORTED_TYPES and tensor names no rule maps. Tensors are dequantized to
float32 with `gguf.quants.dequantize` (the reference NumPy port of ggml's
kernels), one at a time, and mapped onto the params pytree of
notes/MODEL_CONTRACT.md by a declarative table per architecture: a regex on the
GGUF name -> our path(s) (layers stacked on axis 0) and a transform; each is
written into its stacked array in the target dtype as it comes
(`brf.checkpoints.assemble`).

Two facts about llama.cpp's writer (convert_hf_to_gguf.py) the tables undo or keep:

* Llama-arch Q and K projections are stored with their output rows permuted
  from HF's half-split RoPE layout to GGML's interleaved one
  (`permute(w, n_head)`: rows of each head reordered (2, E/2) -> (E/2, 2)).
  `_unpermute` inverts it. The other architectures use NEOX (half-split) RoPE
  in llama.cpp and are stored unpermuted (OLMo 2 included, whose converter,
  unlike OLMo 1's, does not permute).
* Phi-3's fused projections stay fused in GGUF: attn_qkv rows [q | k | v] and
  ffn_up rows [gate | up] (llama.cpp's SwiGLU takes the first half as the gate).
* Gemma's HF checkpoints store a norm weight w that the model applies as
  (1 + w); the GGUF writer stores 1 + w (Gemma2Model / Gemma3Model.modify_tensors
  add 1 to every '*norm.weight'), and llama.cpp applies the stored value as a plain
  scale. We checked the shipped gemma-3-270m file: every norm value v has v - 1
  exactly representable in bfloat16 (55936 of 55936 values; only 75% of the v
  themselves are), i.e. v = 1 + w with w a bfloat16 weight, and the smallest
  values are 0.0 (w = -1). So GGUF norm weights are already the scale applied,
  which is what the contract wants: they are kept as they are (the HF reader,
  by contrast, adds 1).
"""

from __future__ import annotations

import math
import os
import re
import struct
from typing import Any, NamedTuple

import gguf
import numpy as np
from tqdm.auto import tqdm

from brf.checkpoints.assemble import (Assembler, Entry, check_fits, default_dtype, kernel,
                                      same, split_gate_up, split_qkv)
from brf.errors import UserError
from brf.models.config import ModelConfig

Q = gguf.GGMLQuantizationType

# Tensor types we dequantize. The two shipped files use F32, Q8_0, Q4_1, Q5_0,
# Q4_K and Q6_K; the others are the common plain and legacy block types, each
# covered by a test that writes a tiny file.
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                             Q.Q4_K, Q.Q6_K})

ARCHS = ("llama", "gemma3", "qwen2", "qwen3", "phi3", "gemma2", "olmo2")


class GGUFError(UserError):
    """A GGUF file that is unreadable or holds something this reader does not support."""


# --------------------------------------------------------------------------- file

class TensorInfo(NamedTuple):
    """Where one tensor lives in a GGUF file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # NumPy order (GGUF lists dims fastest-first; reversed here)
    ggml_type: Q
    offset: int  # absolute byte offset in the file
    n_bytes: int
    part: int = 0  # which file of a split set holds it (GGUFFile.data[part])


class GGUFFile(NamedTuple):
    """A parsed GGUF header plus read-only memory maps of the file (or of every
    part of a split set, read as one file).

    Attributes:
        path: the file (of a split set: its first part).
        metadata: {key: value}; strings as str, arrays as lists (of a split set:
            the first part's, which carries the model's).
        tensors: the tensor table, in file order (parts in order).
        data: each file as a uint8 memmap (pages load on first touch), one per
            part; a tensor lies in ``data[tensor.part]``.
    """

    path: str
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data: tuple[np.ndarray, ...]


_V = gguf.GGUFValueType
_SCALAR = {_V.UINT8: "<u1", _V.INT8: "<i1", _V.UINT16: "<u2", _V.INT16: "<i2",
           _V.UINT32: "<u4", _V.INT32: "<i4", _V.FLOAT32: "<f4", _V.BOOL: "?",
           _V.UINT64: "<u8", _V.INT64: "<i8", _V.FLOAT64: "<f8"}


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    if pos + n > len(buf):
        raise EOFError(f"string of {n} bytes runs past the end")
    return str(buf[pos:pos + n], "utf-8"), pos + n


def _value(buf: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALAR:
        dt = np.dtype(_SCALAR[vtype])
        return np.frombuffer(buf, dt, 1, pos)[0].item(), pos + dt.itemsize
    if vtype == _V.STRING:
        return _string(buf, pos)
    if vtype == _V.ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALAR:  # one vectorised read (token types, scores)
            dt = np.dtype(_SCALAR[etype])
            return np.frombuffer(buf, dt, count, pos).tolist(), pos + count * dt.itemsize
        if etype == _V.STRING:
            out = []
            for _ in range(count):
                s, pos = _string(buf, pos)
                out.append(s)
            return out, pos
        raise GGUFError(f"metadata array of element type {etype} is not supported")
    raise GGUFError(f"metadata value type {vtype} is not a GGUF type")


def _open_file(path: str, part: int = 0) -> GGUFFile:
    """Parses a GGUF header (v2/v3, little-endian) and memory-maps the file.

    The parse follows the format `gguf.GGUFReader` reads (tests check the two
    agree) but reads arrays in bulk: the reference reader builds one NumPy view
    per vocabulary string and takes tens of seconds on a 262k-token vocabulary.

    Args:
        path: the .gguf file.
        part: its index in a split set (each tensor's ``part``).

    Returns:
        A GGUFFile whose tensors all lie inside the file.

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a GGUF file, an unsupported version or byte order, or a
            truncated / corrupted file (the message says which).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{path} is truncated: {size} bytes, shorter than a GGUF header")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version & 0xFFFF == 0:
        raise GGUFError(f"{path} is a big-endian GGUF file; only little-endian is supported")
    if version not in (2, 3):
        raise GGUFError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
    try:
        pos, meta = 24, {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            meta[key], pos = _value(buf, pos + 4, vtype)
        table = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            table.append((name, tuple(reversed(dims)), qtype, offset))
    except GGUFError:
        raise
    except (struct.error, EOFError, UnicodeDecodeError, ValueError, OverflowError) as e:
        raise GGUFError(f"{path} ({size} bytes) is truncated or corrupted: its header cannot "
                        f"be parsed ({type(e).__name__}: {e})") from None
    align = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise GGUFError(f"{path}: general.alignment={align} is not a power of two")
    start = -(-pos // align) * align
    tensors, names = [], set()
    for name, shape, qtype, offset in table:
        if name in names:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        try:
            qtype = Q(qtype)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type {qtype}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        info = TensorInfo(name, shape, qtype, start + offset, n_bytes, part)
        if info.offset + n_bytes > size:
            raise GGUFError(f"{path} is truncated: tensor {name!r} ends at byte "
                            f"{info.offset + n_bytes}, the file has {size}")
        tensors.append(info)
    return GGUFFile(path, meta, tuple(tensors), (data,))


# llama.cpp's gguf-split (and gguf.GGUFWriter's split_max_*) name the parts so.
_PART_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


def split_parts(path: str | os.PathLike) -> list[str]:
    """Every file of the split set whose part ``path`` names by its file name
    (``NAME-00002-of-00003.gguf`` -> parts 1 to 3), in order; [path] for any
    other name."""
    path = os.fspath(path)
    m = _PART_NAME.fullmatch(os.path.basename(path))
    if m is None:
        return [path]
    stem, n = m.group(1), int(m.group(3))
    return [os.path.join(os.path.dirname(path), f"{stem}-{i:05d}-of-{n:05d}.gguf")
            for i in range(1, n + 1)]


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parses a GGUF file's header and memory-maps it; a split set as one file.

    A set llama.cpp's gguf-split wrote (``NAME-00001-of-0000N.gguf``, ...; the
    first part carries the metadata, every part ``split.no``, ``split.count``
    and ``split.tensors.count``) is read whole, whichever part ``path`` names:
    no merge step. The parse follows the format `gguf.GGUFReader` reads (tests
    check the two agree) but reads arrays in bulk: the reference reader builds
    one NumPy view per vocabulary string and takes tens of seconds on a
    262k-token vocabulary.

    Args:
        path: the .gguf file, or any part of a split set.

    Returns:
        A GGUFFile whose tensors all lie inside their files.

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a GGUF file, an unsupported version or byte order, a
            truncated / corrupted file, or a split set with a part missing or
            from another set (the message names the file).
    """
    path = os.fspath(path)
    named = _open_file(path)
    count = int(named.metadata.get("split.count", 1))
    if count <= 1:
        return named
    names = split_parts(path)
    if len(names) != count:
        raise GGUFError(f"{path} is part of a GGUF split in {count} parts, but its name is not "
                        f"NAME-0000i-of-{count:05d}.gguf, so the other parts cannot be found")
    parts = []
    for i, name in enumerate(names):  # checked against the first part, which holds the model
        if not os.path.isfile(name):
            raise GGUFError(f"part {i + 1} of {count} of the split GGUF {path} is missing: "
                            f"{name}")
        part = named._replace(tensors=tuple(t._replace(part=i) for t in named.tensors)) \
            if name == path else _open_file(name, i)
        got = tuple(part.metadata.get(k) for k in ("split.no", "split.count",
                                                   "split.tensors.count"))
        want = (i, count, (parts[0] if parts else part).metadata.get("split.tensors.count"))
        if got != want:
            raise GGUFError(f"{name} does not belong to the split set of {names[0]}: its "
                            f"split.no, split.count, split.tensors.count are {got}, expected "
                            f"{want}")
        parts.append(part)
    tensors = tuple(t for p in parts for t in p.tensors)
    if len(tensors) != want[2] or len({t.name for t in tensors}) != len(tensors):
        raise GGUFError(f"the split GGUF {names[0]} holds {len(tensors)} tensors "
                        f"({len({t.name for t in tensors})} names) over its {count} parts; "
                        f"split.tensors.count says {want[2]}")
    return GGUFFile(names[0], parts[0].metadata, tensors, tuple(p.data[0] for p in parts))


# --------------------------------------------------------------------------- config

# Metadata keys (after '<arch>.') each architecture reads; any other key under
# the prefix raises. Keys with no effect on the forward pass are listed too.
_COMMON_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "attention.key_length",
    "attention.value_length", "vocab_size", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "rope.scaling.attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_log_multiplier",
}
_ARCH_KEYS = {
    "llama": _COMMON_KEYS,
    "gemma3": _COMMON_KEYS | {"attention.sliding_window", "attention.sliding_window_pattern",
                              "final_logit_softcapping", "attn_logit_softcapping"},
    "qwen2": _COMMON_KEYS,
    "qwen3": _COMMON_KEYS,
    # Phi-3 writes sliding_window 0 for none (Phi-4).
    "phi3": _COMMON_KEYS | {"attention.sliding_window"},
    "gemma2": _COMMON_KEYS | {"attention.sliding_window", "final_logit_softcapping",
                              "attn_logit_softcapping"},
    "olmo2": _COMMON_KEYS,
}
# Tokens llama.cpp treats as end-of-generation besides tokenizer.ggml.eos_token_id
# (llama-vocab.cpp's text heuristic); eos_ids lists those the vocabulary has.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|eom_id|>", "<EOT>", "<|end_of_text|>")


def _get(meta: dict, key: str, default: Any = KeyError) -> Any:
    if key in meta:
        return meta[key]
    if default is KeyError:
        raise GGUFError(f"GGUF metadata lacks the required field {key!r}")
    return default


def _scalar(meta: dict, key: str, default: Any = KeyError) -> Any:
    value = _get(meta, key, default)
    if isinstance(value, list):
        raise GGUFError(f"GGUF metadata field {key!r} is a per-layer array {value[:4]}...; "
                        "only a single value is supported")
    return value


# Tensors that are part of the config, not of the parameters: Phi-3's longrope factors,
# and the per-frequency divisors llama.cpp writes for Llama 3.1 / 3.2's llama3 scaling.
_ROPE_FACTOR_TENSORS = {"short_factor": "rope_factors_short.weight",
                        "long_factor": "rope_factors_long.weight"}
_LLAMA3_FREQS = "rope_freqs.weight"
_CONFIG_TENSORS = frozenset({*_ROPE_FACTOR_TENSORS.values(), _LLAMA3_FREQS})


def _llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float,
                    original: int) -> dict | None:
    """Llama 3.1 / 3.2's 'llama3' rope scaling from the per-frequency divisors llama.cpp
    writes in its place (``rope_freqs.weight``: 1 for the frequencies kept, the factor
    for those interpolated, ``1 / ((1 - s) / factor + s)`` between, s rising linearly
    in ``original / wavelength`` from low_freq_factor to high_freq_factor).

    The factor is the largest divisor; the two others follow from the divisors between
    (a line through their s); only their ratios to ``original`` shape the frequencies.
    The result is checked to give back every divisor (to 1e-5): a file whose divisors
    are not of that form is refused, as is one with fewer than two between (the
    factors would not be determined). None when every divisor is 1.
    """
    f = np.asarray(divisors, np.float64).reshape(-1)
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    what = f"GGUF tensor '{_LLAMA3_FREQS}'"
    if f.shape != inv.shape or not np.all(np.isfinite(f)) or np.any(f < 1 - 1e-6):
        raise GGUFError(f"{what} (shape {f.shape}, smallest {np.min(f, initial=np.inf)}) "
                        f"is not Llama 3's frequency divisors: {inv.size} values >= 1")
    factor = float(f.max())
    if factor <= 1 + 1e-6:
        return None
    s = (1 / f - 1 / factor) / (1 - 1 / factor)  # 1: kept, 0: divided by the factor
    mid = (s > 1e-4) & (s < 1 - 1e-4)
    if mid.sum() < 2:
        raise GGUFError(f"{what} has {int(mid.sum())} frequencies between the kept and the "
                        "interpolated ones; llama3's low/high frequency factors need two")
    slope, icept = np.polyfit(original * inv[mid] / (2 * math.pi), s[mid], 1)
    low = -icept / slope
    scaling = dict(type="llama3", factor=factor, low_freq_factor=float(low),
                   high_freq_factor=float(low + 1 / slope),
                   original_max_position_embeddings=int(original))
    from brf.models.transformer import rope_inv_freq
    got = inv / rope_inv_freq(head_dim, theta, scaling).astype(np.float64)
    if not (low > 0 and np.allclose(got, f, rtol=1e-5, atol=0)):
        raise GGUFError(f"{what} is not a llama3 scaling (the nearest one is "
                        f"{np.max(np.abs(got / f - 1)):.1e} off): not supported")
    return scaling


def _rope_scaling(f: GGUFFile, arch: str, head_dim: int, theta: float) -> dict | None:
    """The rope scaling a file's metadata (and longrope's or llama3's factor tensors)
    describe, with what transformers derives where llama.cpp writes nothing (a yarn
    file without yarn_beta_* or yarn_attn_factor)."""
    meta = f.metadata

    def field(name, default=KeyError):
        return _scalar(meta, f"{arch}.rope.scaling.{name}", default)

    kind = field("type", "none")
    names = {i.name for i in f.tensors}
    factors = {k: t for k, t in _ROPE_FACTOR_TENSORS.items() if t in names}
    if _LLAMA3_FREQS in names:  # Llama 3.1 / 3.2: llama.cpp writes the divisors only
        if kind != "none" or factors:
            raise GGUFError(f"GGUF tensor '{_LLAMA3_FREQS}' with rope scaling type {kind!r}"
                            f"{' and ' + str(sorted(factors.values())) if factors else ''}: "
                            "not supported")
        divisors = dequantize(f, next(i for i in f.tensors if i.name == _LLAMA3_FREQS))
        # Llama 3's original context; only the ratios to it matter (above)
        return _llama3_scaling(divisors, head_dim, theta,
                               int(field("original_context_length", 8192)))
    if factors and kind not in ("none", "longrope"):
        raise GGUFError(f"GGUF metadata field '{arch}.rope.scaling.type'={kind!r} with the "
                        f"tensors {sorted(factors.values())}: not supported")
    if factors:  # Phi-3 128k / Phi-3.5: llama.cpp writes no type for longrope (older files)
        kind = "longrope"
    if kind in ("none", "linear"):
        for key in ("attn_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_ext_factor",
                    "yarn_attn_factor", "yarn_log_multiplier"):
            if field(key, None) is not None:
                raise GGUFError(f"GGUF metadata field '{arch}.rope.scaling.{key}' without yarn "
                                "or longrope (rope_factors_long/short tensors): not supported")
        return (None if kind == "none" else
                {"type": "linear", "factor": float(field("factor"))})
    if kind == "longrope":
        if len(factors) != 2:
            raise GGUFError(f"GGUF longrope needs both {sorted(_ROPE_FACTOR_TENSORS.values())}; "
                            f"the file has {sorted(factors.values())}")
        original = int(field("original_context_length"))
        attention = field("attn_factor", None)
        if attention is None:  # what llama.cpp's converter would have written
            ratio = int(_scalar(meta, f"{arch}.context_length")) / original
            attention = 1.0 if ratio <= 1 else math.sqrt(1 + math.log(ratio) / math.log(original))
        by_name = {t.name: t for t in f.tensors}
        return dict(type="longrope", original_max_position_embeddings=original,
                    attention_factor=float(attention),
                    **{k: tuple(dequantize(f, by_name[t]).astype(float).tolist())
                       for k, t in factors.items()})
    if kind == "yarn":
        for key, ok in (("yarn_log_multiplier", (0.0,)), ("yarn_ext_factor", (1.0,)),
                        ("attn_factor", (1.0,))):
            value = field(key, None)
            if value is not None and float(value) not in ok:
                raise GGUFError(f"GGUF metadata field '{arch}.rope.scaling.{key}'={value} is "
                                f"not supported with yarn (supported: absent or {ok[0]})")
        factor = float(field("factor"))
        attention = field("yarn_attn_factor", None)
        return dict(type="yarn", factor=factor,
                    original_max_position_embeddings=int(field("original_context_length")),
                    beta_fast=float(field("yarn_beta_fast", 32.0)),
                    beta_slow=float(field("yarn_beta_slow", 1.0)),
                    attention_factor=float(1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0)
                    if attention is None else float(attention), truncate=True)
    raise GGUFError(f"GGUF metadata field '{arch}.rope.scaling.type'={kind!r} is not supported "
                    "(supported: none, linear, yarn, longrope)")


def config_from_file(f: GGUFFile) -> ModelConfig:
    """Builds the ModelConfig a GGUF file describes, refusing what we do not handle.

    Args:
        f: an open GGUF file; its metadata, and its tensor table, which decides
            tie_embeddings (no 'output.weight') and the vocabulary size.

    Returns:
        The ModelConfig.

    Raises:
        GGUFError: an unsupported architecture, or a metadata field that is
            unknown, missing or has an unsupported value (the message names it).
    """
    meta, tensor_shapes = f.metadata, {t.name: t.shape for t in f.tensors}
    arch = _get(meta, "general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"GGUF metadata field 'general.architecture'={arch!r} is not supported "
                        f"(supported: {', '.join(ARCHS)})")
    unknown = sorted(k for k in meta if k.startswith(arch + ".")
                     and k[len(arch) + 1:] not in _ARCH_KEYS[arch])
    if unknown:
        raise GGUFError(f"GGUF metadata fields {unknown} are not handled for arch {arch!r}")

    def field(name, default=KeyError):
        return _scalar(meta, f"{arch}.{name}", default)

    d, n_heads = int(field("embedding_length")), int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", d // n_heads))
    if int(field("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"GGUF metadata field '{arch}.attention.value_length' differs from "
                        "the key length; not supported")
    if int(field("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"GGUF metadata field '{arch}.rope.dimension_count'="
                        f"{field('rope.dimension_count')} != head_dim={head_dim}: partial "
                        "rotary embeddings are not supported")
    if "token_embd.weight" not in tensor_shapes:
        raise GGUFError("GGUF file has no 'token_embd.weight' tensor")
    vocab = int(tensor_shapes["token_embd.weight"][0])
    if int(field("vocab_size", vocab)) != vocab:
        raise GGUFError(f"GGUF metadata field '{arch}.vocab_size'={field('vocab_size')} "
                        f"disagrees with token_embd.weight ({vocab} rows)")
    n_layers = int(field("block_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = ([int(eos)] if eos is not None else []) + [
        i for i, t in enumerate(tokens) if t in _EOG_TEXTS and i != eos]
    theta = float(field("rope.freq_base", 10000.0))
    common = dict(
        arch=arch, vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)), head_dim=head_dim,
        d_ff=int(field("feed_forward_length")),
        norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        rope_theta=theta, rope_scaling=_rope_scaling(f, arch, head_dim, theta),
        tie_embeddings="output.weight" not in tensor_shapes,
        max_seq_len=int(field("context_length", 2048)),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_ids=tuple(eos_ids),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if arch == "gemma3":
        return _gemma3_config(meta, arch, common, field)
    if arch == "gemma2":
        return _gemma2_config(common, field)
    structure = dict(_STRUCTURE[arch])
    window = int(field("attention.sliding_window", 0)) if arch == "phi3" else 0
    if window:
        structure.update(sliding_window=window, layer_types=("local",) * n_layers)
    return ModelConfig(**common, act="silu", **structure)


# What the Llama-like architectures add to Llama (GGUF says nothing of it).
_STRUCTURE = {
    "llama": {},
    "qwen2": dict(attn_bias=True),
    "qwen3": dict(qk_norm="head"),
    "phi3": {},
    "olmo2": dict(norm_placement="post", qk_norm="full"),
}


def _gemma2_config(common: dict, field) -> ModelConfig:
    """The Gemma 2 fields on top of ``common``, with what llama.cpp hard-codes
    (llama-model.cpp, LLM_ARCH_GEMMA2): even layers local, one RoPE base for
    all, attention scale 1/sqrt(d/n_heads) for the 46-layer 27B, else 1/sqrt(head_dim)."""
    n_layers, d, n_heads = common["n_layers"], common["d_model"], common["n_heads"]
    return ModelConfig(
        **common, sliding_window=int(field("attention.sliding_window")),
        layer_types=tuple("local" if i % 2 == 0 else "global" for i in range(n_layers)),
        query_pre_attn_scalar=float(d // n_heads if n_layers == 46 else common["head_dim"]),
        act="gelu_tanh", embed_scale=True, norm_placement="sandwich",
        final_logit_softcap=field("final_logit_softcapping", None),
        attn_logit_softcap=field("attn_logit_softcapping", None))


def _gemma3_config(meta, arch: str, common: dict, field) -> ModelConfig:
    """The Gemma 3 fields on top of ``common``. llama.cpp hard-codes what the file does
    not say (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer global, local RoPE base
    10000, and the attention scale 1/sqrt(d/n_heads) for the 62-layer 27B, else
    1/sqrt(head_dim)."""
    n_layers, d, n_heads = common["n_layers"], common["d_model"], common["n_heads"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per-layer flags, True = sliding window
        if len(pattern) != n_layers:
            raise GGUFError(f"GGUF metadata field '{arch}.attention.sliding_window_pattern' has "
                            f"{len(pattern)} entries for {n_layers} layers")
        layer_types = tuple("local" if p else "global" for p in pattern)
    else:
        layer_types = tuple("local" if (i + 1) % int(pattern) else "global"
                            for i in range(n_layers))
    return ModelConfig(
        **common, rope_local_theta=10000.0,
        sliding_window=int(field("attention.sliding_window")), layer_types=layer_types,
        query_pre_attn_scalar=float(d // n_heads if n_layers == 62 else common["head_dim"]),
        act="gelu_tanh", embed_scale=True, norm_placement="sandwich", qk_norm="head",
        final_logit_softcap=field("final_logit_softcapping", None),
        attn_logit_softcap=field("attn_logit_softcapping", None))


# --------------------------------------------------------------------------- tensors

def _unpermute(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverts llama.cpp's `permute`: GGML interleaved RoPE rows -> HF half-split rows."""
    o, i = w_OxI.shape
    w = w_OxI.reshape(n_heads, o // n_heads // 2, 2, i)
    return w.swapaxes(1, 2).reshape(o, i)


def _llama_q(w_OxI: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return kernel(_unpermute(w_OxI, cfg.n_heads), cfg)


def _llama_k(w_OxI: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return kernel(_unpermute(w_OxI, cfg.n_kv_heads), cfg)


_L = r"blk\.(\d+)\."

# GGUF tensor name (regex; a group captures the layer index) -> (our path(s), transform).
_HEAD: tuple[Entry, ...] = (
    (r"token_embd\.weight", "embed", same),
    (r"output_norm\.weight", "final_norm", same),
    (r"output\.weight", "lm_head", same),
)
_PRE_NORMS: tuple[Entry, ...] = (
    (_L + r"attn_norm\.weight", "layers/attn_norm", same),
    (_L + r"ffn_norm\.weight", "layers/mlp_norm", same),
)
_MLP: tuple[Entry, ...] = (
    (_L + r"ffn_gate\.weight", "layers/w_gate", kernel),
    (_L + r"ffn_up\.weight", "layers/w_up", kernel),
    (_L + r"ffn_down\.weight", "layers/w_down", kernel),
)
# Half-split (NEOX) RoPE: q and k as written.
_PROJECTIONS: tuple[Entry, ...] = (
    (_L + r"attn_q\.weight", "layers/wq", kernel),
    (_L + r"attn_k\.weight", "layers/wk", kernel),
    (_L + r"attn_v\.weight", "layers/wv", kernel),
    (_L + r"attn_output\.weight", "layers/wo", kernel),
) + _MLP
_QK_NORMS: tuple[Entry, ...] = (
    (_L + r"attn_q_norm\.weight", "layers/q_norm", same),
    (_L + r"attn_k_norm\.weight", "layers/k_norm", same),
)
_POST_NORMS: tuple[Entry, ...] = (
    (_L + r"post_attention_norm\.weight", "layers/post_attn_norm", same),
    (_L + r"post_ffw_norm\.weight", "layers/post_mlp_norm", same),
)

LLAMA_MAP: tuple[Entry, ...] = _HEAD + _PRE_NORMS + (
    (_L + r"attn_q\.weight", "layers/wq", _llama_q),
    (_L + r"attn_k\.weight", "layers/wk", _llama_k),
    (_L + r"attn_v\.weight", "layers/wv", kernel),
    (_L + r"attn_output\.weight", "layers/wo", kernel),
) + _MLP
# Norms are stored as the applied scale 1 + w already (see the module docstring).
GEMMA2_MAP: tuple[Entry, ...] = _HEAD + _PRE_NORMS + _PROJECTIONS + _POST_NORMS
GEMMA3_MAP: tuple[Entry, ...] = GEMMA2_MAP + _QK_NORMS
QWEN2_MAP: tuple[Entry, ...] = _HEAD + _PRE_NORMS + _PROJECTIONS + (
    (_L + r"attn_q\.bias", "layers/bq", same),
    (_L + r"attn_k\.bias", "layers/bk", same),
    (_L + r"attn_v\.bias", "layers/bv", same),
)
QWEN3_MAP: tuple[Entry, ...] = _HEAD + _PRE_NORMS + _PROJECTIONS + _QK_NORMS
PHI3_MAP: tuple[Entry, ...] = _HEAD + _PRE_NORMS + (
    (_L + r"attn_qkv\.weight", ("layers/wq", "layers/wk", "layers/wv"), split_qkv),
    (_L + r"attn_output\.weight", "layers/wo", kernel),
    (_L + r"ffn_up\.weight", ("layers/w_gate", "layers/w_up"), split_gate_up),
    (_L + r"ffn_down\.weight", "layers/w_down", kernel),
)
# OLMo 2: no pre-norms; q/k norms over all projected features.
OLMO2_MAP: tuple[Entry, ...] = _HEAD + _PROJECTIONS + _QK_NORMS + _POST_NORMS

NAME_MAPS = {
    "llama": LLAMA_MAP,
    "gemma3": GEMMA3_MAP,
    "qwen2": QWEN2_MAP,
    "qwen3": QWEN3_MAP,
    "phi3": PHI3_MAP,
    "gemma2": GEMMA2_MAP,
    "olmo2": OLMO2_MAP,
}


def dequantize(f: GGUFFile, info: TensorInfo) -> np.ndarray:
    """One GGUF tensor as a float32 array in NumPy order (`info.shape`).

    Args:
        f: the open file.
        info: one entry of `f.tensors`.

    Returns:
        float32 array of shape info.shape.

    Raises:
        GGUFError: an unsupported tensor type (named). Non-finite values are refused
            where every converter writes its tensors (`brf.checkpoints.assemble.Assembler`).
    """
    if info.ggml_type not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise GGUFError(f"tensor {info.name!r} has type {info.ggml_type.name}, which is "
                        f"not supported (supported: {names})")
    raw = f.data[info.part][info.offset:info.offset + info.n_bytes]
    raw = raw.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, info.ggml_type))
    w = np.asarray(gguf.quants.dequantize(raw, info.ggml_type), np.float32).reshape(info.shape)
    return w


def params_from_file(f: GGUFFile, cfg: ModelConfig, dtype=np.float32,
                     progress: bool = True, table=None) -> dict:
    """Dequantizes and maps every tensor onto the params pytree using NAME_MAPS[cfg.arch].

    Args:
        f: an open GGUF file (`open_gguf`).
        cfg: its ModelConfig (decides the table and the expected shapes).
        dtype: dtype of the returned arrays; each tensor is dequantized to
            float32 and written into its stacked array in this dtype before the
            next is read.
        progress: show a tqdm bar over the tensors.
        table: the name table (default: NAME_MAPS[cfg.arch]).

    Returns:
        The params pytree of notes/MODEL_CONTRACT.md (NumPy arrays; layers stacked).

    Raises:
        GGUFError: a tensor no rule maps, an unsupported tensor type, a missing
            or duplicated tensor, or a shape that disagrees with cfg.
    """
    rules = [(re.compile(p), (path,) if isinstance(path, str) else tuple(path), fn)
             for p, path, fn in (NAME_MAPS[cfg.arch] if table is None else table)]
    out = Assembler(cfg, dtype, GGUFError, "GGUF file")
    for t in tqdm(f.tensors, desc="GGUF tensors", unit="tensor", disable=not progress):
        if t.name in _CONFIG_TENSORS:  # read by config_from_file
            continue
        for rx, paths, fn in rules:
            m = rx.fullmatch(t.name)
            if m:
                break
        else:
            raise GGUFError(f"tensor {t.name!r} has no rule in the {cfg.arch} GGUF name map")
        values = fn(dequantize(f, t), cfg)
        values = values if isinstance(values, tuple) else (values,)
        layer = int(m.group(1)) if m.groups() else None
        for path, value in zip(paths, values, strict=True):
            out.put(path, layer, value, t.name)
    return out.finish()


def load_gguf(path: str | os.PathLike, dtype="default",
              progress: bool = True) -> tuple[ModelConfig, dict]:
    """Loads a GGUF file into (ModelConfig, params).

    Args:
        path: the .gguf file.
        dtype: parameter dtype (NumPy or ml_dtypes); 'default' is float32, or
            bfloat16 for a model of more than a billion parameters
            (`brf.checkpoints.assemble.default_dtype`).
        progress: show a tqdm bar over the tensors.

    Returns:
        (cfg, params) with params a nested dict of NumPy arrays (pass through
        `jax.device_put` to place them).

    Raises:
        GGUFError: unreadable file or unsupported content (the message says what).
        CheckpointTooLargeError: the parameters would not fit in the host's memory.
    """
    f = open_gguf(path)
    cfg = config_from_file(f)
    if isinstance(dtype, str) and dtype == "default":
        dtype = default_dtype(cfg)
    check_fits(cfg, dtype, f.path)
    return cfg, params_from_file(f, cfg, dtype, progress)


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a GGUF file, without reading its tensors."""
    return config_from_file(open_gguf(path))


__all__ = ["ARCHS", "GEMMA2_MAP", "GEMMA3_MAP", "GGUFError", "GGUFFile", "LLAMA_MAP", "NAME_MAPS",
           "OLMO2_MAP", "PHI3_MAP", "QWEN2_MAP", "QWEN3_MAP", "SUPPORTED_TYPES", "TensorInfo",
           "config_from_file", "dequantize", "load_config", "load_gguf", "open_gguf",
           "params_from_file", "split_parts"]
