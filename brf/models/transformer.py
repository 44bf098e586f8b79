"""Pure-function forward passes for decoder-only transformers (every family of
`brf.models.ARCHITECTURES`).

One code path serves every family; the differences are fields of ModelConfig
(activation, embedding scale, per-layer window and RoPE base, soft-capping,
q/k/v biases, q/k norms, where the norms sit) and the parameters they imply
(`param_shapes`).
Stacked layers run as one `lax.scan`; per-layer params (`unstack_layers`) run
a prompt as one jitted call per layer that every layer shares (compile time
independent of depth) and a decoding step as one call over all layers.

Attention is causal by position. New tokens attend to the cache as it was and
to each other as two parts of one softmax; with several new tokens the queries
run in blocks that skip the causally hidden later keys (`_causal_attention`).

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
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.models.config import ModelConfig

_NEG = -0.7 * float(np.finfo(np.float32).max)  # finite: fully masked rows stay NaN-free
_NO_WINDOW = np.iinfo(np.int32).max


def _acc(dtype):
    """The accumulation dtype for a compute dtype: float32, or float64 when computing
    in float64 (jax's x64 mode), so that a float64 run is float64 throughout."""
    return jnp.promote_types(dtype, jnp.float32)


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of the params pytree of notes/MODEL_CONTRACT.md, as nested dicts of tuples.

    Which per-layer tensors exist follows the config: q/k/v biases with
    ``attn_bias``; q/k norm scales of E features (``qk_norm='head'``) or of all
    projected features (``'full'``); pre-norms unless ``norm_placement='post'``
    and post-norms unless it is ``'pre'``.
    """
    L, D, F, E = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.head_dim
    HE, KE = cfg.n_heads * E, cfg.n_kv_heads * E
    pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
    layers = {"attn_norm": (L, D)} if pre else {}
    layers.update(wq=(L, D, HE), wk=(L, D, KE), wv=(L, D, KE), wo=(L, HE, D))
    if cfg.attn_bias:
        layers.update(bq=(L, HE), bk=(L, KE), bv=(L, KE))
    if pre:
        layers["mlp_norm"] = (L, D)
    layers.update(w_gate=(L, D, F), w_up=(L, D, F), w_down=(L, F, D))
    if cfg.qk_norm != "none":
        full = cfg.qk_norm == "full"
        layers.update(q_norm=(L, HE if full else E), k_norm=(L, KE if full else E))
    if post:
        layers.update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
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


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  long: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], scaled as ``scaling`` says.

    Types as transformers' modeling_rope_utils computes them: 'linear', 'llama3',
    'yarn' (each frequency between its interpolated and original value by a
    ramp over beta_fast..beta_slow rotations in the original context), and
    'longrope' (divided by short_factor, or by long_factor when ``long``).
    The attention factor yarn and longrope also apply is `rope_attention_factor`.
    """
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
    elif kind == "yarn":
        inv = inv * _yarn_blend(head_dim, theta, scaling)
    elif kind == "longrope":
        inv = inv / np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
    else:
        raise ValueError(f"rope_scaling type {kind!r} unsupported; supported: "
                         "linear, llama3, yarn, longrope")
    return inv.astype(np.float32)


def _yarn_blend(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN's per-frequency multiplier [head_dim // 2]: 1 (kept) for the frequencies
    that turn more than beta_fast times over the original context, 1 / factor
    (interpolated) for those turning fewer than beta_slow times, linear between
    (transformers' _compute_yarn_parameters, truncate included)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations):  # the (fractional) dimension that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(scaling["beta_fast"]), dim_of(scaling["beta_slow"])
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
    return ramp / factor + (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """What yarn and longrope multiply RoPE's cosines and sines by (so q.k by its
    square); 1 for the other types."""
    return float((scaling or {}).get("attention_factor", 1.0))


def layer_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer RoPE inverse frequencies [L, E/2] and attention windows [L] (scanned)."""
    inv_RxF, rope_L, window_L = _rope_layout(cfg)
    return inv_RxF[rope_L], window_L


def _rope_layout(cfg: ModelConfig, long: bool = False):
    """The distinct RoPE tables [R, E/2] (global, then local if it differs), each
    layer's table index [L], and each layer's attention window [L]. ``long``:
    the tables longrope uses past its original context."""
    inv_RxF = [rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, long)]
    if cfg.rope_local_theta is not None:
        inv_RxF.append(rope_inv_freq(cfg.head_dim, cfg.rope_local_theta))
    local = np.array([t == "local" for t in cfg.layer_types])
    rope_L = np.where(local, len(inv_RxF) - 1, 0).astype(np.int32)
    window_L = np.where(local, cfg.sliding_window or _NO_WINDOW, _NO_WINDOW).astype(np.int32)
    return np.stack(inv_RxF), rope_L, window_L


def _rope_angles(cfg: ModelConfig, pos_BxT):
    """(cos, sin) of position * inv_freq, [R, B, T, E/2], for `_rope_layout`'s R
    tables: computed once per call and shared by every layer that uses the same
    table (recomputing them inside each layer's fused rotation cost more than
    the rotation itself). Scaled by the global table's attention factor (yarn,
    longrope), as transformers scales them.

    longrope chooses its factors as transformers does (`dynamic_rope_update`):
    by the sequence length a pass reaches, its largest position + 1, not per
    position: past ``original_max_position_embeddings`` every position of the
    pass uses the long factors, else the short ones. Here each row decides for
    itself (transformers takes the largest position over the batch), so a row
    is computed as it would be alone. Keys already in a cache keep the factors
    they were written with.
    """
    inv_RxF = jnp.asarray(_rope_layout(cfg)[0])
    scaling = cfg.rope_scaling or {}
    if scaling.get("type") == "longrope":
        long_RxF = jnp.asarray(_rope_layout(cfg, long=True)[0])
        is_long_B = jnp.max(pos_BxT, axis=1) + 1 > scaling["original_max_position_embeddings"]
        inv_RxBxF = jnp.where(is_long_B[None, :, None], long_RxF[:, None], inv_RxF[:, None])
    else:
        inv_RxBxF = inv_RxF[:, None]
    cos, sin = _angles(pos_BxT, inv_RxBxF)
    factor = rope_attention_factor(cfg.rope_scaling)
    if factor != 1.0:  # the global table only (local layers are not scaled)
        scale_Rx1x1x1 = jnp.asarray([factor] + [1.0] * (inv_RxF.shape[0] - 1),
                                    jnp.float32)[:, None, None, None]
        cos, sin = cos * scale_Rx1x1x1, sin * scale_Rx1x1x1
    return cos, sin


def rms_norm(x, scale, eps: float):
    """RMSNorm in float32 (float64 for float64 x), multiplied by `scale`, returned in x's dtype."""
    x32 = x.astype(_acc(x.dtype))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(x32.dtype)).astype(x.dtype)


def _angles(pos_BxT, inv_RxBxF):
    """(cos, sin) of position * inv_freq, [R, B, T, E/2] (inv_freq per row, or [R, 1, E/2])."""
    ang_RxBxTxF = pos_BxT.astype(jnp.float32)[None, :, :, None] * inv_RxBxF[:, :, None, :]
    return jnp.cos(ang_RxBxTxF), jnp.sin(ang_RxBxTxF)


def apply_rope(x_BxTxNxE, pos_BxT, inv_F):
    """Rotates half-split (rotate_half) feature pairs by position * inv_freq."""
    cos_1xBxTxF, sin_1xBxTxF = _angles(jnp.asarray(pos_BxT), jnp.asarray(inv_F)[None, None])
    return _rotate(x_BxTxNxE, cos_1xBxTxF[0], sin_1xBxTxF[0])


def _rotate(x_BxTxNxE, cos_BxTxF, sin_BxTxF):
    """`apply_rope` with the angles' cosines and sines given."""
    cos, sin = cos_BxTxF[:, :, None, :], sin_BxTxF[:, :, None, :]
    x1, x2 = jnp.split(x_BxTxNxE.astype(_acc(x_BxTxNxE.dtype)), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxE.dtype)


def _softcap(x, cap):
    return x if cap is None else cap * jnp.tanh(x / cap)


def _attention(cfg, q_BxTxHxE, parts):
    """Grouped-query attention over one or more key/value sets.

    Args:
        cfg: the architecture.
        q_BxTxHxE: queries (after RoPE).
        parts: [(kT_BxKxExS, v_BxKxSxE, mask_BxTxS), ...]: e.g. the cache as it
            was before this call and the new keys. One softmax runs over all
            of them, so this equals attention over their concatenation. Keys
            are stored transposed, so q @ kT is a plain matmul.

    Returns:
        o_BxTx(H*E).
    """
    B, T, H, E = q_BxTxHxE.shape
    K = parts[0][0].shape[1]
    G = H // K
    # Queries grouped by kv head, [B, K, T*G, E]: one batched matmul per kv head
    # against keys stored transposed, [B, K, E, S] (the cache's layout).
    # With several queries the scale goes on them (T*H*E products rather than one
    # per score) and the output is normalised after the value matmul (E divisions
    # a query rather than S). A decoding step's attention is a few small ops,
    # and one more op per layer costs more there than the products it saves.
    several = T > 1
    if several:
        q_BxTxHxE = (q_BxTxHxE.astype(_acc(q_BxTxHxE.dtype)) * cfg.attn_scale
                     ).astype(q_BxTxHxE.dtype)
    q_BxKxTGxE = q_BxTxHxE.reshape(B, T, K, G, E).transpose(0, 2, 1, 3, 4).reshape(
        B, K, T * G, E)

    acc = _acc(q_BxTxHxE.dtype)

    def matmul(a_BxKxRxI, b_BxKxIxJ):  # -> [B, K, R, J], float32 (float64) accumulation
        # A decoding step's own key (J = 1) or value (I = 1) needs no matmul call.
        if 1 in b_BxKxIxJ.shape[2:]:
            a, b = a_BxKxRxI.astype(acc), b_BxKxIxJ.astype(acc)
            if b.shape[3] == 1:
                return jnp.sum(a * b[..., 0][:, :, None], axis=-1, keepdims=True)
            return a * b
        return jnp.einsum("bkri,bkij->bkrj", a_BxKxRxI, b_BxKxIxJ,
                          preferred_element_type=acc)

    scores = []
    for kT_BxKxExS, _, mask_BxTxS in parts:
        s_BxKxTGxS = matmul(q_BxKxTGxE, kT_BxKxExS.astype(q_BxTxHxE.dtype))
        if not several:
            s_BxKxTGxS = s_BxKxTGxS * cfg.attn_scale
        s_BxKxTxGxS = _softcap(s_BxKxTGxS, cfg.attn_logit_softcap).reshape(B, K, T, G, -1)
        scores.append(jnp.where(mask_BxTxS[:, None, :, None], s_BxKxTxGxS, _NEG))
    # One softmax over all parts without concatenating them: shared max, summed
    # denominators, outputs accumulated part by part (in float32).
    m_BxKxTxGx1 = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True)
                                                  for s in scores])
    exps = [jnp.exp(s - m_BxKxTxGx1) for s in scores]
    denom_BxKxTxGx1 = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    o_BxKxTGxE = 0.0
    for (_, v_BxKxSxE, _), e in zip(parts, exps):
        v = v_BxKxSxE.astype(q_BxTxHxE.dtype)
        p = e if several else e / denom_BxKxTxGx1
        o_BxKxTGxE = o_BxKxTGxE + matmul(p.astype(v.dtype).reshape(B, K, T * G, -1), v)
    o_BxKxTxGxE = o_BxKxTGxE.reshape(B, K, T, G, E)
    if several:
        o_BxKxTxGxE = o_BxKxTxGxE / denom_BxKxTxGx1
    o_BxTxKxGxE = o_BxKxTxGxE.astype(q_BxTxHxE.dtype).transpose(0, 2, 1, 3, 4)
    return o_BxTxKxGxE.reshape(B, T, H * E)


