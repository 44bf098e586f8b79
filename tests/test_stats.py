"""Tests for brf.eval.stats against independent implementations.

References: astropy.stats.circstats (circmean, circvar, rayleightest), the
published pingouin.circ_rayleigh example (Zar's eq. 27.4), simulated null
distributions, scipy.stats.mannwhitneyu (AUROC = U / (n1 n2)) and
scipy.stats.bootstrap (percentile intervals). Every random draw is seeded,
so the tests are deterministic; the simulation checks use binomial 99.9%
intervals, so a correct implementation passes them for all but ~0.1% of
seed choices.
"""

import numpy as np
import pytest
from astropy.stats import circmean, circvar, rayleightest
from scipy import stats as sps

from brf.eval import stats


def _binom_bounds(n_trials, p, level=0.999):
    lo, hi = sps.binom.interval(level, n_trials, p)
    return int(lo), int(hi)


def _wrap(x):
    return (np.asarray(x) + np.pi) % (2 * np.pi) - np.pi


# ---------------------------------------------------------------------------
# Rayleigh test.
# ---------------------------------------------------------------------------


def test_rayleigh_known_answer_from_pingouin_docs():
    # pingouin.circ_rayleigh docs: z = 1.236, p = 0.304844 (Zar eq. 27.4).
    r = stats.rayleigh_test([0.785, 1.570, 3.141, 0.839, 5.934])
    assert r.n == 5
    assert round(r.z, 3) == 1.236
    assert round(r.p_value, 6) == 0.304844


@pytest.mark.parametrize("n,kappa", [(60, 0.0), (500, 0.5), (2000, 2.0),
                                     (20000, 0.01)])
