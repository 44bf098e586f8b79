"""The control methods (brf/fusion/controls.py) against float64 NumPy references.

Phase-shuffled BRF, per-token reshaping without cross-terms and the power mean
with per-member exponents: their values, the shuffle's permutation properties,
the pools they reduce to, -inf events, gradients and bad input.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import brf
from brf.fusion import FusionInputError, fuse, phase_map
from brf.fusion.controls import shuffle_sources

import fusion_reference as ref
from test_fusion import ATOL, TOKEN_MAPS, assert_close, member_logits, probs, simplex

CURVES = ["linear", "tanh", "sigmoid", "arctan", "log1p"]


def _shape_params(name, data):
    params = {"scale": data.draw(st.floats(0.1, 4.0)),
              "rate": data.draw(st.floats(0.0, 3.0)),
              "center": data.draw(st.floats(-2.0, 2.0))}
    defaults = brf.PHASE_MAPS.get(name).defaults
    return {k: v for k, v in params.items() if k in defaults}


def _rows(x):
    """Flattened [rows, V] view of [..., n, V] (one row per position and member)."""
    return np.asarray(x).reshape(-1, np.shape(x)[-1])


# --- phase-shuffled BRF ----------------------------------------------------------


def test_shuffle_is_one_fixed_function_of_each_row():
    """Same permutation under tempering (the calibrated variant), in any batch,
    with -inf padding appended, under vmap; one for all members; a new one for
    another seed, another ranking."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 3, 30)) * 2).astype(np.float32)
    x[:, 1, :4] = -np.inf
    x[5, 2, 7] = x[5, 2, 8]  # a tie
    base = np.asarray(shuffle_sources(jnp.asarray(x)))
    for t in (0.3, 5.25):
        tempered = jax.nn.log_softmax(jnp.asarray(x) / t, axis=-1)
        np.testing.assert_array_equal(np.asarray(shuffle_sources(tempered)), base)
    idx = rng.permutation(40)[:17]
    np.testing.assert_array_equal(np.asarray(shuffle_sources(jnp.asarray(x[idx]))),
                                  base[idx])
    padded = np.concatenate([x, np.full((40, 3, 9), -np.inf, np.float32)], -1)
    np.testing.assert_array_equal(np.asarray(shuffle_sources(jnp.asarray(padded)))[..., :30],
                                  base)
    mapped = jax.vmap(shuffle_sources)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(mapped), base)
    assert (np.asarray(shuffle_sources(jnp.asarray(x), seed=1)) != base).mean() > 0.5
    # One permutation per position, shared by the members wherever they give mass.
    np.testing.assert_array_equal(base[:, 0], base[:, 2])
    np.testing.assert_array_equal(base[:, 1, 4:], base[:, 0, 4:])
    swapped = x.copy()
    swapped[:, 0, [0, 1]] = swapped[:, 0, [1, 0]]  # another ranking of member 0
    s = np.asarray(shuffle_sources(jnp.asarray(swapped)))
    assert (s != base).mean() > 0.5


def test_shuffle_is_uniform_over_events():
    """Each event takes each other event's phase with probability 1/m."""
    rng = np.random.default_rng(1)
    rows, v = 6000, 12
    x = rng.standard_normal((rows, 1, v)).astype(np.float32)
    src = np.asarray(shuffle_sources(jnp.asarray(x)))[:, 0]
    counts = np.zeros((v, v))
    np.add.at(counts, (np.repeat(np.arange(v)[None], rows, 0), src), 1)
    expected = rows / v
    sd = math.sqrt(expected * (1 - 1 / v))
    assert np.abs(counts - expected).max() < 5 * sd, counts
    # ... also for the top-ranked event (the gold is often the top).
    top = np.argmax(x[:, 0], -1)
    got = np.bincount(src[np.arange(rows), top], minlength=v)
    assert np.abs(got - expected).max() < 5 * sd


