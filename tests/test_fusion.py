"""Fusion kernels against independent float64 NumPy references."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import brf
from brf.fusion import FusionInputError, METHODS, fuse, phase_map

import fusion_reference as ref

ATOL = 1e-5

# --- strategies --------------------------------------------------------------


@st.composite
def member_logits(draw, max_n=6, max_v=48):
    """Random [B, n, V] float32 logits: peaked, flat, huge, tied, masked."""
    b = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_n))
    v = draw(st.integers(2, max_v))
    scale = draw(st.sampled_from([0.0, 0.01, 1.0, 5.0, 30.0, 1e4]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, n, v)) * scale
    if draw(st.booleans()):  # ties: coarse rounding
        x = np.round(x)
    x = x + rng.standard_normal((b, n, 1)) * draw(st.sampled_from([0.0, 100.0]))
    if draw(st.booleans()):  # -inf masks, one valid token kept per row
        mask = rng.random((b, n, v)) < draw(st.sampled_from([0.3, 0.9]))
        keep = rng.integers(0, v, (b, n))
        mask[np.arange(b)[:, None], np.arange(n)[None], keep] = False
        x = np.where(mask, -np.inf, x)
    return x.astype(np.float32), scale


@st.composite
def simplex(draw, n):
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    w = rng.dirichlet(np.ones(n))
    if n > 1 and draw(st.booleans()):
        w[rng.integers(0, n)] = 0.0
        w = w / w.sum()
    return w.astype(np.float32)


def probs(logq):
    out = np.exp(np.asarray(logq, np.float64))
    assert not np.isnan(out).any(), "NaN in the output"
    return out


def assert_close(logq, q_ref, atol=ATOL):
    q = probs(logq)
    np.testing.assert_allclose(q, q_ref, atol=atol, rtol=0)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)


POSITION_MAPS = ["constant", "linear", "tanh", "sigmoid", "arctan", "log1p"]
TOKEN_MAPS = ["token_linear", "token_tanh", "token_sigmoid", "token_arctan",
              "token_log1p"]

# --- Born fusion ---------------------------------------------------------------


@given(member_logits(), st.sampled_from(POSITION_MAPS + TOKEN_MAPS),
       st.data())
def test_born_matches_reference(sample, name, data):
    x, scale = sample
    n = x.shape[1]
    # The linear map of a 1e4-scale gap is ill-conditioned in any precision.
    assume(not (name.endswith("linear") and scale > 30))
    w = data.draw(simplex(n))
    params = {"scale": data.draw(st.floats(0.1, 4.0)),
              "rate": data.draw(st.floats(0.0, 3.0)),
              "center": data.draw(st.floats(-2.0, 2.0))}
    defaults = brf.PHASE_MAPS.get(name).defaults
    params = {k: v for k, v in params.items() if k in defaults}
    offset = data.draw(st.lists(st.floats(-4, 4), min_size=n, max_size=n))
    phi = ref.phases(x, name, offset=np.array(offset), **params)
    q_ref, z_ref = ref.born(x, w, phi)
    # Near the Z guard float32 cancellation is ~eps/Z; test the guard apart.
    assume(np.all((z_ref > 1e-2) | (z_ref < 1e-4)))
    logq, info = fuse("born", x, w, phase=phase_map(name, offset=offset, **params),
                      return_info=True)
    assert_close(logq, q_ref)
    np.testing.assert_array_equal(np.asarray(info["fallback"]), z_ref < 1e-3)


def test_equal_phases_give_hellinger_power_mean():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 50)).astype(np.float32) * 3
    w = np.array([0.5, 0.3, 0.2], np.float32)
    # Born amplitudes carry sqrt(w_i): equal phases give the order-1/2 power
    # mean with weights proportional to sqrt(w_i) (the same weights if uniform).
    w_half = np.sqrt(w) / np.sqrt(w).sum()
    for name in ["constant(offset=1.3)", "tanh(scale=0, offset=2)"]:
        born = probs(fuse("born", x, w, phase=name))
        hell = ref.power(x, w_half, 0.5)
        np.testing.assert_allclose(born, hell, atol=ATOL)
        np.testing.assert_allclose(probs(fuse("power", x, w_half, alpha=0.5)),
                                   hell, atol=ATOL)
        uniform = probs(fuse("born", x, phase=name))
        np.testing.assert_allclose(uniform, probs(fuse("power", x, alpha=0.5)),
                                   atol=ATOL)
    # Identical gaps under any per-position map also mean equal phases.
    same = np.repeat(x[:, :1], 3, axis=1)
    np.testing.assert_allclose(probs(fuse("born", same, w, phase="tanh")),
                               ref.softmax(same[:, 0]), atol=ATOL)


def test_quarter_turn_gives_linear_pool():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 2, 64)).astype(np.float32) * 2
    w = np.array([0.7, 0.3], np.float32)
    q = probs(fuse("born", x, w, phase="constant(offset=[0.4, 0.4 + pi/2])"))
    np.testing.assert_allclose(q, ref.linear(x, w), atol=ATOL)


def test_born_can_fall_below_every_member():
    # Both members favour token 0; opposite phases cancel it completely.
    p1 = np.array([0.6, 0.3, 0.1])
    p2 = np.array([0.6, 0.1, 0.3])
    x = np.log(np.stack([p1, p2]))[None].astype(np.float32)
    q = probs(fuse("born", x, phase="constant(offset=[0, pi])"))[0]
    assert q[0] < 1e-6 < min(p1[0], p2[0])
    # A milder phase difference still pushes token 0 below both members.
    q = probs(fuse("born", x, phase="constant(offset=[0, 2.5])"))[0]
    q_ref, _ = ref.born(x, [0.5, 0.5], np.array([[0.0, 2.5]]))
    np.testing.assert_allclose(q, q_ref[0], atol=ATOL)
    assert q[0] < min(p1[0], p2[0])


def test_z_guard_falls_back_to_linear_pool_without_nan():
    rng = np.random.default_rng(2)
    row = rng.standard_normal(40).astype(np.float32)
    x = np.stack([np.stack([row, row]), np.stack([row, row * 0.5])])
    logq, info = fuse("born", x, phase="constant(offset=[0, pi])",
                      return_info=True)
    fb = np.asarray(info["fallback"])
    assert fb.tolist() == [True, False]
    q = probs(logq)
    np.testing.assert_allclose(q[0], ref.softmax(row), atol=ATOL)
    assert np.isfinite(np.asarray(logq)[1]).all()
    # Gradients through the guarded kernel stay finite.
    g = jax.grad(lambda o: fuse("born", x, phase=phase_map(
        "constant", offset=o))[..., 3].sum())(jnp.array([0.0, math.pi]))
    assert np.isfinite(np.asarray(g)).all()


def test_born_terms_decomposition():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 30)).astype(np.float32) * 2
    w = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    for name in ["tanh(rate=0.7, offset=[0, 1, 2, 3])", "token_arctan(rate=0.3)"]:
        terms = brf.born_terms(x, w, phase=name)
        assert terms.cross.shape == (2, 6, 30) and terms.pairs.shape == (6, 2)
        q = (np.asarray(terms.linear) + np.asarray(terms.cross).sum(-2))
        q = q / np.asarray(terms.z)[..., None]
        np.testing.assert_allclose(q, probs(fuse("born", x, w, phase=name)),
                                   atol=ATOL)
        np.testing.assert_allclose(terms.linear, ref.linear(x, w), atol=ATOL)
        p = ref.softmax(x)
        for k, (i, j) in enumerate(np.asarray(terms.pairs)):
            bc = np.sqrt(p[:, i] * p[:, j]).sum(-1)
            np.testing.assert_allclose(terms.bhattacharyya[:, k], bc, atol=ATOL)


@pytest.mark.parametrize("v", [2, 262144])
def test_born_large_and_tiny_vocabularies(v):
    rng = np.random.default_rng(v)
    x = (rng.standard_normal((2, 2, v)) * 4).astype(np.float32)
    w = np.array([0.6, 0.4], np.float32)
    for name in ["tanh(offset=[0, 1])", "token_tanh(rate=0.2)"]:
        q_ref, _ = ref.born(x, w, ref.phases(x, name.split("(")[0],
                                             offset=np.array([0, 1.0])
                                             if "offset" in name else 0.0,
                                             **({"scale": math.pi, "rate": 0.2}
                                                if "token" in name else
                                                {"scale": math.pi, "rate": 1.0})))
        assert_close(fuse("born", x, w, phase=name), q_ref)


# --- baselines -------------------------------------------------------------------


def reference(method, x, w, params):
    if method == "linear":
        return ref.linear(x, w)
    if method == "loglinear":
        return ref.loglinear(x, w, params["temperature"])
    if method == "power":
        return ref.power(x, w, params["alpha"])
    if method == "max":
        return ref.max_pool(x, w)
    if method == "min":
        return ref.min_pool(x, w)
    if method == "routing":
        return ref.routing(x, w)
    if method == "entropy_gated":
        return ref.entropy_gated(x, w, params["threshold"])
    if method == "contrastive":
        if x.shape[1] == 1:
            return ref.softmax(x[:, 0])
        return ref.contrastive(x, params["beta"], params["plausibility"])
    raise AssertionError(method)


@given(member_logits(), st.sampled_from(
    ["linear", "loglinear", "power", "max", "min", "routing", "entropy_gated",
     "contrastive"]), st.data())
def test_baselines_match_reference(sample, method, data):
    x, _ = sample
    n = x.shape[1]
    w = data.draw(simplex(n))
    params = {
        "loglinear": {"temperature": data.draw(st.sampled_from([0.5, 1.0, 2.0]))},
        "power": {"alpha": data.draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]))},
        "entropy_gated": {"threshold": data.draw(st.floats(0.0, 3.0))},
        "contrastive": {"beta": data.draw(st.floats(0.0, 1.0)),
                        "plausibility": data.draw(st.floats(0.0, 1.0))},
    }.get(method, {})
    q_ref = reference(method, x, w, params)
    # A pool that leaves no mass falls back to the linear pool (documented).
    empty = ~np.isfinite(q_ref).all(-1) | (np.nansum(q_ref, -1) == 0)
    q_ref = np.where(empty[..., None], ref.linear(x, w), q_ref)
    logq, info = fuse(method, x, w, return_info=True, **params)
    assert_close(logq, q_ref)


# Softmax-bottleneck methods need unembeddings and, with one member, return the
# objective's choice among all p with p W = p_hat W (tests/test_bottleneck.py).
@pytest.mark.parametrize("method", sorted(m for m in METHODS.names()
                                          if not m.startswith("bottleneck_")))
def test_single_member_returns_its_own_distribution(method):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 1, 20)) * 3).astype(np.float32)
    x[0, 0, 5] = -np.inf
    assert_close(fuse(method, x, np.ones(1, np.float32)), ref.softmax(x[:, 0]))


@pytest.mark.parametrize("method,params", [
    ("born", {"phase": "constant"}), ("born", {"phase": "tanh(rate=0.5)"}),
    ("born", {"phase": "token_arctan"}), ("linear", {}), ("loglinear", {}),
    ("power", {"alpha": 0.3}), ("max", {}), ("min", {}),
])
def test_permuting_members_changes_nothing(method, params):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 5, 33)) * 2).astype(np.float32)
    w = rng.dirichlet(np.ones(5)).astype(np.float32)
    perm = rng.permutation(5)
    a = probs(fuse(method, x, w, **params))
    b = probs(fuse(method, x[:, perm], w[perm], **params))
    np.testing.assert_allclose(a, b, atol=ATOL)


def test_permutation_with_per_member_offsets():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((2, 3, 17)) * 2).astype(np.float32)
    w = np.array([0.2, 0.3, 0.5], np.float32)
    off = np.array([0.0, 1.0, 2.5], np.float32)
    perm = np.array([2, 0, 1])
    a = fuse("born", x, w, phase=phase_map("tanh", offset=off))
    b = fuse("born", x[:, perm], w[perm], phase=phase_map("tanh", offset=off[perm]))
    np.testing.assert_allclose(probs(a), probs(b), atol=ATOL)


# --- jit, tracing, gradients ----------------------------------------------------


@pytest.mark.parametrize("method,params", [
    ("born", {"phase": "sigmoid(rate=2, offset=[0, 1, 2])"}),
    ("born", {"phase": "token_log1p"}), ("loglinear", {"temperature": 0.7}),
    ("power", {"alpha": -0.5}), ("routing", {"criterion": "gap"}),
    ("entropy_gated", {"threshold": 0.5, "inner": "born",
                       "inner_params": {"phase": "constant(offset=[0, 1, 2])"}}),
    ("contrastive", {"beta": 0.5}),
])
def test_jit_and_eager_agree(method, params):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 3, 40)) * 3).astype(np.float32)
    w = np.array([0.5, 0.25, 0.25], np.float32)
    jitted = fuse(method, x, w, **params)
    with jax.disable_jit():
        eager = fuse(method, x, w, **params)
    np.testing.assert_allclose(probs(jitted), probs(eager), atol=1e-6)


def test_no_retrace_when_only_values_change():
    x = np.random.default_rng(8).standard_normal((2, 2, 16)).astype(np.float32)
    fuse("born", x, phase="tanh(rate=1.0)")
    before = brf.fusion.TRACE_COUNTS["born"]
    for rate, offset in [(0.5, 0.0), (2.0, 1.0), (3.0, -1.0)]:
        fuse("born", x, np.array([0.3, 0.7], np.float32),
             phase=f"tanh(rate={rate}, offset={offset})", z_min=1e-4)
    fuse("born", x * 2, phase="tanh(rate=9.0)")
    assert brf.fusion.TRACE_COUNTS["born"] == before

    @jax.jit
    @chex.assert_max_traces(n=1)
    def user_fn(logits, rate, alpha):
        a = fuse("born", logits, phase=phase_map("tanh", rate=rate))
        b = fuse("power", logits, alpha=alpha)
        return a + b

    for k in range(3):
        user_fn(x + k, jnp.float32(0.5 * k), jnp.float32(0.1 + k))


def test_gradients_are_finite_and_match_finite_differences():
    rng = np.random.default_rng(9)
    x = jnp.asarray((rng.standard_normal((3, 2, 12)) * 2).astype(np.float32))
    gold = jnp.array([1, 4, 7])

    def nll(rate, logit_w):
        w = jax.nn.softmax(logit_w)
        lq = fuse("born", x, w, phase=phase_map("tanh", rate=rate, offset=[0, 1]))
        return -jnp.take_along_axis(lq, gold[:, None], -1).sum()

    rate, lw = jnp.float32(0.8), jnp.array([0.1, -0.2], jnp.float32)
    g_rate, g_w = jax.grad(nll, argnums=(0, 1))(rate, lw)
    eps = 1e-2
    fd = (nll(rate + eps, lw) - nll(rate - eps, lw)) / (2 * eps)
    np.testing.assert_allclose(g_rate, fd, rtol=2e-2, atol=1e-3)
    assert np.isfinite(np.asarray(g_w)).all()


def test_vmap_matches_batch():
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((4, 3, 21))).astype(np.float32)
    batched = fuse("born", x, phase="tanh(offset=[0, 1, 2])")
    mapped = jax.vmap(lambda r: fuse("born", r, phase="tanh(offset=[0, 1, 2])",
                                     validate=False))(jnp.asarray(x))
    np.testing.assert_allclose(probs(batched), probs(mapped), atol=1e-6)


# --- bad input -------------------------------------------------------------------

X = np.zeros((2, 3, 5), np.float32)


@pytest.mark.parametrize("call,match", [
    (lambda: fuse("nope", X), "unknown fusion method 'nope'"),
    (lambda: fuse("born", X, phase="spiral"), "unknown phase map 'spiral'"),
    (lambda: fuse("born", X, phase="tanh(rte=1)"), "no parameter"),
    (lambda: fuse("born", X, phase="tanh(rate=-1)"), "rate=-1"),
    (lambda: fuse("born", X, phase="tanh(rate=__import__('os'))"), "numbers"),
    (lambda: fuse("born", X, phase="constant(offset=[0, 1])"), "one value per member"),
    (lambda: fuse("born", X, z_min=-1), "z_min"),
    (lambda: fuse("loglinear", X, temperature=0), "must be > 0"),
    (lambda: fuse("power", X, alpha=float("inf")), "finite"),
    (lambda: fuse("routing", X, criterion="loudest"), "must be one of"),
    (lambda: fuse("linear", X, sharpness=2), "no parameter"),
    (lambda: fuse("contrastive", X, expert=1, amateur=1), "must differ"),
    (lambda: fuse("contrastive", X, amateur=7), "amateur=7"),
    (lambda: fuse("entropy_gated", X, primary=3), "primary=3"),
    (lambda: fuse("entropy_gated", X, inner="nope"), "unknown fusion method"),
    (lambda: fuse("linear", X, [0.5, 0.6, -0.1]), ">= 0"),
    (lambda: fuse("linear", X, [0.5, 0.6, 0.1]), "sum to 1"),
    (lambda: fuse("linear", X, [0.5, 0.5]), "n_members=3"),
    (lambda: fuse("linear", X, np.full((3, 3), 1 / 3)), "broadcast"),
    (lambda: fuse("linear", X[0, 0]), r"\[\.\.\., n_members, V\]"),
    (lambda: fuse("linear", np.where(np.eye(5)[:3] > 0, np.nan, 0.0)[None]),
     "NaN"),
    (lambda: fuse("linear", np.full((1, 2, 3), np.inf)), r"\+inf"),
    (lambda: fuse("linear", np.full((1, 2, 3), -np.inf)), "no valid token"),
    (lambda: fuse("linear", X, where=np.zeros((2, 3, 5), bool)), "no valid token"),
    (lambda: fuse("linear", X, where=np.ones((4, 5), bool)), "does not broadcast"),
    (lambda: fuse("linear", np.zeros((2, 3), np.int32)), "floating point"),
])
def test_bad_input_is_refused_with_a_clear_error(call, match):
    with pytest.raises(FusionInputError, match=match):
        call()


def _bad_value_cases():
    """The clean inputs (logits, weights, where) and, for every value check
    (`brf.fusion.checks.value_status`'s bits), the same with row 1 of 3 made bad."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((3, 2, 6)).astype(np.float32)
    w = np.tile(np.asarray([0.5, 0.5], np.float32), (3, 1))
    where = np.ones((3, 2, 6), bool)

    def logits(value, at=(1, 0, 2)):
        y = x.copy()
        y[at] = value
        return y

    def weights(bad):
        v = w.copy()
        v[1] = bad
        return v
    hole = where.copy()
    hole[1, 0] = False
    cases = {"nan": (logits(np.nan), w, where), "+inf": (logits(np.inf), w, where),
             "empty member": (logits(-np.inf, (1, 1)), w, where),
             "empty where": (x, w, hole), "weights nan": (x, weights([np.nan, 0.5]), where),
             "weights negative": (x, weights([-0.5, 1.5]), where),
             "weights off the simplex": (x, weights([0.5, 0.6]), where)}
    return (x, w, where), cases


# Every method (bottleneck ones with unembeddings), its default parameters.
def _every_method():
    u = np.random.default_rng(22).standard_normal((6, 2)).astype(np.float32)
    return [(m, {"unembeddings": [u, u]} if m.startswith("bottleneck_") else {})
            for m in sorted(METHODS.names())]


@pytest.mark.parametrize("method,params", _every_method(), ids=lambda v: str(v)[:20])
def test_bad_values_raise_outside_jit_and_give_nan_rows_inside(method, params):
    """Issue 71: docs/fusion.md says bad values are refused before any computation;
    under jax.jit no value can be read, so a checked call marks the bad row NaN (every
    entry) and leaves the good rows as they are. Every method, every value check."""
    clean, cases = _bad_value_cases()
    jitted = jax.jit(lambda x, w, wh: fuse(method, x, w, where=wh, **params))
    good = np.asarray(jitted(*clean))
    assert np.isfinite(good).any(-1).all()
    for case, (x, w, where) in cases.items():
        with pytest.raises(FusionInputError):
            fuse(method, x, w, where=where, **params)
        out = np.asarray(jitted(x, w, where))
        assert np.isnan(out[1]).all(), (method, case)
        np.testing.assert_allclose(out[[0, 2]], good[[0, 2]], atol=1e-5,
                                   err_msg=f"{method} {case}")


def test_phase_expression_errors_are_fusion_input_errors():
    """Issue 71: arithmetic in a phase map that fails (1/0, a float overflow) raised
    brf.specs.SpecError, not the documented brf.FusionInputError."""
    for phase, match in (("tanh(rate=1/0)", "divides by zero"),
                         ("tanh(rate=2**99999)", "too large"),
                         ("tanh(rate=9**9**9)", "too large")):
        with pytest.raises(FusionInputError, match=match):
            fuse("born", X, phase=phase)


def test_where_mask_equals_minus_inf_logits():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 2, 9)).astype(np.float32)
    mask = rng.random((2, 1, 9)) > 0.3
    mask[..., 0] = True
    a = fuse("born", x, where=mask, phase="tanh")
    b = fuse("born", np.where(mask, x, -np.inf), phase="tanh")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@given(member_logits(max_n=2, max_v=64), st.sampled_from([2, 4, 8]))
