"""Load a Hugging Face checkpoint directory into (ModelConfig, params). No torch.

Supported model_type values: the keys of `FAMILIES`, from config.json plus
model.safetensors or the shards model.safetensors.index.json lists. Config
fields this module does not understand, or understands but does not implement
(an output-projection bias, rope types other than default/linear/llama3/yarn/longrope,
partial rotary embeddings, ...), raise HFCheckpointError naming the field.

Tensor names are converted by a declarative table per architecture
(`NAME_MAPS`): a regex on the HF name -> our params path (or several, for a
fused tensor) and one transform. Tensors are read one at a time with plain
file reads (no memory map, so pages of the file never count against the
process) and written straight into the stacked arrays, in the target dtype
(`brf.checkpoints.assemble`).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Callable, Iterator, NamedTuple

import ml_dtypes
import numpy as np

from brf.checkpoints.assemble import (Assembler, Entry, check_fits, default_dtype, kernel,
                                      same, split_gate_up, split_qkv)
from brf.errors import UserError
from brf.models.config import ModelConfig


class HFCheckpointError(UserError):
    """A Hugging Face directory brf cannot read (the message names the file or field)."""


def _plus_one(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.astype(np.float32) + 1.0  # Gemma's RMSNorm applies (1 + w)


_L = r"model\.layers\.(\d+)\."

# HF tensor name (regex; a group captures the layer index) -> (our path(s), transform).
_HEAD: tuple[Entry, ...] = (
    (r"model\.embed_tokens\.weight", "embed", same),
    (r"model\.norm\.weight", "final_norm", same),
    (r"lm_head\.weight", "lm_head", same),
)
_PROJECTIONS: tuple[Entry, ...] = (
    (_L + r"self_attn\.q_proj\.weight", "layers/wq", kernel),
    (_L + r"self_attn\.k_proj\.weight", "layers/wk", kernel),
    (_L + r"self_attn\.v_proj\.weight", "layers/wv", kernel),
    (_L + r"self_attn\.o_proj\.weight", "layers/wo", kernel),
    (_L + r"mlp\.gate_proj\.weight", "layers/w_gate", kernel),
    (_L + r"mlp\.up_proj\.weight", "layers/w_up", kernel),
    (_L + r"mlp\.down_proj\.weight", "layers/w_down", kernel),
)
_PRE_NORMS: tuple[Entry, ...] = (
    (_L + r"input_layernorm\.weight", "layers/attn_norm", same),
    (_L + r"post_attention_layernorm\.weight", "layers/mlp_norm", same),
)

LLAMA_MAP: tuple[Entry, ...] = _HEAD + _PRE_NORMS + _PROJECTIONS
# Qwen2: biases on q, k and v (not on o).
QWEN2_MAP: tuple[Entry, ...] = LLAMA_MAP + (
    (_L + r"self_attn\.q_proj\.bias", "layers/bq", same),
    (_L + r"self_attn\.k_proj\.bias", "layers/bk", same),
    (_L + r"self_attn\.v_proj\.bias", "layers/bv", same),
)
# Qwen3: an RMSNorm of E features on each query / key head (a plain scale).
QWEN3_MAP: tuple[Entry, ...] = LLAMA_MAP + (
    (_L + r"self_attn\.q_norm\.weight", "layers/q_norm", same),
    (_L + r"self_attn\.k_norm\.weight", "layers/k_norm", same),
)
# Phi-3: q, k, v in one tensor and gate, up in another, split on reading.
PHI3_MAP: tuple[Entry, ...] = _HEAD + _PRE_NORMS + (
    (_L + r"self_attn\.qkv_proj\.weight", ("layers/wq", "layers/wk", "layers/wv"), split_qkv),
    (_L + r"self_attn\.o_proj\.weight", "layers/wo", kernel),
    (_L + r"mlp\.gate_up_proj\.weight", ("layers/w_gate", "layers/w_up"), split_gate_up),
    (_L + r"mlp\.down_proj\.weight", "layers/w_down", kernel),
)
# Gemma 2: norms before and after attention and the MLP, each applying (1 + w).
_GEMMA_NORMS: tuple[Entry, ...] = (
    (_L + r"input_layernorm\.weight", "layers/attn_norm", _plus_one),
    (_L + r"post_attention_layernorm\.weight", "layers/post_attn_norm", _plus_one),
    (_L + r"pre_feedforward_layernorm\.weight", "layers/mlp_norm", _plus_one),
    (_L + r"post_feedforward_layernorm\.weight", "layers/post_mlp_norm", _plus_one),
)
GEMMA2_MAP: tuple[Entry, ...] = (
    (r"model\.embed_tokens\.weight", "embed", same),
    (r"model\.norm\.weight", "final_norm", _plus_one),
    (r"lm_head\.weight", "lm_head", same),
) + _GEMMA_NORMS + _PROJECTIONS
# Gemma 3: Gemma 2's norms plus per-head q/k norms, also (1 + w).
GEMMA3_MAP: tuple[Entry, ...] = GEMMA2_MAP + (
    (_L + r"self_attn\.q_norm\.weight", "layers/q_norm", _plus_one),
    (_L + r"self_attn\.k_norm\.weight", "layers/k_norm", _plus_one),
)
# OLMo 2: no norm before attention or the MLP; HF's post_attention_layernorm is a
# norm *after* attention here (in Llama it is the MLP's pre-norm), and the q/k norms
# run over all H*E / K*E features.
OLMO2_MAP: tuple[Entry, ...] = _HEAD + _PROJECTIONS + (
    (_L + r"self_attn\.q_norm\.weight", "layers/q_norm", same),
    (_L + r"self_attn\.k_norm\.weight", "layers/k_norm", same),
    (_L + r"post_attention_layernorm\.weight", "layers/post_attn_norm", same),
    (_L + r"post_feedforward_layernorm\.weight", "layers/post_mlp_norm", same),
)

NAME_MAPS = {
    "llama": LLAMA_MAP,
    "gemma3": GEMMA3_MAP,
    "qwen2": QWEN2_MAP,
    "mistral": LLAMA_MAP,
    "qwen3": QWEN3_MAP,
    "phi3": PHI3_MAP,
    "gemma2": GEMMA2_MAP,
    "olmo2": OLMO2_MAP,
}

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_TENSORS = (r".*\.rotary_emb\.inv_freq",)

# Config fields with no effect on the forward pass.
_IGNORED_FIELDS = {
    "_name_or_path", "_model_name_or_path", "unk_token_id", "architectures", "dtype",
    "torch_dtype", "transformers_version", "auto_map",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp",
    "model_type", "cache_implementation", "_sliding_window_pattern", "output_attentions",
    "output_hidden_states", "return_dict", "attn_implementation", "_attn_implementation",
    "tokenizer_class", "is_decoder", "id2label", "label2id", "torchscript",
    "use_return_dict", "max_length", "unsloth_fixed", "chunk_size_feed_forward",
    "resid_pdrop", "embd_pdrop",  # dropout (Phi-3): training only
}
# Fields read by every family's converter.
_COMMON_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
}
_LLAMA_FIELDS = _COMMON_FIELDS | {"hidden_act", "attention_bias", "mlp_bias"}
_QWEN_FIELDS = _COMMON_FIELDS | {"hidden_act", "use_sliding_window", "sliding_window",
                                 "max_window_layers", "layer_types"}
_GEMMA3_FIELDS = _COMMON_FIELDS | {
    "attention_bias", "hidden_activation", "hidden_act", "query_pre_attn_scalar",
    "sliding_window", "sliding_window_pattern", "layer_types", "final_logit_softcapping",
    "attn_logit_softcapping", "use_bidirectional_attention", "rope_local_base_freq",
}


def _require(hf: dict, field: str, allowed, default=None):
    value = hf.get(field, default)
    if value not in allowed:
        raise HFCheckpointError(f"config.json field {field}={value!r} is not supported "
                         f"(supported: {allowed})")
    return value


# Keys a scaled RoPE may carry (transformers' RopeParameters), per type.
_ROPE_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"},
}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(params: dict | None, field: str, hf: dict | None = None,
          original: int | None = None) -> tuple[float | None, dict | None]:
    """HF rope parameters (either format) -> (theta, our rope_scaling or None).

    yarn and longrope get what transformers derives when the config leaves it
    out (modeling_rope_utils): the original context (``original``, where the
    family keeps it outside the rope parameters as Phi-3 does, else
    max_position_embeddings), the factor, the attention factor and yarn's betas.
    """
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
    if kind not in _ROPE_KEYS:
        raise HFCheckpointError(f"config.json {field}: rope type {kind!r} is not supported "
                                f"(supported: default, {', '.join(_ROPE_KEYS)})")
    extra = set(params) - _ROPE_KEYS[kind]
    if extra:
        raise HFCheckpointError(f"config.json {field}: unsupported keys {sorted(extra)} for {kind!r}")
    if kind in ("linear", "llama3"):
        missing = sorted(_ROPE_KEYS[kind] - set(params))
        if missing:
            raise HFCheckpointError(f"config.json {field}: {kind!r} lacks {missing}")
        return theta, {"type": kind, **params}
    return theta, _long_context_rope(kind, params, field, hf or {}, original)


def _long_context_rope(kind: str, p: dict, field: str, hf: dict, original) -> dict:
    """yarn / longrope parameters completed as transformers completes them."""
    max_len = hf.get("max_position_embeddings")
    if original is None:
        original = p.get("original_max_position_embeddings", max_len)
    factor = p.get("factor")
    if original is None or (factor is None and max_len is None):
        raise HFCheckpointError(f"config.json {field}: {kind!r} needs "
                                "original_max_position_embeddings and factor (or "
                                "max_position_embeddings to derive them)")
    if factor is None:  # transformers: the ratio of the two context lengths
        factor = max_len / original
    attention = p.get("attention_factor")
    if kind == "longrope":
        missing = sorted({"short_factor", "long_factor"} - set(p))
        if missing:
            raise HFCheckpointError(f"config.json {field}: 'longrope' lacks {missing}")
        if attention is None:
            attention = (1.0 if factor <= 1 else
                         math.sqrt(1 + math.log(factor) / math.log(original)))
        return dict(type=kind, short_factor=p["short_factor"], long_factor=p["long_factor"],
                    original_max_position_embeddings=int(original),
                    attention_factor=float(attention))
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    return dict(type=kind, factor=float(factor), original_max_position_embeddings=int(original),
                beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                attention_factor=float(attention), truncate=bool(p.get("truncate", True)))


def _eos(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _layer_types(types, n_layers: int) -> tuple[str, ...]:
    """HF layer_types ('full_attention' / 'sliding_attention') -> ours, checked."""
    names = {"sliding_attention": "local", "full_attention": "global"}
    bad = sorted(set(types) - set(names))
    if bad:
        raise HFCheckpointError(f"config.json layer_types {bad} are not supported "
                                "(supported: full_attention, sliding_attention)")
    if len(types) != n_layers:
        raise HFCheckpointError(f"config.json layer_types has {len(types)} entries for "
                                f"num_hidden_layers={n_layers}")
    return tuple(names[t] for t in types)


class Family(NamedTuple):
    """How one config.json model_type becomes a ModelConfig."""

    arch: str                             # ModelConfig.arch (and NAME_MAPS key)
    fields: frozenset                     # config.json fields it reads (others raise)
    build: Callable[[dict, dict], ModelConfig]  # (config.json, common fields) -> config


def _llama_rope(hf: dict, original: int | None = None,
                aliases: dict | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) of a single-RoPE config.json (rope_parameters or the older
    fields). ``original``: the original context where the family keeps it outside
    the rope parameters; ``aliases``: rope type names the family's transformers
    config renames."""
    field = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rp = hf.get(field)
    if rp and aliases:
        kind = rp.get("rope_type", rp.get("type"))
        rp = {k: v for k, v in rp.items() if k not in ("type", "rope_type")}
        rp["rope_type"] = aliases.get(kind, kind)
    theta, scaling = _rope(rp, field, hf, original)
    if field == "rope_scaling":
        theta = None
    return theta or hf.get("rope_theta", 10000.0), scaling


