"""Pure-function forward passes for decoder-only transformers (Llama, Gemma 3).

One code path serves both families; the differences are fields of ModelConfig
(activation, embedding scale, per-layer window and RoPE base) and the presence
of the Gemma-only parameters (q/k norms, post-attention / post-MLP norms).
Layers are stacked on a leading axis and run with `lax.scan`, so compile time
does not grow with depth.

Shapes: B batch, T new tokens, S cache slots, D d_model, H query heads,
K kv heads, G = H // K, E head_dim, F d_ff, V vocab, L layers.

Padding: every call takes `valid_BxT` (True for real tokens). A sequence's
positions count only its valid tokens, so left- and right-padded batches give
each sequence the same positions as when it runs alone. Invalid tokens write
their K/V into the cache with position -1 and are never attended to.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from brf.models.config import ModelConfig

_NEG = -0.7 * float(np.finfo(np.float32).max)  # finite: fully masked rows stay NaN-free
_NO_WINDOW = np.iinfo(np.int32).max


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of the params pytree of notes/MODEL_CONTRACT.md, as nested dicts of tuples."""
    L, D, F, E = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.head_dim
    layers = {
        "attn_norm": (L, D),
        "wq": (L, D, cfg.n_heads * E),
        "wk": (L, D, cfg.n_kv_heads * E),
        "wv": (L, D, cfg.n_kv_heads * E),
        "wo": (L, cfg.n_heads * E, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if cfg.arch == "gemma3":
        layers.update(q_norm=(L, E), k_norm=(L, E), post_attn_norm=(L, D), post_mlp_norm=(L, D))
    shapes = {"embed": (cfg.vocab_size, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, D)
    return shapes


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters (normal, std 0.02; norm scales 1) for tests and shape checks.

    Args:
        cfg: the architecture (static).
        key: a PRNG key.
        dtype: parameter dtype.

    Returns:
        A params pytree with the shapes of `param_shapes(cfg)`.
    """
    shapes = param_shapes(cfg)
    is_shape = lambda s: isinstance(s, tuple)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    sizes = [math.prod(s) for _, s in flat]
    # One draw for all tensors: a single RNG op keeps compile time small.
    noise = 0.02 * jax.random.normal(key, (sum(sizes),), dtype)
    offsets = np.cumsum([0] + sizes)
    out = [jnp.ones(s, dtype) if "norm" in jax.tree_util.keystr(p)
           else noise[offsets[i]:offsets[i + 1]].reshape(s)
           for i, (p, s) in enumerate(flat)]
    return jax.tree.unflatten(treedef, out)


def cast_params(params: dict, dtype) -> dict:
    """Casts every parameter to `dtype`.

    Store params in the compute dtype for bf16 runs: `forward` casts each weight
    to the compute dtype on use, which costs a read and a write per step otherwise.
    """
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], with optional 'linear' / 'llama3' scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    kind = scaling.get("type")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = np.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"rope_scaling type {kind!r} unsupported; supported: linear, llama3")
    return inv.astype(np.float32)


def layer_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer RoPE inverse frequencies [L, E/2] and attention windows [L] (scanned)."""
    inv_global = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    inv_local = (rope_inv_freq(cfg.head_dim, cfg.rope_local_theta)
                 if cfg.rope_local_theta is not None else inv_global)
    local = np.array([t == "local" for t in cfg.layer_types])
    inv_LxF = np.where(local[:, None], inv_local[None], inv_global[None]).astype(np.float32)
    window_L = np.where(local, cfg.sliding_window or _NO_WINDOW, _NO_WINDOW).astype(np.int32)
    return inv_LxF, window_L


def rms_norm(x, scale, eps: float):
    """RMSNorm in float32, multiplied by `scale`, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x_BxTxNxE, pos_BxT, inv_F):
    """Rotates half-split (rotate_half) feature pairs by position * inv_freq."""
    ang_BxTxF = pos_BxT.astype(jnp.float32)[..., None] * inv_F
    cos = jnp.cos(ang_BxTxF)[:, :, None, :]
    sin = jnp.sin(ang_BxTxF)[:, :, None, :]
    x1, x2 = jnp.split(x_BxTxNxE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxE.dtype)


def _softcap(x, cap):
    return x if cap is None else cap * jnp.tanh(x / cap)


def _attention(cfg, q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS):
    B, T, H, E = q_BxTxHxE.shape
    K = k_BxSxKxE.shape[2]
    q_BxTxKxGxE = q_BxTxHxE.reshape(B, T, K, H // K, E)
    s_BxKxGxTxS = jnp.einsum("btkge,bske->bkgts", q_BxTxKxGxE, k_BxSxKxE,
                             preferred_element_type=jnp.float32) * cfg.attn_scale
    s_BxKxGxTxS = _softcap(s_BxKxGxTxS, cfg.attn_logit_softcap)
    s_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], s_BxKxGxTxS, _NEG)
    p_BxKxGxTxS = jax.nn.softmax(s_BxKxGxTxS, axis=-1).astype(v_BxSxKxE.dtype)
    o_BxTxKxGxE = jnp.einsum("bkgts,bske->btkge", p_BxKxGxTxS, v_BxSxKxE)
    return o_BxTxKxGxE.reshape(B, T, H * E)


def _block(cfg, dtype, x_BxTxD, lp, inv_F, window, kv, layer, pos_BxT, kpos_BxS, write_at):
    """One decoder layer; returns the new residual stream and the updated kv caches.

    kv is None (no cache) or the whole (k_LxBxSxKxE, v_LxBxSxKxE); only the T new
    slots of `layer` are written, so with a donated cache the update is in place.
    """
    B, T, _ = x_BxTxD.shape
    E, H, K = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    w = lambda name: lp[name].astype(dtype)
    h_BxTxD = rms_norm(x_BxTxD, lp["attn_norm"], cfg.norm_eps)
    q_BxTxHxE = (h_BxTxD @ w("wq")).reshape(B, T, H, E)
    k_BxTxKxE = (h_BxTxD @ w("wk")).reshape(B, T, K, E)
    v_BxTxKxE = (h_BxTxD @ w("wv")).reshape(B, T, K, E)
    if "q_norm" in lp:
        q_BxTxHxE = rms_norm(q_BxTxHxE, lp["q_norm"], cfg.norm_eps)
        k_BxTxKxE = rms_norm(k_BxTxKxE, lp["k_norm"], cfg.norm_eps)
    q_BxTxHxE = apply_rope(q_BxTxHxE, pos_BxT, inv_F)
    k_BxTxKxE = apply_rope(k_BxTxKxE, pos_BxT, inv_F)
    if kv is None:  # no cache: attend over the new tokens only
        k_BxSxKxE, v_BxSxKxE = k_BxTxKxE, v_BxTxKxE
    else:
        at = (layer, 0, write_at, 0, 0)
        kv = tuple(jax.lax.dynamic_update_slice(c, new.astype(c.dtype)[None], at)
                   for c, new in zip(kv, (k_BxTxKxE, v_BxTxKxE)))
        k_BxSxKxE, v_BxSxKxE = (c[layer] for c in kv)
    # Causal by position (not slot), restricted to valid slots and the layer's window.
    diff_BxTxS = pos_BxT[:, :, None] - kpos_BxS[:, None, :]
    mask_BxTxS = (kpos_BxS[:, None, :] >= 0) & (diff_BxTxS >= 0) & (diff_BxTxS < window)
    o_BxTxD = _attention(cfg, q_BxTxHxE, k_BxSxKxE.astype(dtype), v_BxSxKxE.astype(dtype),
                         mask_BxTxS) @ w("wo")
    if "post_attn_norm" in lp:
        o_BxTxD = rms_norm(o_BxTxD, lp["post_attn_norm"], cfg.norm_eps)
    x_BxTxD = x_BxTxD + o_BxTxD
    h_BxTxD = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.norm_eps)
    act = jax.nn.silu if cfg.act == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    m_BxTxD = (act(h_BxTxD @ w("w_gate")) * (h_BxTxD @ w("w_up"))) @ w("w_down")
    if "post_mlp_norm" in lp:
        m_BxTxD = rms_norm(m_BxTxD, lp["post_mlp_norm"], cfg.norm_eps)
    return x_BxTxD + m_BxTxD, kv


def forward(params: dict, cfg: ModelConfig, tokens_BxT, valid_BxT=None, cache=None, *,
            dtype=jnp.float32, logits: str = "all"):
    """Runs T new tokens through the model, optionally against a KV cache.

    Args:
        params: params pytree (notes/MODEL_CONTRACT.md).
        cfg: the architecture.
        tokens_BxT: int token ids.
        valid_BxT: bool, True for real tokens (default: all True). Padding may be
            anywhere; each sequence's positions count its valid tokens only.
        cache: a KV cache from `brf.models.cache.init_cache`, or None to attend
            over the T tokens alone (no state kept).
        dtype: compute dtype (jnp.float32 or jnp.bfloat16); norms, softmax and
            RoPE run in float32 whatever this is.
        logits: 'all' -> logits_BxTxV; 'last' -> logits_BxV at each sequence's
            last valid token; 'none' -> None (only fill the cache).

    Returns:
        (logits, cache): float32 logits as chosen, and the updated cache (None
        when no cache was given). The cache must have room for T more slots;
        writes past its end are not checked inside jit (see cache.room).
    """
    dtype = jnp.dtype(dtype)
    B, T = tokens_BxT.shape
    if valid_BxT is None:
        valid_BxT = jnp.ones((B, T), bool)
    valid_BxT = valid_BxT.astype(bool)
    start_B = jnp.zeros((B,), jnp.int32) if cache is None else cache["next_pos"]
    pos_BxT = start_B[:, None] + jnp.cumsum(valid_BxT, axis=1, dtype=jnp.int32) - 1
    pos_BxT = jnp.where(valid_BxT, pos_BxT, -1)

    x_BxTxD = params["embed"][tokens_BxT].astype(dtype)
    if cfg.embed_scale:
        x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(cfg.d_model), dtype)

    inv_LxF, window_L = layer_tables(cfg)
    if cache is None:
        kpos_BxS, write_at, kv = pos_BxT, 0, None
    else:
        write_at = cache["end"]
        kpos_BxS = jax.lax.dynamic_update_slice(cache["pos"], pos_BxT, (0, write_at))
        kv = (cache["k"], cache["v"])

    def step(carry, xs):
        x, kv = carry
        lp, inv_F, window, layer = xs
        return _block(cfg, dtype, x, lp, inv_F, window, kv, layer, pos_BxT, kpos_BxS,
                      write_at), None

    xs = (params["layers"], inv_LxF, window_L, jnp.arange(cfg.n_layers))
    (x_BxTxD, new_kv), _ = jax.lax.scan(step, (x_BxTxD, kv), xs)

    new_cache = None
    if cache is not None:
        new_cache = dict(k=new_kv[0], v=new_kv[1], pos=kpos_BxS, end=cache["end"] + T,
                         next_pos=cache["next_pos"] + valid_BxT.sum(axis=1, dtype=jnp.int32))
    if logits == "none":
        return None, new_cache
    if logits == "last":
        last_B = jnp.max(jnp.where(valid_BxT, jnp.arange(T), 0), axis=1)
        x_BxTxD = jnp.take_along_axis(x_BxTxD, last_B[:, None, None], axis=1)
    elif logits != "all":
        raise ValueError(f"logits={logits!r}; use 'all', 'last' or 'none'")
    out = unembed(params, cfg, x_BxTxD)
    return (out[:, 0] if logits == "last" else out), new_cache


def unembed(params: dict, cfg: ModelConfig, x_BxTxD):
    """Final norm, output projection (tied or untied) and optional softcap; float32 logits."""
    x_BxTxD = rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps)
    head_VxD = params["embed" if cfg.tie_embeddings else "lm_head"].astype(x_BxTxD.dtype)
    out = jnp.einsum("btd,vd->btv", x_BxTxD, head_VxD, preferred_element_type=jnp.float32)
    return _softcap(out, cfg.final_logit_softcap)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "logits"))
def prefill(params: dict, cfg: ModelConfig, tokens_BxT, valid_BxT, cache, *,
            dtype=jnp.float32, logits: str = "all"):
    """Jitted `forward` with a cache: prompt prefill, or catching up on pending tokens.

    Args:
        params: params pytree.
        cfg: the architecture (static).
        tokens_BxT: int token ids.
        valid_BxT: bool mask of real tokens (left or right padding), or None.
        cache: KV cache (`brf.models.cache.init_cache`), or None for a stateless pass.
        dtype: compute dtype (static).
        logits: 'all' | 'last' | 'none' (static); see `forward`.

    Returns:
        (logits_BxTxV or logits_BxV or None, cache).
    """
    return forward(params, cfg, tokens_BxT, valid_BxT, cache, dtype=dtype, logits=logits)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def decode_step(params: dict, cfg: ModelConfig, token_B, cache, valid_B=None, *,
                dtype=jnp.float32):
    """One decoding step: appends token_B to the cache and returns next-token logits.

    Args:
        params: params pytree.
        cfg: the architecture (static).
        token_B: int token ids, one per sequence.
        cache: KV cache with at least one free slot.
        valid_B: optional bool; False leaves that sequence's position unchanged
            (e.g. finished sequences) and its slot masked.
        dtype: compute dtype (static).

    Returns:
        (logits_BxV float32, cache).
    """
    valid_Bx1 = None if valid_B is None else valid_B[:, None]
    out, cache = forward(params, cfg, token_B[:, None], valid_Bx1, cache, dtype=dtype)
    return out[:, 0], cache


# Same functions with the cache donated: XLA updates it in place instead of copying
# it every call (about 2x faster decoding). The cache passed in is invalidated.
prefill_donated = jax.jit(prefill, static_argnames=("cfg", "dtype", "logits"),
                          donate_argnames="cache")
decode_step_donated = jax.jit(decode_step, static_argnames=("cfg", "dtype"),
                              donate_argnames="cache")

__all__ = ["cast_params", "prefill_donated", "decode_step_donated", "param_shapes", "init_params", "forward", "prefill", "decode_step", "unembed",
           "rope_inv_freq", "layer_tables", "rms_norm", "apply_rope"]
