"""The validation study end to end on tiny random models (fast)."""

import hashlib
import json
import os
from typing import NamedTuple
from unittest import mock

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from brf.errors import UserError
from brf.eval import plan as plan_lib, report as report_lib, scorer, study
from brf.eval.config_specs import method_entry, phase_map_entries
from brf.specs import split_list
from brf.eval.corpus import CorpusError, load_default_corpus
from brf.models import ModelConfig, init_params

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "validate_config", pathlib.Path(__file__).parent.parent / "configs" / "validate.py")
validate_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate_config)


class TinyModel(NamedTuple):
    cfg: ModelConfig
    params: dict
    tokenizer: object


def _tokenizer(text: str, vocab: int):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


@pytest.fixture(scope="module")
def text():
    return load_default_corpus(min_chars=100)[:5000]


def tiny_members(text: str) -> dict:
    """'tiny-a' and 'tiny-b': random 2-layer models with BPE tokenizers (vocabularies
    of 300 and 420) trained on ``text``; also used by the multi-device checks."""
    out = {}
    for i, (name, vocab) in enumerate([("tiny-a", 300), ("tiny-b", 420)]):
        tok = _tokenizer(text, vocab)
        v = len(tok)
        cfg = ModelConfig(arch="llama", vocab_size=v, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, head_dim=8, d_ff=64, norm_eps=1e-5,
                          rope_theta=10000.0, layer_types=("global", "global"),
                          max_seq_len=4096, bos_id=tok.convert_tokens_to_ids("<s>"))
        params = init_params(cfg, jax.random.key(i))
        out[name] = TinyModel(cfg, params, tok)
    return out


@pytest.fixture(scope="module")
def members(text):
    return tiny_members(text)


def _cfg(tmp_path, text, **over):
    """The short config on one corpus file (no prompt study), shrunk for speed;
    ``over`` sets fields, dotted for nested ones (``scoring__top_k=8``)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    c = validate_config.get_config("short")
    c.members = "tiny-a, tiny-b"
    c.corpora = str(corpus)
    c.topk_sensitivity = 0
    c.scoring.segment_chars = 800
    c.scoring.top_k = 16
    c.scoring.chunk = 128
    c.stats.n_perm = 100
    c.stats.n_boot = 100
    c.out_dir = str(tmp_path / "run")
    # A representative subset keeps the test fast; the full set runs in the
    # real-model run.
    c.methods = ", ".join(s for s in split_list(c.methods) if method_entry(s).label in (
        "linear (tuned)", "loglinear (tuned)", "entropy-gated", "contrastive",
        "PackLLM (perplexity weights)"))
    c.phase_maps = ", ".join(s for s in split_list(c.phase_maps) if phase_map_entries(s).popitem()[0] in (
        "hellinger (equal phases)", "linear pool (pi/2)", "tanh", "token_tanh"))
    c.sweep = c.sweep[:2]
    c.controls = False    # fitted in test_one_corpus_end_to_end only
    for k, v in over.items():
        *path, last = k.split("__")
        node = c
        for p in path:
            node = node[p]
        node[last] = v
    return c


def _run(cfg, load):
    return study.run(plan_lib.from_config(cfg), load_model=load)


def _corpus_report(cfg) -> dict:
    """The one-corpus study's full report of its main analysis."""
    (path,) = [p for p in (pathlib.Path(cfg.out_dir) / "corpus").glob("report-corpus-*.json")]
    return json.load(open(path))