def _silu(hf: dict) -> None:
    _require(hf, "hidden_act", ("silu",), "silu")


def _silu_llama_rope(hf: dict, common: dict, rope: dict | None = None,
                     **layout) -> ModelConfig:
    """A SiLU model with Llama's RoPE (what most families share); ``layout``: the
    family's own ModelConfig fields (biases, norms, windows); ``rope``: its
    `_llama_rope` options."""
    _silu(hf)
    theta, scaling = _llama_rope(hf, **(rope or {}))
    return ModelConfig(**common, rope_theta=theta, rope_scaling=scaling,
                       tie_embeddings=hf.get("tie_word_embeddings", False), act="silu",
                       **layout)


def _llama_from_hf(hf: dict, common: dict) -> ModelConfig:
    """Llama (and SmolLM2): no biases, SiLU, global attention."""
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "mlp_bias", (False,), False)
    return _silu_llama_rope(hf, common)


def _windowed(common: dict, window) -> dict:
    """Every layer local with `window` when it is set (Mistral v0.1, Phi-3), else global."""
    if window is None:
        return {}
    return dict(sliding_window=int(window), layer_types=("local",) * common["n_layers"])


def _mistral_from_hf(hf: dict, common: dict) -> ModelConfig:
    """Mistral: Llama's layers, a sliding window on every layer where sliding_window is set."""
    return _silu_llama_rope(hf, common, **_windowed(common, hf.get("sliding_window")))