@given(member_logits(), st.sampled_from(TOKEN_MAPS), st.sampled_from([0, 7]), st.data())
def test_born_shuffled_matches_reference(sample, name, seed, data):
    x, scale = sample
    n = x.shape[1]
    src = np.asarray(shuffle_sources(jnp.asarray(x), seed))
    # Each member's finite events are permuted among themselves; -inf events stay;
    # an event takes its phases from one event that the same members give mass.
    for row, s in zip(_rows(x), _rows(src)):
        fin = np.flatnonzero(np.isfinite(row))
        np.testing.assert_array_equal(np.sort(s[fin]), fin)
        out = np.flatnonzero(~np.isfinite(row))
        np.testing.assert_array_equal(s[out], out)
    fin = np.isfinite(x)
    for b in np.ndindex(x.shape[:-2]):
        for t in range(x.shape[-1]):
            members = np.flatnonzero(fin[b][:, t])
            if members.size:
                assert len(set(src[b][members, t])) == 1
                np.testing.assert_array_equal(fin[b][:, src[b][members[0], t]], fin[b][:, t])
    assume(not (name.endswith("linear") and scale > 30))
    w = data.draw(simplex(n))
    params = _shape_params(name, data)
    offset = data.draw(st.lists(st.floats(-4, 4), min_size=n, max_size=n))
    phi = ref.phases(x, name, offset=np.array(offset), **params)
    q_ref, z_ref = ref.born(x, w, np.take_along_axis(phi, src, -1))
    assume(np.all((z_ref > 1e-2) | (z_ref < 1e-4)))
    logq, info = fuse("born_shuffled", x, w, phase=phase_map(name, offset=offset, **params),
                      seed=seed, return_info=True)
    assert_close(logq, q_ref)
    np.testing.assert_array_equal(np.asarray(info["fallback"]), z_ref < 1e-3)


def test_born_shuffled_is_born_when_phases_ignore_the_token():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 3, 25)) * 2).astype(np.float32)
    x[0, 1, 3:9] = -np.inf
    w = np.array([0.2, 0.5, 0.3], np.float32)
    pm = phase_map("token_tanh", scale=0.0, offset=[0.0, 1.0, 2.5])
    np.testing.assert_allclose(probs(fuse("born_shuffled", x, w, phase=pm)),
                               probs(fuse("born", x, w, phase=pm)), atol=ATOL)
    # With token-dependent phases the shuffle does change the distribution.
    pm = phase_map("token_linear", scale=2.0, offset=[0.0, 1.0, 2.5])
    assert np.abs(probs(fuse("born_shuffled", x, w, phase=pm))
                  - probs(fuse("born", x, w, phase=pm))).max() > 1e-2


@pytest.mark.parametrize("members", ["uniform", "random"])
@pytest.mark.parametrize("phase", ["token_tanh", "token_linear(scale=2, offset=[0, 1])",
                                   "token_sigmoid(scale=3, rate=2, center=1)"])
def test_born_shuffled_of_identical_members_is_born(members, phase):
    """Issue 37: two identical members (analyze_csv's two identical uniform CSVs:
    V = 4 equal tokens plus a negligible OTHER event whose phase is ~pi) took
    opposite phases on tokens both give mass and floored half the positions.
    Identical members have identical phases at every event; a shuffle shared by
    the members keeps them so, and the control equals Born (the member itself
    for equal offsets), with no token losing mass."""
    rng = np.random.default_rng(8)
    if members == "uniform":
        one = np.tile(np.log(np.array([0.25, 0.25, 0.25, 0.25, 1e-8])), (40, 1))
    else:
        one = rng.standard_normal((40, 9)) * 2
        one[::3, -2:] = -np.inf
    x = np.repeat(one[:, None], 2, axis=1).astype(np.float32)
    p = np.exp(one - np.log(np.exp(one).sum(-1, keepdims=True)))
    for seed, w in [(0, [0.5, 0.5]), (1, [0.5, 0.5]), (2, [0.3, 0.7]), (3, [0.9, 0.1])]:
        w = np.array(w, np.float32)
        logq, info = fuse("born_shuffled", x, w, phase=phase, seed=seed, return_info=True)
        q = probs(logq)
        assert not np.asarray(info["fallback"]).any()
        np.testing.assert_allclose(q, probs(fuse("born", x, w, phase=phase)), atol=ATOL)
        if "offset" not in phase:
            assert (q[p > 1e-3] > 0.5 * p[p > 1e-3]).all()
            np.testing.assert_allclose(q, p, atol=1e-6)


# --- per-token reshaping ----------------------------------------------------------


@given(member_logits(), st.sampled_from(CURVES), st.sampled_from(["linear", "loglinear"]),
       st.data())
