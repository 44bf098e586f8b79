"""Ensemble decoding on tiny random models: exactness, ME statistics, catch-up, bad input.

References are independent of the decoder: member distributions come from a
full, cache-free forward pass over the whole text (``brf.models.forward``),
and fused ones from ``brf.fuse`` applied to those.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import brf
from brf.ensemble import EnsembleInputError, Member, catchup, generate, stream
from brf.ensemble.text import TextStream, utf8_prefix
from brf.models import forward

from tiny_lm import tiny_member, tiny_tokenizer

PROMPTS = ["the cat sat", "in a hat"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def pair(tok):
    """Two different random models sharing one tokenizer."""
    return [tiny_member(0, tok, name="a"), tiny_member(1, tok, name="b")]


@pytest.fixture(scope="module")
def prompt_pair(pair):
    """One model under two conditioning prefixes (a prompt ensemble)."""
    m = pair[0]
    return [dataclasses.replace(m, name="plain", prefix="the "),
            dataclasses.replace(m, name="other", prefix="a hat in ")]


REF_LEN = 64  # references run at one padded length: one compilation per config


@functools.partial(jax.jit, static_argnames="cfg")
def _full_forward(params, cfg, tokens_1xN, valid_1xN):
    logits, _ = forward(params, cfg, tokens_1xN, valid_1xN)
    return jax.nn.log_softmax(logits[0], axis=-1)


def reference_steps(member: Member, prompt: str, events: list[int]) -> np.ndarray:
    """log p(. | prefix + prompt + events[:t]) for every t, from ONE cache-free
    forward pass over the whole text: [len(events) + 1, V]."""
    ids = member.prompt_ids(prompt) + list(events)
    assert len(ids) <= REF_LEN
    tokens = np.zeros((1, REF_LEN), np.int32)
    tokens[0, :len(ids)] = ids
    valid = np.arange(REF_LEN)[None] < len(ids)
    logp = np.asarray(_full_forward(member.params, member.cfg, tokens, valid))
    n = len(ids) - len(events)
    return logp[n - 1:len(ids)]


def reference_logp(member: Member, prompt: str, events: list[int]) -> np.ndarray:
    """log p(. | prefix + prompt + events) from one cache-free forward pass."""
    return reference_steps(member, prompt, events)[-1]


def close_logp(a, b, floor=-12.0, atol=2e-4):
    """Log-probs agree where either is above exp(floor)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    keep = (a > floor) | (b > floor)
    np.testing.assert_allclose(a[keep], b[keep], atol=atol)


# --------------------------------------------------------------------- exactness

@pytest.mark.parametrize("ensemble,method,params", [
    ("pair", "born", {"phase": "tanh(rate=0.5, offset=[0, 1.0])"}),
    ("pair", "loglinear", {}),
    ("prompt_pair", "born", {"phase": "token_tanh(rate=0.8)"}),
])
def test_fused_distribution_matches_kernel_step_by_step(request, ensemble, method, params):
    members = request.getfixturevalue(ensemble)
    w = [0.3, 0.7]
    res = generate(members, PROMPTS, weights=w, method=method, method_params=params,
                   sampler="temperature=0.9,top_k=50", max_new_tokens=12, seed=3, trace=True)
    for prompt, g in zip(PROMPTS, res):
        events = [s["event"] for s in g.trace]
        assert len(events) == g.n_events >= 1
        refs = [reference_steps(m, prompt, events) for m in members]
        for t, s in enumerate(g.trace):
            ref = np.stack([r[t] for r in refs])
            for i in range(2):
                close_logp(s["member_logp"][i], ref[i])
            fused = np.asarray(brf.fuse(method, jnp.asarray(ref), jnp.asarray(w), **params))
            close_logp(s["logq"], fused)


def test_mixture_exact_member_rows_match_reference(pair):
    res = generate(pair, PROMPTS, mode="mixture_exact", max_new_tokens=12, seed=5,
                   trace=True, choice="shared")
    for prompt, g in zip(PROMPTS, res):
        events = [s["event"] for s in g.trace]
        ran = {s["member"] for s in g.trace}
        assert ran == {0, 1}  # both members were chosen at some step, so both caught up
        refs = [reference_steps(m, prompt, events) for m in pair]
        for t, s in enumerate(g.trace):
            k = s["member"]
            assert list(s["member_logp"]) == [k]  # only the chosen member ran
            close_logp(s["logq"], refs[k][t])
        assert sum(g.members_run) == g.n_events  # one member per step


