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
import math

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


def _padded_decode(params, cfg, seqs, lengths, n_new):
    """Each seqs[b]'s first lengths[b] tokens left-padded into one batch and
    prefilled (per-layer params, cache donated), then n_new - 1 decoding steps
    feeding the sequences' next tokens: the n_new logits [B, V] of each step."""
    params = transformer.unstack_layers(params)
    width = max(lengths)
    tokens, valid = np.zeros((len(seqs), width), np.int32), np.zeros((len(seqs), width), bool)
    for b, (n, s) in enumerate(zip(lengths, seqs)):
        tokens[b, width - n:], valid[b, width - n:] = s[:n], True
    cache = init_cache(cfg, len(seqs), width + n_new)
    logits, cache = prefill_donated(params, cfg, tokens, valid, cache, logits="last")
    steps = [np.asarray(logits)]
    for j in range(n_new - 1):
        step, cache = decode_step_donated(
            params, cfg, jnp.asarray([s[n + j] for n, s in zip(lengths, seqs)]), cache)
        steps.append(np.asarray(step))
    return steps


def test_padded_prefill_and_decode_match_transformers(family):
    """A left-padded batch prefilled then decoded token by token (per-layer params,
    cache donated): every sequence's logits are transformers' on it alone."""
    name, _, ref, _, cfg, params, _ = family
    lengths, n_new = [6, 3], T - 6
    seqs = [_tokens(7 + b, (n + n_new,)) for b, n in enumerate(lengths)]
    steps = _padded_decode(params, cfg, seqs, lengths, n_new)
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