# Query block of causal attention over the new tokens (see `_causal_attention`).
_Q_BLOCK = 128


def _causal_attention(cfg, q_BxTxHxE, old, new):
    """Attention of the T new queries to the cache as it was (`old`: a list of parts,
    empty or None when it holds nothing) and to the new keys (`new`), each (kT, v, mask).

    The queries run in blocks of `_Q_BLOCK`; block [t0, t1) meets the new keys
    [0, t1) only. Valid tokens' positions grow along T (padding has position -1
    and is masked), so a later new key is causally hidden from these queries
    anyway: skipping it is exact and saves about half of the new-key work.
    """
    T = q_BxTxHxE.shape[1]
    kT_BxKxExT, v_BxKxTxE, mask_BxTxT = new
    out = []
    for t0 in range(0, T, _Q_BLOCK):
        t1 = min(T, t0 + _Q_BLOCK)
        parts = [(o[0], o[1], o[2][:, t0:t1]) for o in old or ()]
        parts.append((kT_BxKxExT[..., :t1], v_BxKxTxE[:, :, :t1], mask_BxTxT[:, t0:t1, :t1]))
        out.append(_attention(cfg, q_BxTxHxE[:, t0:t1], parts))
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=1)


class Reads(NamedTuple):
    """Which cache slots a call's layers read: a static (hashable) promise of the caller.

    Attributes:
        span: global layers read slots [0, span) only. The caller promises that
            every slot written before this call lies below span (e.g. a power
            of two >= the cache's ``end``); None reads all S slots.
        local: sliding-window layers read only the ``local`` slots before the
            call's first new slot. The caller promises that every earlier slot
            holding a key inside a new query's window lies among them: with
            window W and at most P padding slots (position -1) among a
            sequence's recent slots, W + P suffices (`cache_reads`). None: as
            the global layers.

    Reading fewer slots changes no value: the slots left out are masked anyway.
    Powers of two keep the number of compiled shapes small.
    """
    span: int | None = None
    local: int | None = None


