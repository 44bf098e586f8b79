"""Synthetic Hugging Face checkpoints: random weights at a real model's shape, on disk.

For measuring what loading a large checkpoint costs (experiments/bench_load.py)
without downloading one, and for tests of the sharded reader. The directory
holds what transformers' save_pretrained writes for a Qwen2 model: config.json,
and safetensors shards of at most ``shard_bytes`` with
model.safetensors.index.json. Tensors are written one at a time (the writer
never holds more than one), random normal scaled by 0.02 (norm scales 1),
stored in bfloat16 (as the large checkpoints people publish are) or float32.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

# Qwen2.5-3B's shape (3.09e9 parameters, tied head), with `layers` chosen by the caller.
QWEN25_3B = dict(model_type="qwen2", vocab_size=151936, hidden_size=2048,
                 intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
                 use_sliding_window=False, bos_token_id=151643, eos_token_id=151645)

_ST_DTYPES = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32"}


def qwen2_tensors(hf: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a Qwen2 checkpoint with config `hf` stores."""
    d, f, L = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    e = d // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * e, hf["num_key_value_heads"] * e
    out = [("model.embed_tokens.weight", (hf["vocab_size"], d))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (q, d)), (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.weight", (kv, d)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (d, q)),
                (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    out.append(("model.norm.weight", (d,)))
    if not hf.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (hf["vocab_size"], d)))
    return out


def _random(shape, name: str, dtype, rng) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype)
    out = np.empty(shape, dtype)
    flat = out.reshape(-1)
    step = 1 << 24  # draw in float32 chunks of 64 MB
    for start in range(0, flat.size, step):
        n = min(step, flat.size - start)
        flat[start:start + n] = (0.02 * rng.standard_normal(n, np.float32)).astype(dtype)
    return out


def write_synthetic_hf(directory: str, hf: dict, dtype=ml_dtypes.bfloat16,
                       shard_bytes: int = 2 << 30, seed: int = 0) -> int:
    """Writes a random Qwen2 checkpoint with config `hf` into `directory`.

    Args:
        directory: created if needed; config.json, model-0000i-of-0000n.safetensors
            and model.safetensors.index.json are written into it.
        hf: the config.json fields (e.g. ``dict(QWEN25_3B, num_hidden_layers=28)``).
        dtype: bfloat16 or float32.
        shard_bytes: the most bytes of tensors a shard holds.
        seed: the weights' random seed.

    Returns:
        The number of parameters written.
    """
    dtype = np.dtype(dtype)
    os.makedirs(directory, exist_ok=True)
    tensors = qwen2_tensors(hf)
    shards, cur, size = [], [], 0
    for name, shape in tensors:
        n = math.prod(shape) * dtype.itemsize
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    shards.append(cur)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        with open(os.path.join(directory, fname), "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for name, shape in shard:
                f.write(_random(shape, name, dtype, rng).tobytes())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**hf, "architectures": ["Qwen2ForCausalLM"],
                   "torch_dtype": "bfloat16" if dtype.itemsize == 2 else "float32"}, f)
    return sum(math.prod(s) for _, s in tensors)


__all__ = ["QWEN25_3B", "qwen2_tensors", "write_synthetic_hf"]