def test_one_corpus_end_to_end(tmp_path, text, members):
    cfg = _cfg(tmp_path, text, controls=True)
    _run(cfg, members.__getitem__)
    out = os.path.join(cfg.out_dir, "corpus")
    for name in ("nll_by_method.png", "phase_differences.png", "sweep.png", "cross_terms.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    assert os.path.getsize(os.path.join(cfg.out_dir, "report.md")) > 0
    data = _corpus_report(cfg)
    assert data["schema"] == "brf.analysis/3"
    labels = {m["label"] for m in data["methods"] if m["role"] != "control"}
    assert len(labels) == 2 * (len(split_list(cfg.methods)) + 2 + len(split_list(cfg.phase_maps)))
    # The controls of the best per-token row (token_tanh is the only one here), per variant.
    controls = [m for m in data["methods"] if m["role"] == "control"]
    assert sorted(m["method"] for m in controls) == sorted(
        ["born_shuffled", "reshape", "reshape", "power_members"] * 2)
    assert {m["variant"] for m in controls} == {"proposed", "calibrated"}
    # The fair summary: the best BRF row and the best other row are the calibration
    # minima of their groups; the difference is their test NLLs' difference.
    for v, c in data["fair_summary"].items():
        rows = [m for m in data["methods"] if m["variant"] == v]
        brf = min((m for m in rows if m["role"] == "brf"), key=lambda m: m["calib_nll"])
        rival = min((m for m in rows if m["role"] != "brf"), key=lambda m: m["calib_nll"])
        assert c["brf"]["label"] == brf["label"] and c["rival"]["label"] == rival["label"]
        np.testing.assert_allclose(c["mean_difference"],
                                   brf["test"]["nll"] - rival["test"]["nll"], atol=1e-6)
        assert c["per_token"]["label"] == f"born token_tanh{'' if v == 'proposed' else ' [calibrated]'}"
        assert len(c["controls"]) == 4 and c["brf"]["free_parameters"] >= 1
    assert {"linear (tuned)", "loglinear (tuned)", "member 0 alone", "member 1 alone",
            "born linear pool (pi/2)", "born tanh", "born token_tanh"} <= labels
    roles = {m["label"]: m["role"] for m in data["methods"]}
    assert roles["member 0 alone"] == "member" and roles["born tanh"] == "brf"
    assert roles["linear (tuned)"] == "baseline" and roles["contrastive"] == "other"
    cov = data["coverage"]
    assert 0.2 < cov["fraction_of_bytes"] <= 1.0
    assert data["split"]["calibration_positions"] > 0 and data["split"]["test_positions"] > 0
    assert len(data["phase_coherence"]) == 2  # tanh, token_tanh (constant maps left out)
    for r in data["phase_coherence"]:
        assert 0 <= r["rayleigh_p"] <= 1 and 0 < r["permutation_p"] <= 1
    assert set(data["verdict"]) == {"phase_coherence", "cross_term", "nll", "fair_summary",
                                    "forking_tokens", "stability"}
    # The stability check: every calibrated row a verdict could choose (within the
    # check's reach of the best of a set it chooses from; controls always) refitted under
    # other last bits (positions reordered, the table moved by ulps, XLA's sin and cos); no
    # verdict resting on them moves (the rows' moves widen the ties they are judged
    # by); the rows that moved by more than the fits' tolerance are each named, the
    # largest move among them.
    stab = data["stability"]
    calibrated = [m for m in data["methods"] if m["variant"] == "calibrated"]
    assert stab["perturbation"] == "order+ulp+sincos"
    assert stab["refitted_rows"] + len(stab["not_refitted"]) == len(calibrated)
    assert stab["verdicts"] >= 4 and stab["reach"] >= 0.02
    sets = [lambda m: m["role"] == "brf", lambda m: m["role"] == "baseline",
            lambda m: m["role"] != "brf", lambda m: m["role"] == "member"]
    for label in stab["not_refitted"]:
        m = next(m for m in calibrated if m["label"] == label)
        assert m["role"] != "control", label
        for pick in sets:
            if pick(m):
                low = min(x["calib_nll"] for x in calibrated if pick(x))
                assert m["calib_nll"] > low + stab["reach"], label
    assert stab["moved"] == [], stab
    # a verdict the check had moved would say so in its own sentence (two moved by hand)
    hand = ["cross-term", "controls [calibrated]"]
    said = report_lib.verdicts({**data, "stability": {
        **stab, "moved": hand, "moved_untied": hand,
        "answers": {**stab["answers"], **{k: {**stab["answers"][k], "refit": "other"}
                                          for k in hand}}}})
    assert "FRAGILE under the stability check (cross-term)" in said["cross_term"]
    assert "FRAGILE under the stability check (controls [calibrated])" in said["fair_summary"]
    assert "FRAGILE" not in data["verdict"]["stability"]
    # The rows as proposed are not refitted, and the report says their verdicts are
    # unchecked; every verdict the check compared rests on the calibrated rows.
    assert stab["variants_not_refitted"] == ["proposed"]
    assert "as proposed were not refitted" in data["verdict"]["stability"]
    assert not any(k.endswith("[proposed]") for k in stab["answers"]), stab["answers"]
    over = stab["rows_over_tolerance"]
    assert all(abs(r["move"]) > stab["tolerance"] for r in over)
    if over:
        assert abs(stab["largest_row_move"]["move"]) == max(abs(r["move"]) for r in over)
    study = json.load(open(os.path.join(cfg.out_dir, "report.json")))
    assert study["stability"]["moved"] == [] and "stability" in study["verdict"]
    by = {m["label"]: m for m in data["methods"]}
    # Tuned weights moved away from uniform (the fit has gradients).
    assert by["linear (tuned)"]["weights"] != [0.5, 0.5]
    # So did the calibrated variant's temperatures (event tables hold -inf entries;
    # the temperatures must still get gradients).
    cal = by["linear (tuned) [calibrated]"]["params"]
    assert cal["calib.temperature"] != 1.0 and cal["calib.member_temperature"] != [1.0, 1.0]
    assert (by["linear (tuned) [calibrated]"]["calib_nll"]
            < by["linear (tuned)"]["calib_nll"])
    assert by["linear (tuned) [calibrated]"]["fit"]["converged"]
    # The pi/2 reference point is the linear pool: same NLL with the same weights.
    born_lin = by["born linear pool (pi/2)"]
    from brf.eval.fitting import Fitted, evaluate
    table, _ = _table(cfg, members)
    n_cal = max(1, round(len(plan_lib.split_segments(text, cfg.scoring.segment_chars)) * 0.5))
    test = table.take(np.nonzero(table.segment >= n_cal)[0])
    lin = evaluate(Fitted("l", "linear", {}, np.asarray(born_lin["weights"]), 0.0), test)
    np.testing.assert_allclose(born_lin["test"]["nll"], lin["nll"].mean(), rtol=1e-4)
    # A single member's test NLL is its mean log-loss of the gold event there, plus the
    # gold's offset where no member lists it.
    gold_lp = test.logp[np.arange(test.n_positions), 0, test.gold].astype(np.float64)
    assert by["member 0 alone"]["test"]["nll"] == pytest.approx(
        -np.mean(gold_lp + test.offset), rel=1e-5)
    # Resuming reuses the stored scores (no model is loaded again) and the fits.
    with _forbid_fitting():
        _run(cfg, _forbid_scoring(members))
    again = _corpus_report(cfg)
    assert again["coverage"] == data["coverage"]
    assert [m["params"] for m in again["methods"]] == [m["params"] for m in data["methods"]]


def _table(cfg, members):
    from brf.eval.events import build_event_table
    from brf.eval.scoring import load_partial, assemble
    text = open(cfg.corpora, encoding="utf-8").read()
    segs = plan_lib.split_segments(text, cfg.scoring.segment_chars)
    scores, tbs = [], []
    for name in split_list(cfg.members):
        m = members[name]
        ids = [scorer.encode(m.tokenizer, m.cfg, s) for s in segs]
        fp = hashlib.sha256("\x00".join(segs).encode()).hexdigest()[:16]
        meta = {"member": name, "corpus": fp, "segments": len(segs),
                "top_k": cfg.scoring.top_k, "n_segments": len(segs)}
        path = scorer.store_path(os.path.join(cfg.out_dir, "corpus"), plan_lib.Member(name))
        rows = load_partial(path, meta)
        assert len(rows) == len(segs)
        scores.append(assemble(ids, rows, m.cfg.vocab_size))
        tbs.append(scorer.member_token_bytes(m.tokenizer, m.cfg.vocab_size))
    return build_event_table(scores, tbs, segs)


def _forbid_fitting():
    """A context in which fitting any method fails (a resumed run must reuse the
    cached fits)."""
    from brf.eval import analysis

    def refit(spec, *args, **kwargs):
        raise AssertionError(f"refitted {spec.label!r} instead of reusing its fit")
    return mock.patch.object(analysis, "fit_spec", refit)


def _forbid_scoring(members):
    class Guard(dict):
        def __getitem__(self, name):
            m = members[name]
            return TinyModel(m.cfg, None, m.tokenizer)  # params None: scoring would fail
    return Guard().__getitem__


@pytest.mark.parametrize("change,match", [
    (dict(methods="linear, nope(x=1)"), "unknown fusion method 'nope'"),
    (dict(methods="loglinear(temprature=fit(1.0))"), "has no parameter.*temprature"),
    (dict(methods="loglinear(temperature=fitt(1.0))"), "fit\\(initial value\\)"),
    (dict(methods="linear(label=\"a\"), max(label=\"a\")"), "duplicate labels"),
    (dict(methods="loglinear(temperature=(1.0"), "missing"),
    (dict(phase_maps="tanh, spiral"), "unknown phase map"),
    (dict(members="tiny-a, tiny-b(prefx=\"Hi\")"), "unknown parameter.*prefx"),
    (dict(scoring__calibration_fraction=1.0), "calibration_fraction"),
    (dict(members="tiny-a"), "at least two members"),
])
def test_bad_config_is_refused_before_any_model_runs(tmp_path, text, change, match):
    cfg = _cfg(tmp_path, text, **change)
    with pytest.raises(UserError, match=match):
        _run(cfg, lambda name: pytest.fail("a model was loaded"))


def test_split_with_no_test_positions_is_refused(tmp_path, text, members):
    cfg = _cfg(tmp_path, text[:1500], scoring__segment_chars=1400, scoring__min_chars=100)
    with pytest.raises(plan_lib.ValidationError,
                       match=r"no test positions|test positions \(fewer than"):
        _run(cfg, members.__getitem__)


@pytest.mark.parametrize("content,match", [
    (b"", "empty"), (b"too short", "fewer than"), (b"abc\xff\xfedef" * 500, "UTF-8"),
])
def test_bad_corpus_is_refused(tmp_path, text, content, match):
    cfg = _cfg(tmp_path, text)
    with open(cfg.corpora, "wb") as f:
        f.write(content)
    with pytest.raises(CorpusError, match=match):
        _run(cfg, lambda name: pytest.fail("a model was loaded"))


def test_split_segments_keeps_every_character():
    text = "line one\n" * 50 + "x" * 300 + " tail\n"
    segs = plan_lib.split_segments(text, 100)
    assert "".join(segs) == text
    assert max(len(s) for s in segs) <= 100


@pytest.mark.parametrize("v,k", [(4096, 8), (1000, 5), (2048, 64)])
def test_chunked_top_k_is_exact(v, k):
    from brf.eval.scoring import chunked_top_k
    rng = np.random.default_rng(v)
    x = rng.standard_normal((6, v)).astype(np.float32)
    x[0, :300] = 5.0  # a plateau of ties in the first chunk
    x[1, -1] = 9.0
    vals, ids = chunked_top_k(jax.numpy.asarray(x), k, chunk=16)
    want = -np.sort(-x, axis=1)[:, :k]
    np.testing.assert_array_equal(np.asarray(vals), want)
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), 1), want)
    assert all(len(set(r)) == k for r in np.asarray(ids).tolist())