# Spans below this many slots are rounded up to it: a span is a static shape, so
# each one is a compiled program, and below it attention is a small part of a step.
SMALLEST_SPAN = 1024


def cache_reads(cfg: ModelConfig, end: int, slots: int, n_read: Sequence[int] = (),
                new: int = 1, smallest: int = SMALLEST_SPAN) -> Reads | None:
    """The `Reads` a call may use, from what its caller knows on the host.

    Args:
        cfg: the architecture (its sliding window, if it has local layers).
        end: slots written so far (the cache's ``end``; a bound on it is fine).
        slots: S, the slots allocated.
        n_read: per sequence that has queries in the call, its tokens read so far
            (so ``end - n_read`` bounds its padding slots); empty: no local reads.
        new: the call's new tokens (a bound on the query positions' spread).
        smallest: the smallest span used (see SMALLEST_SPAN).

    Returns:
        None (read every slot) or a `Reads`: ``span`` the next power of two >=
        ``end`` (at least ``smallest``) when that is at most half the
        allocation, ``local`` a power of two >= window + the most padding any of
        these sequences has + ``new``, when below what the global layers read.
    """
    span = max(_bucket(end), _bucket(smallest))
    span = span if 2 * span <= slots else None
    local = None
    if "local" in cfg.layer_types and n_read:
        need = max(_bucket(cfg.sliding_window + max(end - min(n_read), 0) + new),
                   _bucket(min(smallest, cfg.sliding_window)))
        local = need if need < (span or slots) else None
    return None if span is None and local is None else Reads(span, local)


