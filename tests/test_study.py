"""The study's analyses on synthetic tables whose answers are known.

Calibrated variants against float64 NumPy; PackLLM context weights against a
naive loop; a planted miscalibration and a planted high-entropy gain are
recovered; the pooled (stratified block) bootstrap covers a known difference
at its nominal rate.
"""

import math

import numpy as np
import pytest

from brf.eval import forking, stats
from brf.event_table import EventTable
from brf.eval.fitting import Fitted, context_nll, evaluate, fit_method


def _log_softmax(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _table(logp_PxNxE, gold, segment=None):
    P, n, _ = logp_PxNxE.shape
    return EventTable(logp_PxNxE.astype(np.float32), gold.astype(np.int32),
                      np.ones((P, n), np.float32), np.ones(P, np.int32),
                      np.zeros(P, np.int32) if segment is None else segment.astype(np.int32))


def test_calibrated_linear_and_loglinear_match_float64_numpy():
    rng = np.random.default_rng(0)
    P, n, E = 50, 3, 9
    x = rng.normal(size=(P, n, E)) * 2.0
    x[:, 1, :2] = -np.inf  # events member 1 gives no mass
    logp = _log_softmax(x)
    gold = rng.integers(2, E, P)
    t = _table(logp, gold)
    w = np.array([0.2, 0.5, 0.3])
    tm = np.array([0.7, 1.6, 2.5])
    post = 1.3
    params = {"calib.temperature": post, "calib.member_temperature": tm.tolist()}
    got = evaluate(Fitted("x", "linear", params, w, 0.0), t)["nll"]
    lp = _log_softmax(logp / tm[None, :, None])
    q = np.einsum("n,pne->pe", w, np.exp(lp))
    lq = _log_softmax(np.log(q) / post)
    np.testing.assert_allclose(got, -lq[np.arange(P), gold], rtol=1e-5, atol=1e-5)
    got = evaluate(Fitted("x", "loglinear", {**params, "temperature": 0.8}, w, 0.0), t)["nll"]
    lq = _log_softmax(_log_softmax(np.einsum("n,pne->pe", w, lp) / 0.8) / post)
    np.testing.assert_allclose(got, -lq[np.arange(P), gold], rtol=1e-5, atol=1e-5)


def test_calibrated_variant_recovers_a_planted_member_temperature():
    """Both members are overconfident (sharpened 2.5x; member 1 also noisy): the
    calibrated linear pool tempers them back and beats the variant as proposed."""
    rng = np.random.default_rng(1)
    P, E = 6000, 12
    true = _log_softmax(rng.normal(size=(P, E)) * 1.5)
    gold = np.array([rng.choice(E, p=np.exp(r)) for r in true])
    noisy = true + rng.normal(size=(P, E))
    noisy[:, -1] = -np.inf  # an event member 1 cannot express (as in real event tables)
    logp = np.stack([_log_softmax(true * 2.5), _log_softmax(noisy * 2.5)], axis=1)
    t = _table(logp, gold)
    spec = {"label": "lin", "method": "linear"}
    proposed = fit_method(spec, t)
    calibrated = fit_method({**spec, "variant": "calibrated"}, t)
    assert calibrated.calib_nll < proposed.calib_nll - 0.05
    # The fit is at least as good as the planted truth (members tempered back by 2.5)...
    truth = Fitted("t", "linear", {"calib.temperature": 1.0,
                                   "calib.member_temperature": [2.5, 2.5]},
                   calibrated.weights, 0.0)
    assert calibrated.calib_nll <= np.mean(evaluate(truth, t)["nll"]) + 1e-4
    # ...and where one member carries the pool, only the product of its temperature and
    # the post-fusion one is identified: it is the planted 2.5.
    top = int(np.argmax(calibrated.weights))
    if calibrated.weights[top] > 0.99:
        eff = (calibrated.params["calib.member_temperature"][top]
               * calibrated.params["calib.temperature"])
        assert eff == pytest.approx(2.5, rel=0.08)
    # One member alone: the post-fusion temperature recovers the planted 2.5.
    one = EventTable(t.logp[:, :1], t.gold, t.gap[:, :1], t.gold_bytes, t.segment)
    alone = fit_method({**spec, "variant": "calibrated"}, one)
    assert alone.params["calib.temperature"] == pytest.approx(2.5, rel=0.08)
    with pytest.raises(ValueError, match="unknown method variant"):
        fit_method({**spec, "variant": "tuned"}, t)


def test_context_nll_is_the_running_mean_within_each_segment():
    rng = np.random.default_rng(2)
    P, n, E = 40, 2, 5
    logp = _log_softmax(rng.normal(size=(P, n, E)))
    gold = rng.integers(0, E, P)
    seg = np.repeat([0, 1, 2], [15, 5, 20])
    got = context_nll(_table(logp, gold, seg))
    want = np.zeros((P, n))
    for p in range(P):
        prev = [q for q in range(p) if seg[q] == seg[p]]
        if prev:
            want[p] = -np.mean([logp[q, :, gold[q]] for q in prev], axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_perplexity_weighting_follows_the_member_that_fits_the_segment():
    """Segments alternate between texts member 0 predicts well and texts member 1
    predicts well; PackLLM context weights beat any fixed weights."""
    rng = np.random.default_rng(3)
    E, L = 10, 60
    rows, golds, segs = [], [], []
    for s in range(40):
        good = s % 2
        for _ in range(L):
            true = _log_softmax(rng.normal(size=E) * 2.0)
            g = rng.choice(E, p=np.exp(true))
            noise = _log_softmax(rng.normal(size=E) * 2.0)
            rows.append(np.stack([true, noise] if good == 0 else [noise, true]))
            golds.append(g)
            segs.append(s)
    t = _table(np.asarray(rows), np.asarray(golds), np.asarray(segs))
    fixed = fit_method({"label": "a", "method": "linear"}, t)
    packed = fit_method({"label": "b", "method": "linear", "weighting": "perplexity"}, t)
    assert packed.calib_nll < fixed.calib_nll - 0.1
    assert np.mean(evaluate(packed, t)["nll"]) == pytest.approx(packed.calib_nll, rel=1e-4)


def test_pooled_bootstrap_covers_a_known_difference_at_its_nominal_rate():
    """Three corpora of AR(1)-dependent differences with known means; the pooled
    estimate's target is the mean of the corpus means. 95% intervals cover it in
    about 95% of 300 simulations (the i.i.d. bootstrap would under-cover)."""
    rng = np.random.default_rng(4)
    mus, sizes, phi = [0.1, -0.05, 0.3], [1500, 900, 2000], 0.8
    target = float(np.mean(mus))
    cover, cover_iid = 0, 0
    sims = 300
    for k in range(sims):
        pairs = []
        for mu, n in zip(mus, sizes):
            e = np.empty(n)
            e[0] = rng.normal()
            for i in range(1, n):
                e[i] = phi * e[i - 1] + np.sqrt(1 - phi ** 2) * rng.normal()
            pairs.append((mu + e, np.zeros(n)))
        ci = stats.pooled_paired_bootstrap_ci(pairs, n_boot=400, rng=rng, block_size=40)
        cover += ci.ci_low <= target <= ci.ci_high
        ci1 = stats.pooled_paired_bootstrap_ci(pairs, n_boot=400, rng=rng, block_size=1)
        cover_iid += ci1.ci_low <= target <= ci1.ci_high
    assert 0.90 <= cover / sims <= 0.985, cover / sims
    assert cover_iid / sims < 0.75  # dependence ignored: far too narrow


def test_pooled_bootstrap_with_one_corpus_is_the_paired_bootstrap():
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=500), rng.normal(size=500)
    a = stats.pooled_paired_bootstrap_ci([(x, y)], n_boot=2000, rng=np.random.default_rng(7),
                                         block_size=16)
    b = stats.paired_bootstrap_ci(x, y, n_boot=2000, rng=np.random.default_rng(7),
                                  block_size=16)
    assert a.estimate == pytest.approx(b.estimate)
    assert (a.ci_low, a.ci_high) == pytest.approx((b.ci_low, b.ci_high))


def test_a_gain_planted_at_high_entropy_positions_is_recovered():
    rng = np.random.default_rng(6)
    P = 5000
    ent = rng.gamma(2.0, 1.0, P)
    ref = rng.normal(3.0, 1.0, P)
    top = ent >= np.quantile(ent, 0.8)
    method = ref - np.where(top, 0.5, 0.0) + rng.normal(0, 0.05, P)
    out = forking.gain_by_entropy(method, ref, ent, n_boot=200)
    assert out["top_share"] == pytest.approx(1.0, abs=0.05)
    assert out["mean_gain"][-1] == pytest.approx(0.5, abs=0.03)
    assert out["mean_gain"][-2] == pytest.approx(0.5, abs=0.03)
    assert all(abs(m) < 0.03 for m in out["mean_gain"][:8])
    assert all(lo <= m <= hi for m, (lo, hi) in zip(out["mean_gain"], out["ci"]))
    # Gating at the 80th percentile keeps (nearly) all of the gain and saves
    # 80% of the second member's calls (40% of all calls with two members).
    g = forking.gated_fusion(method, ref, ref, ent, np.quantile(ent, 0.8), 2)
    assert g["kept"] == pytest.approx(1.0, abs=0.02)
    assert g["calls_saved"] == pytest.approx(0.4, abs=0.01)


def test_member_entropy_matches_numpy():
    rng = np.random.default_rng(8)
    logp = _log_softmax(rng.normal(size=(7, 2, 6)))
    logp[0, 0, 3] = -np.inf
    logp[0, 0] = _log_softmax(logp[0, 0])
    t = _table(logp, np.zeros(7, int))
    from scipy.stats import entropy
    want = entropy(np.exp(logp), axis=-1)
    np.testing.assert_allclose(forking.member_entropy(t), want, rtol=1e-5)


def test_linked_phases_and_a_planted_tightening_are_recovered():
    """Members whose phases are linked by construction (member 2's gap is member 1's
    plus noise) reject the permutation null; the paired R̄ change between two runs
    with a planted tighter link is recovered with a CI that excludes 0."""
    from brf.eval import hypotheses
    from brf.eval.compare import rbar_change
    rng = np.random.default_rng(9)
    P, E = 3000, 6
    gap1 = rng.gamma(2.0, 1.0, P)
    loose = np.stack([gap1, np.abs(gap1 + rng.normal(0, 1.5, P))], 1)
    tight = np.stack([gap1, np.abs(gap1 + rng.normal(0, 0.3, P))], 1)
    lp = _log_softmax(rng.normal(size=(P, 2, E)))
    out = []
    for gaps in (loose, tight):
        t = EventTable(lp.astype(np.float32), np.zeros(P, np.int32), gaps.astype(np.float32),
                       np.ones(P, np.int32), np.zeros(P, np.int32))
        out.append(hypotheses.phase_coherence(t, {"tanh": "tanh(scale=1.5, rate=0.5)"},
                                              n_perm=200)[0])
    for r in out:  # linked by construction: beyond the permutation null
        assert r["permutation_p"] < 0.01
        assert r["mean_resultant_length"] > r["null_mean_resultant_length"]
    ch = rbar_change(out[0]["diffs"], out[1]["diffs"], n_boot=300)
    want = out[1]["mean_resultant_length"] - out[0]["mean_resultant_length"]
    assert ch.estimate == pytest.approx(want, abs=1e-9) and want > 0
    assert ch.ci[0] > 0  # the tightening is detected
    same = rbar_change(out[0]["diffs"], out[0]["diffs"], n_boot=100)
    assert same.estimate == 0 and same.ci == (0.0, 0.0)


def test_per_token_phases_are_paired_on_the_positions_both_tables_list():
    """A per-token map is read only where the gold is listed; two tables of the same
    positions that list different golds are compared on the rows both list."""
    from brf.eval import hypotheses
    from brf.eval.compare import paired_diffs
    rng = np.random.default_rng(3)
    P, E = 40, 5
    lp = _log_softmax(rng.normal(size=(P, 2, E))).astype(np.float32)
    gold = rng.integers(0, E - 1, P).astype(np.int32)
    rows = []
    for unlisted in ([3, 7, 8], [7, 20]):
        off = np.zeros(P)
        off[unlisted] = -1.5
        t = EventTable(lp, gold, np.ones((P, 2), np.float32), np.ones(P, np.int32),
                       np.zeros(P, np.int32), gold_offset=off)
        r = hypotheses.phase_coherence(t, {"tt": "token_tanh(scale=1.5, rate=0.5)"},
                                       n_perm=20)[0]
        want = np.setdiff1d(np.arange(P), unlisted)
        np.testing.assert_array_equal(r["positions"], want)
        assert r["n"] == len(want) == len(r["diffs"])
        rows.append(r)
    a, b = paired_diffs(*rows)
    both = np.setdiff1d(np.arange(P), [3, 7, 8, 20])
    assert len(a) == len(b) == len(both)
    # the same table under both: the paired differences are the same numbers
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, rows[0]["diffs"][np.isin(rows[0]["positions"], both)])


