"""Load a Hugging Face checkpoint directory into (ModelConfig, params). No torch.

Supported: model_type 'llama' and 'gemma3_text' (config.json plus
model.safetensors, or shards listed in model.safetensors.index.json). Config
fields this module does not understand, or understands but does not implement
(attention bias, rope types other than default/linear/llama3, ...), raise
ValueError naming the field.

Tensor names are converted by a declarative table per architecture: a regex
on the HF name -> our params path (layers stacked on axis 0) and a transform.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Callable

import ml_dtypes
import numpy as np
from safetensors import safe_open

from brf.errors import UserError
from brf.models.config import ModelConfig
from brf.models.transformer import param_shapes


class HFCheckpointError(UserError):
    """A Hugging Face directory brf cannot read (the message names the file or field)."""

Transform = Callable[[np.ndarray], np.ndarray]


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _transpose(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.T)  # torch Linear stores [out, in]; we use [in, out]


def _plus_one(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float32) + 1.0  # Gemma's RMSNorm applies (1 + w)


_L = r"model\.layers\.(\d+)\."

# HF tensor name (regex; a group captures the layer index) -> (our path, transform).
LLAMA_MAP: tuple[tuple[str, str, Transform], ...] = (
    (r"model\.embed_tokens\.weight", "embed", _same),
    (r"model\.norm\.weight", "final_norm", _same),
    (r"lm_head\.weight", "lm_head", _same),
    (_L + r"input_layernorm\.weight", "layers/attn_norm", _same),
    (_L + r"self_attn\.q_proj\.weight", "layers/wq", _transpose),
    (_L + r"self_attn\.k_proj\.weight", "layers/wk", _transpose),
    (_L + r"self_attn\.v_proj\.weight", "layers/wv", _transpose),
    (_L + r"self_attn\.o_proj\.weight", "layers/wo", _transpose),
    (_L + r"post_attention_layernorm\.weight", "layers/mlp_norm", _same),
    (_L + r"mlp\.gate_proj\.weight", "layers/w_gate", _transpose),
    (_L + r"mlp\.up_proj\.weight", "layers/w_up", _transpose),
    (_L + r"mlp\.down_proj\.weight", "layers/w_down", _transpose),
)

GEMMA3_MAP: tuple[tuple[str, str, Transform], ...] = (
    (r"model\.embed_tokens\.weight", "embed", _same),
    (r"model\.norm\.weight", "final_norm", _plus_one),
    (r"lm_head\.weight", "lm_head", _same),
    (_L + r"input_layernorm\.weight", "layers/attn_norm", _plus_one),
    (_L + r"self_attn\.q_proj\.weight", "layers/wq", _transpose),
    (_L + r"self_attn\.k_proj\.weight", "layers/wk", _transpose),
    (_L + r"self_attn\.v_proj\.weight", "layers/wv", _transpose),
    (_L + r"self_attn\.o_proj\.weight", "layers/wo", _transpose),
    (_L + r"self_attn\.q_norm\.weight", "layers/q_norm", _plus_one),
    (_L + r"self_attn\.k_norm\.weight", "layers/k_norm", _plus_one),
    (_L + r"post_attention_layernorm\.weight", "layers/post_attn_norm", _plus_one),
    (_L + r"pre_feedforward_layernorm\.weight", "layers/mlp_norm", _plus_one),
    (_L + r"post_feedforward_layernorm\.weight", "layers/post_mlp_norm", _plus_one),
    (_L + r"mlp\.gate_proj\.weight", "layers/w_gate", _transpose),
    (_L + r"mlp\.up_proj\.weight", "layers/w_up", _transpose),
    (_L + r"mlp\.down_proj\.weight", "layers/w_down", _transpose),
)

NAME_MAPS = {"llama": LLAMA_MAP, "gemma3": GEMMA3_MAP}

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_TENSORS = (r".*\.rotary_emb\.inv_freq",)

# Config fields with no effect on the forward pass.
_IGNORED_FIELDS = {
    "_name_or_path", "_model_name_or_path", "unk_token_id", "architectures", "dtype",
    "torch_dtype", "transformers_version",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp",
    "model_type", "cache_implementation", "_sliding_window_pattern", "output_attentions",
    "output_hidden_states", "return_dict", "attn_implementation", "_attn_implementation",
    "tokenizer_class", "is_decoder", "id2label", "label2id", "torchscript",
    "use_return_dict", "max_length", "unsloth_fixed", "chunk_size_feed_forward",
}
# Fields read by the converters below (any other field raises).
_LLAMA_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "bos_token_id", "eos_token_id", "pad_token_id",
}
_GEMMA3_FIELDS = (_LLAMA_FIELDS - {"hidden_act", "mlp_bias"}) | {
    "hidden_activation", "hidden_act", "query_pre_attn_scalar", "sliding_window",
    "sliding_window_pattern", "layer_types", "final_logit_softcapping",
    "attn_logit_softcapping", "use_bidirectional_attention", "rope_local_base_freq",
}


def _require(hf: dict, field: str, allowed, default=None):
    value = hf.get(field, default)
    if value not in allowed:
        raise HFCheckpointError(f"config.json field {field}={value!r} is not supported "
                         f"(supported: {allowed})")
    return value


def _rope(params: dict | None, field: str) -> tuple[float | None, dict | None]:
    """HF rope parameters (either format) -> (theta, our rope_scaling or None)."""
    if not params:
        return None, None
    params = dict(params)
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", None)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(f"config.json {field}: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        if params:
            raise HFCheckpointError(f"config.json {field}: unexpected keys {sorted(params)}")
        return theta, None
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}.get(kind)
    if keys is None:
        raise HFCheckpointError(f"config.json {field}: rope type {kind!r} is not supported "
                         f"(supported: default, linear, llama3)")
    extra = set(params) - set(keys)
    if extra:
        raise HFCheckpointError(f"config.json {field}: unsupported keys {sorted(extra)} for {kind!r}")
    return theta, {"type": kind, **{k: params[k] for k in keys}}


def _eos(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(hf: dict) -> ModelConfig:
    """Converts a parsed config.json into a ModelConfig, refusing what we do not handle.

    Args:
        hf: the dict read from config.json.

    Returns:
        The ModelConfig.

    Raises:
        ValueError: unsupported model_type, or a config field that is unknown or
            has a value this implementation does not support (the message names it).
    """
    model_type = hf.get("model_type")
    if model_type == "llama":
        arch, fields = "llama", _LLAMA_FIELDS
    elif model_type == "gemma3_text":
        arch, fields = "gemma3", _GEMMA3_FIELDS
    else:
        raise HFCheckpointError(f"config.json model_type={model_type!r} is not supported "
                         "(supported: 'llama', 'gemma3_text')")
    unknown = sorted(set(hf) - fields - _IGNORED_FIELDS)
    if unknown:
        raise HFCheckpointError(f"config.json fields {unknown} are not handled for {model_type}")
    _require(hf, "attention_bias", (False,), False)
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    common = dict(
        arch=arch, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        d_ff=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        bos_id=hf.get("bos_token_id"), eos_ids=_eos(hf.get("eos_token_id")),
        pad_id=hf.get("pad_token_id"),
    )
    if arch == "llama":
        return _llama_from_hf(hf, common)
    return _gemma3_from_hf(hf, common)


def _llama_from_hf(hf: dict, common: dict) -> ModelConfig:
    """The Llama-specific fields of config.json (checked) on top of ``common``."""
    _require(hf, "mlp_bias", (False,), False)
    _require(hf, "hidden_act", ("silu",), "silu")
    rp = hf.get("rope_parameters")
    if rp is not None:
        theta, scaling = _rope(rp, "rope_parameters")
    else:
        _, scaling = _rope(hf.get("rope_scaling"), "rope_scaling")
        theta = None
    theta = theta or hf.get("rope_theta", 10000.0)
    return ModelConfig(**common, rope_theta=theta, rope_scaling=scaling,
                       tie_embeddings=hf.get("tie_word_embeddings", False), act="silu")


def _gemma3_from_hf(hf: dict, common: dict) -> ModelConfig:
    """The Gemma 3 (text) fields of config.json (checked) on top of ``common``."""
    if hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 stores this field but never applies it; refuse rather
        # than guess which behaviour the checkpoint was trained with.
        raise HFCheckpointError("config.json attn_logit_softcapping is not supported for "
                                "gemma3_text (transformers ignores it); set it to null")
    if hf.get("use_bidirectional_attention"):
        raise HFCheckpointError("config.json use_bidirectional_attention=True is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise HFCheckpointError(f"config.json hidden_activation={act!r} is not supported "
                                "(supported: 'gelu_pytorch_tanh')")
    theta, local_theta, scaling = _gemma3_rope(hf)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(common["n_layers"])]
    names = {"sliding_attention": "local", "full_attention": "global"}
    bad = sorted(set(layer_types) - set(names))
    if bad:
        raise HFCheckpointError(f"config.json layer_types {bad} are not supported")
    return ModelConfig(
        **common, rope_theta=theta, rope_local_theta=local_theta, rope_scaling=scaling,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        sliding_window=hf.get("sliding_window"),
        layer_types=tuple(names[t] for t in layer_types),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256), act="gelu_tanh",
        embed_scale=True, final_logit_softcap=hf.get("final_logit_softcapping"))


def _gemma3_rope(hf: dict):
    """(global theta, local theta, global scaling) of a Gemma 3 config.json."""
    rp = hf.get("rope_parameters")
    if rp is not None:
        unknown = set(rp) - {"full_attention", "sliding_attention"}
        if unknown:
            raise HFCheckpointError(f"config.json rope_parameters keys {sorted(unknown)} not "
                                    f"supported")
        theta, scaling = _rope(rp.get("full_attention"), "rope_parameters.full_attention")
        local_theta, local_scaling = _rope(rp.get("sliding_attention"),
                                           "rope_parameters.sliding_attention")
        if local_scaling is not None:
            raise HFCheckpointError("config.json rope_parameters.sliding_attention: scaling of "
                                    "local layers is not supported")
    else:
        _, scaling = _rope(hf.get("rope_scaling"), "rope_scaling")
        theta, local_theta = None, None
    return (theta or hf.get("rope_theta", 1_000_000.0),
            local_theta or hf.get("rope_local_base_freq", 10_000.0), scaling)


def _read_bf16(path: str) -> dict[str, np.ndarray]:
    """The BF16 tensors of a safetensors file (safetensors.numpy cannot type them)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] == "BF16":
            a, b = info["data_offsets"]
            out[name] = data[a:b].view(ml_dtypes.bfloat16).reshape(info["shape"])
    return out