def test_chunked_top2_gap_matches_sort(sample, chunk):
    from brf.fusion.members import chunked_top2_gap
    x, _ = sample
    if x.shape[-1] % chunk:  # exercise the chunked path: pad to a multiple
        pad = chunk - x.shape[-1] % chunk
        x = np.concatenate([x, np.full(x.shape[:-1] + (pad,), -np.inf, x.dtype)], -1)
    top1, gap = chunked_top2_gap(jnp.asarray(x), chunk=chunk)
    np.testing.assert_array_equal(np.asarray(top1), x.max(-1))
    np.testing.assert_allclose(np.asarray(gap), ref.gap(x), rtol=1e-6)


def test_chunked_gap_ties_across_and_within_chunks():
    from brf.fusion.members import chunked_top2_gap
    x = np.zeros((4, 16), np.float32)
    x[0, [1, 9]] = 5.0            # tie across chunks -> 0
    x[1, [1, 2]] = 5.0            # tie within a chunk -> 0
    x[2, 1], x[2, 2] = 5.0, 4.0   # runner-up in the winning chunk
    x[3, 1], x[3, 12] = 5.0, 4.5  # runner-up in another chunk
    _, gap = chunked_top2_gap(jnp.asarray(x), chunk=4)
    np.testing.assert_array_equal(np.asarray(gap), [0.0, 0.0, 1.0, 0.5])