def _bucket(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _visible_slots(S: int, write_at, window, reads: Reads | None):
    """Which cache slots one layer's attention reads: None (all S), or ``(start, R)``:
    R slots (static) from slot ``start`` (a static 0, or a traced index).

    Global layers read the first ``reads.span`` slots; a sliding-window layer
    (``window`` a static int below _NO_WINDOW) with ``reads.local`` reads that
    many slots ending at ``write_at``. The rest of the cache is not touched,
    so a step costs what its context needs, not what was allocated.
    """
    if reads is None:
        return None
    span = S if reads.span is None else min(int(reads.span), S)
    static_window = isinstance(window, (int, np.integer)) and int(window) < _NO_WINDOW
    if static_window and reads.local is not None and int(reads.local) < span:
        R = int(reads.local)
        return jnp.clip(write_at - R, 0, span - R).astype(jnp.int32), R
    return (0, span) if span < S else None


def _take_slots(x, axis: int, slots):
    """x restricted to the slots `_visible_slots` chose, along ``axis``."""
    if slots is None:
        return x
    start, R = slots
    if isinstance(start, int):
        return jax.lax.slice_in_dim(x, start, start + R, axis=axis)
    return jax.lax.dynamic_slice_in_dim(x, start, R, axis=axis)


class Slots(NamedTuple):
    """Where a call's T new tokens sit; the same for every layer of the call."""
    pos_BxT: jax.Array   # each new token's position (-1: padding)
    kpos_BxS: jax.Array  # each cache slot's position once this call is written
    write_at: jax.Array  # the slot the new tokens are written from
    # None, or (cache_allow_BxTxS, tree_allow_BxTxT[, (slots_BxA, allow_BxTxA)]):
    # explicit masks ANDed with the positional one (tree attention, `forward_tree`;
    # all queries kept); the third, slots gathered from the cache as a part of their own.
    allow: Any = None


def _block(cfg, dtype, x_BxTxD, lp, *, rope, window, kv, at: Slots, keep="all", reads=None):
    """One decoder layer: returns the new residual stream and the T new keys and values.

    keep='last' carries on only each sequence's last valid token (the residual
    stream comes back as B x 1 x D) and keep='none' only computes the keys and
    values: for the last layer when only the last logits, or none, are wanted.

    rope is this layer's (cos_BxTxF, sin_BxTxF) from `_rope_angles` and window
    its attention window. kv is None (no cache, or a cache known to be empty)
    or this layer's (kT_BxKxExS, v_BxKxSxE) before this call; it is only read.
    The caller writes the returned (kT_BxKxExT, v_BxKxTxE) at slot
    ``at.write_at`` (`_write_cache`): an in-place update inside a computation
    that also reads the cache makes XLA:CPU copy the whole cache per layer.
    reads (static, `Reads`) bounds the cache slots the attention reads.
    """
    q_BxTxHxE, new = _qkv(cfg, dtype, x_BxTxD, lp, rope)
    if keep == "none":
        return x_BxTxD, new
    q_pos_BxT = at.pos_BxT
    if keep == "last":
        last_Bx1 = _last_valid(at.pos_BxT >= 0)[:, None]
        x_BxTxD = jnp.take_along_axis(x_BxTxD, last_Bx1[:, :, None], axis=1)
        q_BxTxHxE = jnp.take_along_axis(q_BxTxHxE, last_Bx1[:, :, None, None], axis=1)
        q_pos_BxT = jnp.take_along_axis(at.pos_BxT, last_Bx1, axis=1)
    o_BxTxHE = _self_attention(cfg, q_BxTxHxE.astype(dtype), q_pos_BxT, new, kv, window, at,
                               several=keep != "last", reads=reads)
    x_BxTxD = x_BxTxD + _post_norm(cfg, lp, "post_attn_norm", _proj(lp, "wo", o_BxTxHE, dtype))
    return x_BxTxD + _mlp(cfg, dtype, x_BxTxD, lp), new


def _proj(lp, name, h_BxTxI, dtype):
    """h @ W for W stored [in, out] as <name>, or [out, in] as <name>_t."""
    if name in lp:
        return h_BxTxI @ lp[name].astype(dtype)
    return jnp.einsum("bti,oi->bto", h_BxTxI, lp[name + "_t"].astype(dtype))


def _post_norm(cfg, lp, name, x):
    """Gemma's and OLMo 2's norm after attention / the MLP (`name` absent in Llama:
    x unchanged)."""
    return rms_norm(x, lp[name], cfg.norm_eps) if name in lp else x


def _pre_norm(cfg, lp, name, x):
    """The norm before attention / the MLP (`name` absent in OLMo 2: x unchanged)."""
    return rms_norm(x, lp[name], cfg.norm_eps) if name in lp else x


def _qkv(cfg, dtype, x_BxTxD, lp, rope):
    """Queries q_BxTxHxE and the new (kT_BxKxExT, v_BxKxTxE), normed and rotated.

    Around the projections, as the config has them: the pre-norm (absent for
    OLMo 2's post-norms), q/k/v biases (Qwen2), and q/k RMSNorms before RoPE,
    per head (Gemma 3, Qwen3) or over all projected features (OLMo 2).
    """
    B, T, _ = x_BxTxD.shape
    E, H, K = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    h_BxTxD = _pre_norm(cfg, lp, "attn_norm", x_BxTxD)
    if "wq" in lp:
        q, k, v = (_proj(lp, name, h_BxTxD, dtype) for name in ("wq", "wk", "wv"))
        if "bq" in lp:
            q, k, v = (a + lp[b].astype(dtype) for a, b in zip((q, k, v), ("bq", "bk", "bv")))
    else:  # fused by unstack_layers
        qkv = _proj(lp, "wqkv", h_BxTxD, dtype)
        if "bqkv" in lp:
            qkv = qkv + lp["bqkv"].astype(dtype)
        q, k, v = jnp.split(qkv, [H * E, (H + K) * E], axis=-1)
    if cfg.qk_norm == "full":
        q, k = rms_norm(q, lp["q_norm"], cfg.norm_eps), rms_norm(k, lp["k_norm"], cfg.norm_eps)
    q_BxTxHxE = q.reshape(B, T, H, E)
    k_BxTxKxE = k.reshape(B, T, K, E)
    v_BxTxKxE = v.reshape(B, T, K, E)
    if cfg.qk_norm == "head":
        q_BxTxHxE = rms_norm(q_BxTxHxE, lp["q_norm"], cfg.norm_eps)
        k_BxTxKxE = rms_norm(k_BxTxKxE, lp["k_norm"], cfg.norm_eps)
    q_BxTxHxE = _rotate(q_BxTxHxE, *rope)
    k_BxTxKxE = _rotate(k_BxTxKxE, *rope)
    return q_BxTxHxE, (k_BxTxKxE.transpose(0, 2, 3, 1), v_BxTxKxE.transpose(0, 2, 1, 3))


def _mask(q_pos_BxT, k_pos_BxS, window):
    """Causal by position (not slot), valid keys only, within the layer's window."""
    diff_BxTxS = q_pos_BxT[:, :, None] - k_pos_BxS[:, None, :]
    return (k_pos_BxS[:, None, :] >= 0) & (diff_BxTxS >= 0) & (diff_BxTxS < window)


def _self_attention(cfg, q_BxTxHxE, q_pos_BxT, new, kv, window, at: Slots, several: bool,
                    reads: Reads | None = None):
    """Attention of the queries to the cache as it was (kv) and to the new keys.

    Slots from at.write_at on are not these tokens' yet in the old cache. The new
    keys are a second part of the same softmax (attending to an updated cache
    would copy the whole cache per layer). several: the queries are every new
    token (causal blocks, `_causal_attention`), not each sequence's last one.
    reads: which cache slots are read (`_visible_slots`).
    """
    old = []
    if kv is not None:
        S = at.kpos_BxS.shape[1]
        slots = _visible_slots(S, at.write_at, window, reads)
        old_pos_BxS = jnp.where(jnp.arange(S) < at.write_at, at.kpos_BxS, -1)
        mask = _mask(q_pos_BxT, _take_slots(old_pos_BxS, 1, slots), window)
        if at.allow is not None:  # tree attention: the explicit slot mask, on the same slots
            mask = mask & _take_slots(at.allow[0], 2, slots)
        old.append((_take_slots(kv[0], 3, slots), _take_slots(kv[1], 2, slots), mask))
        if at.allow is not None and len(at.allow) > 2:  # a few slots gathered, wherever they are
            idx_BxA, allow_BxTxA = at.allow[2]
            kpos_BxA = jnp.take_along_axis(old_pos_BxS, idx_BxA, axis=1)
            old.append((jnp.take_along_axis(kv[0], idx_BxA[:, None, None, :], axis=3),
                        jnp.take_along_axis(kv[1], idx_BxA[:, None, :, None], axis=2),
                        _mask(q_pos_BxT, kpos_BxA, window) & allow_BxTxA))
    new_part = (*new, _mask(q_pos_BxT, at.pos_BxT, window))
    if at.allow is not None:
        new_part = (*new_part[:2], new_part[2] & at.allow[1])
    if several:
        return _causal_attention(cfg, q_BxTxHxE, old, new_part)
    return _attention(cfg, q_BxTxHxE, old + [new_part])


def _mlp(cfg, dtype, x_BxTxD, lp):
    """The gated MLP's output (after a post-MLP norm where there is one), to add to x."""
    h_BxTxD = _pre_norm(cfg, lp, "mlp_norm", x_BxTxD)
    act = jax.nn.silu if cfg.act == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    if "w_gate" in lp:
        gate, up = _proj(lp, "w_gate", h_BxTxD, dtype), _proj(lp, "w_up", h_BxTxD, dtype)
    else:  # fused by unstack_layers
        gate, up = jnp.split(_proj(lp, "w_gate_up", h_BxTxD, dtype), 2, axis=-1)
    return _post_norm(cfg, lp, "post_mlp_norm", _proj(lp, "w_down", act(gate) * up, dtype))


def _write_layer(kv, new, write_at):
    """One layer's cache (kT_BxKxExS, v_BxKxSxE) with `new` (T slots) written at write_at."""
    kT, v = kv
    new_kT, new_v = new
    z = jnp.zeros_like(write_at)  # index dtypes must match (int32 also in x64 mode)
    return (jax.lax.dynamic_update_slice(kT, new_kT.astype(kT.dtype), (z, z, z, write_at)),
            jax.lax.dynamic_update_slice(v, new_v.astype(v.dtype), (z, z, write_at, z)))


def _write_cache(k_L, v_L, new_k_L, new_v_L, write_at):
    """Writes each layer's new keys and values at slot write_at."""
    out = [_write_layer(kv, new, write_at)
           for kv, new in zip(zip(k_L, v_L), zip(new_k_L, new_v_L))]
    return tuple(o[0] for o in out), tuple(o[1] for o in out)


def unstack_layers(params: dict) -> dict:
    """The per-layer layout: ``params['layers']`` as a tuple of per-layer dicts.

    Each layer's weights become buffers of their own, so a layer reads them in
    place. With the stacked layout, `lax.scan` slices each layer's weights out
    of the [L, ...] arrays, and on XLA:CPU that slice is a copy feeding the
    matmul: decoding then moves about three times the weight bytes.
    `prefill` / `decode_step` run the per-layer layout (see `_run_layers`);
    `forward` accepts both layouts.

    The projections that read the same input are also concatenated along their
    output axis (``wqkv`` = [wq | wk | wv], ``w_gate_up`` = [w_gate | w_up];
    q/k/v biases likewise, ``bqkv`` = [bq | bk | bv]):
    one larger matrix-vector product per group instead of three or two small
    ones, which matters when decoding is bound by reading the weights.

    The four projections are then stored transposed, [out, in], under
    ``<name>_t`` (``wqkv_t``, ``wo_t``, ``w_gate_up_t``, ``w_down_t``): each
    output is then a dot product over a contiguous row. XLA:CPU's
    matrix-vector product reads that layout faster: SmolLM2 decodes about 14%
    faster than with [in, out] (BENCHMARKS.md), and prompt-sized matmuls are
    no slower.
    """
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return params
    n = len(next(iter(layers.values())))
    stacked = dict(layers)
    for name, parts in _FUSED.items():
        if parts[0] in stacked:  # biases: only where the architecture has them
            stacked[name] = jnp.concatenate([stacked.pop(k) for k in parts], axis=-1)
    for name in _TRANSPOSED:
        stacked[name + "_t"] = jnp.swapaxes(stacked.pop(name), -1, -2)
    per_layer = tuple({k: v[i] for k, v in stacked.items()} for i in range(n))
    return {**params, "layers": per_layer}


# Projections concatenated by `unstack_layers` (name -> parts, in order).
_FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"), "bqkv": ("bq", "bk", "bv")}
# Projections `unstack_layers` stores transposed, [out, in], as <name>_t.
_TRANSPOSED = ("wqkv", "wo", "w_gate_up", "w_down")


def _split_fused(lp: dict, cfg: ModelConfig) -> dict:
    """The separate [in, out] projections of a per-layer dict made by `unstack_layers`."""
    E = cfg.head_dim
    width = dict(wq=cfg.n_heads * E, wk=cfg.n_kv_heads * E, wv=cfg.n_kv_heads * E,
                 w_gate=cfg.d_ff, w_up=cfg.d_ff, bq=cfg.n_heads * E, bk=cfg.n_kv_heads * E,
                 bv=cfg.n_kv_heads * E)
    out = dict(lp)
    for name in _TRANSPOSED:
        if name + "_t" in out:
            out[name] = jnp.swapaxes(out.pop(name + "_t"), -1, -2)
    for name, parts in _FUSED.items():
        if name in out:
            cuts = np.cumsum([width[k] for k in parts])[:-1]
            out.update(zip(parts, jnp.split(out.pop(name), cuts, axis=-1)))
    return out


def stack_layers(params: dict, cfg: ModelConfig) -> dict:
    """Inverse of `unstack_layers`: the stacked layout of notes/MODEL_CONTRACT.md."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    layers = [_split_fused(lp, cfg) for lp in layers]
    return {**params, "layers": {k: jnp.stack([lp[k] for lp in layers]) for k in layers[0]}}


def is_unstacked(params: dict) -> bool:
    """True for the per-layer layout of `unstack_layers`."""
    return isinstance(params["layers"], (tuple, list))


def _embed_tokens(embed_VxD, cfg, tokens_BxT, dtype):
    """Token embeddings (scaled by sqrt(d_model) where the architecture does)."""
    x_BxTxD = embed_VxD[tokens_BxT].astype(dtype)
    if cfg.embed_scale:
        x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(cfg.d_model), dtype)
    return x_BxTxD


def _embed(embed_VxD, cfg, tokens_BxT, valid_BxT, cache, dtype):
    """Token embeddings, positions, and the cache's slot positions after this call."""
    B, T = tokens_BxT.shape
    if valid_BxT is None:
        valid_BxT = jnp.ones((B, T), bool)
    valid_BxT = valid_BxT.astype(bool)
    start_B = jnp.zeros((B,), jnp.int32) if cache is None else cache["next_pos"]
    pos_BxT = start_B[:, None] + jnp.cumsum(valid_BxT, axis=1, dtype=jnp.int32) - 1
    pos_BxT = jnp.where(valid_BxT, pos_BxT, -1)
    x_BxTxD = _embed_tokens(embed_VxD, cfg, tokens_BxT, dtype)
    if cache is None:
        return x_BxTxD, valid_BxT, pos_BxT, pos_BxT, None
    kpos_BxS = jax.lax.dynamic_update_slice(cache["pos"], pos_BxT,
                                            (jnp.zeros_like(cache["end"]), cache["end"]))
    meta = dict(pos=kpos_BxS, end=cache["end"] + T,
                next_pos=cache["next_pos"] + valid_BxT.sum(axis=1, dtype=jnp.int32))
    return x_BxTxD, valid_BxT, pos_BxT, kpos_BxS, meta


def _last_valid(valid_BxT):
    """Index of each row's last True (0 for a row with none)."""
    return jnp.max(jnp.where(valid_BxT, jnp.arange(valid_BxT.shape[1]), 0), axis=1)


def _check_logits(logits: str) -> None:
    if logits not in ("all", "last", "none"):
        raise ValueError(f"logits={logits!r}; use 'all', 'last' or 'none'")


def _logits(params, cfg, x_BxTxD, valid_BxT, logits):
    """The logits `forward` returns for its `logits` choice (checked by the caller)."""
    if logits == "none":
        return None
    if logits == "last":
        if x_BxTxD.shape[1] > 1:
            last_B = _last_valid(valid_BxT)
            x_BxTxD = jnp.take_along_axis(x_BxTxD, last_B[:, None, None], axis=1)
        return unembed(params, cfg, x_BxTxD)[:, 0]
    return unembed(params, cfg, x_BxTxD)


def ordered_write(cache, out, new_L, write_at, meta):
    """`_updated_cache` inside a program that also read the cache (e.g. a decoding
    loop on the device): every layer's new keys and values are made to depend on
    ``out`` (the logits, which depend on every layer's reads of the cache) by
    adding min(|out[0]|, 0) = 0. Without that dependence XLA cannot order the
    reads before the in-place write and copies the whole cache every step."""
    zero = jnp.minimum(jnp.abs(out.reshape(-1)[0]), 0)
    new_L = [(k + zero.astype(k.dtype), v + zero.astype(v.dtype)) for k, v in new_L]
    return _updated_cache(cache, new_L, write_at, meta)


def _updated_cache(cache, new_L, write_at, meta, write=_write_cache):
    """The cache after a call: every layer's new keys/values written, `meta` from `_embed`."""
    if cache is None:
        return None
    k_L, v_L = write(cache["k"], cache["v"], tuple(n[0] for n in new_L),
                     tuple(n[1] for n in new_L), write_at)
    return dict(k=k_L, v=v_L, **meta)


def forward(params: dict, cfg: ModelConfig, tokens_BxT, valid_BxT=None, cache=None, *,
            dtype=jnp.float32, logits: str = "all", reads: Reads | None = None):
    """Runs T new tokens through the model, optionally against a KV cache.

    Args:
        params: params pytree (notes/MODEL_CONTRACT.md), stacked layers (run
            with `lax.scan`) or per-layer (`unstack_layers`, unrolled).
        cfg: the architecture.
        tokens_BxT: int token ids.
        valid_BxT: bool, True for real tokens (default: all True). Padding may be
            anywhere; each sequence's positions count its valid tokens only.
        cache: a KV cache from `brf.models.cache.init_cache`, or None to attend
            over the T tokens alone (no state kept).
        dtype: compute dtype (jnp.float32 or jnp.bfloat16); norms, softmax and
            RoPE run in float32 whatever this is (float64 in jax's x64 mode with
            dtype jnp.float64, which makes the whole pass float64).
        logits: 'all' -> logits_BxTxV; 'last' -> logits_BxV at each sequence's
            last valid token; 'none' -> None (only fill the cache).
        reads: which cache slots the layers read (`Reads`; None: all of them).

    Returns:
        (logits, cache): float32 logits as chosen, and the updated cache (None
        when no cache was given). The cache must have room for T more slots;
        writes past its end are not checked inside jit (see cache.room).
    """
    _check_logits(logits)
    out, new_L, write_at, meta = _compute(params, cfg, tokens_BxT, valid_BxT, cache,
                                          jnp.dtype(dtype), logits, reads)
    return out, _updated_cache(cache, new_L, write_at, meta)


def _compute(params, cfg, tokens_BxT, valid_BxT, cache, dtype, logits, reads=None):
    """`forward` up to the cache write: (logits, each layer's new (kT, v), write_at,
    meta for `_updated_cache`). The cache is only read."""
    x_BxTxD, valid_BxT, pos_BxT, kpos_BxS, meta = _embed(params["embed"], cfg, tokens_BxT,
                                                         valid_BxT, cache, dtype)
    write_at = 0 if cache is None else cache["end"]
    at = Slots(pos_BxT, kpos_BxS, write_at)
    _, rope_L, window_L = _rope_layout(cfg)
    cos_RxBxTxF, sin_RxBxTxF = _rope_angles(cfg, pos_BxT)
    kv_L = [None] * cfg.n_layers if cache is None else list(zip(cache["k"], cache["v"]))
    if is_unstacked(params):
        new_L = []
        for layer, lp in enumerate(params["layers"]):
            rope = (cos_RxBxTxF[rope_L[layer]], sin_RxBxTxF[rope_L[layer]])
            x_BxTxD, new = _block(cfg, dtype, x_BxTxD, lp, rope=rope, window=window_L[layer],
                                  kv=kv_L[layer], at=at, reads=reads)
            new_L.append(new)
    else:
        # The per-layer caches are stacked for the scan.
        kv_stacked = None if cache is None else tuple(jnp.stack(c) for c in zip(*kv_L))

        def step(x, xs):
            lp, r, window, kv = xs
            rope = (cos_RxBxTxF[r], sin_RxBxTxF[r])
            return _block(cfg, dtype, x, lp, rope=rope, window=window, kv=kv, at=at,
                          reads=reads)

        xs = (params["layers"], rope_L, window_L, kv_stacked)
        x_BxTxD, new_stacked = jax.lax.scan(step, x_BxTxD, xs)
        new_L = list(zip(*(tuple(c) for c in new_stacked)))
    return _logits(params, cfg, x_BxTxD, valid_BxT, logits), new_L, write_at, meta


def unembed(params: dict, cfg: ModelConfig, x_BxTxD):
    """Final norm, output projection (tied or untied) and optional softcap; float32 logits."""
    x_BxTxD = rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps)
    head_VxD = params["embed" if cfg.tie_embeddings else "lm_head"].astype(x_BxTxD.dtype)
    out = jnp.einsum("btd,vd->btv", x_BxTxD, head_VxD, preferred_element_type=_acc(x_BxTxD.dtype))
    return _softcap(out, cfg.final_logit_softcap)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "logits", "reads"))