def _section(brf_row: str, ci: list, pooled_ci: list) -> dict:
    """A study report's level section with one corpus ('c') and its pooled comparison."""
    d = (ci[0] + ci[1]) / 2
    return {"per_corpus": {"c": {"nll_comparison": {"calibrated": {
                "brf": brf_row, "baseline": "linear", "mean_difference": d, "ci": ci}}}},
            "pooled": {"calibrated": {"mean_difference": sum(pooled_ci) / 2, "ci": pooled_ci}},
            "pooled_fair": {}, "prompts": {}}


def test_run_moves_names_the_verdicts_whose_answer_or_rows_changed():
    """Two runs' reports: a verdict moves when its CI moves to another side of 0; one
    whose CI stays while BRF's row changes holds, with its rows changed; each level
    both runs have is compared, in its own keys."""
    from brf.eval.compare import run_moves
    before = {**_section("born tanh", [-0.02, -0.01], [-0.01, 0.01]),
              "bytes": _section("born tanh", [-0.002, -0.001], [-0.001, 0.001])}
    after = {**_section("born tanh", [-0.02, 0.01], [-0.01, 0.02]),
             "bytes": _section("born log1p", [-0.003, -0.001], [0.0005, 0.001])}
    moves = run_moves(before, after)
    assert list(moves) == ["co-aligned: c: nll [calibrated]",
                           "co-aligned: pooled: nll [calibrated]",
                           "every byte: c: nll [calibrated]",
                           "every byte: pooled: nll [calibrated]"]
    assert [k for k, m in moves.items() if m.moved] == [
        "co-aligned: c: nll [calibrated]", "every byte: pooled: nll [calibrated]"]
    m = moves["co-aligned: c: nll [calibrated]"]
    assert (m.before.answer, m.after.answer) == ("BRF better than the best baseline",
                                                 "not distinguishable")
    assert m.before.value == pytest.approx(-0.015) and m.after.value == pytest.approx(-0.005)
    held = moves["every byte: c: nll [calibrated]"]
    assert not held.moved and held.rows_changed
    assert held.after.rows == ("born log1p", "linear")
    assert not any(m.moved or m.rows_changed for m in run_moves(before, before).values())
    # a run without the byte level compares the co-aligned level alone
    assert all(k.startswith("co-aligned") for k in run_moves(before, {**after, "bytes": None}))