def test_chunk_summaries_match_float64_numpy():
    from brf.eval.scoring import _summarise
    rng = np.random.default_rng(7)
    x = (4 * rng.standard_normal((5, 4096))).astype(np.float32)
    x[0] = 0.0                      # flat: entropy log V, gap 0
    x[1, 17] = 60.0                 # one token takes nearly all the mass
    x[2, :100] = -np.inf            # masked tokens
    x[3] += 1e4                     # huge offsets
    gold = np.array([3, 17, 200, 5, 4095])
    ids, top, gold_lp, ent, gap, lnorm = map(np.asarray, _summarise(jax.numpy.asarray(x),
                                                                      jax.numpy.asarray(gold), 8))
    x64 = x.astype(np.float64)
    m = x64.max(1, keepdims=True)
    ln = (m + np.log(np.exp(x64 - m).sum(1, keepdims=True)))[:, 0]
    lp = x64 - ln[:, None]
    p = np.exp(lp)
    want_ent = -np.where(p > 0, p * np.where(p > 0, lp, 0.0), 0.0).sum(1)
    np.testing.assert_allclose(lnorm, ln, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(ent, want_ent, atol=2e-4)
    np.testing.assert_allclose(gold_lp, lp[np.arange(5), gold], atol=2e-4)
    want_top = -np.sort(-lp, axis=1)[:, :8]
    np.testing.assert_allclose(top, want_top, atol=2e-4)
    np.testing.assert_allclose(np.take_along_axis(lp, ids, 1), want_top, atol=2e-4)
    np.testing.assert_allclose(gap, want_top[:, 0] - want_top[:, 1], atol=2e-4)
    assert ent[0] == pytest.approx(np.log(4096), abs=1e-4)


def test_prefixed_member_is_scored_on_the_segments_own_positions(tmp_path, text, members):
    """A member with a prefix reads [BOS] + prefix + segment; its rows are the segment's
    (the unprefixed layout) and equal a full forward pass over the prefixed sequence."""
    from brf.eval.events import build_event_table
    from brf.models import score_tokens
    segs = plan_lib.split_segments(text[:2500], 800)
    prefix = "A note before the text.\n\n"
    infos, scores, tbs = scorer.score_members(
        [plan_lib.Member("tiny-a"), plan_lib.Member("tiny-a", prefix)], segs, str(tmp_path),
        members.__getitem__, top_k=16, chunk=128)
    plain, pre = scores
    assert infos[1].prefix_tokens > 0 and infos[1].name.startswith("tiny-a(prefix=")
    np.testing.assert_array_equal(plain.token_ids, pre.token_ids)
    np.testing.assert_array_equal(plain.row_starts, pre.row_starts)
    m = members["tiny-a"]
    pre_ids = m.tokenizer.encode(prefix, add_special_tokens=False)
    for s, seg in enumerate(segs):
        ids = m.tokenizer.encode(seg, add_special_tokens=False)
        full = [m.cfg.bos_id] + list(pre_ids) + list(ids)
        ref = score_tokens(m.params, m.cfg, np.asarray([full]))[0][len(pre_ids):]
        got = pre.gold_logp[pre.row_starts[s]:pre.row_starts[s + 1]]
        np.testing.assert_allclose(got, ref, atol=2e-4)
    assert not np.allclose(plain.gold_logp, pre.gold_logp)  # the prefix conditions
    table, cov = build_event_table(scores, tbs, segs)
    assert cov.positions == plain.row_starts[-1]  # one tokenizer: every position co-aligned


def test_a_prefix_longer_than_the_context_is_refused_before_scoring(tmp_path, text, members):
    segs = plan_lib.split_segments(text[:2500], 800)
    long = "word " * 5000
    with pytest.raises(plan_lib.ValidationError, match="prefix .* more than its context"):
        scorer.score_members([plan_lib.Member("tiny-b"), plan_lib.Member("tiny-a", long)],
                             segs, str(tmp_path), members.__getitem__, top_k=16, chunk=128)
    assert not list(tmp_path.glob("scores-*"))  # nothing was scored


def _notebook_cells(name: str, **env) -> dict:
    """Runs a notebook's code cells after its install cell in this process (no kernel),
    with ``env`` set; returns their namespace."""
    import nbformat
    nb = nbformat.read(pathlib.Path(__file__).parent.parent / "notebooks" / f"{name}.ipynb",
                       as_version=4)
    ns: dict = {}
    with mock.patch.dict(os.environ, {"MPLBACKEND": "Agg", **env}):
        for i, cell in enumerate(nb.cells[2:], 2):
            if cell.cell_type == "code":
                exec(compile(cell.source, f"{name}.ipynb cell {i}", "exec"), ns)
    return ns


# Bytes of each corpus the tiny study rescores at its reference settings (its precision
# check; the first 48 bytes of the test segment).
CHECK = 48


def test_study_end_to_end_on_tiny_models(tmp_path, text, members, capsys):
    """Two corpora (pooled), a prefix study (prefix pair, same-model pair, swarm of 4)
    and the event-space check, on tiny models, on co-aligned positions and on every
    byte (each corpus's every byte a row; the verdicts compared across levels);
    resumable without scoring or fitting anything again."""
    import brf.bytes.scoring
    from brf.eval import byte_scorer
    from brf.eval.fitting import Fitted, evaluate
    # No swarm at the byte level: four members' byte tables are the dearest fits here,
    # and every analysis of either level runs through the same code (run_level).
    cfg = _cfg(tmp_path, text, bytes__enabled=True, bytes__beam=2, bytes__threshold=0.2,
               bytes__max_lag=1, bytes__check_bytes=CHECK, bytes__reference_beam=8,
               bytes__reference_threshold=1e-3, bytes__swarm=False, bytes__prompts=True)
    cfg.methods = 'linear(label="linear (tuned)"), loglinear(label="loglinear (tuned)", ' \
                  'temperature=fit(1.0))'
    cfg.phase_maps = 'constant(label="hellinger (equal phases)", fixed=True), tanh'
    chars = 800  # two segments per corpus (byte-level scoring is slow; tens of seconds)
    cfg.corpora = (f'{tmp_path / "corpus.txt"}(label="first", max_chars={chars}, '
                   f'prefix="A story.\\n\\n"), '
                   f'{tmp_path / "corpus.txt"}(label="second", skip_chars={chars}, '
                   f'max_chars={chars})')
    cfg.scoring.min_chars = 500
    cfg.scoring.segment_chars = 450
    cfg.prompts.second_prefix = "Text:\n"
    cfg.topk_sensitivity = 32
    # Both variants run in test_one_corpus_end_to_end; the proposed one is the cheaper
    # here (the byte level doubles the fits).
    cfg.variants = cfg.prompts.variants = "proposed"
    cfg.bottleneck.positions = 4
    cfg.stats.n_perm = cfg.stats.n_boot = 60
    cfg.sweep = cfg.sweep[:1]
    rep = _run(cfg, members.__getitem__)
    data = json.load(open(os.path.join(cfg.out_dir, "report.json")))
    assert data["schema"] == "brf.study/3"
    assert set(data["per_corpus"]) == {"first", "second"}
    assert set(data["pooled"]) == {"proposed"}
    for v, p in data["pooled"].items():
        diffs = [c["mean_difference"] for c in p["corpora"]]
        assert p["mean_difference"] == pytest.approx(np.mean(diffs), abs=1e-9)
        assert p["ci"][0] <= p["mean_difference"] <= p["ci"][1]
    pr = data["prompts"]["first"]
    assert pr["effect"]["paired"] and pr["effect"]["phase_concentration"]
    assert len(pr["swarm"]["members"]) == 4 and len(pr["same_model"]["members"]) == 2
    assert pr["bottleneck"]["positions"] == 4 and len(pr["bottleneck"]["rows"]) == 6
    assert pr["same_model"]["coverage"]["fraction_of_member_positions"] == [1.0, 1.0]
    assert data["topk_sensitivity"]["top_k"] == [16, 32]
    ts = data["topk_sensitivity"]
    assert set(ts["rows"]) == {"nll[proposed]", "fair[proposed]", "cross_term",
                               "phase_coherence"}
    assert ts["moved"] == [k for k, r in ts["rows"].items() if r["a"] != r["b"]]
    for key in ("nll: first", "nll: pooled (proposed)", "prompts: first", "swarm: first",
                "event space", "every byte"):
        assert key in data["verdict"], sorted(data["verdict"])
    for name in ("report.md", "pooled.png", "gain_by_entropy.png",
                 "first/gain_by_entropy.png", "second/nll_by_method.png"):
        assert os.path.getsize(os.path.join(cfg.out_dir, name)) > 0, name
    # The byte level.
    b = data["bytes"]
    assert (b["beam"], b["threshold"], b["max_lag"]) == (2, 0.2, 1)
    assert set(b["per_corpus"]) == {"first", "second"}
    plan = plan_lib.from_config(cfg)
    for corpus in plan.corpora:
        label, body = corpus.label, "".join(plan_lib.load_segments(plan, corpus)[0])
        n = len(body.encode("utf-8"))
        tok, byt = data["per_corpus"][label], b["per_corpus"][label]
        assert tok["level"] == "tokens" and byt["level"] == "bytes"
        # the forking verdict names the rows it is about
        assert "forking_tokens" in tok["verdict"] and "forking_tokens" not in byt["verdict"]
        assert "forking_bytes" in byt["verdict"]
        cov = byt["coverage"]
        # Every byte of the corpus is a row, split into calibration and test.
        assert cov["positions"] == cov["bytes_total"] == n and cov["fraction_of_bytes"] == 1.0
        # and says nothing of co-aligned positions (no placeholders)
        assert not {"member_positions", "bytes_covered"} & set(cov)
        assert byt["split"]["calibration_positions"] + byt["split"]["test_positions"] == n
        assert tok["coverage"]["bytes_total"] == n > tok["coverage"]["bytes_covered"]
        assert len(cov["pruned_mean"]) == len(cov["lost_bits_per_byte"]) == 2
        assert all(0 <= x < 1 for x in cov["pruned_mean"] + cov["lost_bits_per_byte"])
        for m in byt["members"]:
            c = m["consistency"]
            assert m["positions"] == c["bytes"] == n
            # every tokenization counts: at most the canonical one's bits per byte,
            # give or take what pruning dropped
            assert c["byte"] <= c["canonical"] + c["lost"] + 1e-6
        # The stores hold every byte's distribution over the 257 byte events; the table
        # built from them gives every row's reported test NLL.
        segs = [x.encode() for x in plan_lib.load_segments(plan, corpus)[0]]
        meta = {"corpus": hashlib.sha256(b"\x00".join(segs)).hexdigest()[:16]}
        stored = []
        for name in ("tiny-a", "tiny-b"):
            path = byte_scorer.store_path(os.path.join(cfg.out_dir, label),
                                          plan_lib.Member(name))
            sc = byte_scorer._stored(path, name, segs, [], plan.bytes, meta)
            assert sc["gold"].tobytes() == body.encode("utf-8") and sc["logp"].shape == (n, 257)
            np.testing.assert_allclose(np.exp(sc["logp"].astype(np.float64)).sum(1), 1.0,
                                       rtol=1e-4)
            stored.append(sc)
        table = brf.bytes.scoring.byte_event_table(stored)
        test = table.take(np.nonzero(table.segment >= 1)[0])  # segment 0 calibrates
        (full,) = (pathlib.Path(cfg.out_dir) / label / "bytes").glob(
            f"report-{label}__bytes-*.json")
        rows = {m["label"]: m for m in json.load(open(full))["methods"]}
        for row in ("member 0 alone", "linear (tuned)", "born tanh"):
            r = rows[row]
            ev = evaluate(Fitted(row, r["method"], r["params"], np.asarray(r["weights"]), 0.0),
                          test)
            assert r["test"]["nll"] == pytest.approx(ev["nll"].mean(), rel=1e-5)
            assert r["test"]["bits_per_byte"] == pytest.approx(ev["nll"].mean() / np.log(2),
                                                               rel=1e-5)
    # The precision check: each member of the default pair rescored the first CHECK bytes
    # of the first test segment with the reference settings; the study's rows against
    # them, as recomputed here; each comparison's shift between the two views.
    from brf.bytes import Settings
    from brf.bytes.lm import ByteLM, score_text
    from brf.bytes.precision import compare
    from brf.eval import byte_precision
    p = b["precision"]
    assert p["reference"] == Settings(8, 1e-3, 0).as_dict() and p["slice_bytes"] == CHECK
    assert p["settings"] == Settings(2, 0.2, 1).as_dict()
    for corpus in plan.corpora:
        label = corpus.label
        segs = plan_lib.load_segments(plan, corpus)[0]
        c = p["per_corpus"][label]
        assert (c["segment"], c["bytes"]) == (1, CHECK)  # segment 0 calibrates
        text_b = segs[1].encode("utf-8")
        gold = np.frombuffer(text_b[:CHECK], np.uint8)
        offset = len(segs[0].encode("utf-8"))
        stored = [byte_scorer._stored(
            byte_scorer.store_path(os.path.join(cfg.out_dir, label), plan_lib.Member(name)),
            name, [x.encode() for x in segs], [], plan.bytes,
            {"corpus": hashlib.sha256(b"\x00".join(x.encode() for x in segs)).hexdigest()[:16]})
            for name in ("tiny-a", "tiny-b")]
        refs = []
        for name, sc in zip(("tiny-a", "tiny-b"), stored):
            m = members[name]
            lm = ByteLM(m.params, m.cfg, m.tokenizer, name=name)
            ref = score_text(lm, text_b, beam=8, threshold=1e-3, max_lag=0, n_bytes=CHECK)
            refs.append(ref.logp)
            want = compare(sc["logp"][offset:offset + CHECK], ref.logp, gold)
            got = c["members"][name]
            for k in ("dbpb", "tv_mean", "tv_p99", "tv_max"):
                assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (label, name, k)
            assert "merging" in got  # the study merges (max_lag 1)
        for key, v in c["verdicts"].items():
            assert key in ("nll [proposed]", "fair [proposed]")
            assert v["holds"] == byte_precision.holds(v["ci"], v["shift"])
            tables = [byte_precision.slice_table(
                [sc["logp"][offset:offset + CHECK] for sc in stored], gold, 1),
                byte_precision.slice_table(refs, gold, 1)]
            (full,) = (pathlib.Path(cfg.out_dir) / label / "bytes").glob(
                f"report-{label}__bytes-*.json")
            rows = {m["label"]: m for m in json.load(open(full))["methods"]}
            diffs = []
            for t in tables:
                nll = [evaluate(Fitted(r, rows[r]["method"], rows[r]["params"],
                                       np.asarray(rows[r]["weights"]), 0.0), t)["nll"]
                       for r in (v["brf"], v["other"])]
                diffs.append(float(np.mean(nll[0] - nll[1])))
            assert v["shift"] == pytest.approx(diffs[1] - diffs[0], abs=1e-5)
    assert set(p["pooled"]) == {"nll [proposed]", "fair [proposed]"}
    assert b["verdict"]["precision"].startswith("Each member's byte-level view")
    # Each member's consistency, prefixed members included.
    assert len(b["consistency"]["first"]) == 5 and len(b["consistency"]["second"]) == 2
    bp = b["prompts"]["first"]
    assert bp["effect"]["paired"] and "bottleneck" not in bp
    assert len(bp["same_model"]["members"]) == 2
    assert "swarm" not in bp and "swarm: first" not in b["verdict"]  # bytes.swarm=False
    assert bp["with_prefix"]["members"][0]["prefix_tokens"] > 0
    assert set(b["pooled"]) == set(b["pooled_fair"]) == {"proposed"}
    for key in ("nll: first", "nll: pooled (proposed)", "prompts: first"):
        assert key in b["verdict"], sorted(b["verdict"])
    assert "nats/byte" in b["verdict"]["nll: first"]
    # Which verdicts moved: each verdict's answer at both levels.
    moved = b["moved"]
    for key in ("first: nll [proposed]", "second: cross-term", "pooled: nll [proposed]",
                "pooled: fair [proposed]", "prompts: first: phase concentration",
                "first same model: nll [proposed]",
                "first: forking [proposed]"):
        assert key in moved["rows"], sorted(moved["rows"])
    for k, r in moved["rows"].items():
        assert r["moved"] == (r["tokens"] != r["bytes"]) and (k in moved["moved"]) == r["moved"]
    pooled = moved["rows"]["pooled: nll [proposed]"]
    assert pooled["tokens_value"] == pytest.approx(data["pooled"]["proposed"]["mean_difference"])
    assert pooled["bytes_value"] == pytest.approx(b["pooled"]["proposed"]["mean_difference"])
    assert data["verdict"]["every byte"].startswith("On every byte")
    md = open(os.path.join(cfg.out_dir, "report.md")).read()
    assert "| first / top-32 events | proposed |" in md  # the event-space check's fair row
    for head in ("## Every byte", "### Coverage and consistency", "### Verdicts on every byte",
                 "### Forking bytes", "### Which verdicts moved",
                 "### Precision of the members' byte-level views",
                 "### The byte-level verdicts against the approximation"):
        assert head in md, head
    for name in ("pooled_bytes.png", "gain_by_entropy_bytes.png", "first/bytes/sweep.png"):
        assert os.path.getsize(os.path.join(cfg.out_dir, name)) > 0, name

    # Notebook 02 reads the report, the byte level included.
    capsys.readouterr()
    _notebook_cells("02_validation_report", BRF_REPORT=os.path.join(cfg.out_dir, "report.json"))
    out = capsys.readouterr().out
    assert "beam 2, prune threshold 0.2" in out and f"of {len(moved['rows'])} verdicts moved" in out

    def rescored(*args, **kwargs):
        raise AssertionError("a byte store was rescored")
    # Resumes: nothing scored (no weights at hand, byte scoring forbidden) or refitted.
    with _forbid_fitting(), mock.patch.object(brf.bytes.scoring, "score_text", rescored):
        rep2 = _run(cfg, _forbid_scoring(members))
    assert rep2["pooled"] == rep["pooled"]
    for r in (rep, rep2):
        r["bytes"].pop("seconds")
    assert rep2["bytes"] == rep["bytes"]
    # Another beam, threshold or merge lag, other segments: another store key, rescored.
    segs = [s.encode() for s in plan_lib.load_segments(plan, plan.corpora[0])[0]]
    meta = {"corpus": hashlib.sha256(b"\x00".join(segs)).hexdigest()[:16]}
    path = byte_scorer.store_path(os.path.join(cfg.out_dir, "first"), plan_lib.Member("tiny-a"))
    same = plan_lib.ByteSettings(True, 2, 0.2, 1)
    assert byte_scorer._stored(path, "tiny-a", segs, [], same, meta) is not None
    for other in (plan_lib.ByteSettings(True, 3, 0.2, 1), plan_lib.ByteSettings(True, 2, 0.1, 1),
                  plan_lib.ByteSettings(True, 2, 0.2, 0)):
        assert byte_scorer._stored(path, "tiny-a", segs, [], other, meta) is None
    assert byte_scorer._stored(path, "tiny-a", segs[:-1], [], same, meta) is None


@pytest.mark.parametrize("change,match", [
    (dict(corpora="no-such-corpus"), "unknown corpus"),
    (dict(corpora="hamlet(max_chars=1000)"), "fewer than"),
    (dict(corpora="hamlet(max_chars=2100)", scoring__segment_chars=3000), "at least 2"),
    (dict(corpora="hamlet(colour=1)"), "unknown parameter"),
    (dict(variants="proposed, tuned"), "unknown method variant"),
    (dict(variants=""), r"^config.variants is empty; give one or more of the method variants "
     r"proposed, calibrated \(comma-separated\)$"),
    (dict(variants=" , "), r"^config.variants is empty; .* proposed, calibrated"),
    (dict(topk_sensitivity=8), "topk_sensitivity"),
    (dict(fit__max_iter=0), "max_iter"),
    (dict(stats__forking_top_fraction=1.5), "forking_top_fraction"),
    (dict(bytes__beam=0), r"config.bytes.beam must be an integer >= 1; got 0"),
    (dict(bytes__threshold=1.0), r"config.bytes.threshold must lie in \[0, 1\); got 1.0"),
    (dict(bytes__threshold=-0.1, bytes__enabled=True), r"bytes.threshold .* got -0.1"),
    (dict(bytes__max_lag=-1), r"config.bytes.max_lag must be an integer >= 0; got -1"),
    (dict(bytes__check_bytes=-1), r"config.bytes.check_bytes must be an integer >= 0"),
    (dict(bytes__reference_beam=0), r"config.bytes.reference_beam must be an integer >= 1"),
    (dict(bytes__reference_threshold=1.0), r"config.bytes.reference_threshold must lie in"),
])
def test_bad_study_config_is_refused_before_any_model_runs(tmp_path, text, change, match):
    cfg = _cfg(tmp_path, text, **change)
    with pytest.raises(UserError, match=match):
        _run(cfg, lambda name: pytest.fail("a model was loaded"))



def _ties_table(logp_PxNxE, gold=None):
    from brf.event_table import EventTable
    p, n, _ = logp_PxNxE.shape
    return EventTable(np.asarray(logp_PxNxE, np.float32),
                      np.zeros(p, np.int64) if gold is None else np.asarray(gold),
                      np.zeros((p, n), np.float32), np.ones(p, np.int64), np.arange(p))


def test_top1_ties_share_the_credit():
    """A tie at the top earns 1/(number tied), not a hit for the gold (event 0, which an
    argmax would always pick): identical uniform members over 4 events score chance."""
    from brf.eval import csv_analysis
    from brf.eval.fitting import Fitted, evaluate
    uniform = _ties_table(np.full((50, 2, 4), np.log(0.25)))
    for method in ("linear", "loglinear", "born"):
        ev = evaluate(Fitted("m", method, {}, np.full(2, 0.5), 0.0), uniform)
        np.testing.assert_allclose(ev["top1_credit"], 0.25, rtol=1e-12)
    # Every consumer sees the credit: the analysis's metrics (top-1 and ECE: confidence
    # 1/4 with accuracy 1/4 is perfectly calibrated) and the CSV analysis.
    from brf.eval import analysis
    m = analysis.metrics(ev, uniform.gold_bytes, n_boot=100, seed=0)
    assert m["top1_accuracy"] == pytest.approx(0.25) and m["ece"] == pytest.approx(0.0, abs=1e-6)
    rows = {r["label"]: r for r in csv_analysis.fusion_rows(uniform, ["linear", "contrastive"])}
    assert rows["member 0 alone"]["top1_accuracy"] == pytest.approx(0.25)
    assert rows["linear"]["top1_accuracy"] == pytest.approx(0.25)
    # One member; gold strictly on top, tied with one, tied with two, below the top.
    p = np.array([[.4, .3, .2, .1], [.35, .35, .2, .1], [.3, .3, .3, .1], [.2, .5, .2, .1],
                  [.25, .25, .25, .25]])
    table = _ties_table(np.log(p)[:, None, :], gold=[0, 1, 2, 0, 3])
    ev = evaluate(Fitted("m", "linear", {}, np.ones(1), 0.0), table)
    np.testing.assert_allclose(ev["top1_credit"], [1, 0.5, 1 / 3, 0, 0.25], rtol=1e-12)
    # Ties the fusion produces only up to float32 rounding still count as ties: a
    # member and its mirror image fused log-linearly are symmetric.
    rng = np.random.default_rng(0)
    a = rng.dirichlet(np.ones(6), size=40)
    b = a[:, ::-1]
    pair = _ties_table(np.log(np.stack([a, b], 1)), gold=np.zeros(40, np.int64))
    ev = evaluate(Fitted("m", "loglinear", {}, np.full(2, 0.5), 0.0), pair)
    q = np.log(a) + np.log(b)  # float64 reference: events e and 5 - e tie exactly
    ref = [1 / np.sum(np.isclose(r, r.max(), rtol=0, atol=1e-9)) if np.isclose(
        r[0], r.max(), rtol=0, atol=1e-9) else 0.0 for r in q]
    np.testing.assert_allclose(ev["top1_credit"], ref, rtol=1e-12)
    assert 0 < np.mean(ev["top1_credit"]) < 1 and set(np.round(ref, 6)) >= {0.5}


def _damage_warnings(caplog, path):
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and str(path) in r.getMessage() and "cannot be read"
            in r.getMessage()]