def iter_safetensors(directory: str):
    """Yields (name, numpy array) over model.safetensors or its index's shards."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise HFCheckpointError(f"no model.safetensors(.index.json) in {directory}")
    for fname in files:
        path = os.path.join(directory, fname)
        bf16 = None
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                try:
                    yield name, f.get_tensor(name)
                except TypeError:  # bfloat16: numpy has no such dtype
                    bf16 = bf16 if bf16 is not None else _read_bf16(path)
                    yield name, bf16[name]


def convert_tensors(cfg: ModelConfig, tensors, dtype=np.float32) -> dict:
    """Maps (HF name, array) pairs onto the params pytree using NAME_MAPS[cfg.arch].

    Args:
        cfg: the architecture (decides the table and the expected shapes).
        tensors: iterable of (name, array).
        dtype: dtype of the returned arrays (None keeps each tensor's own).

    Returns:
        The params pytree of notes/MODEL_CONTRACT.md (numpy arrays).

    Raises:
        ValueError: a tensor no rule maps, a missing or duplicated tensor, or a
            shape that disagrees with cfg.
    """
    table = [(re.compile(p), path, fn) for p, path, fn in NAME_MAPS[cfg.arch]]
    ignored = [re.compile(p) for p in _IGNORED_TENSORS]
    shapes = param_shapes(cfg)
    flat: dict[str, object] = {}
    for name, w in tensors:
        for rx, path, fn in table:
            m = rx.fullmatch(name)
            if m:
                break
        else:
            if any(rx.fullmatch(name) for rx in ignored):
                continue
            raise HFCheckpointError(f"tensor {name!r} has no rule in the {cfg.arch} name map")
        if path == "lm_head" and cfg.tie_embeddings:
            continue  # tied: the head is the embedding
        w = fn(np.asarray(w))
        w = w.astype(dtype) if dtype is not None else w
        if m.groups():
            slot = flat.setdefault(path, [None] * cfg.n_layers)
            i = int(m.group(1))
            if i >= cfg.n_layers or slot[i] is not None:
                raise HFCheckpointError(f"tensor {name!r}: layer {i} out of range or duplicated")
            slot[i] = w
        else:
            if path in flat:
                raise HFCheckpointError(f"tensor {name!r} duplicated")
            flat[path] = w
    params: dict = {"layers": {}}
    for key, shape in shapes.items():
        for sub, sub_shape in (shape.items() if key == "layers" else [(None, shape)]):
            path = key if sub is None else f"{key}/{sub}"
            value = flat.pop(path, None)
            if value is None or (isinstance(value, list) and any(v is None for v in value)):
                raise HFCheckpointError(f"checkpoint lacks tensors for {path}")
            if isinstance(value, list):
                value = np.stack(value)
            if tuple(value.shape) != tuple(sub_shape):
                raise HFCheckpointError(f"{path}: shape {value.shape}, config expects {sub_shape}")
            if sub is None:
                params[key] = value
            else:
                params["layers"][sub] = value
    if flat:
        raise HFCheckpointError(f"tensors mapped to unexpected params {sorted(flat)}")
    return params


def load_hf(directory: str, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Loads a Hugging Face model directory into (ModelConfig, params).

    Args:
        directory: holds config.json and model.safetensors (or a sharded index).
            A generation_config.json, when present, adds its eos_token_id(s).
        dtype: parameter dtype (numpy or ml_dtypes; None keeps the stored dtype).

    Returns:
        (cfg, params) with params a nested dict of numpy arrays (pass through
        `jax.device_put` to place them).
    """
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise HFCheckpointError(f"{directory} has no config.json: not a Hugging Face model "
                                "directory (nor a brf checkpoint)") from None
    except ValueError as e:
        raise HFCheckpointError(f"{path} is not valid JSON: {e}") from None
    try:
        cfg = config_from_hf(hf)
    except KeyError as e:
        raise HFCheckpointError(f"{path} lacks the field {e}") from None
    gen = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            extra = _eos(json.load(f).get("eos_token_id"))
        eos = cfg.eos_ids + tuple(e for e in extra if e not in cfg.eos_ids)
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "eos_ids": eos})
    return cfg, convert_tensors(cfg, iter_safetensors(directory), dtype)
