"""brf.fusion.compile and brf.fuse's cache: same values as the kernels, nothing
parsed or traced twice, value checks on the device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import brf
from brf.fusion import FusionInputError, METHODS, api, checks, methods

N, V = 3, 24


def _params(name):
    """Every registered method with parameters that exercise it (its defaults
    otherwise); softmax-bottleneck methods get random unembeddings."""
    given = {"born": {"phase": "tanh(rate=0.5, offset=[0, 1, 2])"},
             "born_shuffled": {"phase": "token_tanh(rate=0.7)", "seed": 3},
             "entropy_gated": {"threshold": 0.5, "inner": "born",
                               "inner_params": {"phase": "token_log1p"}},
             "power_members": {"alpha": [0.3, 0.5, 0.9]},
             "reshape": {"scale": [0.1, 0.2, 0.3]}}.get(name, {})
    if name.startswith("bottleneck_"):
        rng = np.random.default_rng(1)
        given = {"unembeddings": [rng.standard_normal((V, 4)).astype(np.float32)
                                  for _ in range(N)], "top_k": 8}
    return given


@pytest.mark.parametrize("name", METHODS.names())
def test_compiled_fuser_and_fuse_equal_the_kernel(name):
    rng = np.random.default_rng(0)
    x = jnp.asarray((rng.standard_normal((2, N, V)) * 3).astype(np.float32))
    w = jnp.asarray([0.2, 0.3, 0.5], jnp.float32)
    params = _params(name)
    m = methods.get_method(name)
    resolved = methods.resolve_params(m, dict(params))
    static, dynamic = methods.split_params(m, resolved)
    want = jax.jit(lambda x, w, d: m.fn(x, w, **methods.join_params(static, d))[0])(
        x, w, dynamic)
    got_fuse = brf.fuse(name, x, w, **params)
    got_compiled = brf.fusion.compile(name, **params)(x, w)
    got_inside = jax.jit(brf.fusion.compile(name, **params).fn)(x, w)[0]
    for got in (got_fuse, got_compiled, got_inside):
        np.testing.assert_allclose(np.exp(np.asarray(got, np.float64)),
                                   np.exp(np.asarray(want, np.float64)), atol=1e-6)


def test_repeated_calls_parse_once_and_trace_once(monkeypatch):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 2, 16)) * 2).astype(np.float32)
    spec = dict(phase="tanh(rate=0.25, offset=[0, 1.5])", z_min=2e-3)
    brf.fuse("born", x, **spec)
    traced = api.TRACE_COUNTS["born"]
    parsed = []
    real = methods.resolve_params
    monkeypatch.setattr(methods, "resolve_params",
                        lambda *a, **k: parsed.append(a[0].name) or real(*a, **k))
    for k in range(3):
        out = brf.fuse("born", x + k, **spec)
        assert np.isfinite(np.asarray(out)).all()
    assert parsed == [] and api.TRACE_COUNTS["born"] == traced
    assert api.cached_fuser("born", spec) is api.cached_fuser("born", dict(spec))
    # Weights given or not share one program; so do calls of a compiled fuser.
    fuser = brf.fusion.compile("born", **spec)
    fuser(x, np.array([0.4, 0.6], np.float32))
    assert api.TRACE_COUNTS["born"] == traced


def test_value_checks_run_on_the_device_and_the_host_only_names_the_fault(monkeypatch):
    host_checks = []
    real = checks.check_inputs
    monkeypatch.setattr(api, "check_inputs",
                        lambda *a: host_checks.append(1) or real(*a))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((64, 2, 512)), jnp.float32)
    brf.fuse("linear", x, jnp.asarray([0.5, 0.5]))
    assert host_checks == []  # good input: no NumPy pass over the logits
    bad = np.zeros((2, 2, 5), np.float32)
    cases = [(np.where(np.arange(5) == 3, np.nan, bad), None, None, checks.NAN),
             (np.where(np.arange(5) == 1, np.inf, bad), None, None, checks.POSINF),
             (np.where(np.arange(5) < 5, -np.inf, bad), None, None, checks.EMPTY_MEMBER),
             (bad, np.array([0.7, 0.7]), None, checks.BAD_WEIGHTS),
             (bad, np.array([1.5, -0.5]), None, checks.BAD_WEIGHTS),
             (bad, None, np.zeros((2, 2, 5), bool), checks.EMPTY_WHERE),
             (bad, np.array([0.5, 0.5]), np.ones((2, 2, 5), bool), 0)]
    for logits, w, where, bit in cases:
        status = int(jax.jit(checks.value_status)(logits, w, where))
        assert status == bit
        if bit:
            with pytest.raises(FusionInputError):
                brf.fuse("linear", logits, w, where=where)
            assert host_checks  # the host names the first bad index
            host_checks.clear()
