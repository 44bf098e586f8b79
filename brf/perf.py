"""Speed of brf's models, decoding and fusion with random weights at real shapes.

What ``experiments/bench_gpu.py`` measures, importable so a test runs it at toy
sizes. Every figure is set beside a bound measured or derived in the same run:

* **scoring** (teacher-forced forward passes without a cache, the study's
  workload): tokens/s and model FLOP utilisation against the device's peak
  (``PEAK_FLOPS``; None where the device is not listed, e.g. a CPU);
* **decoding** at a fixed context, batch 1 and 16: steps/s of brf's own loop
  over its jitted, cache-donating ``decode_step`` (one dispatch per step, as
  before issue 52), of the same step looped on the device (``lax.fori_loop``),
  and the memory roofline: the bytes a step must read (weights and the KV
  cache it attends to) over the memory bandwidth of a large reduction timed
  in the same run;
* **the fused pair**: greedy fused generation through the public
  ``brf.ensemble.generate`` on both engines, beside the members' own decoding
  steps (:func:`brf.ensemble.bench.bench_engines`);
* **brf.fuse** from Python against the same computation inside ``jax.jit``;
* **attention**: brf's against ``jax.nn.dot_product_attention`` at a model's
  head shapes (one decoding query over a context, a causal prompt).

Members need a tokenizer to generate; :func:`word_tokenizer` builds a
word-level one with exactly the model's vocabulary size, so no tokenizer file
is needed either.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.benchmark import memory_bandwidth, time_call
from brf.models import init_cache, init_params
from brf.models import transformer as T
from brf.models.config import ModelConfig
from brf.models.shapes import param_count

# Dense bfloat16 peak FLOP/s by jax device_kind (vendors' data sheets, SXM parts).
PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100": 989e12,
              "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
              "NVIDIA A100-SXM4-40GB": 312e12, "TPU v5e": 197e12, "TPU v4": 275e12}


def peak_flops(device=None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind
    return PEAK_FLOPS.get(kind)


def random_params(cfg: ModelConfig, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """Random weights in brf's decoding layout (per-layer, fused projections)."""
    params = init_params(cfg, jax.random.PRNGKey(seed), dtype)
    out = T.unstack_layers(params)
    del params
    gc.collect()
    return out


def forward_flops(cfg: ModelConfig, tokens: int, context: float) -> float:
    """FLOPs of one forward pass per token: 2 per weight multiply-add (the output
    head included, the embedding lookup not) plus attention's two products over
    ``context`` keys on average."""
    n = param_count(cfg)
    attn = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
    return tokens * (2 * (n["layers"] + n["head"]) + attn)


def scoring(cfg: ModelConfig, params, *, batch: int, length: int, dtype, repeats: int) -> dict:
    """Teacher-forced forward passes without a cache: tokens/s and MFU."""
    fwd = jax.jit(lambda p, t: T.forward(p, cfg, t, dtype=dtype, logits="all")[0])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, length)),
                         jnp.int32)
    s = time_call(lambda: fwd(params, tokens), repeats=repeats, warmup=1)
    flops = forward_flops(cfg, batch * length, length / 2)
    peak = peak_flops()
    return {"batch": batch, "length": length, "seconds": s, "tokens_per_s": batch * length / s,
            "tflops": flops / s / 1e12, "mfu": None if peak is None else flops / s / peak}


def _cache_bytes(cfg: ModelConfig, batch: int, context: int, dtype) -> int:
    """Bytes of KV cache one decoding step reads (local layers read their window)."""
    per_layer = [min(context, cfg.sliding_window) if t == "local" else context
                 for t in cfg.layer_types]
    return 2 * batch * cfg.n_kv_heads * cfg.head_dim * sum(per_layer) * jnp.dtype(dtype).itemsize