def test_same_seed_same_text_and_streaming_concatenates(pair):
    kw = dict(method="born", sampler="temperature=1.0", max_new_tokens=12)
    pieces = []
    a = generate(pair, PROMPTS, seed=7, on_piece=pieces.append, **kw)
    b = generate(pair, PROMPTS, seed=7, **kw)
    c = generate(pair, PROMPTS, seed=8, **kw)
    assert [g.text for g in a] == [g.text for g in b]
    assert [g.text for g in a] != [g.text for g in c]
    for i, g in enumerate(a):
        assert "".join(p.text for p in pieces if p.index == i) == g.text
        assert [p.finished for p in pieces if p.index == i][-1] == g.finish_reason == "length"


def test_greedy_fuse_is_argmax_of_fused(pair):
    res = generate(pair, PROMPTS, method="linear", sampler="greedy", max_new_tokens=12,
                   trace=True)
    for g in res:
        for s in g.trace:
            assert s["event"] == int(np.argmax(s["logq"]))


def test_eos_of_any_member_stops(pair):
    first = generate(pair, PROMPTS, sampler="greedy", max_new_tokens=12, trace=True)
    events = [s["event"] for s in first[0].trace]
    t = next(t for t in range(1, 12) if events[t] not in events[:t])
    a = dataclasses.replace(pair[0], cfg=dataclasses.replace(pair[0].cfg,
                                                             eos_ids=(2, events[t])))
    res = generate([a, pair[1]], PROMPTS, sampler="greedy", max_new_tokens=12)
    assert res[0].finish_reason == "eos" and res[0].n_events == t + 1
    assert first[0].text.startswith(res[0].text)


def test_stop_string_cuts_text(pair):
    full = generate(pair, PROMPTS, sampler="greedy", max_new_tokens=12)[0].text
    assert len(full) >= 4
    stop = full[2:4]
    pieces = []
    res = generate(pair, PROMPTS, sampler="greedy", max_new_tokens=12, stop=[stop],
                   on_piece=pieces.append)[0]
    assert res.finish_reason == "stop"
    assert res.text == full[:full.find(stop)]
    assert "".join(p.text for p in pieces if p.index == 0) == res.text


# --------------------------------------------------------------- ME statistics

N_DRAWS = 4000


def _chi2(counts, p, min_expected=5.0):
    """Pearson chi-square of counts against p, bins with expected < 5 pooled."""
    expected = N_DRAWS * p
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < min_expected:  # fold a tiny pooled bin into the smallest big bin
        j = np.argmin(exp[:-1])
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return stat, df, stats.chi2.sf(stat, df), (big, min_expected)


def _power(p0, p1, df, alpha=0.01, bins=None):
    """Power of the chi-square test of p0 against the alternative p1 at N_DRAWS."""
    big, _ = bins
    a = np.append(p0[big], p0[~big].sum())
    b = np.append(p1[big], p1[~big].sum())
    lam = N_DRAWS * ((b - a) ** 2 / np.maximum(a, 1e-300)).sum()
    crit = stats.chi2.isf(alpha, df)
    return stats.ncx2.sf(crit, df, lam)


def _first_tokens(members, mode, sampler=None, weights=(0.3, 0.7)):
    res = generate(members, [PROMPTS[0]] * N_DRAWS, weights=weights, mode=mode,
                   sampler=sampler, max_new_tokens=1, seed=11, trace=True)
    V = members[0].cfg.vocab_size
    return np.bincount([g.trace[0]["event"] for g in res], minlength=V)