def test_rayleigh_matches_astropy(n, kappa):
    rng = np.random.default_rng(n)
    theta = rng.vonmises(1.0, kappa, size=n) if kappa else rng.uniform(
        -np.pi, np.pi, size=n)
    r = stats.rayleigh_test(theta)
    np.testing.assert_allclose(r.mean_resultant_length, 1.0 - circvar(theta),
                               rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(_wrap(r.mean_direction - circmean(theta)), 0.0,
                               atol=1e-10)
    # For n >= 50 astropy's p-value is exactly exp(-z).
    p_astropy = rayleightest(theta)
    if p_astropy > 1e-300:
        np.testing.assert_allclose(r.z, -np.log(p_astropy), rtol=1e-10)
    # Zar's p = exp(-z) (1 + (2z - z²) / (4n) + O(1/n²)): within a few
    # percent of astropy's exp(-z) where z is moderate (the seeds give
    # z = 0.97 and 0.32 in the first and last cases).
    if r.z < 4:
        np.testing.assert_allclose(r.p_value, p_astropy, rtol=0.03)


def test_rayleigh_p_value_matches_simulated_null_at_small_n():
    n = 10
    rng = np.random.default_rng(0)
    rbar = stats.rayleigh_test(
        rng.uniform(0, 2 * np.pi, size=(200_000, n))).mean_resultant_length
    for q in (0.5, 0.1, 0.05, 0.01):
        r_q = np.quantile(rbar, 1.0 - q)  # P(R̄ >= r_q) = q under H0.
        p_zar = float(stats.rayleigh_p_value(n, r_q))
        assert abs(p_zar - q) < 0.003 + 0.1 * q, (q, p_zar)
        # astropy's n < 50 p-value (the Greenwood/Durand series) is another
        # independent small-sample approximation; feed it a sample whose R̄
        # is r_q (n/2 angles at +t, n/2 at -t, so R̄ = cos t).
        angles = np.where(np.arange(n) % 2 == 0, 1.0, -1.0) * np.arccos(r_q)
        assert stats.rayleigh_test(angles).mean_resultant_length == (
            pytest.approx(r_q, rel=1e-12))
        assert abs(p_zar - rayleightest(angles)) < 0.002


def test_rayleigh_batched_equals_loop():
    rng = np.random.default_rng(1)
    theta = rng.vonmises(0.3, 0.7, size=(7, 40))
    batch = stats.rayleigh_test(theta, axis=1)
    for i in range(7):
        one = stats.rayleigh_test(theta[i])
        assert one.n == batch.n == 40
        np.testing.assert_allclose(batch.z[i], one.z, rtol=1e-12)
        np.testing.assert_allclose(batch.p_value[i], one.p_value, rtol=1e-12)
    np.testing.assert_allclose(
        stats.rayleigh_test(theta.T, axis=0).z, batch.z, rtol=1e-12)


def test_rayleigh_uniform_rejected_at_nominal_rate():
    rng = np.random.default_rng(2)
    reps = 1000
    p = stats.rayleigh_test(
        rng.uniform(-np.pi, np.pi, size=(reps, 100))).p_value
    lo, hi = _binom_bounds(reps, 0.05)
    assert lo <= np.count_nonzero(p < 0.05) <= hi
    # The whole null distribution of p is close to uniform.
    assert sps.kstest(p, "uniform").pvalue > 1e-3


def test_rayleigh_rejects_von_mises_kappa_half():
    rng = np.random.default_rng(3)
    p = stats.rayleigh_test(
        rng.vonmises(2.0, 0.5, size=(200, 500))).p_value
    # E[R̄] = I1(0.5)/I0(0.5) ~ 0.24, so z ~ 29 and p ~ 1e-13.
    assert np.all(p < 0.05)
    assert np.median(p) < 1e-8


def test_rayleigh_p_value_edges():
    assert stats.rayleigh_test(np.zeros(20)).p_value < 1e-12  # R̄ = 1.
    np.testing.assert_allclose(stats.rayleigh_p_value(20, 0.0), 1.0,
                               atol=1e-12)
    pts = np.linspace(0, 2 * np.pi, 12, endpoint=False)  # R̄ = 0.
    r = stats.rayleigh_test(pts)
    assert r.mean_resultant_length < 1e-12 and r.p_value == pytest.approx(1.0)
    with pytest.raises(ValueError):
        stats.rayleigh_test([])
    with pytest.raises(ValueError):
        stats.rayleigh_test([0.0, np.nan])


# ---------------------------------------------------------------------------
# Permutation null for phase differences.
# ---------------------------------------------------------------------------


def test_permutation_null_values_are_exact():
    rng = np.random.default_rng(4)
    a, b = rng.uniform(0, np.pi, size=(2, 300))
    res = stats.permutation_rayleigh(a, b, 25, np.random.default_rng(9))
    replay = np.random.default_rng(9)
    direct = [np.abs(np.mean(np.exp(1j * (a - b[replay.permutation(300)]))))
              for _ in range(25)]
    np.testing.assert_allclose(res.null_mean_resultant_length, direct,
                               rtol=1e-10, atol=1e-14)
    assert res.mean_resultant_length == pytest.approx(
        abs(np.mean(np.exp(1j * (a - b)))), rel=1e-12)
    exceed = np.sum(np.asarray(direct) >= res.mean_resultant_length)
    assert res.p_value == pytest.approx((1 + exceed) / 26)


def test_half_circle_phases_fool_rayleigh_but_not_permutation():
    # Two members' phases, independent, each mapped onto [0, pi).
    rng = np.random.default_rng(5)
    a, b = rng.uniform(0, np.pi, size=(2, 5000))
    res = stats.permutation_rayleigh(a, b, 199, rng)
    assert res.rayleigh.p_value < 1e-50  # Uniformity rejected trivially.
    assert res.p_value > 0.05


def test_permutation_rejects_at_nominal_rate_under_independence():
    rng = np.random.default_rng(6)
    reps, n_perm = 200, 99
    p = np.array([
        stats.permutation_rayleigh(*rng.uniform(0, np.pi, size=(2, 200)),
                                   n_perm, rng).p_value
        for _ in range(reps)])
    assert np.all(p >= 1.0 / (n_perm + 1))
    lo, hi = _binom_bounds(reps, 0.05)
    assert lo <= np.count_nonzero(p <= 0.05) <= hi


def test_permutation_detects_coherent_phases():
    rng = np.random.default_rng(7)
    a = rng.uniform(0, np.pi, size=500)
    b = np.clip(a + rng.normal(0, 0.3, size=500), 0, np.pi)
    res = stats.permutation_rayleigh(a, b, 199, rng)
    assert res.p_value == pytest.approx(1 / 200)
    with pytest.raises(ValueError):
        stats.permutation_rayleigh(a, b[:-1], 10, rng)
    with pytest.raises(ValueError):
        stats.permutation_rayleigh(a, b, 0, rng)


# ---------------------------------------------------------------------------
# AUROC.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ties", [False, True])
def test_auroc_matches_mann_whitney(ties):
    rng = np.random.default_rng(8)
    for n1, n2 in [(1, 1), (5, 3), (200, 700), (3000, 1000)]:
        if ties:
            pos = rng.integers(0, 6, size=n1).astype(float)
            neg = rng.integers(0, 5, size=n2).astype(float)
        else:
            pos = rng.normal(0.4, 1, size=n1)
            neg = rng.normal(0, 1, size=n2)
        u = sps.mannwhitneyu(pos, neg).statistic
        assert stats.auroc(pos, neg) == pytest.approx(u / (n1 * n2),
                                                      rel=1e-12)


def test_auroc_edges():
    assert stats.auroc([2, 3], [0, 1]) == 1.0
    assert stats.auroc([0, 1], [2, 3]) == 0.0
    assert stats.auroc([1, 1], [1, 1, 1]) == 0.5
    with pytest.raises(ValueError):
        stats.auroc([], [1.0])


def _mw_auroc(x, y, axis=-1):
    n1, n2 = x.shape[axis], y.shape[axis]
    return sps.mannwhitneyu(x, y, axis=axis).statistic / (n1 * n2)


@pytest.mark.parametrize("ties", [False, True])
def test_auroc_bootstrap_matches_scipy_bootstrap(ties):
    rng = np.random.default_rng(10)
    if ties:
        pos = rng.integers(0, 8, size=300).astype(float)
        neg = rng.integers(0, 7, size=400).astype(float)
    else:
        pos = rng.normal(0.5, 1, size=300)
        neg = rng.normal(0, 1, size=400)
    ours = stats.auroc_bootstrap_ci(pos, neg, n_boot=4000, alpha=0.05,
                                    rng=np.random.default_rng(11))
    ref = sps.bootstrap((pos, neg), _mw_auroc, n_resamples=4000,
                        method="percentile", confidence_level=0.95,
                        vectorized=True, paired=False,
                        random_state=np.random.default_rng(12))
    assert ours.estimate == pytest.approx(_mw_auroc(pos, neg), rel=1e-12)
    np.testing.assert_allclose(ours.std_error, ref.standard_error, rtol=0.08)
    tol = 0.15 * ref.standard_error
    assert abs(ours.ci_low - ref.confidence_interval.low) < tol
    assert abs(ours.ci_high - ref.confidence_interval.high) < tol
    assert ours.p_value < 0.01 and ours.n_boot == 4000


def test_auroc_bootstrap_replicates_are_aurocs_of_resamples():
    # With one negative, every replicate is the fraction of resampled
    # positives above it (ties 1/2): check the values are on that lattice.
    pos = np.array([0.0, 1.0, 2.0, 3.0])
    res = stats.auroc_bootstrap_ci(pos, [1.0], n_boot=500,
                                   rng=np.random.default_rng(0))
    lattice = np.arange(9) / 8
    assert np.all(np.min(np.abs(res.boot[:, None] - lattice), axis=1) < 1e-12)
    assert res.estimate == (0 + 0.5 + 1 + 1) / 4
    np.testing.assert_allclose(res.boot.mean(), res.estimate, atol=0.03)


# ---------------------------------------------------------------------------
# Paired bootstrap.
# ---------------------------------------------------------------------------


def test_paired_bootstrap_matches_scipy_bootstrap():
    rng = np.random.default_rng(13)
    x = rng.gamma(2.0, 1.0, size=2000)
    y = x - 0.1 + rng.normal(0, 0.5, size=2000)
    ours = stats.paired_bootstrap_ci(x, y, n_boot=4000, alpha=0.1,
                                     rng=np.random.default_rng(14))
    ref = sps.bootstrap((x - y,), np.mean, n_resamples=4000,
                        method="percentile", confidence_level=0.9,
                        random_state=np.random.default_rng(15))
    assert ours.estimate == pytest.approx(np.mean(x - y), rel=1e-12)
    np.testing.assert_allclose(ours.std_error, ref.standard_error, rtol=0.08)
    tol = 0.15 * ref.standard_error
    assert abs(ours.ci_low - ref.confidence_interval.low) < tol
    assert abs(ours.ci_high - ref.confidence_interval.high) < tol
    assert ours.p_value < 0.01


def test_paired_bootstrap_coverage_and_size():
    rng = np.random.default_rng(16)
    reps, n, delta = 200, 200, 0.3
    covered = rejected = 0
    for _ in range(reps):
        x = rng.exponential(1.0, size=n) + delta
        y = rng.exponential(1.0, size=n)
        ci = stats.paired_bootstrap_ci(x, y, n_boot=1000, rng=rng)
        covered += ci.ci_low <= delta <= ci.ci_high
        # Same data with the true difference removed: H0 holds.
        rejected += stats.paired_bootstrap_ci(
            x - delta, y, n_boot=1000, rng=rng).p_value <= 0.05
    lo, hi = _binom_bounds(reps, 0.95)
    assert lo <= covered <= hi
    lo, hi = _binom_bounds(reps, 0.05)
    assert lo <= rejected <= hi


def _ar1(rng, n, phi):
    e = rng.normal(size=n)
    x = np.empty(n)
    x[0] = e[0] / np.sqrt(1 - phi**2)
    for t in range(1, n):
        x[t] = phi * x[t - 1] + e[t]
    return x


def test_block_bootstrap_covers_autocorrelated_mean():
    rng = np.random.default_rng(17)
    reps, n, phi = 200, 1000, 0.6
    cover_block = cover_iid = 0
    zeros = np.zeros(n)
    for _ in range(reps):
        d = _ar1(rng, n, phi)  # True mean 0.
        b = stats.paired_bootstrap_ci(d, zeros, n_boot=500, rng=rng,
                                      block_size=40)
        i = stats.paired_bootstrap_ci(d, zeros, n_boot=500, rng=rng)
        cover_block += b.ci_low <= 0.0 <= b.ci_high
        cover_iid += i.ci_low <= 0.0 <= i.ci_high
    # i.i.d. resampling ignores the correlation: the standard error is too
    # small by sqrt((1 - phi) / (1 + phi)) = 0.5, coverage ~ 68%.
    assert cover_iid < 0.8 * reps
    # Blocks of 40 >> correlation length: close to nominal. Block
    # bootstraps run a little short in finite samples (the block variance is
    # biased down by O(1/L), the percentile interval by O(1/n)); over many
    # seeds this setting covers ~91%, so the bound is centred on 0.92.
    lo, hi = _binom_bounds(reps, 0.92)
    assert lo <= cover_block <= hi


def test_block_bootstrap_exact_cases():
    d = np.random.default_rng(18).normal(size=97)
    zeros = np.zeros(97)
    # Blocks as long as the series: each replicate is a rotation of d.
    full = stats.paired_bootstrap_ci(d, zeros, n_boot=50, block_size=97,
                                     rng=np.random.default_rng(0))
    np.testing.assert_allclose(full.boot, np.mean(d), rtol=1e-12)
    # Replicates (blocks of 10, last cut to 7) are means of 97 values of d.
    res = stats.paired_bootstrap_ci(d, zeros, n_boot=300, block_size=10,
                                    rng=np.random.default_rng(1))
    assert np.all(res.boot >= d.min()) and np.all(res.boot <= d.max())
    np.testing.assert_allclose(res.boot.mean(), d.mean(),
                               atol=4 * res.std_error / np.sqrt(300))


def test_paired_bootstrap_is_seeded_and_validates():
    x, y = np.random.default_rng(19).normal(size=(2, 500))
    r1 = stats.paired_bootstrap_ci(x, y, 300, rng=np.random.default_rng(3))
    r2 = stats.paired_bootstrap_ci(x, y, 300, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(r1.boot, r2.boot)
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci(x, y[:-1], 100)
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci(x, y, 100, alpha=1.5)
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci(x, y, 100, block_size=0)
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci(x, np.full(500, np.nan), 100)


# ---------------------------------------------------------------------------
# Expected calibration error.
# ---------------------------------------------------------------------------


def _ece_loop(conf, correct, n_bins):
    """Reference: explicit loop over right-closed bins (lo, hi]."""
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        in_bin = [(c, k) for c, k in zip(conf, correct)
                  if (lo < c <= hi) or (b == 0 and c == 0.0)]
        if in_bin:
            cs, ks = zip(*in_bin)
            total += len(in_bin) / len(conf) * abs(np.mean(ks) - np.mean(cs))
    return total


def test_ece_hand_example():
    # Two bins: (0, .5] holds 0.2, 0.4 (1 correct): |0.5 - 0.3| = 0.2;
    # (.5, 1] holds 0.9, 1.0 (both correct): |1 - 0.95| = 0.05.
    ece = stats.expected_calibration_error([0.2, 0.4, 0.9, 1.0],
                                           [0, 1, 1, 1], n_bins=2)
    assert ece == pytest.approx(0.5 * 0.2 + 0.5 * 0.05)


def test_ece_matches_loop_and_limits():
    rng = np.random.default_rng(20)
    conf = rng.uniform(size=3000)
    correct = rng.uniform(size=3000) < conf**1.5  # Over-confident.
    for n_bins in (1, 10, 15):
        assert stats.expected_calibration_error(
            conf, correct, n_bins) == pytest.approx(
                _ece_loop(conf, correct, n_bins), abs=1e-12)
    big = rng.uniform(size=200_000)
    calibrated = rng.uniform(size=200_000) < big
    assert stats.expected_calibration_error(big, calibrated) < 0.01
    assert stats.expected_calibration_error(
        big, np.zeros_like(big)) == pytest.approx(big.mean())
    with pytest.raises(ValueError):
        stats.expected_calibration_error([1.2], [1])
    with pytest.raises(ValueError):
        stats.expected_calibration_error([0.5, 0.5], [1])


@pytest.mark.parametrize("ties", [False, True])
def test_auroc_bootstrap_replicates_are_brute_force_aurocs_of_the_drawn_resamples(ties):
    """Each replicate is the pairwise Mann-Whitney AUROC of the resample it drew (the
    negatives', then the positives' indices, from the generator it was given): scores
    below, between, at and above the positives' values, with and without ties."""
    rng = np.random.default_rng(5)
    pos = rng.normal(0.3, 1.0, 40)
    neg = np.concatenate([rng.normal(0.0, 1.0, 60), pos[:7], [pos.min() - 1, pos.max() + 1]])
    if ties:
        pos, neg = np.round(pos, 1), np.round(neg, 1)
    n_boot = 6
    res = stats.auroc_bootstrap_ci(pos, neg, n_boot=n_boot, rng=np.random.default_rng(9))
    assert stats._chunk_rows(max(pos.size, neg.size)) >= n_boot  # one chunk of draws
    draw = np.random.default_rng(9)
    i_neg = draw.integers(0, neg.size, size=(n_boot, neg.size))
    i_pos = draw.integers(0, pos.size, size=(n_boot, pos.size))

    def brute(p, q):
        d = p[:, None] - q[None, :]
        return (np.sum(d > 0) + 0.5 * np.sum(d == 0)) / d.size

    want = [brute(pos[i_pos[b]], neg[i_neg[b]]) for b in range(n_boot)]
    np.testing.assert_allclose(res.boot, want, rtol=0, atol=1e-15)
    assert res.estimate == pytest.approx(brute(pos, neg), abs=1e-15)