def test_not_distinguishable_for_the_fit_is_the_same_call_as_not_distinguishable():
    """A verdict that one run calls "not distinguishable" and the other "not
    distinguishable (fit)" (its bootstrap interval alone clears 0, widened by the rows'
    fit spreads it does not) has not moved: neither run calls a difference; one that
    goes from either to a called difference has."""
    from brf.eval.compare import run_moves, same_call
    plain = _section("born tanh", [-0.02, 0.01], [-0.01, 0.01])
    fit = _section("born tanh", [-0.02, 0.01], [-0.01, 0.01])
    fit["per_corpus"]["c"]["nll_comparison"]["calibrated"]["statistical_ci"] = [-0.02, -0.01]
    moves = run_moves(plain, fit)
    m = moves["co-aligned: c: nll [calibrated]"]
    assert (m.before.answer, m.after.answer) == ("not distinguishable",
                                                 "not distinguishable (fit)")
    assert not m.moved
    called = _section("born tanh", [-0.02, -0.01], [-0.01, 0.01])
    assert run_moves(fit, called)["co-aligned: c: nll [calibrated]"].moved
    assert same_call("not distinguishable (fit)", "not distinguishable")
    assert not same_call("not distinguishable (fit)", "BRF better than the best baseline")


def _checked(section: dict, refit: str, study_refit: str) -> dict:
    """``section`` (a one-corpus level section, :func:`_section`) as a run whose stability
    check answered the corpus's verdict ``refit`` and the pooled one ``study_refit``."""
    from brf.eval import study_report
    rep = {**section["per_corpus"]["c"], "methods": [],
           "stability": {"answers": {"nll [calibrated]": {
               "run": "?", "refit": refit, "tied_fragile": False}}, "moved": []}}
    return {**section, "per_corpus": {"c": study_report.brief(rep)},
            "stability": {"study": {"pooled: nll [calibrated]": {
                "run": "?", "refit": study_refit, "tied_fragile": False}}}}