def _qwen_windows(hf: dict, common: dict) -> dict:
    """Qwen2/3: layers from max_window_layers on are local when use_sliding_window
    (transformers ignores sliding_window otherwise); layer_types when given."""
    n = common["n_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types")
    if window is None:
        return {}
    if types is None:
        start = hf.get("max_window_layers", n)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    return dict(sliding_window=int(window), layer_types=_layer_types(types, n))


def _qwen2_from_hf(hf: dict, common: dict) -> ModelConfig:
    """Qwen2 / Qwen2.5: biases on q, k, v."""
    return _silu_llama_rope(hf, common, attn_bias=True, **_qwen_windows(hf, common))


def _qwen3_from_hf(hf: dict, common: dict) -> ModelConfig:
    """Qwen3 (dense): per-head q/k norms; attention_bias would add an o bias too: refused."""
    _require(hf, "attention_bias", (False,), False)
    return _silu_llama_rope(hf, common, qk_norm="head", **_qwen_windows(hf, common))


def _phi3_from_hf(hf: dict, common: dict) -> ModelConfig:
    """Phi-3 / Phi-4: fused projections (split by the table), a sliding window where set.
    Phi3Config keeps the original context outside the rope parameters (4096 unless
    set) and reads the rope types 'su' and 'yarn' as 'longrope'."""
    _require(hf, "attention_bias", (False,), False)
    rope = dict(original=hf.get("original_max_position_embeddings", 4096),
                aliases={"su": "longrope", "yarn": "longrope"})
    return _silu_llama_rope(hf, common, rope=rope, **_windowed(common, hf.get("sliding_window")))


