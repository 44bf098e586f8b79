"""brf.models' flax.nnx modules (brf/models/modules.py) on tiny models.

References: transformers (PyTorch) models built here, for logits and for the
gradients of the next-token loss (torch autograd), and the functional path
(`brf.models.prefill`) on the same checkpoint, which the module must equal
bit for bit since it runs the same jitted functions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from brf.checkpoints import registry, store  # noqa: E402
from brf.models import (Gemma3, Llama, ModelConfig, decode_step, from_params,  # noqa: E402
                        init_params, param_shapes, prefill, transformer)
from brf.models.modules import (check_params, make_optimizer, next_token_nll,  # noqa: E402
                                train_step)

V, T = 61, 13
ATOL = 1e-4
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **SMALL, num_hidden_layers=2, tie_word_embeddings=False)),
    "gemma3": lambda: (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=3.0)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family, HF directory, torch model, brf cache root)."""
    torch.manual_seed(0)
    cls, conf = FAMILIES[request.param]()
    conf._attn_implementation = "eager"
    ref = cls(conf).float().eval()
    with torch.no_grad():  # weights large enough that every part matters
        for p in ref.parameters():
            p.add_(0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, str(path), ref, str(tmp_path_factory.mktemp("cache"))


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


@pytest.mark.parametrize("layout", ["layers", "stacked"])
def test_module_equals_functional_path_and_transformers(family, layout):
    """load_module -> logits of __call__ and of prefill + decode_step: those of the
    functional path on the same checkpoint exactly, and transformers' within float32."""
    name, path, ref, root = family
    model, _ = registry.load_module(path, cache_root=root, layout=layout, progress=False)
    assert isinstance(model, {"llama": Llama, "gemma3": Gemma3}[name])
    assert model.layout == layout
    params = registry.load(path, cache_root=root, layout=layout, progress=False).params
    cfg, tokens = model.cfg, _tokens(0, (2, T))
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = np.asarray(model(tokens))
    np.testing.assert_array_equal(got, np.asarray(prefill(params, cfg, tokens, None, None)[0]))
    assert np.abs(got - want).max() < ATOL
    p = 6
    cache = model.init_cache(2, T)
    fcache = cache
    first, cache = model.prefill(tokens[:, :p], None, cache)
    np.testing.assert_array_equal(first, prefill(params, cfg, tokens[:, :p], None, fcache)[0])
    steps = [np.asarray(first)]
    for t in range(p, T):
        step, cache = model.decode_step(tokens[:, t], cache, donate=t % 2 == 0)
        steps.append(np.asarray(step)[:, None])
    assert np.abs(np.concatenate(steps, 1) - want).max() < ATOL


def test_state_is_the_params_pytree(family):
    """nnx.state(model, nnx.Param) holds the checkpoint's arrays under its names:
    stacked as stored; per layer as unstack_layers makes them (one mapping both ways)."""
    _, path, _, root = family
    stored = store.restore(registry.cache_path(path, root), with_tokenizer=False)[1]
    for layout in ("stacked", "layers"):
        model, _ = registry.load_module(path, cache_root=root, layout=layout, progress=False)
        state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        params = model.to_params()
        if layout == "layers":
            assert sorted(state["layers"]) == list(range(model.cfg.n_layers))
            state["layers"] = tuple(state["layers"][i] for i in sorted(state["layers"]))
            assert "wqkv_t" in params["layers"][0]
        assert jax.tree.structure(state) == jax.tree.structure(params)
        assert all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(params)))
        restacked = transformer.stack_layers(params, model.cfg)
        assert jax.tree.structure(restacked) == jax.tree.structure(stored)
        for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(stored)):
            np.testing.assert_array_equal(a, b)
        again = from_params(model.cfg, params)  # wraps the same buffers
        assert all(a is b for a, b in zip(jax.tree.leaves(again.to_params()),
                                           jax.tree.leaves(params)))


def test_split_merge_and_nnx_jit_give_the_same_logits(family):
    _, path, _, root = family
    model, _ = registry.load_module(path, cache_root=root, progress=False)
    tokens = _tokens(1, (1, T))
    want = np.asarray(model(tokens))
    graphdef, state = nnx.split(model)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(tokens), want)
    jitted = nnx.jit(lambda m, t: m(t, logits="last"))
    np.testing.assert_allclose(jitted(model, tokens), want[:, -1], rtol=0, atol=1e-5)


# Our stacked per-layer names -> transformers' module names, per family.
_HF_LAYER = {
    "llama": dict(attn_norm="input_layernorm", mlp_norm="post_attention_layernorm"),
    "gemma3": dict(attn_norm="input_layernorm", post_attn_norm="post_attention_layernorm",
                   mlp_norm="pre_feedforward_layernorm",
                   post_mlp_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm",
                   k_norm="self_attn.k_norm"),
}
_HF_PROJ = dict(wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj",
                wo="self_attn.o_proj", w_gate="mlp.gate_proj", w_up="mlp.up_proj",
                w_down="mlp.down_proj")


