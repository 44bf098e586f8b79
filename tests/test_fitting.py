"""The study's fitter (brf.eval.fitting.fit_method, brf.eval.lbfgs) against scipy in float64."""

import dataclasses

import numpy as np
import pytest
from scipy import optimize

from brf.eval import lbfgs
from brf.event_table import EventTable
from brf.eval.planted import two_members
from brf.eval.fitting import FitSettings, Fitted, MethodSpec, evaluate, fit_method


def _log_softmax(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _table(P=1500, E=12, seed=0):
    """Two members, one sharp and one noisy; gold drawn from a third distribution."""
    return two_members(P, E, seed)


def _loglinear_nll64(x, logp, gold):
    """Mean NLL of loglinear(temperature) with weights softmax([0, z]), float64."""
    t, z = np.exp(x[0]), x[1]
    w = np.exp([0.0, z]) / np.exp([0.0, z]).sum()
    lp = np.where(np.isfinite(logp), logp, -1e30)
    s = np.einsum("n,pne->pe", w, lp) / t
    return -np.mean(_log_softmax(s)[np.arange(len(gold)), gold])


def test_lbfgs_finds_scipys_optimum_of_a_smooth_problem():
    """Rosenbrock from the usual start: the same minimum as scipy's L-BFGS-B."""
    def fun(x):
        f = (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2
        g = np.array([-2 * (1 - x[0]) - 400 * x[0] * (x[1] - x[0] ** 2),
                      200 * (x[1] - x[0] ** 2)])
        return f, g
    r = lbfgs.minimize(fun, np.array([-1.2, 1.0]), max_iter=500, ftol=1e-14, gtol=1e-8,
                       history=10, max_step=1.0)
    ref = optimize.minimize(fun, [-1.2, 1.0], jac=True, method="L-BFGS-B")
    assert r.converged
    np.testing.assert_allclose(r.x, ref.x, atol=1e-3)
    np.testing.assert_allclose(r.x, [1.0, 1.0], atol=1e-3)


def test_fit_matches_a_float64_scipy_fit():
    """loglinear with a fitted temperature and weights: brf's calibration NLL and
    parameters equal scipy's float64 optimum of the same objective."""
    t = _table()
    f = fit_method({"label": "ll", "method": "loglinear", "fit": {"temperature": 1.0}}, t)
    ref = optimize.minimize(_loglinear_nll64, [0.0, 0.0], args=(t.logp.astype(np.float64),
                                                               t.gold), method="L-BFGS-B")
    assert f.info["converged"]
    assert f.calib_nll == pytest.approx(ref.fun, abs=2e-6)
    assert f.params["temperature"] == pytest.approx(np.exp(ref.x[0]), rel=2e-3)
    w_ref = np.exp([0.0, ref.x[1]]) / np.exp([0.0, ref.x[1]]).sum()
    np.testing.assert_allclose(f.weights, w_ref, atol=2e-3)
    # The reported NLL is the fitted parameters' NLL on the table.
    assert np.mean(evaluate(f, t)["nll"]) == pytest.approx(f.calib_nll, abs=1e-6)


def test_the_float64_objective_is_the_float64_reference():
    """The diagnostic float64 objective (what bench_fit_repeat --census continues fits
    on) is a float64 NumPy log-linear pool's mean NLL to 1e-12 and its gradient a
    finite difference's; the fits' float32 program agrees with it to its rounding."""
    from brf.eval.fitting import _Problem
    t = _table()
    p = _Problem(MethodSpec.coerce({"label": "ll", "method": "loglinear",
                                    "fit": {"temperature": 1.0}}), t, FitSettings())
    point, data = p.grid_points()[0], p.data()
    f64, f32 = p.objective(point, data, float64=True), p.objective(point, data)
    lp = t.logp.astype(np.float64)
    assert list(p.layout.keys) == ["_w", "temperature"]  # the reference's x, reversed
    for x in (np.array([0.0, 0.0]), np.array([-1.3, 0.7])):
        v, g = f64(x)
        assert v == pytest.approx(_loglinear_nll64(x[::-1], lp, t.gold) + np.mean(t.offset),
                                  abs=1e-12)
        g_ref = optimize.approx_fprime(x[::-1], _loglinear_nll64, 1e-7, lp, t.gold)[::-1]
        np.testing.assert_allclose(g, g_ref, atol=1e-6)
        assert abs(f32(x)[0] - v) < 1e-5


def test_padding_events_and_positions_changes_nothing():
    """Extra all-(-inf) events and a table size in another position bucket give the
    same fit (padding is masked out)."""
    t = _table(P=700)
    wide = t._replace(logp=np.concatenate(
        [t.logp, np.full(t.logp.shape[:2] + (21,), -np.inf, np.float32)], axis=2))
    spec = {"label": "b", "method": "born", "phase": "tanh",
            "fit": {"phase.scale": 1.5, "phase.rate": 0.5, "phase.offset": [0.0, 0.5]}}
    a, b = fit_method(spec, t), fit_method(spec, wide)
    assert a.calib_nll == pytest.approx(b.calib_nll, abs=1e-6)


def test_subsample_then_polish_reaches_the_full_optimum():
    """Fitting on a subsample first, then on all positions from there, ends at the
    optimum of the whole calibration NLL (the same as fitting on all positions)."""
    t = _table(P=1600)
    for spec in ({"label": "g", "method": "entropy_gated",
                  "grid": {"threshold": [0.5, 1.0, 2.0]}},
                 {"label": "b", "method": "born", "phase": "tanh", "grid": {"phase.rate": [0.3, 0.6]},
                  "fit": {"phase.scale": 1.5, "phase.offset": [0.0, 0.5]}}):
        direct = fit_method(spec, t, settings=FitSettings(subsample=0))
        staged = fit_method(spec, t, settings=FitSettings(subsample=300))
        assert staged.info["subsample_evaluations"] > 0 and staged.info["converged"]
        assert staged.calib_nll == pytest.approx(direct.calib_nll, abs=2e-6)


def test_calibration_temperatures_stay_in_their_range():
    """The calibrated variant's fused temperature T lies in [1/r, r] and each member's
    temperature all the way through, T_i * T (the coordinate the fit moves), in
    [1/r^2, r^2], so every point of the box [1/r, r] of each temperature is reachable;
    with r = 0 they are free (and this table's optimum lies outside the box of r = 2)."""
    t = _table()
    spec = {"label": "lin", "method": "linear", "variant": "calibrated"}
    for r in (1000.0, 10.0, 2.0):
        f = fit_method(spec, t, settings=FitSettings(calib_range=r))
        post = f.params["calib.temperature"]
        through = [post * x for x in f.params["calib.member_temperature"]]
        assert 1 / r * (1 - 1e-5) <= post <= r * (1 + 1e-5), (r, post)
        assert all(r ** -2 * (1 - 1e-5) <= x <= r ** 2 * (1 + 1e-5) for x in through), (
            r, through)
    free = fit_method(spec, t, settings=FitSettings(calib_range=0.0))
    narrow = fit_method(spec, t, settings=FitSettings(calib_range=2.0))
    assert free.calib_nll < narrow.calib_nll


def test_specs_differing_in_float_values_share_one_compilation():
    """loglinear(T fitted), loglinear(T = 1) and PackLLM's loglinear (perplexity weights)
    are one compiled program; a second table of the same chunk shape reuses it too, and
    the born rows of every per-position phase map share one program."""
    from brf.eval import fitting
    t = _table(P=600)
    fit_method({"label": "a", "method": "loglinear", "fit": {"temperature": 1.0}}, t)
    before = len(fitting._PROGRAMS)
    fit_method({"label": "b", "method": "loglinear", "fixed": {"temperature": 1.0}}, t)
    fit_method({"label": "c", "method": "loglinear", "fit": {"temperature": 0.5}},
               _table(P=650, seed=1))
    fit_method({"label": "d", "method": "loglinear", "fixed": {"temperature": 1.0},
                "weighting": "perplexity", "variant": "calibrated"}, t)
    assert len(fitting._PROGRAMS) == before
    fit_method({"label": "e", "method": "born", "phase": "tanh",
                "fit": {"phase.scale": 1.5, "phase.rate": 0.5, "phase.offset": [0.0, 0.5]}}, t)
    before = len(fitting._PROGRAMS)
    for phase in ("constant", "sigmoid", "log1p"):
        fit_method({"label": phase, "method": "born", "phase": phase,
                    "fit": {"phase.offset": [0.0, 0.5]}}, t)
    fit_method({"label": "f", "method": "born", "phase": "constant",
                "fixed": {"phase.offset": 0.0}, "variant": "calibrated"}, t)
    assert len(fitting._PROGRAMS) == before


def _corner(t):
    """A calibrated born fit in a corner of the box [1/10, 10] (the study's bound before
    it was widened): every member tempered to 10 and the fused distribution sharpened
    to 1/10, a poor start that the fit must leave."""
    f = Fitted("h", "born", {"phase.offset": 0.0, "phase": "constant",
                             "calib.temperature": 0.1, "calib.member_temperature": [10.0, 10.0]},
               np.array([0.5, 0.5]), 0.0, {"converged": True})
    return dataclasses.replace(f, calib_nll=float(np.mean(evaluate(f, t)["nll"])))


def test_several_starts_keep_the_best_basin():
    """With several starts the fit is the best of the fits from each start alone (a
    cold start, and a poor start in a corner of [1/10, 10], which the fit leaves)."""
    t = _table()
    spec = MethodSpec("h", "born", fixed={"phase.offset": 0.0}, phase="constant",
                      variant="calibrated")
    corner = _corner(t)
    cold, from_corner = fit_method(spec, t), fit_method(spec, t, warm=corner)
    assert from_corner.calib_nll < corner.calib_nll - 1e-2
    both = fit_method(spec, t, starts=[corner])
    assert both.calib_nll <= min(cold.calib_nll, from_corner.calib_nll) + 1e-6


@pytest.mark.parametrize("phase", ["tanh", "sigmoid", "constant", "token_tanh", "token_log1p"])
def test_one_program_for_every_phase_map_gives_each_maps_nll(phase):
    """The born program that switches between the phase maps of a kind gives, at the
    same values, the NLL of that map through brf.fusion.fuse (a float64 mean of it)."""
    t = _table(P=300)
    spec = {"label": "b", "method": "born", "phase": phase, "variant": "calibrated",
            "fit": {"phase.offset": [0.0, 0.7]}}
    f = fit_method(spec, t, settings=FitSettings(max_iter=3))
    assert np.mean(evaluate(f, t)["nll"]) == pytest.approx(f.calib_nll, abs=2e-6)


def test_chunks_change_nothing(monkeypatch):
    """Evaluating a table in many small chunks gives the fit of one chunk."""
    from brf.eval import fitting
    t = _table(P=700)
    spec = {"label": "l", "method": "loglinear", "fit": {"temperature": 1.0},
            "variant": "calibrated"}
    one = fit_method(spec, t)
    monkeypatch.setattr(fitting, "MAX_CHUNK", 64)
    many = fit_method(spec, t)
    assert many.calib_nll == pytest.approx(one.calib_nll, abs=1e-6)


def test_a_warm_start_with_a_positive_parameter_at_0_is_used():
    """Issue 37: a fit whose phase.scale ran off to 0 (its log coordinate below
    float32's range) started the next fit at log(0) = -inf: RuntimeWarnings, NaN steps,
    one iteration and the warm values returned unmoved. Floored at float32's smallest
    normal, the start is finite, the same function, and L-BFGS moves from it. (Unbounded
    here: with a box, FitSettings.param_range, the start is clipped to the box instead.)"""
    import warnings

    from brf.eval import fitting
    t = _table(P=600)
    spec = MethodSpec("b", "born", phase="token_tanh",
                      fit={"phase.scale": 1.0, "phase.rate": 1.0, "phase.offset": [0.0, 0.5]})
    warm = Fitted("b", "born", {"phase.scale": 0.0, "phase.rate": 1.0,
                                "phase.offset": [0.0, 0.5], "phase": "token_tanh"},
                  np.array([0.5, 0.5]), 0.0, {"converged": True})
    warm = dataclasses.replace(warm, calib_nll=float(np.mean(evaluate(warm, t)["nll"])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning fails the test
        (x0,) = fitting._Problem(spec, t, FitSettings(param_range=0)).starts(warm, [])
        f = fit_method(spec, t, warm=warm, settings=FitSettings(param_range=0))
    assert np.isfinite(x0).all()
    assert np.exp(np.float32(x0.min())) > 0  # floored at a float32 normal, not rounded to 0
    assert f.info["converged"] and f.info["iterations"] > 1
    assert f.calib_nll < warm.calib_nll - 1e-3
    assert np.abs(np.asarray(f.params["phase.offset"]) - [0.0, 0.5]).max() > 0.1
    # The floored start is the warm fit's function: the same NLL (float32 resolution).
    at_start = fitting._Problem(spec, t, FitSettings(param_range=0))
    assert at_start.value({}, x0, at_start.data()) - float(np.mean(t.offset)) == pytest.approx(
        warm.calib_nll, abs=1e-6)


def _two_optima_table(seed=6, P=600, E=6):
    """Two members, the second a noisy copy of the first, gold drawn near their mean: the
    per-token Born row with phases scale * (distance to the top logit) has two optima in
    its scale, near 0.21 and near 3.6 (found by the scan in the test below)."""
    rng = np.random.default_rng(seed)
    a = _log_softmax(rng.normal(size=(P, E)) * 2.0)
    b = _log_softmax(a + rng.normal(size=(P, E)) * 1.5)
    true = _log_softmax(0.5 * a + 0.5 * b + rng.normal(size=(P, E)))
    gold = np.array([rng.choice(E, p=np.exp(r)) for r in true])
    logp = np.stack([a, b], 1).astype(np.float32)
    return EventTable(logp, gold, np.ones((P, 2), np.float32), np.ones(P, np.int64),
                      np.arange(P) // 50)


_SCALE_SPEC = MethodSpec("x", "born", fit={"phase.scale": 3.0}, fixed={"phase.offset": 0.0},
                         phase="token_linear", fit_weights=False)


def test_a_single_start_ends_in_the_worse_of_two_optima_and_the_starts_find_the_better():
    """A dense scan of the planted row's NLL over its scale's whole box finds two basins,
    0.16 nats apart; from its initial scale (3.0) a single start ends in the worse one,
    and the fit's random starts reach the better one (within 1e-4 of the scan's minimum,
    refined by scipy's bounded scalar minimiser)."""
    t = _two_optima_table()

    def nll(log_scale):
        f = Fitted("x", "born", {"phase": "token_linear", "phase.scale": float(np.exp(log_scale)),
                                 "phase.offset": 0.0}, np.array([0.5, 0.5]), 0.0)
        return float(np.mean(evaluate(f, t)["nll"]))

    grid = np.linspace(np.log(1e-3), np.log(1e3), 240)
    values = np.array([nll(x) for x in grid])
    minima = [i for i in range(1, len(grid) - 1)
              if values[i] < values[i - 1] and values[i] < values[i + 1]]
    assert len(minima) >= 2
    i = int(np.argmin(values))
    best = optimize.minimize_scalar(nll, bounds=(grid[i - 1], grid[i + 1]),
                                    method="bounded").fun
    single = fit_method(_SCALE_SPEC, t, settings=FitSettings(starts=0))
    several = fit_method(_SCALE_SPEC, t)
    assert single.calib_nll > best + 0.1
    assert several.calib_nll <= best + 1e-4
    assert several.info["starts"] == FitSettings().starts + 1
    assert several.info["runner_up"] >= several.calib_nll


def test_random_starts_depend_on_the_spec_alone():
    """A refit starts from the same points whatever the table or the perturbation; another
    spec from others."""
    from brf.eval import fitting
    t, u = _two_optima_table(), _two_optima_table(seed=7)
    a = fitting._Problem(_SCALE_SPEC, t, FitSettings()).random_starts(5, 0)
    b = fitting._Problem(_SCALE_SPEC, u, FitSettings(perturb="ulp+order")).random_starts(5, 0)
    other = dataclasses.replace(_SCALE_SPEC, label="y")
    c = fitting._Problem(other, t, FitSettings()).random_starts(5, 0)
    assert len(a) == 5 and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not any(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("perturb", ["order", "ulp", "chunk", "sincos"])
def test_perturbations_change_the_objective_in_its_last_bits_only(perturb):
    """Each perturbation moves a calibrated per-token Born row's NLL and gradient at a
    fixed point by float32 rounding only (the ulp nudge and XLA's sin and cos move the
    value or the gradient at all)."""
    from brf.eval import fitting
    t = _table()
    spec = MethodSpec("b", "born", fit={"phase.scale": 1.5, "phase.rate": 0.5,
                                        "phase.offset": [0.0, 0.5]},
                      phase="token_tanh", variant="calibrated")
    x = None
    out = {}
    for p in ("", perturb):
        problem = fitting._Problem(spec, t, FitSettings(perturb=p))
        if x is None:
            x = problem.layout.initial + np.random.default_rng(0).normal(
                0.0, 0.3, problem.layout.size)
        out[p] = problem.objective({}, problem.data())(x)
    (v0, g0), (v1, g1) = out[""], out[perturb]
    assert abs(v1 - v0) <= 2e-6 * abs(v0)
    np.testing.assert_allclose(g1, g0, rtol=0, atol=1e-4 * max(1.0, np.abs(g0).max()))
    if perturb in ("ulp", "sincos"):  # they move something (a chunk's float32 sum
        assert v1 != v0 or not np.array_equal(g1, g0)  # may round the value back)


_PERTURBED = "order+ulp+sincos"


@pytest.mark.parametrize("spec", [
    MethodSpec("l", "loglinear", fit={"temperature": 1.0}, variant="calibrated"),
    MethodSpec("r", "routing", grid={"criterion": ["max_prob", "gap"]}, fit_weights=False,
               variant="calibrated")], ids=["loglinear", "routing"])
def test_fits_repeat_under_a_perturbation_of_the_last_bits(spec):
    """A smooth row and a piecewise row (routing, whose choice of member a temperature
    flips) end within FIT_TOLERANCE of their unperturbed fits when refitted with the
    positions reordered, the table moved by ulps and XLA's sin and cos."""
    from brf.eval.fitting import FIT_TOLERANCE
    t = _table()
    a = fit_method(spec, t)
    b = fit_method(spec, t, settings=FitSettings(perturb=_PERTURBED))
    assert abs(a.calib_nll - b.calib_nll) <= FIT_TOLERANCE, spec.label


def test_a_calibrated_born_row_repeats_and_reports_its_ends():
    """A calibrated per-token Born row (six free coordinates: the members' temperatures
    all the way through, the fused one, tanh's slope and ceiling, a phase difference and
    a weight) ends within FIT_TOLERANCE of its unperturbed fit when refitted with the
    positions reordered, the table moved by ulps and XLA's sin and cos, at the study's
    stages; and the fit's census lists its distinct ends, lowest first, the fit's own
    first, with the parameters of those within FIT_NEAR of it, each of which is its
    calibration NLL on the table."""
    from brf.eval.fitting import FIT_NEAR, FIT_TOLERANCE
    t = _table()
    spec = MethodSpec("b", "born", fit={"phase.scale": 1.5, "phase.rate": 0.5,
                                        "phase.offset": [0.0, 0.5]},
                      phase="token_tanh", variant="calibrated")
    a = fit_method(spec, t)
    b = fit_method(spec, t, settings=FitSettings(perturb=_PERTURBED))
    assert abs(a.calib_nll - b.calib_nll) <= FIT_TOLERANCE
    ends = a.info["ends"]
    assert ends[0] == pytest.approx(a.calib_nll, abs=1e-12) and ends == sorted(ends)
    assert a.info["near"], "this table's row has other ends within FIT_NEAR"
    for e in a.info["near"]:
        assert 0 <= e["calib_nll"] - a.calib_nll <= FIT_NEAR
        other = Fitted("b", "born", e["params"], np.asarray(e["weights"]), e["calib_nll"])
        assert np.mean(evaluate(other, t)["nll"]) == pytest.approx(e["calib_nll"], abs=2e-6)


@pytest.mark.parametrize("source,target", [("constant", "tanh"), ("tanh", "sigmoid"),
                                           ("constant", "token_log1p")])
def test_a_born_row_starts_where_the_fit_of_a_map_it_contains_ended(source, target):
    """The study's second pass starts each calibrated Born row from the fits of the maps
    its own contains (brf.fusion.phase.embed, via analysis._nested_start): that start's
    calibration NLL, as the larger row, is the smaller row's fit (within the fits'
    tolerance: constant -> tanh puts the scale on its box's bound, 1e-3), so the larger
    family never ends worse than the one it contains."""
    from brf.eval.analysis import _nested_start
    from brf.eval.fitting import FIT_TOLERANCE, _Problem
    t = _table()
    curves = {"constant": {}, "tanh": {"phase.scale": 1.0, "phase.rate": 1.0},
              "sigmoid": {"phase.scale": 3.0, "phase.rate": 1.0, "phase.center": 0.0},
              "token_log1p": {"phase.scale": 1.0, "phase.rate": 1.0}}
    spec = lambda m: MethodSpec(f"born {m}", "born", phase=m, variant="calibrated",  # noqa: E731
                                fit={**curves[m], "phase.offset": [0.0, 0.5]})
    # (a fit whose rate ends above half its box cannot be transcribed exactly: the
    # sigmoid's rate 2r is clipped; the every-position fit here ends inside it)
    small = fit_method(spec(source), t, settings=FitSettings(starts=2, screen_positions=0,
                                                             subsample=0))
    start = _nested_start(spec(target), small)
    problem = _Problem(spec(target), t, FitSettings())
    (x,) = problem.starts(None, [start])[1:]
    value = problem.value({}, x, problem.data()) - float(np.mean(t.offset))
    assert abs(value - small.calib_nll) <= FIT_TOLERANCE
    assert _nested_start(spec(source), fit_method(spec(target), t,
                                                  settings=FitSettings(starts=0))) is None


def test_no_born_row_ends_above_a_row_its_map_contains():
    """The study's last step (analysis._nesting_pass): a calibrated Born row that ended
    above a row whose map its own contains (here a per-token tanh row stopped after two
    iterations, above the constant row) is fitted again from that row's fit and ends no
    higher than it; the row it came from is named, its own end joins its census where
    within FIT_NEAR; a row with nothing lower below it is kept as it was; proposed rows
    are left alone."""
    from brf.eval.analysis import _nesting_pass
    from brf.eval.fitting import FIT_NEAR, FIT_TOLERANCE
    t = _table()
    const = MethodSpec("born constant [calibrated]", "born", phase="constant",
                       variant="calibrated", role="brf", fit={"phase.offset": [0.0, 0.5]})
    tok = MethodSpec("born token_tanh [calibrated]", "born", phase="token_tanh",
                     variant="calibrated", role="brf",
                     fit={"phase.scale": 1.5, "phase.rate": 0.5, "phase.offset": [0.0, 0.5]})
    prop = dataclasses.replace(tok, label="born token_tanh", variant="proposed")
    quick = FitSettings(starts=0, screen_positions=0, subsample=0)
    c = fit_method(const, t, settings=quick)
    # a fit that stopped early: the row's own fit with its fused temperature tripled
    good = fit_method(tok, t, settings=quick)
    poor = dataclasses.replace(good, params={
        **good.params, "calib.temperature": 3.0 * good.params["calib.temperature"]})
    nll = float(np.mean(evaluate(poor, t)["nll"]))
    poor = dataclasses.replace(poor, calib_nll=nll, info={"ends": [nll], "near": []})
    assert poor.calib_nll > c.calib_nll + 10 * FIT_TOLERANCE  # the case the step is for
    mark = lambda f: dataclasses.replace(f, info={**f.info, "nested": None})  # noqa: E731
    out = _nesting_pass([const, tok, prop], [mark(c), mark(poor), mark(poor)], t, quick,
                        None, [])
    assert out[1].calib_nll <= c.calib_nll + FIT_TOLERANCE
    assert out[1].info["nested"] == const.label
    near = [e["calib_nll"] for e in out[1].info["near"]]
    assert (poor.calib_nll - out[1].calib_nll <= FIT_NEAR) == (poor.calib_nll in near)
    assert out[0].calib_nll == c.calib_nll and out[0].info["nested"] == ""
    assert out[2] is not None and out[2].info["nested"] is None  # proposed: untouched
    # the step ran: a cached row (its "nested" set) is not fitted again
    again = _nesting_pass([const, tok], [out[0], poor], t, quick, None, [])
    assert again[1] is poor


def test_an_infimum_at_zero_temperature_ends_on_the_bound():
    """Members that always rank the gold first: a log-linear pool's NLL falls as its
    temperature falls, all the way to 0 (the infimum, 0 nats, is not attained). The fit
    heads for the box's bound 1/param_range and ends converged within FIT_TOLERANCE of
    the infimum, where a refit under other last bits ends too."""
    from brf.eval.fitting import FIT_TOLERANCE
    P, E = 400, 5
    rng = np.random.default_rng(3)
    x = rng.normal(size=(P, 2, E))
    gold = rng.integers(0, E, P)
    x[np.arange(P), :, gold] = x.max(-1) + 1.0
    t = EventTable(_log_softmax(x).astype(np.float32), gold, np.ones((P, 2), np.float32),
                   np.ones(P, np.int64), np.arange(P) // 50)
    spec = MethodSpec("l", "loglinear", fit={"temperature": 1.0}, fit_weights=False)
    f = fit_method(spec, t, settings=FitSettings(param_range=100.0))
    g = fit_method(spec, t, settings=FitSettings(param_range=100.0, perturb="ulp+order"))
    assert 0.01 * (1 - 1e-6) <= f.params["temperature"] < 0.1
    assert f.info["converged"] and 0.0 <= f.calib_nll <= FIT_TOLERANCE
    assert g.calib_nll == pytest.approx(f.calib_nll, abs=FIT_TOLERANCE)


def test_compass_search_crosses_steps_that_stop_lbfgs():
    """On a staircase (the value constant between jumps, its gradient 0) L-BFGS cannot
    move; compass search walks down to the step holding the minimum, the same from
    either side."""
    from brf.eval import compass
    c = np.array([1.3, -0.7])
    stairs = lambda x: (float(np.sum(np.floor(4 * np.abs(x - c)) ** 2)), np.zeros(2))  # noqa
    stuck = lbfgs.minimize(stairs, np.zeros(2), max_iter=50, ftol=1e-8, gtol=1e-8, history=5,
                           max_step=1.0)
    assert stuck.value == stairs(np.zeros(2))[0]
    for x0 in (np.zeros(2), np.array([3.0, -3.0])):
        r = compass.minimize(stairs, x0, step=0.5, min_step=1e-3, max_evals=500)
        assert r.value == 0.0 and np.all(np.abs(r.x - c) < 0.25)


def test_lbfgs_reaches_an_optimum_on_the_bound_exactly():
    """A bounded coordinate whose optimum lies beyond its bound ends on the bound (held
    there), the free one at its own optimum; the same as scipy's L-BFGS-B."""
    def fun(x):
        f = (x[0] - 3.0) ** 2 + (x[1] + 0.5) ** 2 + 0.5 * x[0] * x[1]
        return f, np.array([2 * (x[0] - 3.0) + 0.5 * x[1], 2 * (x[1] + 0.5) + 0.5 * x[0]])
    lo, hi = np.array([-1.0, -np.inf]), np.array([1.0, np.inf])
    r = lbfgs.minimize(fun, np.array([0.0, 0.0]), max_iter=100, ftol=1e-12, gtol=1e-8,
                       history=10, max_step=1.0, lower=lo, upper=hi)
    ref = optimize.minimize(fun, [0.0, 0.0], jac=True, method="L-BFGS-B",
                            bounds=[(-1.0, 1.0), (None, None)])
    assert r.converged and r.x[0] == 1.0
    np.testing.assert_allclose(r.x, ref.x, atol=1e-6)


def test_a_hessian_start_takes_newton_steps():
    """Given the Hessian of a quadratic whose scales differ 10^6-fold, L-BFGS's first
    step is the Newton step (the minimiser at once); without it, dozens of steps."""
    A = np.diag([1e4, 1.0, 1e-2]) + 0.1 * np.ones((3, 3))
    b = np.array([1.0, 2.0, 3.0])
    fun = lambda x: (0.5 * x @ A @ x - b @ x, A @ x - b)
    args = dict(max_iter=500, ftol=1e-14, gtol=1e-9, history=10, max_step=1e3)
    plain = lbfgs.minimize(fun, np.zeros(3), **args)
    newton = lbfgs.minimize(fun, np.zeros(3), hessian=A, **args)
    np.testing.assert_allclose(newton.x, np.linalg.solve(A, b), rtol=1e-9)
    assert newton.iterations <= 2 < 10 < plain.iterations


def test_fisher_information_is_the_mean_outer_product_of_position_gradients():
    """The preconditioner's Fisher information of a linear pool's weight logit equals
    a float64 NumPy one from the closed-form gradient of each position's NLL,
    -s(1-s)(p1 - p0)/q with s = sigmoid(z), q = (1-s) p0 + s p1 (plus its ridge)."""
    from brf.eval.fitting import FISHER_RIDGE, FitSettings, MethodSpec, _Problem
    t = _table(P=700)
    problem = _Problem(MethodSpec.coerce({"label": "lin", "method": "linear"}), t,
                       FitSettings())
    z = 0.4
    got = problem.fisher({}, np.array([z]), problem.data())
    p = np.exp(t.logp.astype(np.float64)[np.arange(t.n_positions), :, t.gold])  # [P, 2]
    s = 1 / (1 + np.exp(-z))
    q = (1 - s) * p[:, 0] + s * p[:, 1]
    g = -s * (1 - s) * (p[:, 1] - p[:, 0]) / q
    want = np.mean(g * g) * (1 + 2 * FISHER_RIDGE)
    assert got.shape == (1, 1)
    assert got[0, 0] == pytest.approx(want, rel=1e-4)


def test_a_multi_start_fit_never_ends_above_its_first_start_alone():
    """On 2,600 positions of Hamlet's calibration table (the default pair, token level:
    tests/data/first_start_table.npz), the sampled screen ranks the basin the first
    start reaches below four others, which end 2.7e-4 nats higher; the first start's
    run is carried through every cut, so the fit ends no higher than that start alone
    (starts=0) reaches."""
    import os
    from brf.event_table import EventTable
    d = np.load(os.path.join(os.path.dirname(__file__), "data", "first_start_table.npz"))
    table = EventTable(*(d[f] if f in d else None for f in EventTable._fields))
    spec = MethodSpec("born token_tanh", "born", phase="token_tanh",
                      fit={"phase.scale": 1.5, "phase.rate": 0.5, "phase.offset": [0.0, 0.5]})
    alone = fit_method(spec, table, settings=FitSettings(starts=0)).calib_nll
    full = fit_method(spec, table, settings=FitSettings()).calib_nll
    assert full <= alone + 1e-6, (full, alone)


def test_the_first_start_is_carried_in_a_slot_of_its_own():
    """A cut keeps the ``keep`` lowest distinct runs other than the first start's, and
    that run besides: where the first run ranks among the lowest it must not push out
    a run the cut would have kept without it (that run could end lowest later), and
    where a kept run ends in its basin it is not carried twice."""
    from brf.eval.fitting import _SAME_END, _carry_first, _lowest_distinct, _Run

    def run(order, value, x):
        return _Run(0, np.asarray([x], np.float64), value, [], True, order)

    out = [run(0, 1.0, 0.0), run(1, 1.1, 1.0), run(2, 1.2, 2.0), run(3, 1.3, 3.0)]
    kept = _carry_first(out, 2)
    assert [r.order for r in kept] == [0, 1, 2]  # sorted by value, the first on top
    assert {r.order for r in _lowest_distinct(out, 2)} <= {r.order for r in kept}
    low = [run(0, 1.25, 0.0), run(1, 1.1, 1.0), run(2, 1.2, 2.0), run(3, 1.3, 3.0)]
    assert [r.order for r in _carry_first(low, 2)] == [1, 2, 0]  # dropped by the cut
    same = [run(0, 1.25, 0.0), run(1, 1.1, 0.5 * _SAME_END), run(2, 1.2, 2.0)]
    assert [r.order for r in _carry_first(same, 2)] == [1, 2]  # its basin is kept