def test_a_verdict_its_own_stability_check_moved_is_fragile_in_that_run():
    """Issue 70 item 2: the refit is the fits' other end, so its answer stands beside the
    run's; where the two differ the verdict is fragile in that run (per corpus, from the
    analysis's brief report; pooled, from the level's check), where they agree it
    stands, and 'not distinguishable (fit)' against 'not distinguishable' is no move. A
    verdict that moves between two runs is then warned of in the run whose check moved
    it."""
    from brf.eval import report
    from brf.eval.compare import REFIT, run_moves
    better, undecided = "BRF better than the best baseline", "not distinguishable"
    base = _section("born tanh", [-0.02, -0.01], [-0.02, -0.001])
    run = _checked(base, undecided, "BRF worse")
    assert "stability" not in run["per_corpus"]["c"]  # the brief keeps the answers only
    assert run["per_corpus"]["c"]["refit_answers"] == {"nll [calibrated]": undecided}
    other = _section("born tanh", [-0.02, 0.01], [-0.02, 0.001])
    moves = run_moves(run, other)
    m, p = moves["co-aligned: c: nll [calibrated]"], moves["co-aligned: pooled: nll [calibrated]"]
    assert m.moved and m.before.fragile and not m.after.fragile
    assert m.before.answer == better  # the run's own answer is still the one stated
    assert [a.rows for a in m.before.alternatives] == [(REFIT,)]
    assert p.moved and p.before.fragile
    held = run_moves(_checked(base, better, "BRF better"), other)
    assert not any(x.before.fragile for x in held.values())
    fit = run_moves(_checked(other, "not distinguishable (fit)", undecided), base)
    assert not any(x.before.fragile for x in fit.values())
    # without the check (an older report) nothing is added
    assert not run_moves(base, other)["co-aligned: c: nll [calibrated]"].before.fragile
    # the check's sentence names both answers of a moved verdict
    s = {"perturbation": "ulp", "tolerance": 1e-4, "refitted_rows": 3, "verdicts": 5,
         "largest_row_move": None, "rows_over_tolerance": [], "moved": ["nll [calibrated]"],
         "moved_untied": ["nll [calibrated]"],
         "answers": {"nll [calibrated]": {"run": better, "refit": undecided}}}
    line = report.stability_sentence(s)
    assert f"nll [calibrated]: {better}, refit: {undecided}" in line and "FRAGILE" in line
    assert undecided in report.refit_words(s, "nll [calibrated]", s["answers"])
    assert report.refit_words({**s, "moved": []}, "nll [calibrated]", s["answers"]) == ""
    # and the study's pooled sentence says so where the level's check moved it
    from brf.eval import study_report
    level = {"per_corpus": {}, "prompts": {}, "pooled_fair": {},
             "pooled": {"calibrated": {"mean_difference": -0.01, "ci": [-0.02, -0.001],
                                       "corpora": ["c"]}},
             "stability": {**s, "analyses": 1, "not_refitted": 0, "rows_over_tolerance": 0,
                           "moved": ["pooled: nll [calibrated]"], "moved_untied": [],
                           "study": {"pooled: nll [calibrated]": {"run": "BRF better",
                                                                  "refit": "BRF worse"}}}}
    said = study_report.verdicts(level)
    assert "FRAGILE under the stability check" in said["nll: pooled (calibrated)"]
    assert "refit" in said["stability"]


