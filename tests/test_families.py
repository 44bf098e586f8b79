"""The families beside Llama and Gemma 3 (FAMILIES) against their transformers classes.

For each family a tiny random model is built in transformers' own PyTorch class,
saved with save_pretrained (sharded, so the index is read) and loaded by
brf.checkpoints.hf; its logits must equal transformers' within the tolerance of
the Llama / Gemma 3 parity (tests/test_models_hf.py), through a full forward in
both params layouts, through prefill + decoding steps on a left-padded batch,
and through the flax.nnx module `registry.load_module` builds. The same weights
written as llama.cpp writes that architecture (names from gguf's own
TensorNameMap, llama.cpp's Q/K permutation for 'llama', Gemma's 1 + w norms,
Phi-3's fused tensors) and read by brf.checkpoints.gguf give the same
parameters. A mutation of the name table or config mapping (a missing bias,
swapped norms, swapped fused halves, a dropped window) must break the parity.
torch/transformers are test references only.
"""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from brf.checkpoints.assemble import same  # noqa: E402
from brf.checkpoints import gguf as G  # noqa: E402
from brf.checkpoints import hf as hf_ckpt  # noqa: E402
from brf.checkpoints import registry  # noqa: E402
from brf.models import (ARCHITECTURES, decode_step_donated, init_cache, prefill,  # noqa: E402
                        prefill_donated, transformer)

V, T = 97, 16
ATOL = 1e-4
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)

# name -> (transformers class, its config, the GGUF architecture llama.cpp writes it as)
FAMILIES = {
    # layer 1 of 2 slides (max_window_layers=1), window 5 < T
    "qwen2": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **SMALL, num_hidden_layers=2, use_sliding_window=True, sliding_window=5,
        max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 300.0}),
        "qwen2"),
    "mistral": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(
        **SMALL, head_dim=8, num_hidden_layers=2, sliding_window=5), "llama"),
    "qwen3": lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        **SMALL, head_dim=8, num_hidden_layers=2, tie_word_embeddings=True), "qwen3"),
    "phi3": lambda: (transformers.Phi3ForCausalLM, transformers.Phi3Config(
        **SMALL, num_hidden_layers=2, sliding_window=6, pad_token_id=0, bos_token_id=1,
        eos_token_id=2), "phi3"),
    # query_pre_attn_scalar = head_dim: what llama.cpp assumes below 46 layers
    "gemma2": lambda: (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        **SMALL, head_dim=8, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=8,
        attn_logit_softcapping=1.5, final_logit_softcapping=3.0), "gemma2"),
    "olmo2": lambda: (transformers.Olmo2ForCausalLM, transformers.Olmo2Config(
        **SMALL, num_hidden_layers=2, pad_token_id=0, eos_token_id=2), "olmo2"),
}
# What each family's config must come out as (beyond the shared shapes).
STRUCTURE = {
    "qwen2": dict(attn_bias=True, qk_norm="none", norm_placement="pre",
                  layer_types=("global", "local"), sliding_window=5),
    "mistral": dict(attn_bias=False, qk_norm="none", norm_placement="pre",
                    layer_types=("local", "local"), sliding_window=5),
    "qwen3": dict(attn_bias=False, qk_norm="head", norm_placement="pre", tie_embeddings=True),
    "phi3": dict(attn_bias=False, qk_norm="none", norm_placement="pre",
                 layer_types=("local", "local"), sliding_window=6),
    "gemma2": dict(qk_norm="none", norm_placement="sandwich", attn_logit_softcap=1.5,
                   final_logit_softcap=3.0, layer_types=("local", "global", "local"),
                   embed_scale=True, act="gelu_tanh", rope_local_theta=None),
    "olmo2": dict(attn_bias=False, qk_norm="full", norm_placement="post"),
}


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


