"""Architectures of real models as ModelConfigs, for benchmarks with random weights.

No checkpoint is needed to measure what the hardware does with a model's shapes:
``init_params(SHAPES[name], key, dtype)`` gives weights of the right sizes. The
values are those of the models' published configs (the two shipped models' agree
with what ``brf.checkpoints.gguf.load_config`` reads from their GGUF files; the
tokenizer-dependent fields -- BOS, EOS, padding -- are left out).

:func:`shrunk` keeps an architecture's kind (Llama or Gemma 3, sliding windows,
grouped queries, tied head) at toy sizes, so a benchmark's code path runs in
seconds on a CPU (``--tiny``).
"""

from __future__ import annotations

import dataclasses

from brf.models.config import ModelConfig


def _gemma3_layers(n: int) -> tuple[str, ...]:
    """Gemma 3's pattern: five sliding-window layers, then one global, repeated."""
    return tuple("local" if (i + 1) % 6 else "global" for i in range(n))


_LLAMA3_ROPE = dict(type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

SHAPES: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, d_ff=14336, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0), tie_embeddings=False,
        max_seq_len=131072),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        head_dim=64, d_ff=8192, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), tie_embeddings=True,
        max_seq_len=131072),
    "gemma-3-4b": ModelConfig(
        arch="gemma3", vocab_size=262208, d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4,
        head_dim=256, d_ff=10240, norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_theta=10000.0, rope_scaling=dict(type="linear", factor=8.0),
        sliding_window=1024, layer_types=_gemma3_layers(34), query_pre_attn_scalar=256.0,
        act="gelu_tanh", embed_scale=True, tie_embeddings=True, max_seq_len=131072),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, d_ff=1536, norm_eps=1e-5, rope_theta=100000.0, tie_embeddings=True,
        max_seq_len=8192),
    "gemma-3-270m": ModelConfig(
        arch="gemma3", vocab_size=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1,
        head_dim=256, d_ff=2048, norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_theta=10000.0, sliding_window=512, layer_types=_gemma3_layers(18),
        query_pre_attn_scalar=256.0, act="gelu_tanh", embed_scale=True, tie_embeddings=True,
        max_seq_len=32768),
}


def shrunk(cfg: ModelConfig, vocab_size: int = 512) -> ModelConfig:
    """The same kind of architecture at toy sizes (two or six layers, d_model 64)."""
    local = "local" in cfg.layer_types
    n_layers = 6 if local else 2
    return dataclasses.replace(
        cfg, vocab_size=vocab_size, d_model=64, n_layers=n_layers,
        n_heads=4, n_kv_heads=2 if cfg.n_kv_heads < cfg.n_heads else 4, head_dim=16, d_ff=128,
        sliding_window=16 if local else None,
        layer_types=_gemma3_layers(n_layers) if local else ("global",) * n_layers,
        query_pre_attn_scalar=16.0 if cfg.query_pre_attn_scalar else None, max_seq_len=1024)


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters: 'embed' (input embedding), 'head' (output projection, counted
    even when tied: it is read and multiplied every step), 'layers' (the rest)."""
    L, D, E, F = cfg.n_layers, cfg.d_model, cfg.head_dim, cfg.d_ff
    attn = D * E * (cfg.n_heads + 2 * cfg.n_kv_heads) + cfg.n_heads * E * D
    norms = 2 * D + (2 * E + 2 * D if cfg.arch == "gemma3" else 0)
    return {"embed": cfg.vocab_size * D, "head": cfg.vocab_size * D,
            "layers": L * (attn + 3 * D * F + norms) + D}


__all__ = ["SHAPES", "param_count", "shrunk"]
