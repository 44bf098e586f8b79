"""brf.models + brf.checkpoints.hf against tiny random transformers (PyTorch) models.

Each model is built here, saved with save_pretrained (safetensors), loaded with
brf.checkpoints.hf and compared at every position. torch/transformers are test
references only.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from brf.checkpoints import hf as hf_ckpt  # noqa: E402
from brf.models import transformer  # noqa: E402
from brf.models import (ARCHITECTURES, ModelConfig, cast_params, decode_step,  # noqa: E402
                        decode_step_donated, init_cache, init_params, iter_logits_chunks,
                        param_shapes, prefill, prefill_donated, score_tokens)

V, T = 97, 21
ATOL = 1e-4

SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128)

HF_MODELS = {
    "llama_untied": lambda: transformers.LlamaConfig(
        **SMALL, num_hidden_layers=2, tie_word_embeddings=False, rope_theta=500.0),
    "llama_tied_llama3": lambda: transformers.LlamaConfig(
        **SMALL, num_hidden_layers=2, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", rope_theta=100.0, factor=4.0,
                          low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)),
    "llama_linear": lambda: transformers.LlamaConfig(
        **SMALL, num_hidden_layers=1, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", rope_theta=100.0, factor=3.0)),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
        final_logit_softcapping=3.0),
}


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def any_model(request, tmp_path_factory):
    """(name, cfg, params, reference logits_1xTxV of _tokens(0, (1, T)), torch model)."""
    name = request.param
    torch.manual_seed(0)
    hf_cfg = HF_MODELS[name]()
    hf_cfg._attn_implementation = "eager"
    cls = (transformers.Gemma3ForCausalLM if name.startswith("gemma")
           else transformers.LlamaForCausalLM)
    ref = cls(hf_cfg).float().eval()
    with torch.no_grad():  # random weights big enough that every part matters
        for p in ref.parameters():
            p.add_(0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    # Shard the untied Llama to exercise model.safetensors.index.json.
    ref.save_pretrained(path, max_shard_size="20KB" if name == "llama_untied" else "1GB")
    cfg, params = hf_ckpt.load_hf(str(path))
    return name, cfg, jax.device_put(params), _ref_logits(ref, _tokens(0, (1, T))), ref


@pytest.fixture(scope="module", params=["stacked", "layers"])
def model(request, any_model):
    """The models the slower tests run on (llama_linear differs only in its RoPE), in
    both params layouts: stacked layers (one jitted scan) and per-layer (one jitted
    call per layer, what `registry.load` returns)."""
    name, cfg, params, want, ref = any_model
    if name == "llama_linear":
        pytest.skip("RoPE variant: checked by test_logits_match_transformers only")
    if request.param == "layers":
        params = transformer.unstack_layers(params)
        assert transformer.is_unstacked(params)
        restacked = transformer.stack_layers(params, cfg)
        assert jax.tree.all(jax.tree.map(np.array_equal, restacked, any_model[2]))
    return f"{name}/{request.param}", cfg, params, want, ref


def _ref_logits(ref, tokens_BxT):
    with torch.no_grad():
        return ref(torch.tensor(tokens_BxT, dtype=torch.long)).logits.numpy()


def _full(params, cfg, tokens_BxT, **kw):
    """Stateless jitted forward over whole sequences."""
    return np.asarray(prefill(params, cfg, jnp.asarray(tokens_BxT), None, None, **kw)[0])


def test_loaded_config(any_model):
    name, cfg, params, _, _ = any_model
    assert cfg.arch == ("gemma3" if name == "gemma3" else "llama")
    assert cfg.tie_embeddings == ("lm_head" not in params)
    assert jax.tree.map(lambda a: a.shape, params) == param_shapes(cfg)
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    if name == "gemma3":
        assert cfg.layer_types == ("local", "local", "global", "local")
        assert cfg.rope_scaling == {"type": "linear", "factor": 2.0}
        assert cfg.rope_local_theta == 50.0 and cfg.sliding_window == 4


def test_logits_match_transformers(any_model):
    name, cfg, params, want, _ = any_model
    got = _full(params, cfg, _tokens(0, (1, T)))
    err = float(np.max(np.abs(got - want)))
    assert err < ATOL, f"{name}: max abs diff {err:.2e} vs transformers"
    assert np.std(want) > 0.1, "reference logits too flat to test anything"


def test_kv_cache_decode_equals_full_forward(model):
    name, cfg, params, want, _ = model
    tokens = _tokens(0, (1, T))
    cache = init_cache(cfg, 1, T + 1)  # one spare slot for the masked step below
    p = 5
    # The donated variants: same maths, cache updated in place.
    logits, cache = prefill_donated(params, cfg, jnp.asarray(tokens[:, :p]), None, cache)
    steps = [np.asarray(logits)[0]]
    for t in range(p, T):
        if t == p + 3:  # a masked (finished-sequence) step leaves no trace
            _, cache = decode_step_donated(params, cfg, jnp.array([7]), cache,
                                           jnp.array([False]))
        step, cache = decode_step_donated(params, cfg, jnp.asarray(tokens[:, t]), cache)
        steps.append(np.asarray(step))
        if t == p:
            n_compiled = transformer.compiled_count()
    assert transformer.compiled_count() <= n_compiled + 1, "decode_step retraced"
    got = np.concatenate(steps, 0)
    err = float(np.max(np.abs(got - want[0])))
    assert err < ATOL, f"{name}: cached decode vs full forward, max abs diff {err:.2e}"


def test_prefill_keeping_no_or_last_logits(model):
    """logits='none' still fills every layer's cache (the last layer computes only
    its keys and values) and logits='last' on a later chunk sees all of it."""
    name, cfg, params, want, _ = model
    tokens = _tokens(0, (1, T))
    cache = init_cache(cfg, 1, T)
    out, cache = prefill(params, cfg, jnp.asarray(tokens[:, :12]), None, cache, logits="none")
    assert out is None
    last, cache = prefill(params, cfg, jnp.asarray(tokens[:, 12:]), None, cache, logits="last")
    err = float(np.max(np.abs(np.asarray(last)[0] - want[0, -1])))
    assert err < ATOL, f"{name}: last logits after a logits='none' chunk, max abs diff {err:.2e}"


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_singles(model, side):
    name, cfg, params, _, ref = model
    lengths, width, n_new = [9, 4, 7], 9, 3
    seqs = [_tokens(i + 1, (n + n_new,)) for i, n in enumerate(lengths)]
    tokens = np.zeros((3, width), np.int32)
    valid = np.zeros((3, width), bool)
    for b, (n, s) in enumerate(zip(lengths, seqs)):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        tokens[b, cols], valid[b, cols] = s[:n], True
    cache = init_cache(cfg, 3, width + n_new)
    logits, cache = prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(valid), cache)
    last, _ = prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(valid), None,
                      logits="last")
    steps = []
    for j in range(n_new):
        tok = np.array([s[n + j] for n, s in zip(lengths, seqs)], np.int32)
        step, cache = decode_step(params, cfg, jnp.asarray(tok), cache)
        steps.append(np.asarray(step))
    for b, (n, s) in enumerate(zip(lengths, seqs)):
        single = _ref_logits(ref, s[None])[0]
        got = np.asarray(logits)[b][valid[b]]
        errs = [np.max(np.abs(got - single[:n])), np.max(np.abs(np.asarray(last)[b] - single[n - 1]))]
        errs += [np.max(np.abs(steps[j][b] - single[n + j])) for j in range(n_new)]
        assert max(errs) < ATOL, f"{name} {side}-padded seq {b}: max abs diffs {errs}"


@pytest.fixture
def small_query_blocks(monkeypatch):
    """Causal attention in query blocks of 4 tokens (traced afresh, then restored)."""
    jax.clear_caches()
    monkeypatch.setattr(transformer, "_Q_BLOCK", 4)
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("side", ["left", "right"])
def test_query_blocks_padded_two_chunk_prefill(model, side, small_query_blocks):
    """Prompts prefilled in two chunks, the first into an empty cache and the
    second against it, with attention in query blocks smaller than the chunks:
    every valid position's logits equal transformers' on each sequence alone."""
    name, cfg, params, _, ref = model
    lengths, width = [13, 6, 10], 13
    seqs = [_tokens(i + 11, (n,)) for i, n in enumerate(lengths)]
    tokens = np.zeros((3, width), np.int32)
    valid = np.zeros((3, width), bool)
    for b, (n, s) in enumerate(zip(lengths, seqs)):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        tokens[b, cols], valid[b, cols] = s, True
    cache = init_cache(cfg, 3, width)
    cut = 7  # chunks of 7 and 6 tokens: blocks of 4 + 3, and 4 + 2
    first, cache = prefill(params, cfg, jnp.asarray(tokens[:, :cut]),
                           jnp.asarray(valid[:, :cut]), cache)
    second, cache = prefill(params, cfg, jnp.asarray(tokens[:, cut:]),
                            jnp.asarray(valid[:, cut:]), cache)
    got_BxTxV = np.concatenate([np.asarray(first), np.asarray(second)], axis=1)
    for b, s in enumerate(seqs):
        err = np.max(np.abs(got_BxTxV[b][valid[b]] - _ref_logits(ref, s[None])[0]))
        assert err < ATOL, f"{name} {side}-padded seq {b}: max abs diff {err:.2e}"


def test_bfloat16_close(model):
    name, cfg, params, want, _ = model
    params = cast_params(params, jnp.bfloat16)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(params))
    got = _full(params, cfg, _tokens(0, (1, T)), dtype=jnp.bfloat16)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    err = float(np.max(np.abs(got - want)))
    assert err < 0.1 * np.max(np.abs(want)), f"{name}: bf16 max abs diff {err:.3f}"
    agree = np.mean(got.argmax(-1) == want.argmax(-1))
    assert agree >= 0.8, f"{name}: bf16 argmax agreement {agree:.2f}"


def test_chunked_scoring(model):
    name, cfg, params, want, _ = model
    tokens = _tokens(0, (1, T))
    chunks = list(iter_logits_chunks(params, cfg, tokens, chunk=8))
    assert [s for s, _ in chunks] == [0, 8, 16] and chunks[-1][1].shape == (1, T - 16, V)
    got = np.concatenate([np.asarray(c) for _, c in chunks], axis=1)
    err = float(np.max(np.abs(got - want)))
    assert err < ATOL, f"{name}: chunked logits max abs diff {err:.2e}"
    logp = score_tokens(params, cfg, tokens, chunk=8)
    ref = jax.nn.log_softmax(want, -1)[0, np.arange(T - 1), tokens[0, 1:]]
    np.testing.assert_allclose(logp[0], ref, atol=ATOL)


def test_registry_and_full_size_shapes():
    assert {"llama", "gemma3"} <= set(ARCHITECTURES.names())
    cfg = ModelConfig(  # Gemma 3 270M, checked by shape only
        arch="gemma3", vocab_size=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1,
        head_dim=256, d_ff=2048, norm_eps=1e-6, rope_theta=1e6, rope_local_theta=1e4,
        sliding_window=512, layer_types=(("local",) * 5 + ("global",)) * 3,
        query_pre_attn_scalar=256, act="gelu_tanh", embed_scale=True, max_seq_len=32768)
    arch = ARCHITECTURES.get(cfg.arch)
    params = jax.eval_shape(lambda k: arch.init_params(cfg, k), jax.random.key(0))
    n = sum(np.prod(a.shape) for a in jax.tree.leaves(params))
    assert 260e6 < n < 280e6, n
    cache = jax.eval_shape(lambda: arch.init_cache(cfg, 2, 64))
    out = jax.eval_shape(lambda p, t, c: arch.prefill(p, cfg, t, None, c, logits="last"),
                         params, jax.ShapeDtypeStruct((2, 64), jnp.int32), cache)
    assert out[0].shape == (2, 262144)


def test_random_params_run_without_nan():
    cfg = ModelConfig(arch="llama", vocab_size=V, d_model=16, n_layers=2, n_heads=2,
                      n_kv_heads=1, head_dim=8, d_ff=32, norm_eps=1e-5, rope_theta=1e4)
    params = init_params(cfg, jax.random.key(0))
    valid = np.array([[False, False, True, True]])  # pad queries see no keys
    out, _ = prefill(params, cfg, jnp.zeros((1, 4), jnp.int32), jnp.asarray(valid), None)
    assert np.all(np.isfinite(np.asarray(out)))


GOOD_LLAMA = dict(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6)


@pytest.mark.parametrize("change, field", [
    (dict(model_type="falcon"), "model_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "original_max_position"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.0}), "dynamic"),
    (dict(some_new_field=1), "some_new_field"),
])
def test_refuses_unsupported_config(change, field):
    hf_ckpt.config_from_hf(GOOD_LLAMA)  # the base config is fine
    with pytest.raises(ValueError, match=field):
        hf_ckpt.config_from_hf({**GOOD_LLAMA, **change})


def test_refuses_gemma3_attn_softcap():
    gemma = {**GOOD_LLAMA, "model_type": "gemma3_text", "sliding_window": 4}
    hf_ckpt.config_from_hf(gemma)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        hf_ckpt.config_from_hf({**gemma, "attn_logit_softcapping": 50.0})


@pytest.mark.parametrize("scaling, match", [
    ({"type": "dynamic", "factor": 2.0}, "'dynamic' unsupported"),
    ({"type": "yarn", "factor": 2.0}, "'yarn' lacks keys"),
])
def test_modelconfig_refuses_unknown_rope_scaling(scaling, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(arch="llama", vocab_size=V, d_model=16, n_layers=1, n_heads=2,
                    n_kv_heads=1, head_dim=8, d_ff=32, norm_eps=1e-5, rope_theta=1e4,
                    rope_scaling=scaling)


def test_refuses_unmapped_tensor():
    cfg = hf_ckpt.config_from_hf(GOOD_LLAMA)
    with pytest.raises(ValueError, match="bias"):
        hf_ckpt.convert_tensors(cfg, [("model.layers.0.self_attn.q_proj.bias", np.zeros(4))])


def test_non_finite_weights_refused_naming_the_tensor():
    """Issue 71: a checkpoint whose weights held NaN converted, and generated an empty
    text with exit 0. Every tensor of a Llama checkpoint, NaN or inf in it: refused at
    conversion naming that tensor (the GGUF reader writes through the same Assembler)."""
    from brf.checkpoints.assemble import kernel
    from brf.models.transformer import param_shapes
    cfg = hf_ckpt.config_from_hf(dict(GOOD_LLAMA, tie_word_embeddings=False))
    shapes = param_shapes(cfg)
    rng = np.random.default_rng(0)
    tensors = []
    for pattern, path, fn in hf_ckpt.LLAMA_MAP:
        name = pattern.replace(r"model\.layers\.(\d+)\.", "model.layers.1.").replace("\\", "")
        ours = shapes["layers"][path[7:]][1:] if path.startswith("layers/") else shapes[path]
        tensors.append((name, ours[::-1] if fn is kernel else ours))
    assert len(tensors) == 12
    for k, (bad, _) in enumerate(tensors):
        arrays = []
        for layer in range(cfg.n_layers):
            for name, shape in tensors:
                if "layers" not in name and layer:
                    continue
                name = name.replace("layers.1.", f"layers.{layer}.")
                x = rng.standard_normal(shape).astype(np.float32)
                if name == bad:
                    x.reshape(-1)[2] = np.nan if k % 2 else -np.inf
                arrays.append((name, x))
        with pytest.raises(hf_ckpt.HFCheckpointError,
                           match=rf"tensor '{re.escape(bad)}' .*holds "
                                 rf"{'NaN' if k % 2 else 'inf'}.*non-finite"):
            hf_ckpt.convert_tensors(cfg, arrays)
    good = [(n.replace("layers.1.", f"layers.{layer}."), rng.standard_normal(s)
             .astype(np.float32)) for layer in range(cfg.n_layers) for n, s in tensors
            if "layers" in n or not layer]
    hf_ckpt.convert_tensors(cfg, good)  # the same without a bad value converts