def _write_gguf(path, gguf_arch, ref, hf_conf, extra=None):
    """The model's tensors and hyperparameters as llama.cpp's converter writes them;
    ``extra(writer)`` adds more (rope scaling metadata and tensors)."""
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
    if extra is not None:
        extra(w)
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
    ("qwen2", dict(rope_scaling={"type": "dynamic", "factor": 4.0}), "dynamic"),
    ("qwen2", dict(rope_scaling={"type": "yarn", "factor": 4.0}), "original_max_position"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.75}), "partial_rotary_factor"),
    ("phi3", dict(max_position_embeddings=64,
                  rope_scaling={"type": "longrope", "long_factor": [1.0] * 4}), "short_factor"),
    ("phi3", dict(max_position_embeddings=64, rope_scaling={
        "type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}), "short_factor has 1"),
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


def test_gguf_refuses_attn_factor_without_long_rope(tmp_path):
    """An attention factor with neither yarn nor longrope's factor tensors is refused
    by name, not ignored."""
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


# --------------------------------------------------------------- rope scalings

# name -> (transformers class, config class, config fields, rope_scaling as the published
# config.json writes it, the GGUF arch llama.cpp writes, whether GGUF carries it all)
ROPE_CASES = {
    # Qwen2.5 (and the DeepSeek-R1-Distill-Qwen) form: rope_theta beside
    # rope_scaling {factor, original_max_position_embeddings, type}
    "qwen2-yarn": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
                           dict(num_hidden_layers=2, rope_theta=20.0),
                           {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                           "qwen2", True),
    # every key transformers reads; mscale and truncate have no GGUF key (llama.cpp
    # truncates and derives the attention factor from the factor alone)
    "llama-yarn-mscale": lambda: (
        transformers.LlamaForCausalLM, transformers.LlamaConfig,
        dict(num_hidden_layers=2, rope_theta=20.0),
        {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16,
         "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.6,
         "truncate": False}, "llama", False),
    # Phi-3-mini-128k / Phi-3.5-mini form: short and long factors, the original context
    # outside rope_scaling; switch after position 8
    "phi3-longrope": lambda: (
        transformers.Phi3ForCausalLM, transformers.Phi3Config,
        dict(num_hidden_layers=2, rope_theta=10000.0, original_max_position_embeddings=8,
             pad_token_id=0, bos_token_id=1, eos_token_id=2),
        {"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6],
         "long_factor": [1.1, 2.5, 5.0, 9.0]}, "phi3", True),
}
SHORT, LONG = 6, 24  # sequence lengths before and after the original context (8 or 16)


@pytest.fixture(scope="module", params=list(ROPE_CASES))
def rope_case(request, tmp_path_factory):
    """(name, HF directory in the published config.json form, transformers model read
    from it, its rope_scaling, GGUF arch, GGUF carries it, cfg, params)."""
    name = request.param
    torch.manual_seed(1)
    cls, conf_cls, fields, scaling, gguf_arch, exact = ROPE_CASES[name]()
    conf = conf_cls(**SMALL, **fields, rope_scaling=scaling)
    ref = cls(conf).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    ref.save_pretrained(path)
    hf = json.loads((path / "config.json").read_text())
    hf.pop("rope_parameters")  # as published: rope_theta and rope_scaling
    hf.update(rope_theta=fields["rope_theta"], rope_scaling=scaling)
    (path / "config.json").write_text(json.dumps(hf))
    ref = cls.from_pretrained(path, attn_implementation="eager").float().eval()
    cfg, params = hf_ckpt.load_hf(str(path))
    return name, str(path), ref, scaling, gguf_arch, exact, cfg, jax.device_put(params)


def test_rope_scaling_logits_match_transformers(rope_case):
    """A full forward before and after the original context (for longrope: the short
    and the long factors, chosen by the sequence's length as transformers chooses
    them), in both params layouts."""
    name, _, ref, scaling, _, _, cfg, params = rope_case
    kind = scaling.get("rope_type", scaling.get("type"))
    assert cfg.rope_scaling["type"] == kind and cfg.rope_scaling["attention_factor"] > 1.0
    for n in (SHORT, LONG):
        tokens = _tokens(3, (1, n))
        want = _ref_logits(ref, tokens)
        for layout in (params, transformer.unstack_layers(params)):
            got = np.asarray(prefill(layout, cfg, tokens, None, None)[0])
            err = float(np.max(np.abs(got - want)))
            assert err < ATOL, f"{name}, {n} tokens: max abs diff {err:.2e}"


def _ref_cached_steps(ref, seq, n_prompt):
    """transformers' logits for seq: a prompt of n_prompt tokens, then one token per
    forward pass against its cache (each pass chooses longrope's factors by its own
    length)."""
    with torch.no_grad():
        out = ref(torch.tensor(seq[None, :n_prompt], dtype=torch.long), use_cache=True)
        logits, past = [out.logits[0, -1].numpy()], out.cache
        for j in range(n_prompt, len(seq) - 1):
            out = ref(torch.tensor(seq[None, j:j + 1], dtype=torch.long), cache=past,
                      use_cache=True)
            logits.append(out.logits[0, -1].numpy())
            past = out.cache
    return np.stack(logits)


def test_rope_scaling_cached_decoding_matches_transformers(rope_case):
    """A left-padded batch prefilled on one side of the switch and decoded one token
    at a time across it: each row's logits are transformers' decoding it alone. For
    longrope this is not a full forward over the sequence: keys written before the
    switch keep the short factors (transformers' Phi-3 generate() instead drops its
    cache once at the switch and recomputes it; docs/model-families.md)."""
    name, _, ref, scaling, _, _, cfg, params = rope_case
    lengths, n_new = [5, 3], LONG - 5
    seqs = [_tokens(11 + b, (n + n_new,)) for b, n in enumerate(lengths)]
    steps = _padded_decode(params, cfg, seqs, lengths, n_new)
    for b, (n, s) in enumerate(zip(lengths, seqs)):
        want = _ref_cached_steps(ref, s[:n + len(steps)], n)
        err = float(np.max(np.abs(np.stack([st[b] for st in steps]) - want)))
        assert err < ATOL, f"{name} sequence {b}: cached decoding max abs diff {err:.2e}"
    if scaling.get("type") == "longrope":  # past the switch: not a full forward
        s, n = seqs[0], lengths[0]
        full = np.asarray(prefill(params, cfg, s[None, :n + len(steps) - 1], None, None)[0])[0]
        assert np.max(np.abs(full[n - 1:] - np.stack([st[0] for st in steps]))) > 100 * ATOL


def test_rope_scaling_module(rope_case, tmp_path):
    """The flax.nnx module registry.load_module builds (through the orbax cache, so
    the config's scaling survives the round trip) gives transformers' logits."""
    name, path, ref, _, _, _, cfg, _ = rope_case
    model, _ = registry.load_module(path, cache_root=str(tmp_path), progress=False)
    assert model.cfg == cfg
    tokens = _tokens(4, (1, LONG))
    err = float(np.max(np.abs(np.asarray(model(tokens)) - _ref_logits(ref, tokens))))
    assert err < ATOL, f"{name}: module max abs diff {err:.2e}"


def _llamacpp_rope(conf, scaling):
    """What llama.cpp's converter writes for a yarn or longrope config (TextModel /
    Qwen2Model yarn keys; Phi3MiniModel: the original context, the attention factor
    it computes and the factors as tensors, and, in older files, no type)."""
    kind = scaling.get("rope_type", scaling.get("type"))

    def extra(w):
        if kind == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(scaling["factor"])
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                             ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
                if key in scaling:
                    add(scaling[key])
            return
        original = conf.original_max_position_embeddings
        ratio = conf.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(ratio) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], np.float32))
    return extra


def test_rope_scaling_from_gguf(rope_case, tmp_path):
    """The same model as llama.cpp writes it: the same scaling (to float32, the file's
    precision) and parameters, and transformers' logits on both sides of the switch.
    Where GGUF cannot carry a key (yarn's mscale, truncate), the file reads as
    llama.cpp reads it: a different model, as the test shows."""
    name, _, ref, scaling, gguf_arch, exact, cfg, params = rope_case
    path = tmp_path / f"{name}.gguf"
    _write_gguf(path, gguf_arch, ref, ref.config, extra=_llamacpp_rope(ref.config, scaling))
    got_cfg, got = G.load_gguf(path, progress=False)
    assert set(got_cfg.rope_scaling) == set(cfg.rope_scaling)
    if not exact:
        for key in ("attention_factor", "truncate"):
            assert got_cfg.rope_scaling[key] != pytest.approx(cfg.rope_scaling[key]), key
        return
    for key, value in cfg.rope_scaling.items():
        assert (got_cfg.rope_scaling[key] == value if isinstance(value, (str, bool)) else
                got_cfg.rope_scaling[key] == pytest.approx(value, rel=1e-6)), key
    for k, v in dict(jax.tree_util.tree_leaves_with_path(params)).items():
        np.testing.assert_array_equal(dict(jax.tree_util.tree_leaves_with_path(got))[k],
                                      np.asarray(v), err_msg=str(k))
    for n in (SHORT, LONG):
        tokens = _tokens(5, (1, n))
        out = np.asarray(prefill(jax.device_put(got), got_cfg, tokens, None, None)[0])
        err = float(np.max(np.abs(out - _ref_logits(ref, tokens))))
        assert err < ATOL, f"{name} from GGUF, {n} tokens: max abs diff {err:.2e}"