def _forward_jit(params, cfg, tokens_BxT, valid_BxT, cache, *, dtype, logits, reads=None):
    return forward(params, cfg, tokens_BxT, valid_BxT, cache, dtype=dtype, logits=logits,
                   reads=reads)


_forward_jit_donated = jax.jit(_forward_jit.__wrapped__,
                               static_argnames=("cfg", "dtype", "logits", "reads"),
                               donate_argnames="cache")
_embed_jit = jax.jit(_embed, static_argnames=("cfg", "dtype"))
# A decoding step's layers in one call (see `_run_layers`); the cache is written by
# `_write_jit(_donated)` after it.
_compute_jit = jax.jit(_compute, static_argnames=("cfg", "dtype", "logits", "reads"))


_block_jit = jax.jit(_block, static_argnames=("cfg", "dtype", "keep", "reads"))
_write_jit = jax.jit(_write_cache)
_write_jit_donated = jax.jit(_write_cache, donate_argnames=("k_L", "v_L"))
_logits_jit = jax.jit(_logits, static_argnames=("cfg", "logits"))


@functools.partial(jax.jit, static_argnames="cfg")
def _rope_jit(cfg, pos_BxT):
    """`_rope_angles` for the per-layer path: one (cos, sin) per distinct table."""
    cos_RxBxTxF, sin_RxBxTxF = _rope_angles(cfg, pos_BxT)
    return tuple(zip(cos_RxBxTxF, sin_RxBxTxF))