@pytest.mark.parametrize("controls", [True, False])
def test_the_fair_verdict_says_controls_only_when_they_ran(controls):
    """Issue 54: with --config.controls=False the pooled fair verdict still said
    '(controls included)'."""
    from brf.eval import study_report
    rep = {"per_corpus": {}, "pooled": {}, "prompts": {}, "config": {"controls": controls},
           "pooled_fair": {"calibrated": {"mean_difference": -0.1, "ci": [-0.2, -0.05],
                                          "corpora": ["a", "b"]}}}
    (line,) = study_report.verdicts(rep).values()
    assert ("controls included" in line) == controls, line
    assert "the best of every other row" in line


def _result(label, role, calib_nll, test_nll, variant="calibrated"):
    """A fitted row as the analysis holds it (a MethodResult), for the choice tests."""
    from brf.eval.analysis import MethodResult
    from brf.eval.fitting import MethodSpec
    spec = MethodSpec(label, "linear", role=role).in_variant(variant)
    f = Fitted(spec.label, "linear", {}, np.array([0.5, 0.5]), calib_nll)
    return MethodResult(spec, f, {"nll": float(np.mean(test_nll))}, np.asarray(test_nll))


@pytest.mark.parametrize("agree", [True, False])
def test_a_near_tie_is_fragile_when_its_rows_disagree_and_stands_when_they_agree(agree):
    """Two BRF rows 5e-5 nats apart on calibration (within the tie margin) and a third
    1e-3 behind: the comparison names the two, gives the answer with each, and the
    verdict stands when both beat the baseline on test, and is fragile (in the answer,
    the report's sentence and compare_fits' answers) when only the chosen one does."""
    import types

    from brf.eval import compare, report
    from brf.eval.analysis import TIE_MARGIN, comparisons, tied
    rng = np.random.default_rng(0)
    n = 3000
    base = 2.0 + rng.normal(0.0, 0.3, n)
    better = base - 0.05 + rng.normal(0.0, 0.01, n)
    rows = [_result("brf a", "brf", 1.00000, better),
            _result("brf b", "brf", 1.00005, better if agree else base + rng.normal(0, 0.01, n)),
            _result("brf c", "brf", 1.00100, base + 0.5),
            _result("base", "baseline", 1.1, base)]
    assert [r.label for r in tied(rows[:3])] == ["brf a [calibrated]", "brf b [calibrated]"]
    assert 5e-5 < TIE_MARGIN < 1e-3
    plan = types.SimpleNamespace(stats=types.SimpleNamespace(n_boot=300, seed=0))
    c = comparisons(plan, ["calibrated"], rows)["calibrated"]
    assert c.brf == "brf a [calibrated]" and c.tied[0] == ("brf a [calibrated]",
                                                            "brf b [calibrated]")
    assert [(a.brf, a.other) for a in c.alternatives] == [("brf b [calibrated]",
                                                             "base [calibrated]")]
    assert c.stands == agree
    d = c.as_dict()
    answer = compare.answers({"nll_comparison": {"calibrated": d}})["nll [calibrated]"]
    assert answer.answer == "BRF better than the best baseline"
    assert answer.fragile == (not agree)
    sentence = report.nll_sentence(d, "calibrated")
    assert ("FRAGILE" in sentence) == (not agree)
    assert ("the verdict stands" in sentence) == agree