def test_mixture_exact_samples_the_linear_pool(pair):
    """Chi-square goodness of fit of 4000 ME first tokens to the exact linear pool.

    Power (stated and asserted): at alpha = 0.01, with N = 4000 draws over the
    ~100 bins with expected count >= 5, the test detects an effect size
    w = sqrt(sum (p1 - p0)^2 / p0) of 0.15 with power > 0.9 (between Cohen's
    "small" 0.1 and "medium" 0.3), and with power > 0.99 the alternatives a
    buggy ME would sample: either member alone, the swapped weights
    (0.7, 0.3), or the Hellinger pool.
    """
    w = np.array([0.3, 0.7])
    ref = np.stack([np.exp(reference_logp(m, PROMPTS[0], [])) for m in pair])
    pool = w @ ref
    counts = _first_tokens(pair, "mixture_exact")
    stat, df, pval, bins = _chi2(counts, pool)
    assert pval > 0.01, (stat, df, pval)
    # Power against a generic small effect and against concrete wrong answers.
    crit = stats.chi2.isf(0.01, df)
    assert stats.ncx2.sf(crit, df, N_DRAWS * 0.15 ** 2) > 0.9
    hell = (np.sqrt(ref).T @ np.sqrt(w)) ** 2
    for alt in (ref[0], ref[1], w[::-1] @ ref, hell / hell.sum()):
        assert _power(pool, alt, df, bins=bins) > 0.99


def test_mixture_per_member_truncation_differs_from_truncated_pool(pair):
    """top_k=1 per member samples w_1 δ(argmax p_1) + w_2 δ(argmax p_2), not argmax(pool)."""
    w = np.array([0.3, 0.7])
    logits = np.stack([reference_logp(m, PROMPTS[0], []) for m in pair])
    top = logits.argmax(-1)
    assert top[0] != top[1], "pick seeds whose members disagree on the first token"
    sampler = brf.Sampler(top_k=1)
    counts = _first_tokens(pair, "mixture_per_member", sampler)
    per_member = np.exp(np.asarray(brf.fusion.mixture_logprobs(jnp.asarray(logits),
                                                               jnp.asarray(w), sampler)))
    truncated_pool = np.exp(np.asarray(brf.fusion.filter_logprobs(
        jnp.log(jnp.asarray(w @ np.exp(logits))), sampler)))
    assert set(np.flatnonzero(counts)) == set(top)
    assert abs(counts[top[0]] / N_DRAWS - w[0]) < 0.03
    assert stats.binomtest(int(counts[top[0]]), N_DRAWS, w[0]).pvalue > 0.01
    # The truncated pool puts all its mass on one token; ME per member on two.
    assert np.count_nonzero(truncated_pool > 0) == 1
    assert 0.5 * np.abs(per_member - truncated_pool).sum() >= min(w)
    stat, df, pval, bins = _chi2(counts, per_member)
    assert pval > 0.01


# ------------------------------------------------------------------ catch-up

def _valid_kv(cache, b):
    pos = np.asarray(cache["pos"][b])
    order = np.argsort(np.where(pos >= 0, pos, np.iinfo(np.int32).max))[:int((pos >= 0).sum())]
    return pos[order], np.asarray(cache["k"][:, b, order]), np.asarray(cache["v"][:, b, order])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_catch_up_in_one_pass_equals_step_by_step(pair, k):
    m = pair[0]
    prompts = [m.prompt_ids("the cat"), m.prompt_ids("a much longer prompt here")]
    rng = np.random.default_rng(k)
    new = [rng.integers(3, m.cfg.vocab_size, size=k).tolist(), []]  # seq 1 skips
    lazy = catchup.start(m, prompts)
    eager = catchup.start(m, prompts)
    before = np.asarray(lazy.logits_BxV)
    for t in range(k):
        eager = catchup.catch_up(m, catchup.add_pending(eager, [[new[0][t]], []]))
    lazy = catchup.catch_up(m, catchup.add_pending(lazy, new))
    assert lazy.pending == ((), ()) and lazy.n_read == eager.n_read
    np.testing.assert_allclose(np.asarray(lazy.logits_BxV), np.asarray(eager.logits_BxV),
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(lazy.logits_BxV)[1], before[1])  # kept
    for b in range(2):
        for x, y in zip(_valid_kv(lazy.cache, b), _valid_kv(eager.cache, b)):
            np.testing.assert_allclose(x, y, atol=1e-5)
    np.testing.assert_array_equal(lazy.cache["next_pos"], eager.cache["next_pos"])
    ref = reference_steps(m, "the cat", new[0])[-1]
    close_logp(jax.nn.log_softmax(lazy.logits_BxV[0]), ref)