def _ref_logits(ref, tokens_BxT):
    with torch.no_grad():
        return ref(torch.tensor(tokens_BxT, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, HF directory, torch model, GGUF arch, cfg, params, reference logits_1xTxV)."""
    name = request.param
    torch.manual_seed(0)
    cls, conf, gguf_arch = FAMILIES[name]()
    conf._attn_implementation = "eager"
    ref = cls(conf).float().eval()
    with torch.no_grad():  # weights large enough that every part matters
        for p in ref.parameters():
            p.add_(0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    ref.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").exists()
    cfg, params = hf_ckpt.load_hf(str(path))
    return (name, str(path), ref, gguf_arch, cfg, jax.device_put(params),
            _ref_logits(ref, _tokens(0, (1, T))))


def test_config_and_logits_match_transformers(family):
    """The config's structure, and logits within ATOL in both params layouts."""
    name, _, _, _, cfg, params, want = family
    assert cfg.arch == name
    for field, value in STRUCTURE[name].items():
        assert getattr(cfg, field) == value, (field, getattr(cfg, field))
    assert np.std(want) > 0.1, "reference logits too flat to test anything"
    for layout in (params, transformer.unstack_layers(params)):
        got = np.asarray(prefill(layout, cfg, _tokens(0, (1, T)), None, None)[0])
        err = float(np.max(np.abs(got - want)))
        assert err < ATOL, f"{name}: max abs diff {err:.2e} vs transformers"


def test_padded_prefill_and_decode_match_transformers(family):
    """A left-padded batch prefilled then decoded token by token (per-layer params,
    cache donated): every sequence's logits are transformers' on it alone."""
    name, _, ref, _, cfg, params, _ = family
    params = transformer.unstack_layers(params)
    lengths, n_new, width = [6, 3], T - 6, 6
    seqs = [_tokens(7 + b, (n + n_new,)) for b, n in enumerate(lengths)]
    tokens, valid = np.zeros((2, width), np.int32), np.zeros((2, width), bool)
    for b, (n, s) in enumerate(zip(lengths, seqs)):
        tokens[b, width - n:], valid[b, width - n:] = s[:n], True
    cache = init_cache(cfg, 2, width + n_new)
    logits, cache = prefill_donated(params, cfg, tokens, valid, cache, logits="last")
    steps = [np.asarray(logits)]
    for j in range(n_new - 1):
        step, cache = decode_step_donated(
            params, cfg, jnp.asarray([s[n + j] for n, s in zip(lengths, seqs)]), cache)
        steps.append(np.asarray(step))
    for b, (n, s) in enumerate(zip(lengths, seqs)):
        want = _ref_logits(ref, s[None])[0, n - 1:n + n_new - 1]
        err = float(np.max(np.abs(np.stack([st[b] for st in steps]) - want)))
        assert err < ATOL, f"{name} sequence {b}: prefill + decode max abs diff {err:.2e}"


def test_module_equals_functional_path(family, tmp_path):
    """registry.load_module (via the orbax cache): the family's nnx class, whose
    call is the functional path's on the same parameters (its decoding entry points
    are the same functions, tests/test_modules.py)."""
    name, path, _, _, cfg, _, want = family
    model, _ = registry.load_module(path, cache_root=str(tmp_path), progress=False)
    assert isinstance(model, ARCHITECTURES.get(name).module) and model.cfg == cfg
    params = model.to_params()
    tokens = _tokens(0, (1, T))
    got = np.asarray(model(tokens))
    np.testing.assert_array_equal(got, np.asarray(prefill(params, cfg, tokens, None, None)[0]))
    assert float(np.max(np.abs(got - want))) < ATOL


# ------------------------------------------------------------------------ GGUF


def _llamacpp_permute(w_OxI, n_head):
    """llama.cpp's LlamaModel.permute (HF half-split rows -> GGML interleaved rows)."""
    return (w_OxI.reshape(n_head, 2, w_OxI.shape[0] // n_head // 2, *w_OxI.shape[1:])
            .swapaxes(1, 2).reshape(w_OxI.shape))


def _write_gguf(path, gguf_arch, ref, hf_conf):
    """The model's tensors and hyperparameters as llama.cpp's converter writes them."""
    c = hf_conf
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, gguf_arch.upper()),
                                     c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if gguf_arch != "gemma2":  # Gemma2Model writes no RoPE base (llama.cpp's default)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if gguf_arch == "gemma2":
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if gguf_arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(c.sliding_window or 0)
    tied = c.tie_word_embeddings
    for name, t in ref.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        x = t.detach().numpy().astype(np.float32)
        if gguf_arch == "llama" and name.endswith("q_proj.weight"):
            x = _llamacpp_permute(x, c.num_attention_heads)
        if gguf_arch == "llama" and name.endswith("k_proj.weight"):
            x = _llamacpp_permute(x, c.num_key_value_heads)
        if gguf_arch == "gemma2" and name.endswith("norm.weight"):
            x = x + 1  # Gemma2Model.modify_tensors
        out = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert out is not None, name
        w.add_tensor(out, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_as_llamacpp_writes_it(family, tmp_path):
    """The same weights as a GGUF file: the same parameters and structure. (llama.cpp
    writes Mistral as 'llama', with permuted Q/K, and keeps no sliding window for
    Mistral or Qwen2.)"""
    name, _, ref, gguf_arch, cfg, params, _ = family
    path = tmp_path / f"{name}.gguf"
    _write_gguf(path, gguf_arch, ref, ref.config)
    got_cfg, got = G.load_gguf(path, progress=False)
    ignore = {"bos_id", "eos_ids", "pad_id", "norm_eps"}  # no tokenizer; eps in float32
    assert got_cfg.norm_eps == pytest.approx(cfg.norm_eps, rel=1e-6)
    if name in ("mistral", "qwen2"):  # llama.cpp keeps no window for either
        assert got_cfg.arch == gguf_arch and set(got_cfg.layer_types) == {"global"}
        ignore |= {"arch", "layer_types", "sliding_window"}
    want_fields = {k: v for k, v in cfg.to_dict().items() if k not in ignore}
    assert {k: v for k, v in got_cfg.to_dict().items() if k not in ignore} == want_fields
    flat_want = dict(jax.tree_util.tree_leaves_with_path(params))
    flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
    assert set(flat_got) == set(flat_want)
    for k, v in flat_want.items():
        np.testing.assert_array_equal(flat_got[k], np.asarray(v), err_msg=str(k))


# ------------------------------------------------------------------- mutations


def _swap(table, a, b):
    """The table with the paths a and b exchanged (entries' targets, or the order of
    a fused entry's targets)."""
    swap = {a: b, b: a}
    out = tuple((e[0], swap.get(e[1], e[1]) if isinstance(e[1], str)
                 else tuple(swap.get(p, p) for p in e[1]), e[2]) for e in table)
    assert out != table, (a, b)
    return out


def _retransform(table, path, fn):
    assert any(e[1] == path for e in table), path
    return tuple((e[0], e[1], fn if e[1] == path else e[2]) for e in table)


# name -> (what the mutation does, how: monkeypatch(hf module, table) -> None)
MUTATIONS = {
    "qwen2": ("drops the q bias", lambda mp, t: mp.setitem(
        hf_ckpt.NAME_MAPS, "qwen2", _retransform(t, "layers/bq", lambda w, c: 0 * w))),
    "mistral": ("drops the sliding window", lambda mp, t: mp.setattr(
        hf_ckpt, "_windowed", lambda common, window: {})),
    "qwen3": ("swaps the q and k norms", lambda mp, t: mp.setitem(
        hf_ckpt.NAME_MAPS, "qwen3", _swap(t, "layers/q_norm", "layers/k_norm"))),
    "phi3": ("swaps the fused gate and up halves", lambda mp, t: mp.setitem(
        hf_ckpt.NAME_MAPS, "phi3", _swap(t, "layers/w_gate", "layers/w_up"))),
    "gemma2": ("reads a post-attention norm without Gemma's + 1", lambda mp, t: mp.setitem(
        hf_ckpt.NAME_MAPS, "gemma2", _retransform(t, "layers/post_attn_norm", same))),
    "olmo2": ("swaps the post-attention and post-MLP norms", lambda mp, t: mp.setitem(
        hf_ckpt.NAME_MAPS, "olmo2", _swap(t, "layers/post_attn_norm", "layers/post_mlp_norm"))),
}


def test_a_mutated_mapping_breaks_parity(family, monkeypatch):
    """The parity above is not vacuous: one wrong entry moves the logits far past ATOL."""
    name, path, _, _, _, _, want = family
    what, mutate = MUTATIONS[name]
    mutate(monkeypatch, hf_ckpt.NAME_MAPS[name])
    cfg, params = hf_ckpt.load_hf(path)
    got = np.asarray(prefill(params, cfg, _tokens(0, (1, T)), None, None)[0])
    err = float(np.max(np.abs(got - want)))
    assert err > 100 * ATOL, f"{name}: the mapping that {what} still matches ({err:.2e})"


# -------------------------------------------------------------------- refusals


@pytest.mark.parametrize("model_type, change, field", [
    ("qwen2", dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 32}), "yarn"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.75}), "partial_rotary_factor"),
    ("phi3", dict(rope_scaling={"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}),
     "longrope"),
    ("olmo2", dict(attention_bias=True), "attention_bias"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
    ("gemma2", dict(layer_types=["chunked_attention"] * 2), "chunked_attention"),
    ("mistral", dict(moe_num_experts=8), "moe_num_experts"),
])
def test_refuses_what_it_does_not_implement(model_type, change, field):
    base = dict(model_type=model_type, vocab_size=V, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-6)
    hf_ckpt.config_from_hf(base)
    with pytest.raises(hf_ckpt.HFCheckpointError, match=field):
        hf_ckpt.config_from_hf({**base, **change})


def test_gguf_refuses_phi3_long_rope(tmp_path):
    """Phi-3 128k files carry rope_factors_long/short: refused by name, not misread."""
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    for key, value in dict(block_count=1, embedding_length=8, feed_forward_length=8,
                           **{"attention.head_count": 2}).items():
        w.add_uint32(f"phi3.{key}", value)
    w.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("phi3.rope.scaling.attn_factor", 1.19)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(G.GGUFError, match="phi3.rope.scaling.attn_factor"):
        G.load_gguf(path, progress=False)


def test_config_json_round_trip(family):
    """What a brf checkpoint stores (config.json) gives the same config back."""
    cfg = family[4]
    assert type(cfg).from_dict(json.loads(cfg.to_json())) == cfg


# ----------------------------------------------------------- large checkpoints


def test_sharded_bfloat16_read_tensor_by_tensor(tmp_path, monkeypatch):
    """A synthetic Qwen2 checkpoint in bfloat16 shards: read into bfloat16 bit for bit
    as safetensors' own loader reads it, or cast to float32; the default dtype is
    float32 below 1e9 parameters and bfloat16 above; a model that would not fit
    is refused in one line with its size and what it needs."""
    import ml_dtypes
    from safetensors.torch import load_file

    from brf.checkpoints import assemble, synthetic
    spec = dict(synthetic.QWEN25_3B, vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    n = synthetic.write_synthetic_hf(str(tmp_path), spec, shard_bytes=4096, seed=1)
    shards = hf_ckpt.safetensors_files(str(tmp_path))
    assert len(shards) > 3
    cfg, params = hf_ckpt.load_hf(str(tmp_path), dtype=None)
    assert assemble.n_params(cfg) == n and cfg.attn_bias and cfg.tie_embeddings
    want = {}
    for path in shards:
        want.update({k: v.view(torch.int16).numpy() for k, v in load_file(path).items()})
    wq = params["layers"]["wq"]
    assert wq.dtype == ml_dtypes.bfloat16
    for i in range(3):
        np.testing.assert_array_equal(wq[i].T.view(np.int16),
                                      want[f"model.layers.{i}.self_attn.q_proj.weight"])
        np.testing.assert_array_equal(params["layers"]["bk"][i].view(np.int16),
                                      want[f"model.layers.{i}.self_attn.k_proj.bias"])
    _, f32 = hf_ckpt.load_hf(str(tmp_path))  # default: float32 at this size
    assert f32["embed"].dtype == np.float32
    np.testing.assert_array_equal(f32["embed"], params["embed"].astype(np.float32))
    big = hf_ckpt.config_from_hf(dict(synthetic.QWEN25_3B, num_hidden_layers=28))
    assert assemble.default_dtype(big) == np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(assemble.CheckpointTooLargeError,
                       match=r"2\.47B parameters\) is 9\.9 GB in float32 and needs about "
                             r"12\.8 GB .* 8\.0 GB available; in bfloat16 it is 4\.9 GB and "
                             r"needs 6\.4 GB \(dtype=bfloat16\)"):
        assemble.check_fits(big, np.float32, "/m", available=8_000_000_000)
    monkeypatch.setattr(assemble, "available_memory", lambda: 1000)
    with pytest.raises(assemble.CheckpointTooLargeError, match=str(tmp_path)):
        hf_ckpt.load_hf(str(tmp_path))