@pytest.mark.parametrize("method,params", [
    ("linear", {}), ("loglinear", {"temperature": 0.8}), ("power", {"alpha": 0.5}),
    ("power", {"alpha": 0.0}), ("power", {"alpha": -0.5}), ("max", {}), ("min", {}), ("routing", {}),
    ("entropy_gated", {"threshold": 0.5}), ("contrastive", {"beta": 0.5}),
    ("born", {"phase": "tanh(offset=[0, 1])"}), ("born", {"phase": "token_tanh"}),
])
def test_gradients_finite_with_events_no_member_can_emit(method, params):
    """Padded events (-inf for every member) must not poison gradients."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 2, 10)).astype(np.float32)
    x[:, :, 7:] = -np.inf  # padding: no member gives these events mass
    x[1, 0, 3] = -np.inf   # one member rules out one event
    gold = jnp.array([0, 1, 2, 4])

    def loss(logit_w, scale):
        w = jax.nn.softmax(logit_w)
        p = dict(params)
        if method == "born":
            p["phase"] = phase_map(p["phase"], scale=scale)
        lq = fuse(method, x, w, validate=False, **p)
        return -jnp.take_along_axis(lq, gold[:, None], -1).mean()

    g_w, g_s = jax.grad(loss, argnums=(0, 1))(jnp.array([0.3, -0.2]), jnp.float32(1.0))
    assert np.isfinite(np.asarray(g_w)).all() and np.isfinite(float(g_s))
    # Every float parameter receives a finite gradient too.
    floats = [k for k, p in brf.fusion.get_method(method).params.items()
              if p.kind == "float" and k in params]
    for key in floats:
        def by_param(v, key=key):
            lq = fuse(method, x, validate=False, **{**params, key: v})
            return -jnp.take_along_axis(lq, gold[:, None], -1).mean()
        g = jax.grad(by_param)(jnp.float32(params[key]))
        assert np.isfinite(float(g)), (key, g)
    if method in ("linear", "loglinear", "power", "born"):
        assert np.abs(np.asarray(g_w)).max() > 0, "weights must receive a gradient"


def test_sincos_is_float32_accurate_and_differentiates_to_itself():
    """The Born kernel's vectorised sin and cos: within 1.2e-7 (about 2 ulp of
    float32) of float64 NumPy's over |x| <= 3000 and at the quadrant boundaries;
    their gradient is (cos, -sin) to the same accuracy; float64 input is NumPy's
    (to 1e-15); inf and NaN give NaN like jnp.sin."""
    from brf.fusion.born import sincos
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-20, 20, 200_001), rng.uniform(-3000, 3000, 100_000),
                        np.arange(-64, 65) * np.pi / 4]).astype(np.float32)
    s, c = jax.jit(sincos)(jnp.asarray(x))
    x64 = x.astype(np.float64)
    assert np.abs(np.asarray(s, np.float64) - np.sin(x64)).max() < 1.2e-7
    assert np.abs(np.asarray(c, np.float64) - np.cos(x64)).max() < 1.2e-7
    g = jax.grad(lambda v: jnp.sum(2.0 * sincos(v)[0] + sincos(v)[1]))(jnp.asarray(x[::50]))
    want = 2.0 * np.cos(x64[::50]) - np.sin(x64[::50])
    assert np.abs(np.asarray(g, np.float64) - want).max() < 4e-7
    with jax.enable_x64(True):
        s64, c64 = sincos(jnp.asarray(x64))
        np.testing.assert_allclose(np.asarray(s64), np.sin(x64), rtol=0, atol=1e-15)
        np.testing.assert_allclose(np.asarray(c64), np.cos(x64), rtol=0, atol=1e-15)
    bad = sincos(jnp.array([np.inf, -np.inf, np.nan], jnp.float32))
    assert np.isnan(np.asarray(bad)).all()


@pytest.mark.parametrize("source,params,target,tol", [
    ("constant", {"offset": [0.1, 0.5, -1.0]}, "tanh", 1e-6),
    ("constant", {"offset": [0.1, 0.5, -1.0]}, "sigmoid", 1e-6),
    ("constant", {"offset": [0.1, 0.5, -1.0]}, "token_log1p", 1e-6),
    ("tanh", {"scale": 0.7, "rate": 1.3, "offset": [0.1, 0.5, -1.0]}, "sigmoid", 1e-5),
    ("linear", {"scale": 0.3, "offset": [0.1, 0.5, -1.0]}, "tanh", 0.011),
    ("linear", {"scale": 0.3, "offset": [0.1, 0.5, -1.0]}, "arctan", 0.011),
    ("linear", {"scale": 0.3, "offset": [0.1, 0.5, -1.0]}, "sigmoid", 0.011),
    ("token_linear", {"scale": 0.2}, "token_tanh", 0.011),
])
def test_a_phase_map_embeds_in_a_family_that_contains_it(source, params, target, tol):
    """brf.fusion.phase.embed: the target map under the returned parameters gives the
    source's phases up to one shift shared by every member (which Born fusion cannot
    see), on gaps 0..10, exactly or within the linear part's error; maps that do not
    contain the source give None."""
    from brf.fusion.phase import embed
    x = jnp.broadcast_to(jnp.linspace(0.0, 10.0, 101), (3, 101))
    q = embed(source, params, target)
    a = np.asarray(phase_map(source, **params)(x, member_axis=0), np.float64)
    b = np.asarray(phase_map(target, **q)(x, member_axis=0), np.float64)
    d = (a - b) - (a - b)[0, 0]
    assert np.max(np.abs(d)) <= tol
    assert embed("tanh", {}, "arctan") is None
    assert embed("linear", {}, "token_tanh") is None