def decoding(cfg: ModelConfig, params, *, batch: int, context: int, steps: int, dtype,
             bandwidth: float, cache_slots: int | None = None) -> dict:
    """Greedy decoding steps/s at a context: brf's per-step loop, the step looped on
    the device, and the memory roofline.

    The cache holds ``context`` tokens (random prompt, prefilled) and has
    ``cache_slots`` slots (default: the context plus the steps, rounded up);
    with more slots than the context, the bounded reads (``Reads``) matter.
    """
    rng = np.random.default_rng(1)
    slots = cache_slots or T._bucket(context + steps)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, context)), jnp.int32)
    reads = T.cache_reads(cfg, context + steps, slots, [context] * batch, steps)

    def prefill():
        return T.prefill_donated(params, cfg, prompt, None, init_cache(cfg, batch, slots, dtype),
                                 dtype=dtype, logits="last")

    def host_loop(read_bounds):
        logits, cache = prefill()
        jax.block_until_ready(logits)
        t0 = time.perf_counter()
        for _ in range(steps):
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, cache = T.decode_step_donated(params, cfg, token, cache, dtype=dtype,
                                                  reads=read_bounds)
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    @jax.jit
    def device_loop(params, logits, cache):
        def body(_, carry):
            logits, cache = carry
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out, new_L, write_at, meta = T._compute(params, cfg, token[:, None], None, cache,
                                                    jnp.dtype(dtype), "last", reads)
            return out, T.ordered_write(cache, out, new_L, write_at, meta)
        return jax.lax.fori_loop(0, steps, body, (logits, cache))

    def on_device():
        logits, cache = prefill()
        jax.block_until_ready(logits)
        t0 = time.perf_counter()
        jax.block_until_ready(device_loop(params, logits, cache))
        return time.perf_counter() - t0

    host_loop(None), host_loop(reads), on_device()  # compile
    host_all = min(host_loop(None) for _ in range(2))
    host_bounded = min(host_loop(reads) for _ in range(2))
    device = min(on_device() for _ in range(2))
    n = param_count(cfg)
    weight_bytes = (n["layers"] + n["head"]) * jnp.dtype(dtype).itemsize
    step_bytes = weight_bytes + _cache_bytes(cfg, batch, context + steps // 2, dtype)
    roof = bandwidth / step_bytes
    return {"batch": batch, "context": context, "cache_slots": slots, "steps": steps,
            "host_loop_steps_per_s": steps / host_all,
            "host_loop_bounded_reads_steps_per_s": steps / host_bounded,
            "device_loop_steps_per_s": steps / device,
            "roofline_steps_per_s": roof,
            "host_loop_of_roofline": steps / host_all / roof,
            "device_loop_of_roofline": steps / device / roof,
            "step_bytes": step_bytes}


def attention(cfg: ModelConfig, *, batch: int, context: int, prompt: int, dtype,
              repeats: int = 10) -> dict:
    """brf's attention against ``jax.nn.dot_product_attention`` at a model's head shapes:
    one decoding query per sequence over ``context`` cached keys (brf's cache layout;
    the library call gets the keys in its own layout, transposed outside the timing),
    and a causal ``prompt`` attending to itself. On a GPU the library call may lower
    to a fused (cuDNN) kernel; on a CPU both are XLA."""
    rng = np.random.default_rng(2)
    B, K, H, E = batch, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    q1, kT, v, kn, vn = arr(B, 1, H, E), arr(B, K, E, context), arr(B, K, context, E), \
        arr(B, K, E, 1), arr(B, K, 1, E)
    ones = jnp.ones((B, 1, context), bool)
    ours_1 = jax.jit(lambda q, kT, v, kn, vn: T._attention(
        cfg, q, [(kT, v, ones), (kn, vn, jnp.ones((B, 1, 1), bool))]))
    k_lib = jnp.concatenate([kT, kn], -1).transpose(0, 3, 1, 2)
    v_lib = jnp.concatenate([v, vn], 2).transpose(0, 2, 1, 3)
    lib_1 = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=cfg.attn_scale))
    qp, kp, vp = arr(B, prompt, H, E), arr(B, prompt, K, E), arr(B, prompt, K, E)
    pos = jnp.broadcast_to(jnp.arange(prompt)[None], (B, prompt))
    mask = T._mask(pos, pos, T._NO_WINDOW)
    ours_p = jax.jit(lambda q, k, v: T._causal_attention(
        cfg, q, None, (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)))
    lib_p = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=cfg.attn_scale,
                                                                  is_causal=True))
    out = {"batch": batch, "context": context, "prompt": prompt}
    out["decode_brf_s"] = time_call(lambda: ours_1(q1, kT, v, kn, vn), repeats=repeats)
    out["decode_library_s"] = time_call(lambda: lib_1(q1, k_lib, v_lib), repeats=repeats)
    out["prompt_brf_s"] = time_call(lambda: ours_p(qp, kp, vp), repeats=max(2, repeats // 5))
    out["prompt_library_s"] = time_call(lambda: lib_p(qp, kp, vp), repeats=max(2, repeats // 5))
    diff = jnp.abs(ours_p(qp, kp, vp).astype(jnp.float32)
                   - lib_p(qp, kp, vp).reshape(B, prompt, H * E).astype(jnp.float32))
    out["prompt_max_abs_diff"] = float(jnp.max(diff))
    return out


def word_tokenizer(vocab_size: int, eos_id: int = 1):
    """A word-level tokenizer with ``vocab_size`` tokens ('<pad>', '</s>', 'w2', ...)
    for random members: prompts are written as 'w5 w17 ...', and generated ids
    decode to such words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return TokenizersBackend(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def random_member(name: str, cfg: ModelConfig, params, tokenizer, weight: float):
    from brf.ensemble.member import Member
    cfg = dataclasses.replace(cfg, eos_ids=(1,), bos_id=None, pad_id=0)
    return Member(name=name, cfg=cfg, params=params, tokenizer=tokenizer, weight=weight)


def fused_pair(members: Sequence, *, batch: int, prompt_len: int, steps: int,
               phase: str, repeats: int, dtype=jnp.bfloat16) -> dict:
    """Fused greedy generation (BRF) on both engines beside the members' own steps,
    computing in ``dtype`` (the weights' dtype: no cast per step)."""
    from brf.ensemble.bench import bench_engines
    prompt = " ".join(f"w{i}" for i in range(2, 2 + prompt_len))
    table, nums = bench_engines(list(members), [prompt] * batch,
                                [m.weight for m in members], aligner="identity",
                                max_new_tokens=steps, repeats=repeats,
                                method_params={"phase": phase}, dtype=dtype)
    out = {"batch": batch, "prompt_len": prompt_len, "steps": steps, "table": table,
           "same_text": nums["same_text"], "members_s": nums["members_s"]}
    for key, label in (("host", "fused, host loop (engine='host')"),
                       ("device", "fused, compiled step (engine='device')")):
        out[f"{key}_s"] = nums[label]
        out[f"{key}_of_members"] = nums["members_s"] / nums[label]
    return out


def speculative_pair(members: Sequence, *, prompt_len: int, steps: int, phase: str,
                     repeats: int, dtype=jnp.bfloat16,
                     drafter: str = "ngram(n=3, k=4, cost=0)") -> dict:
    """Greedy speculative fused generation (BRF) with its rounds on the host and as
    compiled blocks on the device (``engine``), beside plain fused generation: each
    run's best seconds of ``repeats`` after one untimed call, whether its text is
    plain decoding's, and the drafts' acceptance (random weights: an n-gram draft is
    accepted where the greedy text repeats, a member's where the fused argmax is
    its own). ``cost=0``: the rounds draft throughout."""
    from brf.ensemble import generate
    from brf.ensemble.speculative import generate_speculative
    prompt = [" ".join(f"w{i}" for i in range(2, 2 + prompt_len))]
    kw = dict(weights=[m.weight for m in members], method="born",
              method_params={"phase": phase}, sampler="greedy", max_new_tokens=steps,
              dtype=dtype)
    runs = {"plain": lambda: generate(members, prompt, aligner="identity", **kw)}
    for engine in ("host", "device"):
        runs[engine] = lambda engine=engine: generate_speculative(
            members, prompt, drafter=drafter, engine=engine, **kw)
    out: dict[str, Any] = {"drafter": drafter, "prompt_len": prompt_len, "steps": steps}
    results = {k: f() for k, f in runs.items()}
    for key, f in runs.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        out[f"{key}_s"] = best
    for key in ("host", "device"):
        stats = results[key][0].spec.summary()
        out[f"{key}_same_text"] = results[key][0].text == results["plain"][0].text
        out[f"{key}_of_plain"] = out["plain_s"] / out[f"{key}_s"]
        out[f"{key}_acceptance"], out[f"{key}_per_round"] = stats["acceptance"], stats["per_round"]
    out["device_of_host"] = out["host_s"] / out["device_s"]
    return out


def fuse_call(vocab: int, *, batch: int = 64, n: int = 2, phase: str, rounds: int = 5) -> dict:
    """brf.fuse('born') from Python (validated), a compiled fuser, and inside jit."""
    import brf
    rng = np.random.default_rng(0)
    x = jnp.asarray((rng.standard_normal((batch, n, vocab)) * 3).astype(np.float32))
    w = jnp.full((n,), 1.0 / n, jnp.float32)
    fuser = brf.fusion.compile("born", phase=phase)
    inside = jax.jit(lambda x, w: brf.fuse("born", x, w, validate=False, phase=phase))
    calls = {"python": lambda: brf.fuse("born", x, w, phase=phase),
             "compiled": lambda: fuser(x, w), "inside_jit": lambda: inside(x, w)}
    out: dict[str, Any] = {k: float(np.median([time_call(f, repeats=10) for _ in range(rounds)]))
                           for k, f in calls.items()}
    out["python_over_jit"] = out["python"] / out["inside_jit"]
    return {"batch": batch, "members": n, "vocab": vocab, **out}


def bandwidth_bytes_per_s(n_bytes: int) -> float:
    """Memory bandwidth of a large jitted reduction (the roofline's denominator)."""
    return memory_bandwidth(n_bytes, repeats=10)


__all__ = ["PEAK_FLOPS", "attention", "bandwidth_bytes_per_s", "decoding", "forward_flops", "fuse_call",
           "fused_pair", "peak_flops", "random_member", "random_params", "scoring",
           "speculative_pair",
           "word_tokenizer"]