def _gelu_tanh(hf: dict) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise HFCheckpointError(f"config.json hidden_activation={act!r} is not supported "
                                "(supported: 'gelu_pytorch_tanh')")


def _gemma2_from_hf(hf: dict, common: dict) -> ModelConfig:
    """Gemma 2: alternating local / global layers sharing one RoPE, soft-capped
    attention scores and logits, scaled embeddings."""
    _require(hf, "attention_bias", (False,), False)
    if hf.get("use_bidirectional_attention"):
        raise HFCheckpointError("config.json use_bidirectional_attention=True is not supported")
    _gelu_tanh(hf)
    theta, scaling = _llama_rope(hf)
    n = common["n_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(n)]
    window = hf.get("sliding_window", 4096)
    size = hf.get("sliding_window_size")  # an older name some checkpoints also carry
    if size is not None and size != window:
        raise HFCheckpointError(f"config.json sliding_window_size={size} differs from "
                                f"sliding_window={window}")
    return ModelConfig(
        **common, rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=hf.get("tie_word_embeddings", True), sliding_window=window,
        layer_types=_layer_types(types, n), query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        act="gelu_tanh", embed_scale=True, norm_placement="sandwich",
        final_logit_softcap=hf.get("final_logit_softcapping"),
        attn_logit_softcap=hf.get("attn_logit_softcapping"))


def _gemma3_from_hf(hf: dict, common: dict) -> ModelConfig:
    """The Gemma 3 (text) fields of config.json (checked) on top of ``common``."""
    _require(hf, "attention_bias", (False,), False)
    if hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 stores this field but never applies it; refuse rather
        # than guess which behaviour the checkpoint was trained with.
        raise HFCheckpointError("config.json attn_logit_softcapping is not supported for "
                                "gemma3_text (transformers ignores it); set it to null")
    if hf.get("use_bidirectional_attention"):
        raise HFCheckpointError("config.json use_bidirectional_attention=True is not supported")
    _gelu_tanh(hf)
    theta, local_theta, scaling = _gemma3_rope(hf)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(common["n_layers"])]
    return ModelConfig(
        **common, rope_theta=theta, rope_local_theta=local_theta, rope_scaling=scaling,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        sliding_window=hf.get("sliding_window"),
        layer_types=_layer_types(layer_types, common["n_layers"]),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256), act="gelu_tanh",
        embed_scale=True, final_logit_softcap=hf.get("final_logit_softcapping"),
        norm_placement="sandwich", qk_norm="head")