@functools.lru_cache(maxsize=None)
def _layer_plan(cfg: ModelConfig):
    """Per layer: its RoPE table's index and its window (a device scalar), built
    once per config rather than on every decoding step."""
    _, rope_L, window_L = _rope_layout(cfg)
    return [(int(r), jnp.asarray(w)) for r, w in zip(rope_L, window_L)]


def _run_layers(params, cfg, tokens_BxT, valid_BxT, cache, dtype, logits, donate, reads=None):
    """`forward` for the per-layer layout.

    Several tokens run one jitted call per layer: every layer has the same
    shapes, so one executable serves them all (compile time does not grow with
    depth) and each call reads its layer's weight buffers in place. A prompt
    (T > 1) into an empty cache attends to its own keys only, not to the empty
    slots. A single token (a decoding step) runs all layers in one call
    (`_compute_jit`, compiled once per batch and cache size): the step is short
    enough that the gap between 30 calls costs about a fifth of it.

    Either way the layers only read the cache; one more call writes every
    layer's new keys and values, in place when `donate` (writing inside the
    call that reads the cache makes XLA:CPU copy it).
    """
    _check_logits(logits)
    dtype = jnp.dtype(dtype)
    tokens_BxT = jnp.asarray(tokens_BxT)
    write = _write_jit_donated if donate else _write_jit
    if tokens_BxT.shape[1] == 1 and cache is not None:
        out, new_L, write_at, meta = _compute_jit(params, cfg, tokens_BxT, valid_BxT, cache,
                                                  dtype=dtype, logits=logits, reads=reads)
        return out, _updated_cache(cache, new_L, write_at, meta, write)
    meta_in = None if cache is None else {k: cache[k] for k in ("pos", "end", "next_pos")}
    x_BxTxD, valid_BxT, pos_BxT, kpos_BxS, meta = _embed_jit(
        params["embed"], cfg, tokens_BxT, valid_BxT, meta_in, dtype=dtype)
    end = None if cache is None else cache["end"]
    write_at = jnp.zeros((), jnp.int32) if end is None else end
    at = Slots(pos_BxT, kpos_BxS, write_at)
    # One host read per prompt (not per decoding step) to know the cache is empty.
    if end is None or (tokens_BxT.shape[1] > 1 and not isinstance(end, jax.core.Tracer)
                       and int(end) == 0):
        kv_L = [None] * cfg.n_layers
    else:
        kv_L = list(zip(cache["k"], cache["v"]))
    ropes = _rope_jit(cfg, pos_BxT)
    # With several tokens, the last layer carries on only what the logits need.
    keep_L = ["all"] * cfg.n_layers
    if tokens_BxT.shape[1] > 1 and logits != "all":
        keep_L[-1] = logits
    new_L = []
    for lp, kv, (r, window), keep in zip(params["layers"], kv_L, _layer_plan(cfg), keep_L):
        x_BxTxD, new = _block_jit(cfg, dtype, x_BxTxD, lp, rope=ropes[r], window=window, kv=kv,
                                  at=at, keep=keep, reads=reads)
        new_L.append(new)
    new_cache = _updated_cache(cache, new_L, write_at, meta, write)
    head = {k: params[k] for k in ("embed", "final_norm", "lm_head") if k in params}
    out = None if logits == "none" else _logits_jit(head, cfg, x_BxTxD, valid_BxT, logits)
    return out, new_cache