def test_no_tie_gives_no_alternatives():
    """Rows apart by more than the margin: one chosen row, nothing else said."""
    import types

    from brf.eval import report
    from brf.eval.analysis import comparisons
    x = np.linspace(1.0, 2.0, 500)
    rows = [_result("a", "brf", 1.0, x - 0.1), _result("b", "brf", 1.01, x),
            _result("base", "baseline", 1.1, x)]
    plan = types.SimpleNamespace(stats=types.SimpleNamespace(n_boot=100, seed=0))
    c = comparisons(plan, ["calibrated"], rows)["calibrated"]
    assert c.alternatives == () and c.stands
    assert "tied" not in report.nll_sentence(c.as_dict(), "calibrated")


def _token_rows(calib):
    """Calibrated per-token BRF rows (label -> calibration NLL) as fitted results."""
    from brf.eval.analysis import MethodResult
    from brf.eval.fitting import MethodSpec
    rng = np.random.default_rng(1)
    out = []
    for name, c in calib.items():
        spec = MethodSpec(f"born {name}", "born", fit={"phase.scale": 1.0,
                                                        "phase.offset": [0.0, 0.5]},
                          phase=name, role="brf").in_variant("calibrated")
        nll = 2.0 + rng.normal(0.0, 0.3, 800)
        out.append(MethodResult(spec, Fitted(spec.label, "born", {}, np.array([0.5, 0.5]), c),
                                {"nll": float(nll.mean())}, nll))
    return out