def _gemma3_rope(hf: dict):
    """(global theta, local theta, global scaling) of a Gemma 3 config.json."""
    rp = hf.get("rope_parameters")
    if rp is not None:
        unknown = set(rp) - {"full_attention", "sliding_attention"}
        if unknown:
            raise HFCheckpointError(f"config.json rope_parameters keys {sorted(unknown)} not "
                                    f"supported")
        theta, scaling = _rope(rp.get("full_attention"), "rope_parameters.full_attention", hf)
        local_theta, local_scaling = _rope(rp.get("sliding_attention"),
                                           "rope_parameters.sliding_attention")
        if local_scaling is not None:
            raise HFCheckpointError("config.json rope_parameters.sliding_attention: scaling of "
                                    "local layers is not supported")
    else:
        _, scaling = _rope(hf.get("rope_scaling"), "rope_scaling", hf)
        theta, local_theta = None, None
    return (theta or hf.get("rope_theta", 1_000_000.0),
            local_theta or hf.get("rope_local_base_freq", 10_000.0), scaling)


def _olmo2_from_hf(hf: dict, common: dict) -> ModelConfig:
    """OLMo 2: norms after attention and the MLP only, q/k norms over all features."""
    _require(hf, "attention_bias", (False,), False)
    return _silu_llama_rope(hf, common, norm_placement="post", qk_norm="full")


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", frozenset(_LLAMA_FIELDS), _llama_from_hf),
    "mistral": Family("mistral", frozenset(_COMMON_FIELDS | {"hidden_act", "sliding_window"}),
                      _mistral_from_hf),
    "qwen2": Family("qwen2", frozenset(_QWEN_FIELDS), _qwen2_from_hf),
    "qwen3": Family("qwen3", frozenset(_QWEN_FIELDS | {"attention_bias"}), _qwen3_from_hf),
    "phi3": Family("phi3", frozenset(_COMMON_FIELDS | {
        "hidden_act", "attention_bias", "sliding_window", "original_max_position_embeddings"}),
        _phi3_from_hf),
    "gemma2": Family("gemma2", frozenset(_COMMON_FIELDS | {
        "attention_bias", "hidden_activation", "hidden_act", "query_pre_attn_scalar",
        "sliding_window", "sliding_window_size", "layer_types", "final_logit_softcapping",
        "attn_logit_softcapping", "use_bidirectional_attention"}), _gemma2_from_hf),
    "gemma3_text": Family("gemma3", frozenset(_GEMMA3_FIELDS), _gemma3_from_hf),
    "olmo2": Family("olmo2", frozenset(_COMMON_FIELDS | {"hidden_act", "attention_bias"}),
                    _olmo2_from_hf),
}