def prefill(params: dict, cfg: ModelConfig, tokens_BxT, valid_BxT, cache, *,
            dtype=jnp.float32, logits: str = "all", reads: Reads | None = None):
    """`forward` with a cache: prompt prefill, or catching up on pending tokens.

    Stacked params run as one jitted scan; per-layer params (`unstack_layers`,
    what `brf.checkpoints.registry.load` returns) one jitted call per layer for
    several tokens and one call for all layers for a single token.

    Args:
        params: params pytree.
        cfg: the architecture (static).
        tokens_BxT: int token ids.
        valid_BxT: bool mask of real tokens (left or right padding), or None.
        cache: KV cache (`brf.models.cache.init_cache`), or None for a stateless pass.
        dtype: compute dtype (static).
        logits: 'all' | 'last' | 'none' (static); see `forward`.
        reads: which cache slots the layers read (`Reads`, static; None: all).

    Returns:
        (logits_BxTxV or logits_BxV or None, cache).
    """
    if is_unstacked(params):
        return _run_layers(params, cfg, tokens_BxT, valid_BxT, cache, dtype, logits, False,
                           reads)
    return _forward_jit(params, cfg, tokens_BxT, valid_BxT, cache, dtype=dtype, logits=logits,
                        reads=reads)


def prefill_donated(params: dict, cfg: ModelConfig, tokens_BxT, valid_BxT, cache, *,
                    dtype=jnp.float32, logits: str = "all", reads: Reads | None = None):
    """`prefill` with the cache donated: XLA updates it in place instead of
    copying it (about 2x faster decoding); the cache passed in is invalidated."""
    if is_unstacked(params):
        return _run_layers(params, cfg, tokens_BxT, valid_BxT, cache, dtype, logits, True,
                           reads)
    return _forward_jit_donated(params, cfg, tokens_BxT, valid_BxT, cache, dtype=dtype,
                                logits=logits, reads=reads)


def decode_step(params: dict, cfg: ModelConfig, token_B, cache, valid_B=None, *,
                dtype=jnp.float32, reads: Reads | None = None):
    """One decoding step: appends token_B to the cache and returns next-token logits.

    Args:
        params: params pytree (either layout; see `prefill`).
        cfg: the architecture (static).
        token_B: int token ids, one per sequence.
        cache: KV cache with at least one free slot.
        valid_B: optional bool; False leaves that sequence's position unchanged
            (e.g. finished sequences) and its slot masked.
        dtype: compute dtype (static).
        reads: which cache slots the layers read (`Reads`, static; None: all).

    Returns:
        (logits_BxV float32, cache).
    """
    valid_Bx1 = None if valid_B is None else jnp.asarray(valid_B)[:, None]
    return prefill(params, cfg, jnp.asarray(token_B)[:, None], valid_Bx1, cache,
                   dtype=dtype, logits="last", reads=reads)