def test_catch_up_grows_the_cache_and_buckets_lengths(pair):
    m = pair[0]
    s = catchup.start(m, [m.prompt_ids("hi")])
    slots = s.cache["pos"].shape[1]
    s = catchup.catch_up(m, catchup.add_pending(s, [list(range(3, 3 + slots))]))
    assert s.cache["pos"].shape[1] > slots
    assert [catchup.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    close_logp(jax.nn.log_softmax(s.logits_BxV[0]),
               reference_logp(m, "hi", list(range(3, 3 + slots))))


# ------------------------------------------------------------------ bad input

def test_bad_inputs_fail_before_generation(pair, tok, monkeypatch):
    calls = []
    monkeypatch.setattr(catchup, "start", lambda *a, **k: calls.append(a))
    short = tiny_member(0, tok, name="short", max_seq_len=8)
    with pytest.raises(EnsembleInputError, match="longer than its context"):
        generate([short, pair[1]], ["a prompt far longer than eight tokens"])
    with pytest.raises(EnsembleInputError, match="unknown fusion method 'bogus'.*born"):
        generate(pair, PROMPTS, method="bogus")
    with pytest.raises(EnsembleInputError, match="3 weights for 2 members"):
        generate(pair, PROMPTS, weights=[0.2, 0.3, 0.5])
    with pytest.raises(EnsembleInputError, match="sum to 1"):
        generate(pair, PROMPTS, weights=[1.0, 1.0])
    with pytest.raises(EnsembleInputError, match="offset"):
        generate(pair, PROMPTS, method="born", method_params={"phase": "constant(offset=[0, 1, 2])"})
    with pytest.raises(EnsembleInputError, match="no parameter"):
        generate(pair, PROMPTS, method="linear", method_params={"alpha": 0.5})
    with pytest.raises(EnsembleInputError, match="mixture_exact"):
        generate(pair, PROMPTS, mode="mixture_exact", sampler="temperature=0.7")
    with pytest.raises(EnsembleInputError, match="unknown mode"):
        generate(pair, PROMPTS, mode="mixture")
    other_eos = tiny_tokenizer(eos="<pad>")
    with pytest.raises(EnsembleInputError, match="disagree about special tokens"):
        generate([pair[0], tiny_member(1, other_eos)], PROMPTS)
    other_vocab = tiny_tokenizer(merges=(("a", "b"),))
    with pytest.raises(EnsembleInputError, match="different vocabularies"):
        generate([pair[0], tiny_member(1, other_vocab)], PROMPTS)
    assert calls == []  # no member was prefilled


# ------------------------------------------------------------------ text

def test_text_stream_holds_partial_utf8_and_stop_prefixes():
    s = TextStream(stop=["END"])
    assert s.update("abc\ufffd") == "abc"
    assert s.update("abcé E") == "é "
    assert s.update("abcé EN") == ""
    assert s.update("abcé ENX") == "ENX"
    assert s.update("abcé ENX END more") == " " and s.stopped
    assert s.text == "abcé ENX "
    assert utf8_prefix("é".encode()[:1]) == "" and utf8_prefix(b"a\xc3\xa9") == "aé"


def test_prompt_ensemble_members_condition_differently(prompt_pair):
    a, b = prompt_pair
    assert a.prompt_ids("x") != b.prompt_ids("x")
    chat = dataclasses.replace(a, chat=True, prefix="be brief")
    ids = chat.prompt_ids("hello")
    assert chat.tokenizer.decode(ids) == "<s>system: be brief\n<s>user: hello\n<s>assistant: "
    res = generate(prompt_pair + [chat], ["hello", "x"], max_new_tokens=12, sampler="greedy",
                   weights=[0.25, 0.25, 0.5])
    assert all(g.finish_reason in ("length", "eos") and g.n_events >= 1 for g in res)