def _torch_grads(family, ref, tokens_BxN):
    """({our stacked name: gradient}, loss) of the mean next-token NLL, by torch autograd."""
    ref.zero_grad()
    logits = ref(torch.tensor(tokens_BxN, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             torch.tensor(tokens_BxN[:, 1:]).long().reshape(-1))
    loss.backward()
    grad = {k: p.grad.numpy() for k, p in ref.named_parameters()}  # tied head: listed once
    n_layers = ref.config.num_hidden_layers
    out = {"embed": grad["model.embed_tokens.weight"], "final_norm": grad["model.norm.weight"]}
    if "lm_head.weight" in grad:
        out["lm_head"] = grad["lm_head.weight"]
    for ours, theirs in {**_HF_LAYER[family], **_HF_PROJ}.items():
        g = np.stack([grad[f"model.layers.{i}.{theirs}.weight"] for i in range(n_layers)])
        out[ours] = np.swapaxes(g, 1, 2) if ours in _HF_PROJ else g  # [out, in] -> [in, out]
    return out, float(loss.detach())


@pytest.mark.parametrize("layout", ["layers", "stacked"])
def test_gradients_equal_torch_autograd(family, layout):
    """nnx.value_and_grad of next_token_nll: every parameter's gradient (embedding,
    attention, MLP, norms; all layers) equals torch autograd's on the same loss."""
    name, path, ref, root = family
    model, _ = registry.load_module(path, cache_root=root, layout=layout, progress=False)
    tokens = _tokens(2, (2, T))
    loss, grads = nnx.value_and_grad(next_token_nll)(model, tokens)
    want, want_loss = _torch_grads(name, ref, tokens)
    assert abs(float(loss) - want_loss) < 1e-5
    g = nnx.to_pure_dict(nnx.state(grads, nnx.Param))
    if layout == "layers":
        g["layers"] = tuple(g["layers"][i] for i in sorted(g["layers"]))
    g = transformer.stack_layers(g, model.cfg)
    got = {**{k: v for k, v in g.items() if k != "layers"}, **g["layers"]}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        scale = np.abs(want[k]).max()
        assert scale > 0, k
        err = np.abs(np.asarray(got[k]) - want[k]).max()
        assert err < 1e-4 * max(1.0, scale), f"{name}/{layout} d{k}: {err:.2e} (scale {scale:.2e})"


def test_training_lowers_the_loss_and_moves_every_parameter():
    """A few adam steps through nnx.Optimizer on a random tiny model fitting one batch."""
    cfg = ModelConfig(arch="llama", vocab_size=V, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, d_ff=48, norm_eps=1e-6, rope_theta=1e4,
                      tie_embeddings=False)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, model.to_params())
    optimizer = make_optimizer(model, optax.adam(3e-3))
    tokens, valid = _tokens(3, (2, T)), np.ones((2, T), bool)
    valid[1, -4:] = False  # padding: its pairs do not count
    losses = [float(train_step(model, optimizer, tokens, valid)) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    after = model.to_params()
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(b) - a).max()), before, after)
    assert min(jax.tree.leaves(moved)) > 0, moved
    # The trained module is still the functional path on its own parameters.
    np.testing.assert_array_equal(model(tokens), prefill(after, cfg, tokens, None, None)[0])


def test_random_init_and_refusals():
    cfg = ModelConfig(arch="gemma3", vocab_size=V, d_model=16, n_layers=2, n_heads=2,
                      n_kv_heads=1, head_dim=8, d_ff=32, norm_eps=1e-6, rope_theta=1e4,
                      rope_local_theta=1e3, sliding_window=4, layer_types=("local", "global"),
                      act="gelu_tanh", embed_scale=True)
    model = Gemma3(cfg, rngs=nnx.Rngs(1), layout="stacked")
    shapes = jax.tree.map(lambda a: a.shape, model.to_params())
    assert shapes == param_shapes(cfg)
    assert Gemma3(cfg, rngs=nnx.Rngs(1)).layout == "layers"
    with pytest.raises(ValueError, match="gemma3"):
        Llama(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exactly one"):
        Gemma3(cfg)
    params = init_params(cfg, jax.random.key(0))
    del params["layers"]["q_norm"]
    with pytest.raises(ValueError, match="q_norm.*missing"):
        from_params(cfg, params)
    params = init_params(cfg, jax.random.key(0))
    params["layers"]["wq"] = params["layers"]["wq"][:, :, :-1]
    with pytest.raises(ValueError, match=r"wq.*shape \(2, 16, 15\)"):
        check_params(cfg, params)
    params = transformer.unstack_layers(init_params(cfg, jax.random.key(0)))
    params["layers"][1]["bias"] = jnp.zeros(3)
    with pytest.raises(ValueError, match="bias.*not one of"):
        check_params(cfg, params)


def test_bfloat16_module_computes_in_bfloat16():
    cfg = ModelConfig(arch="llama", vocab_size=V, d_model=16, n_layers=2, n_heads=2,
                      n_kv_heads=1, head_dim=8, d_ff=32, norm_eps=1e-6, rope_theta=1e4)
    params = init_params(cfg, jax.random.key(0))
    model = from_params(cfg, transformer.cast_params(params, jnp.bfloat16))
    assert model.dtype == jnp.bfloat16 and model.init_cache(1, 4)["k"][0].dtype == jnp.bfloat16
    tokens = _tokens(4, (1, 5))
    want = prefill(transformer.cast_params(params, jnp.bfloat16), cfg, tokens, None, None,
                   dtype=jnp.bfloat16)[0]
    np.testing.assert_array_equal(model(tokens), want)
    step, _ = model.decode_step(tokens[:, 0], model.init_cache(1, 4))
    np.testing.assert_array_equal(step, decode_step(
        transformer.cast_params(params, jnp.bfloat16), cfg, tokens[:, 0],
        model.init_cache(1, 4), dtype=jnp.bfloat16)[0])