def config_from_hf(hf: dict) -> ModelConfig:
    """Converts a parsed config.json into a ModelConfig, refusing what we do not handle.

    Args:
        hf: the dict read from config.json.

    Returns:
        The ModelConfig.

    Raises:
        HFCheckpointError: unsupported model_type, or a config field that is unknown
            or has a value this implementation does not support (the message names it).
    """
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise HFCheckpointError(f"config.json model_type={model_type!r} is not supported "
                                f"(supported: {', '.join(repr(t) for t in FAMILIES)})")
    unknown = sorted(set(hf) - family.fields - _IGNORED_FIELDS)
    if unknown:
        raise HFCheckpointError(f"config.json fields {unknown} are not handled for {model_type}")
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    common = dict(
        arch=family.arch, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        d_ff=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        bos_id=hf.get("bos_token_id"), eos_ids=_eos(hf.get("eos_token_id")),
        pad_id=hf.get("pad_token_id"),
    )
    try:
        return family.build(hf, common)
    except ValueError as e:  # ModelConfig's own checks (e.g. heads vs kv heads)
        if isinstance(e, UserError):
            raise
        raise HFCheckpointError(f"config.json: {e}") from None


# --------------------------------------------------------------------------- tensors

# safetensors dtype names -> NumPy dtypes we read.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class _Tensor(NamedTuple):
    """Where one tensor of a safetensors file lies."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset
    n_bytes: int


def _header(path: str) -> list[_Tensor]:
    """The tensor table of one safetensors file, checked against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFCheckpointError(f"{path} is truncated: {size} bytes, no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise HFCheckpointError(f"{path} is truncated or not a safetensors file (header of "
                                    f"{n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise HFCheckpointError(f"{path}: its safetensors header is not valid JSON "
                                    f"({e})") from None
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise HFCheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, "
                                    f"not supported (supported: {', '.join(_DTYPES)})")
        a, b = info["data_offsets"]
        shape = tuple(info["shape"])
        if b - a != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise HFCheckpointError(f"{path}: tensor {name!r} has {b - a} bytes for shape {shape}")
        if 8 + n + b > size:
            raise HFCheckpointError(f"{path} is truncated: tensor {name!r} ends at byte "
                                    f"{8 + n + b}, the file has {size}")
        out.append(_Tensor(name, np.dtype(dtype), shape, 8 + n + a, b - a))
    return sorted(out, key=lambda t: t.start)


def safetensors_files(directory: str) -> list[str]:
    """The safetensors files of a directory: its index's shards, or model.safetensors."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index ({e})") from None
        missing = [name for name in files if not os.path.isfile(os.path.join(directory, name))]
        if missing:
            raise HFCheckpointError(f"{index} lists shards that are missing: {missing[:3]}")
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise HFCheckpointError(f"no model.safetensors(.index.json) in {directory}")
    return [os.path.join(directory, name) for name in files]


def iter_safetensors(directory: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, NumPy array) over model.safetensors or its index's shards.

    Each tensor is read into memory of its own with plain reads (bfloat16 as
    ml_dtypes.bfloat16), in file order; the previous one is no longer
    referenced here once the next is read, so a consumer that converts and
    drops each holds one tensor at a time.
    """
    for path in safetensors_files(directory):
        with open(path, "rb", buffering=0) as f:
            for t in _header(path):
                buf = np.empty(t.n_bytes, np.uint8)
                f.seek(t.start)
                got = f.readinto(memoryview(buf))
                if got != t.n_bytes:
                    raise HFCheckpointError(f"{path}: tensor {t.name!r} is truncated")
                yield t.name, buf.view(t.dtype).reshape(t.shape)
                del buf