def test_tied_per_token_rows_share_their_controls_once():
    """Tied per-token rows share controls (the capacity pool always; a linear map borrows
    the tanh curve): each is one row, under one label. Before, token_tanh and
    token_linear each brought a 'reshape tanh + linear pool' and the pool came once per
    row, so the report listed rows no reader could tell apart and the stability check,
    which pairs rows by label, paired them wrongly."""
    from brf.eval.analysis import control_specs
    rows = _token_rows({"token_tanh": 1.0, "token_linear": 1.00001, "token_log1p": 1.00002})
    specs = control_specs(rows, 2, ["calibrated"], seed=0)
    labels = [s.label for s in specs]
    assert len(labels) == len(set(labels)), labels
    assert sorted(labels) == sorted(
        f"{x} [calibrated]" for x in (
            "born token_tanh, phases shuffled", "born token_linear, phases shuffled",
            "born token_log1p, phases shuffled", "reshape tanh + linear pool",
            "reshape tanh + log-linear pool", "reshape log1p + linear pool",
            "reshape log1p + log-linear pool", "power mean, per-member exponents"))
    # the shared reshaping control starts where the best row's would: token_tanh's spec
    tanh = next(s for s in specs if s.label == "reshape tanh + linear pool [calibrated]")
    from brf.eval.controls import controls_for
    assert tanh == controls_for(rows[0].spec, 2)["reshape_linear"]


def test_a_chosen_per_token_row_is_not_read_off_controls_it_shares():
    """The stability check's refit can choose a per-token row whose controls the run did
    not fit. Its answer is 'controls not fitted', not read off the one control it shares
    with the fitted rows (the swarm's refit answered 'beats 1 of 1 controls' so)."""
    import types

    from brf.eval import compare, report
    from brf.eval.analysis import MethodResult, control_specs, fair_summary
    rows = _token_rows({"token_tanh": 1.0})
    rng = np.random.default_rng(2)
    for spec in control_specs(rows, 2, ["calibrated"], seed=0):  # token_tanh's four
        nll = 2.5 + rng.normal(0.0, 0.3, 800)
        rows.append(MethodResult(spec, Fitted(spec.label, spec.method, {},
                                              np.array([0.5, 0.5]), 1.1),
                                 {"nll": float(nll.mean())}, nll))
    plan = types.SimpleNamespace(stats=types.SimpleNamespace(n_boot=100, seed=0))
    run = fair_summary(plan, ["calibrated"], rows, 2)["calibrated"]
    assert len(run.controls) == 4 and run.per_token.label == "born token_tanh [calibrated]"
    # the refit: token_log1p now lowest, its controls never fitted
    refit = rows + _token_rows({"token_log1p": 0.99})
    c = fair_summary(plan, ["calibrated"], refit, 2)["calibrated"].as_dict()
    assert c["per_token"]["label"] == "born token_log1p [calibrated]"
    assert c["controls"] == []
    answer = compare.answers({"fair_summary": {"calibrated": c}})["controls [calibrated]"]
    assert answer.answer == "controls not fitted", answer
    assert "controls not fitted" in report.fair_sentence(c, "calibrated")


