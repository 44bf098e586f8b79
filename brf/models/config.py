"""ModelConfig: the architecture description shared by brf/models and brf/checkpoints.

The fields follow notes/MODEL_CONTRACT.md. The dataclass is frozen and hashable
(so it can be a static argument of `jax.jit`) and JSON-serialisable through
`dataclasses.asdict` / `ModelConfig.from_dict`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope")
LAYER_TYPES = ("global", "local")
ACTIVATIONS = ("silu", "gelu_tanh")
# Where a layer's RMSNorms sit: 'pre' (Llama: before attention and the MLP), 'sandwich'
# (Gemma 2/3: before and after each), 'post' (OLMo 2: after each only).
NORM_PLACEMENTS = ("pre", "sandwich", "post")
# Norms of queries and keys before RoPE: 'none'; 'head' (Gemma 3, Qwen3: over each
# head's E features); 'full' (OLMo 2: over all H*E / K*E projected features).
QK_NORMS = ("none", "head", "full")
# Per architecture, the structure a config gets when it does not state it (checkpoints
# converted before these fields existed state neither).
_ARCH_DEFAULTS = {"gemma3": dict(norm_placement="sandwich", qk_norm="head"),
                  "gemma2": dict(norm_placement="sandwich", qk_norm="none"),
                  "qwen3": dict(norm_placement="pre", qk_norm="head"),
                  "olmo2": dict(norm_placement="post", qk_norm="full")}
_DEFAULTS = dict(norm_placement="pre", qk_norm="none")

# Keys each supported rope_scaling type needs besides "type" (the readers fill in what
# transformers derives, e.g. yarn's and longrope's attention_factor, so the engine
# needs nothing else; yarn may also carry "truncate", default True).
_ROPE_SCALING_KEYS = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                              "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "attention_factor"),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings",
                     "attention_factor"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (every family of
    `brf.models.ARCHITECTURES` runs on one engine; these fields select the differences).

    See notes/MODEL_CONTRACT.md for the meaning of every field.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    norm_eps: float
    rope_theta: float
    rope_local_theta: float | None = None
    rope_scaling: dict | None = None
    tie_embeddings: bool = True
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    act: str = "silu"
    embed_scale: bool = False
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    attn_bias: bool = False
    qk_norm: str | None = None
    norm_placement: str | None = None
    max_seq_len: int = 2048
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None

    def __post_init__(self):
        # Normalise list-valued fields (e.g. after a JSON round trip) to tuples.
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("global",) * self.n_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        if self.rope_scaling is not None:  # lists (longrope's factors) as tuples: hashable
            object.__setattr__(self, "rope_scaling", {
                k: tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else v
                for k, v in self.rope_scaling.items()})
        for name, value in {**_DEFAULTS, **_ARCH_DEFAULTS.get(self.arch, {})}.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        self.validate()

    def __hash__(self):
        # Computed once: a config is a static jit argument, hashed on every call.
        h = self.__dict__.get("_hash")
        if h is None:
            fields = (getattr(self, f.name) for f in dataclasses.fields(self))
            h = hash(tuple(tuple(sorted(f.items())) if isinstance(f, dict) else f
                           for f in fields))
            object.__setattr__(self, "_hash", h)
        return h

    def validate(self) -> None:
        """Raises ValueError naming the first field that is inconsistent."""
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, "
                                              f"n_layers={self.n_layers}")
        bad = set(self.layer_types) - set(LAYER_TYPES)
        if bad:
            raise ValueError(f"layer_types: unknown {sorted(bad)}; use {LAYER_TYPES}")
        if "local" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window must be set when layer_types has local")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                                              f"n_kv_heads={self.n_kv_heads}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement={self.norm_placement!r} unsupported; use one of "
                             f"{NORM_PLACEMENTS}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} unsupported; use one of {QK_NORMS}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"act={self.act!r} unsupported; use one of {ACTIVATIONS}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type")
            if kind not in ROPE_SCALING_TYPES:
                raise ValueError(f"rope_scaling type {kind!r} unsupported; supported: "
                                                  f"{ROPE_SCALING_TYPES}")
            missing = [k for k in _ROPE_SCALING_KEYS[kind]
                                  if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling {kind!r} lacks keys {missing}")
            for key in ("short_factor", "long_factor"):
                n = len(self.rope_scaling.get(key, ()) or ())
                if kind == "longrope" and n != self.head_dim // 2:
                    raise ValueError(f"rope_scaling longrope {key} has {n} entries; "
                                     f"head_dim // 2 = {self.head_dim // 2}")

    @property
    def attn_scale(self) -> float:
        """Multiplier applied to q.k: query_pre_attn_scalar**-0.5 or head_dim**-0.5."""
        base = self.query_pre_attn_scalar or self.head_dim
        return 1.0 / math.sqrt(base)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {sorted(unknown)}")
        return cls(**d)
