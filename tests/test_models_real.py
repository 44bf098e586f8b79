"""The real models (SmolLM2-135M, Gemma 3 270M) against transformers (slow).

transformers dequantizes each GGUF file into a PyTorch model (its own GGUF
converter, without accelerate); we save that model as safetensors, load it
with brf.checkpoints.hf and compare all-position logits. The same directory
cross-checks brf.checkpoints.gguf: both readers must give the same params.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from brf.checkpoints import hf as hf_ckpt  # noqa: E402
from brf.models import decode_step, init_cache, prefill  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.extended]

# Gemma's sequence is longer than its 512-token sliding window.
LENGTHS = {"smollm2-135m-instruct": 48, "gemma3-270m": 530}


@pytest.fixture(scope="module", params=sorted(LENGTHS))
def real(request, tmp_path_factory):
    """(name, gguf path, torch model, HF directory written by save_pretrained)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from brf.checkpoints import registry
    name = request.param
    path = registry.resolve(name)
    conf = transformers.AutoConfig.from_pretrained(os.path.dirname(path),
                                                   gguf_file=os.path.basename(path))
    conf._attn_implementation = "eager"
    ref = transformers.AutoModelForCausalLM.from_config(conf).float().eval()
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=ref)["tensors"]
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in state.items()},
                                              strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied head
    out = tmp_path_factory.mktemp(name)
    ref.save_pretrained(out)
    return name, path, ref, str(out)


def test_real_logits_match_transformers(real):
    name, _, ref, hf_dir = real
    cfg, params = hf_ckpt.load_hf(hf_dir)
    tokens = np.random.default_rng(0).integers(0, 30000, (1, LENGTHS[name])).astype(np.int32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got, _ = prefill(params, cfg, jnp.asarray(tokens), None, None)
    err = float(np.max(np.abs(np.asarray(got) - want)))
    scale = float(np.max(np.abs(want)))
    assert err < 2e-5 * scale, f"{name}: max abs diff {err:.2e} (logit scale {scale:.1f})"
    # KV-cache decoding of the last tokens equals the full forward.
    cache = init_cache(cfg, 1, tokens.shape[1])
    _, cache = prefill(params, cfg, jnp.asarray(tokens[:, :-4]), None, cache, logits="none")
    for t in range(tokens.shape[1] - 4, tokens.shape[1]):
        step, cache = decode_step(params, cfg, jnp.asarray(tokens[:, t]), cache)
        err = float(np.max(np.abs(np.asarray(step)[0] - want[0, t])))
        assert err < 2e-5 * scale, f"{name}: decode step {t} max abs diff {err:.2e}"


def test_gguf_reader_agrees_with_transformers_conversion(real):
    from brf.checkpoints import gguf as G
    name, path, _, hf_dir = real
    cfg_hf, params_hf = hf_ckpt.load_hf(hf_dir)
    cfg_gguf, params_gguf = G.load_gguf(path, progress=False)
    for field in ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                  "rope_theta", "rope_local_theta", "sliding_window", "layer_types",
                  "query_pre_attn_scalar", "act", "embed_scale", "tie_embeddings"):
        assert getattr(cfg_hf, field) == getattr(cfg_gguf, field), field
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params_hf, params_gguf)
    worst = max(jax.tree.leaves(diffs))
    assert worst < 1e-5, f"{name}: params differ: {diffs}"