def test_damaged_score_store_is_rescored_with_a_warning(tmp_path, text, members, caplog):
    """A flipped byte anywhere in a member's score store never crashes the resume and
    never feeds damaged numbers on: the store reads back intact or is rescored with a
    warning that names it."""
    from brf.eval.scoring import load_partial, score_segments
    m = members["tiny-a"]
    ids = [scorer.encode(m.tokenizer, m.cfg, s)
           for s in plan_lib.split_segments(text[:2000], 700)]
    store = tmp_path / "scores-tiny-a.npz"
    kw = dict(top_k=8, chunk=128, store_path=str(store), meta={"member": "tiny-a"})
    ref = score_segments(m.params, m.cfg, ids, **kw)
    meta = {"member": "tiny-a", "top_k": 8, "n_segments": len(ids)}
    want = load_partial(str(store), meta)
    assert len(want) == len(ids)
    good = store.read_bytes()
    detected = 0
    for at in np.linspace(0, len(good) - 1, 97).astype(int):
        caplog.clear()
        store.write_bytes(good[:at] + bytes([good[at] ^ 0x5A]) + good[at + 1:])
        got = load_partial(str(store), meta)
        if got:
            for g, w in zip(got, want, strict=True):
                for name in w:
                    np.testing.assert_array_equal(g[name], w[name])
        else:
            assert _damage_warnings(caplog, store), at
            detected += 1
    assert detected > 80  # nearly every byte is array data under a CRC-32
    # A resumed scoring rescores the damaged store: the same numbers, a sound store.
    at = len(good) // 2
    store.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1:])
    caplog.clear()
    again = score_segments(m.params, m.cfg, ids, **kw)
    assert _damage_warnings(caplog, store) and "rescored" in _damage_warnings(caplog, store)[0]
    for name in ("gold_logp", "topk_logp", "topk_ids"):
        np.testing.assert_array_equal(getattr(again, name), getattr(ref, name))
    assert len(load_partial(str(store), meta)) == len(ids)