def test_reshape_matches_reference(sample, curve, pool, data):
    x, scale = sample
    n = x.shape[1]
    assume(not (curve == "linear" and scale > 30))
    w = data.draw(simplex(n))
    s = data.draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n))
    rate = data.draw(st.floats(-3.0, 3.0))  # the sign is ignored
    center = data.draw(st.floats(-2.0, 2.0))
    q_ref = ref.reshape(x, w, curve, s, rate, center, pool)
    # Where the log-linear pool leaves no mass: the linear pool of the tilted members.
    empty = ~np.isfinite(q_ref).all(-1) | (np.nansum(q_ref, -1) == 0)
    q_ref = np.where(empty[..., None], ref.reshape(x, w, curve, s, rate, center), q_ref)
    logq, info = fuse("reshape", x, w, return_info=True, curve=curve, scale=s, rate=rate,
                      center=center, pool=pool)
    assert_close(logq, q_ref)
    np.testing.assert_array_equal(np.asarray(info["fallback"]), empty)


def test_reshape_reduces_to_the_pools_and_to_member_temperatures():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 2, 40)) * 2).astype(np.float32)
    x[1, 0, :10] = -np.inf
    w = np.array([0.3, 0.7], np.float32)
    for curve in CURVES:
        assert_close(fuse("reshape", x, w, curve=curve, scale=0.0), ref.linear(x, w))
        assert_close(fuse("reshape", x, w, curve=curve, scale=[0.0, 0.0], pool="loglinear"),
                     ref.loglinear(x, w, 1.0))
    # The linear curve is a member temperature: p^(1 - s) = softmax(l / T), T = 1/(1 - s).
    s = np.array([0.4, -0.5])
    tempered = x * (1 - s)[:, None]
    assert_close(fuse("reshape", x, w, curve="linear", scale=s), ref.linear(tempered, w))
    # A shared scale is the same as that scale for every member.
    np.testing.assert_allclose(probs(fuse("reshape", x, w, scale=0.7, rate=0.4)),
                               probs(fuse("reshape", x, w, scale=[0.7, 0.7], rate=0.4)),
                               atol=1e-6)


# --- power mean with per-member exponents -----------------------------------------


@given(member_logits(), st.data())
def test_power_members_matches_reference(sample, data):
    x, scale = sample
    n = x.shape[1]
    assume(scale <= 30)  # 1e4-scale logits raised to mixed exponents overflow float32's
    w = data.draw(simplex(n))
    alpha = data.draw(st.lists(st.sampled_from([-1.0, -0.3, 0.0, 0.5, 1.0, 2.0]),
                               min_size=n, max_size=n))
    order = data.draw(st.sampled_from([-1.0, 0.5, 1.0, 2.0]))
    q_ref = ref.power_members(x, w, alpha, order)
    empty = ~np.isfinite(q_ref).all(-1) | (np.nansum(q_ref, -1) == 0)
    q_ref = np.where(empty[..., None], ref.linear(x, w), q_ref)
    logq, info = fuse("power_members", x, w, return_info=True, alpha=alpha, order=order)
    assert_close(logq, q_ref, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(info["fallback"]), empty)


@pytest.mark.parametrize("a", [-1.0, 0.3, 0.5, 1.0, 2.0])
def test_power_members_with_equal_exponents_is_the_power_mean(a):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((4, 3, 30)) * 2).astype(np.float32)
    x[2, 1, :5] = -np.inf
    w = np.array([0.5, 0.2, 0.3], np.float32)
    got = fuse("power_members", x, w, alpha=[a, a, a], order=a)
    assert_close(got, ref.power(x, w, a))
    np.testing.assert_allclose(probs(got), probs(fuse("power", x, w, alpha=a)), atol=ATOL)


def test_power_members_special_points():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 2, 30)) * 2).astype(np.float32)
    w = np.array([0.4, 0.6], np.float32)
    assert_close(fuse("power_members", x, w, alpha=1.0, order=1.0), ref.linear(x, w))
    assert_close(fuse("power_members", x, w, alpha=0.5, order=0.5), ref.power(x, w, 0.5))
    # Exponents shrinking together: the log-linear pool with weights w_i c_i / sum w c.
    eps, c = 1e-3, np.array([1.0, 3.0])
    wc = w * c / (w * c).sum()
    got = fuse("power_members", x, w, alpha=eps * c, order=eps * float((w * c).sum()))
    assert_close(got, ref.loglinear(x, wc, 1.0), atol=2e-3)
    # One member with weight 0 takes no part, whatever its exponent.
    assert_close(fuse("power_members", x, np.array([1.0, 0.0], np.float32),
                      alpha=[0.7, -2.0], order=0.7), ref.softmax(x[:, 0]))
    # Unequal exponents at order 1: a linear pool of the powered members.
    p = ref.softmax(x)
    s = (w[:, None] * p ** np.array([0.5, 2.0])[:, None]).sum(-2)
    assert_close(fuse("power_members", x, w, alpha=[0.5, 2.0], order=1.0),
                 s / s.sum(-1, keepdims=True))