def decode_step_donated(params: dict, cfg: ModelConfig, token_B, cache, valid_B=None, *,
                        dtype=jnp.float32, reads: Reads | None = None):
    """`decode_step` with the cache donated (updated in place; the input is invalidated)."""
    valid_Bx1 = None if valid_B is None else jnp.asarray(valid_B)[:, None]
    return prefill_donated(params, cfg, jnp.asarray(token_B)[:, None], valid_Bx1, cache,
                           dtype=dtype, logits="last", reads=reads)



def _tree_meta(cache_meta, pos_BxT):
    """The cache's slot positions, end and next positions after `forward_tree` writes."""
    end = cache_meta["end"]
    pos = jax.lax.dynamic_update_slice(cache_meta["pos"], pos_BxT, (jnp.zeros_like(end), end))
    return dict(pos=pos, end=end + pos_BxT.shape[1], next_pos=cache_meta["next_pos"])


_tree_meta_jit = jax.jit(_tree_meta)


def forward_tree(params: dict, cfg: ModelConfig, cache: dict, tokens_BxT, pos_BxT,
                 cache_allow_BxTxS, tree_allow_BxTxT, *, dtype=jnp.float32,
                 donate: bool = False, reads: Reads | None = None, gather=None):
    """T new tokens at given positions, each attending to chosen cache slots and
    chosen new tokens (tree attention); their keys and values are then written
    at the cache's next T slots.

    Many continuations of one cached context run in one call: a token that
    continues the context's first i tokens sits at position i and sees cache
    slots [0, i), the earlier tokens of its own continuation (in the cache from
    an earlier call, or among the new tokens) and itself -- e.g. every
    alternative tokenization of a text's next bytes, all read against the
    canonical tokenization's KV cache at once (`brf.bytes`). Slots hold a
    token's position (padding: -1), so later calls can attend to these tokens
    by slot.

    Args:
        params: params pytree (either layout; stacked params are unstacked per call).
        cfg: the architecture.
        cache: a KV cache with at least T free slots (`prefill` filled its start).
        tokens_BxT: int token ids.
        pos_BxT: int32 position of each new token; -1 marks padding.
        cache_allow_BxTxS: bool, new token t may attend to cache slot s.
        tree_allow_BxTxT: bool, new token t may attend to new token u; only u <= t
            (lower triangular), and t itself must be allowed.
        dtype: compute dtype.
        donate: update the cache in place (the cache passed in is invalidated).
        reads: which cache slots the layers read (`Reads`; None: all). The
            slots ``cache_allow_BxTxS`` allows must lie inside them.
        gather: None, or (slots_BxA, allow_BxTxA): A more cache slots (int indices,
            anywhere below the cache's ``end``) read as a part of their own, new
            token t attending to gathered slot a where allowed. With ``reads``
            bounding the rest, a token's few ancestors far down the cache cost A
            slots, not the span up to them. A slot both allowed here and in
            ``cache_allow_BxTxS`` would count twice: allow each in one place.

    Returns:
        (logits_BxTxV, cache): float32 logits (float64 for a float64 run), each
        row equal to a plain forward pass over the sequence it stands for (its
        visible slots' tokens, its visible new tokens, itself); the cache with
        the new tokens at slots [end, end + T).
    """
    if not is_unstacked(params):
        params = unstack_layers(params)
    pos_BxT = jnp.asarray(pos_BxT, jnp.int32)
    meta_in = {k: cache[k] for k in ("pos", "end", "next_pos")}
    logits, new_L = _tree_jit(params, cfg, (tuple(cache["k"]), tuple(cache["v"])), meta_in,
                              jnp.asarray(tokens_BxT), pos_BxT,
                              jnp.asarray(cache_allow_BxTxS, bool),
                              jnp.asarray(tree_allow_BxTxT, bool), dtype=jnp.dtype(dtype),
                              reads=reads, gather=None if gather is None else (
                                  jnp.asarray(gather[0], jnp.int32), jnp.asarray(gather[1], bool)))
    meta = _tree_meta_jit(meta_in, pos_BxT)
    cache = _updated_cache(cache, new_L, cache["end"], meta,
                           _write_jit_donated if donate else _write_jit)
    return logits, cache


def _tree(params, cfg, kv, meta, tokens_BxT, pos_BxT, cache_allow_BxTxS, tree_allow_BxTxT, *,
          dtype, reads=None, gather=None):
    """`forward_tree` up to the cache write: logits and every layer's new (kT, v).

    All layers run in one call (the cache is only read): unlike a long prompt,
    a tree call is often a few tokens, where 30 separate layer calls cost more
    than their work, and at a few hundred tokens one program is still faster
    on XLA:CPU than a call per layer.
    """
    x_BxTxD = _embed_tokens(params["embed"], cfg, tokens_BxT, dtype)
    _, rope_L, window_L = _rope_layout(cfg)
    cos_RxBxTxF, sin_RxBxTxF = _rope_angles(cfg, pos_BxT)
    allow = (cache_allow_BxTxS, tree_allow_BxTxT) + (() if gather is None else (gather,))
    at = Slots(pos_BxT, meta["pos"], meta["end"], allow)
    new_L = []
    for layer, lp in enumerate(params["layers"]):
        rope = (cos_RxBxTxF[rope_L[layer]], sin_RxBxTxF[rope_L[layer]])
        x_BxTxD, new = _block(cfg, dtype, x_BxTxD, lp, rope=rope, window=window_L[layer],
                              kv=(kv[0][layer], kv[1][layer]), at=at, keep="all", reads=reads)
        new_L.append(new)
    return _logits(params, cfg, x_BxTxD, None, "all"), new_L


_tree_jit = jax.jit(_tree, static_argnames=("cfg", "dtype", "reads"))


def compiled_count() -> int:
    """Executables compiled so far by this module's jitted pieces (retrace checks)."""
    return sum(f._cache_size() for f in (_forward_jit, _forward_jit_donated, _compute_jit,
                                         _embed_jit, _rope_jit, _block_jit, _write_jit,
                                         _write_jit_donated, _logits_jit, _tree_jit,
                                         _tree_meta_jit))


__all__ = ["Reads", "cache_reads", "cast_params", "compiled_count", "decode_step", "decode_step_donated", "forward",
           "forward_tree", "init_params", "is_unstacked", "param_shapes", "prefill", "prefill_donated",
           "rope_attention_factor", "rope_inv_freq", "layer_tables", "rms_norm", "apply_rope", "stack_layers",
           "unembed", "unstack_layers"]