def test_damaged_byte_store_is_rescored_with_one_warning(tmp_path, text, members):
    """A damaged byte store is reported once, naming it (the study read it twice and
    warned twice, issue 37), and rescored: the same numbers, a sound store."""
    import warnings
    from brf.eval import byte_scorer
    from brf.eval.levels import Views
    segments = plan_lib.split_segments(text[:700], 350)
    member, settings = plan_lib.Member("tiny-a"), plan_lib.ByteSettings(True, 2, 0.2, 1)

    def score():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning, repeats included
            (sc,), _ = byte_scorer.score_members([member], segments, str(tmp_path),
                                                 Views(members.__getitem__),
                                                 settings=settings, chunk=128)
        return sc, [str(w.message) for w in caught]

    ref, said = score()
    path = byte_scorer.store_path(str(tmp_path), member)

    def damaged(said):
        return [m for m in said if m.startswith(f"byte store {path} is damaged")]

    assert not damaged(said), said
    good = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(good[:len(good) // 2])
    again, said = score()
    assert len(damaged(said)) == 1 and "rescoring it" in damaged(said)[0], said
    for name in ("gold", "logp", "gap"):
        np.testing.assert_array_equal(again[name], ref[name])
    data = [s.encode("utf-8") for s in segments]
    meta = {"corpus": hashlib.sha256("\x00".join(segments).encode()).hexdigest()[:16]}
    assert byte_scorer._stored(path, "tiny-a", data, [], settings, meta) is not None


@pytest.mark.parametrize("damage", ["truncated", "not JSON", "a list"])
def test_damaged_fit_cache_is_refitted_with_a_warning(tmp_path, caplog, damage):
    from brf.eval.caches import FitCache
    from brf.eval.fitting import Fitted, FitSettings, MethodSpec
    calib = _ties_table(np.log(np.random.default_rng(0).dirichlet(np.ones(5), (30, 2))))
    settings = FitSettings()
    path = tmp_path / "fits.json"
    spec = MethodSpec("linear", "linear")
    fit = Fitted("linear", "linear", {}, np.array([0.3, 0.7]), 1.25)
    FitCache(str(path), calib, settings).put(spec, fit)
    assert FitCache(str(path), calib, settings).get(spec).calib_nll == 1.25
    good = path.read_bytes()
    path.write_bytes({"truncated": good[:len(good) // 2], "not JSON": b"\x00\xff{",
                      "a list": b"[1, 2]"}[damage])
    caplog.clear()
    cache = FitCache(str(path), calib, settings)
    assert cache.get(spec) is None and _damage_warnings(caplog, path)
    cache.put(spec, fit)  # the refit replaces the damaged file
    assert FitCache(str(path), calib, settings).get(spec).calib_nll == 1.25


def test_damaged_bottleneck_cache_is_recomputed_with_a_warning(tmp_path, text, caplog,
                                                               monkeypatch):
    from brf.eval import bottleneck_eval
    calls = []

    def rows(*args, **kwargs):
        calls.append(1)
        return {"positions": 4, "rows": [{"label": "lp", "nll": 1.5 + len(calls)}]}

    monkeypatch.setattr(bottleneck_eval, "bottleneck_rows", rows)
    plan = plan_lib.from_config(_cfg(tmp_path, text))
    args = (plan, "tiny-a", ("", "B: "), ["one", "two"], str(tmp_path), lambda name: None)
    first = study.bottleneck_rows(*args)
    assert study.bottleneck_rows(*args) == first and len(calls) == 1  # read back
    (path,) = tmp_path.glob("bottleneck-*.json")
    path.write_bytes(path.read_bytes()[:-7])
    caplog.clear()
    again = study.bottleneck_rows(*args)
    assert len(calls) == 2 and again["rows"][0]["nll"] == 3.5 and _damage_warnings(caplog, path)
    assert study.bottleneck_rows(*args) == again and len(calls) == 2  # the rewrite is sound