def convert_tensors(cfg: ModelConfig, tensors, dtype=np.float32, table=None) -> dict:
    """Maps (HF name, array) pairs onto the params pytree using NAME_MAPS[cfg.arch].

    Args:
        cfg: the architecture (decides the table and the expected shapes).
        tensors: iterable of (name, array); each is converted and written into
            its stacked array before the next is taken.
        dtype: dtype of the returned arrays (None keeps each tensor's own).
        table: the name table (default: NAME_MAPS[cfg.arch]).

    Returns:
        The params pytree of notes/MODEL_CONTRACT.md (NumPy arrays).

    Raises:
        HFCheckpointError: a tensor no rule maps, a missing or duplicated tensor, or
            a shape that disagrees with cfg (the message names the tensor).
    """
    rules = [(re.compile(p), (path,) if isinstance(path, str) else tuple(path), fn)
             for p, path, fn in (NAME_MAPS[cfg.arch] if table is None else table)]
    ignored = [re.compile(p) for p in _IGNORED_TENSORS]
    out = Assembler(cfg, dtype, HFCheckpointError, "checkpoint")
    for name, w in tensors:
        for rx, paths, fn in rules:
            m = rx.fullmatch(name)
            if m:
                break
        else:
            if any(rx.fullmatch(name) for rx in ignored):
                continue
            raise HFCheckpointError(f"tensor {name!r} has no rule in the {cfg.arch} name map")
        if paths == ("lm_head",) and cfg.tie_embeddings:
            continue  # tied: the head is the embedding
        values = fn(np.asarray(w), cfg)
        values = values if isinstance(values, tuple) else (values,)
        layer = int(m.group(1)) if m.groups() else None
        for path, value in zip(paths, values, strict=True):
            out.put(path, layer, value, name)
    return out.finish()


def read_config(directory: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory (config.json, plus the EOS ids of a
    generation_config.json when there is one), without reading any tensor."""
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
    return cfg


def load_hf(directory: str, dtype="default") -> tuple[ModelConfig, dict]:
    """Loads a Hugging Face model directory into (ModelConfig, params).

    Args:
        directory: holds config.json and model.safetensors (or a sharded index).
            A generation_config.json, when present, adds its eos_token_id(s).
        dtype: parameter dtype (NumPy or ml_dtypes); 'default' is float32, or
            bfloat16 for a model of more than a billion parameters
            (`brf.checkpoints.assemble.default_dtype`); None keeps the stored dtype.

    Returns:
        (cfg, params) with params a nested dict of numpy arrays (pass through
        `jax.device_put` to place them).

    Raises:
        HFCheckpointError: an unreadable or unsupported directory (named).
        CheckpointTooLargeError: the parameters would not fit in the host's memory.
    """
    cfg = read_config(directory)
    if isinstance(dtype, str) and dtype == "default":
        dtype = default_dtype(cfg)
    check_fits(cfg, np.float32 if dtype is None else dtype, directory)
    return cfg, convert_tensors(cfg, iter_safetensors(directory), dtype)


__all__ = ["FAMILIES", "GEMMA2_MAP", "GEMMA3_MAP", "HFCheckpointError", "LLAMA_MAP", "NAME_MAPS",
           "OLMO2_MAP", "PHI3_MAP", "QWEN2_MAP", "QWEN3_MAP", "config_from_hf", "convert_tensors",
           "iter_safetensors", "load_hf", "read_config", "safetensors_files"]
