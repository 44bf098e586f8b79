"""The flax.nnx modules on the two real models (slow): one engine, and training.

`registry.load_module(name)` against `registry.load(name)`, the functional
path, both restored from the same orbax checkpoint. The module runs the same
jitted functions on the same arrays, so its logits must equal the functional
path's bit for bit: at every position of a prompt, and along a prefill and
decoding steps. The module in the checkpoint's stacked layout runs the other
engine (one `lax.scan` over stacked weights, Q/K/V unfused) and must agree to
float32 rounding: TOL_STACKED is a few times the largest difference measured
(module docstring of brf/models/modules.py; the numbers are in the assertion
messages), far below the 0.1 to 10 a real mistake moves logits by.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from brf.checkpoints import registry
from brf.models import decode_step_donated, init_cache, prefill, prefill_donated
from brf.models.modules import make_optimizer, next_token_nll, train_step

pytestmark = pytest.mark.slow

TEXT = ("The history of the Roman Empire spans many centuries. It began when Augustus "
        "became the first emperor in 27 BC, and in the West it ended in AD 476.")
TOL = 2e-3


# Gemma 3's case is extended: test_modules checks the module against the functional
# path on tiny Gemma 3 configurations, test_real_parity the real one's logits.
@pytest.mark.parametrize("name", ["smollm2-135m-instruct",
                                  pytest.param("gemma3-270m", marks=pytest.mark.extended)])
def test_module_logits_are_the_functional_paths(name):
    model, tok = registry.load_module(name, progress=False)
    m = registry.load(name, progress=False)
    ids = np.asarray([tok(TEXT).input_ids], np.int32)
    n = ids.shape[1]
    want = np.asarray(prefill(m.params, m.cfg, ids, None, None)[0])
    np.testing.assert_array_equal(model(ids), want)
    cut = n - 4
    cache, fcache = model.init_cache(1, n), init_cache(m.cfg, 1, n)
    a, cache = model.prefill(ids[:, :cut], None, cache, logits="last", donate=True)
    b, fcache = prefill_donated(m.params, m.cfg, ids[:, :cut], None, fcache, logits="last")
    np.testing.assert_array_equal(a, b)
    steps = []
    for t in range(cut, n):
        a, cache = model.decode_step(ids[:, t], cache, donate=True)
        b, fcache = decode_step_donated(m.params, m.cfg, ids[:, t], fcache)
        np.testing.assert_array_equal(a, b)
        steps.append(np.asarray(a)[0])
    err_decode = np.abs(np.stack(steps) - want[0, cut:]).max()
    del m, model
    stacked, _ = registry.load_module(name, progress=False, layout="stacked")
    err_stacked = np.abs(np.asarray(stacked(ids)) - want).max()
    msg = (f"{name}: max |diff| from the full forward: decode steps {err_decode:.2e}, stacked "
           f"module {err_stacked:.2e} (max |logit| {np.abs(want).max():.1f})")
    print(msg)
    assert err_decode < TOL and err_stacked < TOL, msg


def test_smollm2_fine_tunes_and_every_parameter_gets_a_gradient():
    model, tok = registry.load_module("smollm2-135m-instruct", progress=False)
    ids = np.asarray([tok(TEXT).input_ids], np.int32)
    _, grads = nnx.value_and_grad(next_token_nll)(model, ids)
    kinds = set()
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(grads))):
        g = np.asarray(g)
        name = jax.tree_util.keystr(path)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name
        kinds.add(path[-1].key)
    assert kinds == {"embed", "final_norm", "attn_norm", "wqkv_t", "wo_t", "mlp_norm",
                     "w_gate_up_t", "w_down_t"}, kinds
    del grads
    optimizer = make_optimizer(model, optax.adam(1e-4))
    losses = [float(train_step(model, optimizer, ids)) for _ in range(3)]
    assert losses[2] < losses[1] < losses[0], losses