# --- shared properties ----------------------------------------------------------------

CONTROLS = [
    ("born_shuffled", {"phase": "token_tanh(scale=3, rate=0.5, offset=[0, 1])"}),
    ("reshape", {"curve": "tanh", "scale": [0.8, -0.6], "rate": 0.5}),
    ("reshape", {"curve": "sigmoid", "scale": [0.8, -0.6], "rate": 0.5, "center": 1.0,
                 "pool": "loglinear"}),
    ("power_members", {"alpha": [0.4, -0.7], "order": 0.8}),
]


@pytest.mark.parametrize("method,params", CONTROLS)
def test_minus_inf_events_give_no_nan_and_finite_nonzero_gradients(method, params):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 2, 10)).astype(np.float32)
    x[:, :, 7:] = -np.inf  # padding: no member gives these events mass
    x[1, 0, 3] = -np.inf   # one member rules out one event
    x[2, 1, :5] = -np.inf
    gold = jnp.array([0, 1, 2, 4, 5, 6])

    def loss(logit_w, values):
        p = dict(params)
        for k, v in values.items():
            if k == "phase.scale":
                p["phase"] = phase_map(p["phase"], scale=v)
            else:
                p[k] = v
        lq = fuse(method, x, jax.nn.softmax(logit_w), validate=False, **p)
        return -jnp.take_along_axis(lq, gold[:, None], -1).mean()

    values = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()
              if k in ("scale", "rate", "center", "alpha", "order")}
    if method == "born_shuffled":
        values["phase.scale"] = jnp.float32(3.0)
    lq = np.asarray(fuse(method, x, **params))
    assert not np.isnan(lq).any()
    q = np.exp(lq.astype(np.float64))
    assert (q >= 0).all() and np.allclose(q.sum(-1), 1.0, atol=1e-5)
    assert (q[:, 7:] == 0).all()
    g_w, g_v = jax.grad(loss, argnums=(0, 1))(jnp.array([0.3, -0.2]), values)
    assert np.abs(np.asarray(g_w)).max() > 0
    for k, g in g_v.items():
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, (k, g)


@pytest.mark.parametrize("method,params", CONTROLS)
def test_jit_and_eager_agree_and_values_do_not_retrace(method, params):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 2, 20)) * 2).astype(np.float32)
    w = np.array([0.6, 0.4], np.float32)
    jitted = fuse(method, x, w, **params)
    with jax.disable_jit():
        eager = fuse(method, x, w, **params)
    np.testing.assert_allclose(probs(jitted), probs(eager), atol=1e-6)
    before = brf.fusion.TRACE_COUNTS[method]
    moved = {k: (np.asarray(v) * 0.5 + 0.1).tolist() if k in ("scale", "alpha", "order",
                                                                "rate") else v
             for k, v in params.items()}
    if method == "born_shuffled":
        moved["phase"] = "token_tanh(scale=1.2, rate=0.9, offset=[0, 2])"
    fuse(method, x, w, **moved)
    fuse(method, x * 2, [0.1, 0.9], **moved)
    assert brf.fusion.TRACE_COUNTS[method] == before


X = np.zeros((2, 3, 5), np.float32)


@pytest.mark.parametrize("call,match", [
    (lambda: fuse("born_shuffled", X, phase="tanh"), "per-token map"),
    (lambda: fuse("born_shuffled", X, seed=-1), "seed=-1"),
    (lambda: fuse("reshape", X, curve="spiral"), "must be one of"),
    (lambda: fuse("reshape", X, pool="max"), "must be one of"),
    (lambda: fuse("reshape", X, scale=[1.0, 2.0]), "one number per member"),
    (lambda: fuse("reshape", X, scale=[[1.0]]), "one number per member"),
    (lambda: fuse("reshape", X, scale="big"), "a number"),
    (lambda: fuse("reshape", X, scale=[0.0, float("nan"), 0.0]), "finite"),
    (lambda: fuse("power_members", X, order=0.0), "nonzero"),
    (lambda: fuse("power_members", X, alpha=[1.0, 2.0]), "one number per member"),
])
def test_bad_input_is_refused_with_a_clear_error(call, match):
    with pytest.raises(FusionInputError, match=match):
        call()