def test_the_check_refits_the_rows_in_reach_and_widens_it_when_a_row_moves_far():
    """The stability check refits the rows within its reach of a choice (every control
    too); a refit that moves a row by more than half the reach widens it to twice the
    move and refits the rows that brings in; a row beyond every reach keeps its run."""
    import dataclasses

    from brf.eval import stability
    x = np.zeros(10)
    rows = [_result("a", "brf", 1.000, x), _result("b", "brf", 1.015, x),
            _result("d", "brf", 1.030, x), _result("e", "brf", 1.100, x),
            _result("l", "baseline", 1.200, x), _result("l2", "baseline", 1.250, x),
            _result("c", "control", 1.500, x)]
    moves = {"b [calibrated]": -0.016}
    calls = []

    def fit(batch, earlier):
        calls.append(([m.label for m in batch], sorted(m.label for m in earlier)))
        return [dataclasses.replace(m, fitted=dataclasses.replace(
            m.fitted, calib_nll=m.calib_nll + moves.get(m.label, 0.0))) for m in batch]

    refit, reach = stability.refit_in_reach(rows, ["calibrated"], 0.02, fit)
    first = ["a [calibrated]", "b [calibrated]", "l [calibrated]", "c [calibrated]"]
    # b moved 0.016 > 0.02 / 2: the reach becomes 0.032 and brings d (0.030 up) in
    assert [c[0] for c in calls] == [first, ["d [calibrated]"]]
    assert reach == pytest.approx(0.032)
    assert sorted(refit) == sorted(first + ["d [calibrated]"])
    # the second batch's pool holds the first batch's refits and the rows left out
    assert calls[1][1] == sorted(first + ["e [calibrated]", "l2 [calibrated]"])
    assert refit["b [calibrated]"].calib_nll == pytest.approx(0.999)
    # small moves: one batch, the reach unchanged
    moves.clear()
    calls.clear()
    refit, reach = stability.refit_in_reach(rows, ["calibrated"], 0.02, fit)
    assert [c[0] for c in calls] == [first] and reach == 0.02
    # an infinite reach refits every row at once (the whole check)
    calls.clear()
    refit, _ = stability.refit_in_reach(rows, ["calibrated"], math.inf, fit)
    assert len(calls) == 1 and len(refit) == len(rows)


def test_a_tied_rows_cross_term_interval_does_not_depend_on_the_keys_computed():
    """The cross-term test of a tied row computes only ``rel`` (what its verdict reads);
    each key draws from its own stream, so that interval equals the chosen row's, and
    the AUROC is the brute-force gold-vs-competitor Mann-Whitney of the scores."""
    from brf.eval import hypotheses
    rng = np.random.default_rng(4)
    P, E = 300, 12
    logp = _log_softmax(rng.normal(0.0, 2.0, (P, 2, E)))
    gold = rng.integers(0, E, P)
    table = _table(logp, gold)
    f = Fitted("born tanh", "born", {"phase": "tanh"}, np.array([0.6, 0.4]), 0.0)
    full = hypotheses.cross_term_test(table, f, n_boot=200, seed=3)
    alone = hypotheses.cross_term_test(table, f, n_boot=200, seed=3, keys=("rel",))
    assert set(full) >= set(hypotheses.CROSS_TERM_KEYS) and "cross" not in alone
    assert alone["rel"] == full["rel"]
    s = hypotheses.cross_term_scores(table, f)
    d = s["gold_rel"][:, None] - s["comp_rel"][None, :]
    want = (np.sum(d > 0) + 0.5 * np.sum(d == 0)) / d.size
    assert full["rel"]["auroc"] == pytest.approx(want, abs=1e-12)
    assert full["rel"]["ci"][0] <= full["rel"]["auroc"] <= full["rel"]["ci"][1]
    with pytest.raises(ValueError, match="unknown cross-term key 'nope'"):
        hypotheses.cross_term_test(table, f, keys=("nope",))