def _llamacpp_rope_freqs(theta, head_dim, scaling):
    """The divisors llama.cpp's converter writes for a llama3 scaling (Llama 3.1 / 3.2:
    rope_freqs.weight, float32, and no rope scaling metadata), computed here from the
    scaling's definition: 1 for the frequencies kept, the factor for those interpolated,
    1 / ((1 - s) / factor + s) between."""
    factor, lo, hi = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        s = (old / wavelen - lo) / (hi - lo)
        out.append(1.0 if wavelen < old / hi else factor if wavelen > old / lo
                   else 1 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("with_original", [False, True])
def test_llama3_rope_from_gguf(tmp_path, with_original):
    """Llama 3.1 / 3.2 as llama.cpp writes them: the llama3 scaling only as per-frequency
    divisors (rope_freqs.weight). brf reads the scaling back from them (with the file's
    original context when it names one: then the very config transformers reads) and
    gives transformers' logits past the original context; divisors of another shape
    are refused naming the tensor."""
    theta, old = 20.0, 32  # head_dim 8: wavelengths 6.3 (kept), 13.3 and 28.1 (between),
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,  # 59 (/4)
               "high_freq_factor": 4.0, "original_max_position_embeddings": old}
    torch.manual_seed(3)
    conf = transformers.LlamaConfig(**SMALL, num_hidden_layers=2, rope_theta=theta,
                                    rope_scaling=scaling)
    ref = transformers.LlamaForCausalLM(conf).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.15 * torch.randn_like(p))
    head_dim = conf.hidden_size // conf.num_attention_heads
    divisors = _llamacpp_rope_freqs(theta, head_dim, scaling)

    def extra(w, values=divisors):
        w.add_tensor("rope_freqs.weight", values)
        if with_original:
            w.add_rope_scaling_orig_ctx_len(old)

    path = tmp_path / "llama3.gguf"
    _write_gguf(path, "llama", ref, ref.config, extra=extra)
    cfg, params = G.load_gguf(path, progress=False)
    got = cfg.rope_scaling
    assert got["type"] == "llama3" and got["factor"] == pytest.approx(4.0, rel=1e-6)
    if with_original:
        for key in ("low_freq_factor", "high_freq_factor"):
            assert got[key] == pytest.approx(scaling[key], rel=1e-5), key
        assert got["original_max_position_embeddings"] == old
    for n in (SHORT, LONG):
        tokens = _tokens(7, (1, n))
        out = np.asarray(prefill(jax.device_put(params), cfg, tokens, None, None)[0])
        err = float(np.max(np.abs(out - _ref_logits(ref, tokens))))
        assert err < ATOL, f"llama3 from GGUF, {n} tokens: max abs diff {err:.2e}"
    bent = divisors.copy()
    bent[0] = 1.01  # a kept frequency divided: off the line through the two between
    _write_gguf(path, "llama", ref, ref.config, extra=lambda w: extra(w, bent))
    with pytest.raises(G.GGUFError, match="rope_freqs.weight.*not a llama3 scaling"):
        G.load_gguf(path, progress=False)


def test_published_rope_configs():
    """The scalings of the published configs, as transformers derives them: Phi-3-mini-128k
    (no factor: 131072 / 4096; 'su' is longrope's older name) and Qwen2.5's yarn."""
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
    factors = dict(short_factor=[1.0] * 4, long_factor=[2.0] * 4)
    for kind in ("longrope", "su"):
        cfg = hf_ckpt.config_from_hf(dict(
            base, model_type="phi3", max_position_embeddings=131072,
            original_max_position_embeddings=4096, rope_scaling=dict(type=kind, **factors)))
        assert cfg.rope_scaling == dict(type="longrope", original_max_position_embeddings=4096,
                                        attention_factor=pytest.approx(1.1902380714),
                                        short_factor=(1.0,) * 4, long_factor=(2.0,) * 4)
    cfg = hf_ckpt.config_from_hf(dict(
        base, model_type="qwen2", max_position_embeddings=32768, rope_theta=1e6,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}))
    assert cfg.rope_scaling == dict(type="yarn", factor=4.0, original_max_position_embeddings=32768,
                                    beta_fast=32.0, beta_slow=1.0, truncate=True,
                                    attention_factor=pytest.approx(0.1 * math.log(4) + 1))
