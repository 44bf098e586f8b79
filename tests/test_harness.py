"""brf as a model of lm-evaluation-harness (brf/harness) against independent references.

* One tiny random Llama, built and saved by transformers in the test, through brf's
  harness model and through the harness's own Hugging Face backend (``HFLM``): every
  loglikelihood within 1e-4 nats, the same is_greedy, the same rolling log-likelihood,
  the same greedy generate_until text.
* Two members sharing a vocabulary: the fused loglikelihood equals a float64 NumPy
  computation from each member's logits (linear pool; Born with a tanh phase map).
* Two members across tokenizers, exact mode: the byte-level loglikelihood of a short
  continuation equals the linear pool of each member's next-byte probabilities from a
  brute force over every tokenization (tests/byte_reference.py).
* Model args in the harness's comma-split form; bad ones refused in one line.

The test extra installs lm_eval and accelerate; skipped where lm_eval or torch is missing.
"""

from unittest import mock

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402

import brf.harness as H  # noqa: E402
from brf.errors import UserError  # noqa: E402
from brf.harness.ensemble import HarnessInputError  # noqa: E402
from tests import fusion_reference as ref  # noqa: E402

ATOL = 1e-4
PAIRS = [("The cat", " sat"), ("", "the hat"), ("in the ", "house"), ("a", " b c"),
         ("One two three four", " five six"), ("x\n", "the end")]


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random LlamaForCausalLM with a byte-level BPE tokenizer, saved by transformers."""
    from tests.tiny_lm import tiny_tokenizer
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(conf).float().eval()
    with torch.no_grad():  # peaked distributions: some continuations are greedy
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def both(hf_dir):
    from lm_eval.models.huggingface import HFLM
    theirs = HFLM(pretrained=hf_dir, device="cpu", dtype="float32", batch_size=1)
    ours = H.BRFLM(members=hf_dir, batch_size=4)
    return ours, theirs


def test_loglikelihood_equals_the_harness_hf_backend(both):
    ours, theirs = both
    pairs = list(PAIRS)
    for ctx in ("The cat", "in the house", "a b"):  # the model's own greedy next token
        ids = theirs.tokenizer.encode(ctx)
        with torch.no_grad():
            top = int(theirs.model(torch.tensor([ids])).logits[0, -1].argmax())
        pairs.append((ctx, theirs.tokenizer.decode([top])))
    reqs = [_req("loglikelihood", p, i) for i, p in enumerate(pairs)]
    got, want = ours.loglikelihood(reqs), theirs.loglikelihood(reqs)
    assert ours.level == "tokens"
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=ATOL)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert any(w[1] for w in want), "no greedy continuation: the check would be vacuous"


def test_rolling_equals_the_harness_hf_backend(both):
    ours, theirs = both
    docs = ["the cat sat on the mat. " * 3, "in the house"]
    reqs = [_req("loglikelihood_rolling", (d,), i) for i, d in enumerate(docs)]
    np.testing.assert_allclose(ours.loglikelihood_rolling(reqs),
                               theirs.loglikelihood_rolling(reqs), atol=ATOL)


def test_greedy_generation_equals_the_harness_hf_backend(both):
    ours, theirs = both
    kw = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    reqs = [_req("generate_until", (c, dict(kw)), i)
            for i, c in enumerate(["The cat", "in the house", "a b"])]
    got, want = ours.generate_until(reqs), theirs.generate_until(reqs)
    assert got == want and any(got)


@pytest.fixture(scope="module")
def shared():
    from tests.tiny_lm import tiny_pair, tiny_tokenizer
    return tiny_pair(tiny_tokenizer())


def _member_logits(members, ctx_ids, cont_ids):
    """Each member's logits at the continuation's positions, [C, n, V] float64."""
    from brf.models import forward
    out = []
    for m in members:
        ids = np.asarray([ctx_ids + cont_ids], np.int32)
        x, _ = forward(m.params, m.cfg, ids)
        out.append(np.asarray(x[0, len(ctx_ids) - 1:-1], np.float64))
    return np.stack(out, axis=1)


@pytest.mark.parametrize("method, phase", [("linear", ""), ("born", "tanh(rate=0.5)")])
def test_fused_loglikelihood_equals_a_float64_reference(shared, method, phase):
    lm = H.BRFLM(members=shared, method=method, phase=phase, batch_size=3)
    got = lm.loglikelihood([_req("loglikelihood", p, i) for i, p in enumerate(PAIRS)])
    tok, w = shared[0].tokenizer, np.array([0.5, 0.5])
    for (ctx, cont), (lp, greedy) in zip(PAIRS, got):
        ctx_ids, cont_ids = H.ensemble.encode_pair(tok, ctx, cont)
        l = _member_logits(shared, ctx_ids, cont_ids)
        if method == "linear":
            q = ref.linear(l, w)
        else:
            q, _ = ref.born(l, w, ref.phases(l, "tanh", scale=np.pi, rate=0.5))
        want = np.log(q[np.arange(len(cont_ids)), cont_ids]).sum()
        assert abs(lp - want) < ATOL, (ctx, cont, lp, want)
        assert greedy == bool(np.all(q.argmax(-1) == cont_ids))


@pytest.mark.parametrize("level", ["tokens", "bytes"])
def test_speculative_generation_gives_the_plain_greedy_text(shared, level):
    """speculative=<drafter> in generate_until: greedy speculative fused decoding is the
    same text as plain fused decoding (tokens: two members sharing a vocabulary; bytes:
    two tokenizers), with the request's stop string and length."""
    from tests.tiny_lm import tiny_cross_pair, tiny_tokenizer
    members = shared if level == "tokens" else tiny_cross_pair(tiny_tokenizer())
    kw = {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False}
    reqs = [_req("generate_until", (c, dict(kw)), i)
            for i, c in enumerate(["The cat", "in the house the", "a b a b"])]
    plain = H.BRFLM(members=members, method="born", phase="tanh(rate=0.5)", batch_size=2)
    fast = H.BRFLM(members=members, method="born", phase="tanh(rate=0.5)", batch_size=2,
                   speculative="ngram(n=2; k=4)")
    assert plain.level == fast.level == level
    want = plain.generate_until(reqs)
    assert fast.generate_until(reqs) == want and any(want)


def test_byte_level_exact_equals_brute_force():
    from tests.byte_reference import BruteForce
    from tests.tiny_lm import tiny_cross_pair, tiny_tokenizer
    members = tiny_cross_pair(tiny_tokenizer())
    lm = H.BRFLM(members=members, precision="exact")
    assert lm.level == "bytes"
    ctx, cont = "the", " cat"
    (lp, _), = lm.loglikelihood([_req("loglikelihood", (ctx, cont))])
    assert lm.byte_reports[-1].lost == [0.0, 0.0]
    data = cont.encode()
    prefix = []  # per member, P(data[:k] | ctx) for k = 0..len
    for m, view in zip(members, lm.ensemble.views()):
        bf = BruteForce(m.params, m.cfg, view.codec.table, m.prompt_ids(ctx))
        prefix.append([1.0] + [bf.prefix_prob(data[:k])[0] for k in range(1, len(data) + 1)])
    want = sum(np.log(sum(0.5 * p[k + 1] / p[k] for p in prefix)) for k in range(len(data)))
    assert abs(lp - want) < ATOL, (lp, want)


def test_model_args_in_the_harness_form():
    from lm_eval.utils import simple_parse_args_string
    s = ("members=random:smollm2-135m-instruct:0(weight=0.5); "
         "random:smollm2-135m-instruct:1(weight=0.5),method=born,phase=tanh(rate=0.5; "
         "offset=[0; 0.5]),batch_size=2")
    a = H.ModelArgs.parse(simple_parse_args_string(s))
    assert a.members.count(",") == 1 and a.phase == "tanh(rate=0.5, offset=[0, 0.5])"
    assert a.batch_size == 2 and H.commas('x(prefix="a;b"); y') == 'x(prefix="a;b"), y'
    for bad, says in [({"members": "a", "colour": 1}, "unknown model arg"),
                      ({"members": "nosuchmodel"}, "nosuchmodel"),
                      ({"members": "random:smollm2-135m-instruct", "method": "nosuch"}, "nosuch"),
                      ({"members": "random:smollm2-135m-instruct", "level": "words"}, "level"),
                      ({"members": "random:smollm2-135m-instruct",
                        "speculative": "nosuch(k=2)"}, "speculative"),
                      ({"members": "random:smollm2-135m-instruct",
                        "speculative": "ngram(k=10**12)"}, "speculative"),
                      ({"members": "random:smollm2-135m-instruct", "precision": "ok"},
                       "precision")]:
        with pytest.raises(UserError) as e:
            H.ModelArgs.parse(bad)
        assert says in str(e.value) and "\n" not in str(e.value)


def test_registered_under_brf():
    from lm_eval.api.registry import get_model
    assert get_model("brf") is H.BRFLM
    with pytest.raises(HarnessInputError, match="share one vocabulary"):
        from tests.tiny_lm import tiny_cross_pair, tiny_tokenizer
        H.BRFLM(members=tiny_cross_pair(tiny_tokenizer()), level="tokens")


def test_committed_task_data_equal_a_fresh_build(tmp_path):
    from brf.harness.tasks import TASKS_DIR, build
    for path in build(tmp_path):
        assert path.read_bytes() == (TASKS_DIR / "data" / path.name).read_bytes(), path.name


def test_tiny_experiment_runs_the_shipped_tasks(tmp_path, monkeypatch):
    """configs/harness.py:tiny through lm_eval.simple_evaluate: a results JSON per
    variant and the table; an unknown task refused in one line first."""
    import importlib.util
    import json
    from brf.harness.run import check_tasks, run
    from brf.harness.tasks import ROOT
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    spec = importlib.util.spec_from_file_location("harness_config", ROOT / "configs/harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config("tiny")
    c.variants, c.limit, c.output = "linear, born", 2, str(tmp_path / "out")
    with pytest.raises(HarnessInputError, match="unknown task") as e:
        check_tasks(["nosuch_task"], c.include_path)
    assert "\n" not in str(e.value)
    rows = run(c)
    assert [r["variant"] for r in rows] == ["linear", "born"]
    for r in rows:
        assert set(r["tasks"]) == {"brf_hamlet_next_line", "brf_python_next_line"}
    got = json.loads((tmp_path / "out" / "born.json").read_text())
    assert got["results"]["brf_hamlet_next_line"]["acc,none"] in (0.0, 0.5, 1.0)
    assert "| born | brf_hamlet_next_line | acc |" in (tmp_path / "out" / "table.md").read_text()


def _tempered64(logp, t):
    """log_softmax(logp / t) in float64, -inf kept."""
    x = np.where(np.isfinite(logp), logp / t, -np.inf)
    return ref.log_softmax(x)


def test_tempered_is_the_studys_calibrated_fusion():
    """`tempered` (the study's calibrated variant as a method): each member tempered, the
    inner method (Born with a tanh map), the result tempered: a float64 reference."""
    from brf.fusion import fuse
    from brf.harness import calibrated  # noqa: F401 -- registers 'tempered'
    rng = np.random.default_rng(3)
    l = rng.normal(size=(6, 2, 40)) * 3
    l[:, 1, 5] = -np.inf
    w, tm, t = np.array([0.3, 0.7]), np.array([2.0, 0.6]), 0.45
    got = np.asarray(fuse("tempered", l.astype(np.float32), w.astype(np.float32),
                          member_temperature=tm.tolist(), temperature=t, inner="born",
                          inner_params={"phase": {"name": "tanh", "scale": 1.3, "rate": 0.4,
                                                  "offset": [0.0, 0.8]}}))
    lp = np.stack([_tempered64(ref.log_softmax(l[:, i]), tm[i]) for i in range(2)], axis=1)
    q, _ = ref.born(lp, w, ref.phases(lp, "tanh", offset=np.array([0.0, 0.8]), scale=1.3,
                                      rate=0.4))
    want = _tempered64(np.log(q), t)
    ok = np.isfinite(want)
    assert np.array_equal(ok, np.isfinite(got))
    np.testing.assert_allclose(got[ok], want[ok], atol=2e-5)


def _fake_study(root, corpus, members, row):
    """A study directory holding one byte-level report of ``corpus`` whose calibrated
    fair summary chose ``row``."""
    import json
    d = root / corpus / "bytes"
    d.mkdir(parents=True)
    (d / f"report-{corpus}__bytes-0.json").write_text(json.dumps(dict(
        members=[dict(name=n) for n in members], methods=[row],
        fair_summary=dict(calibrated=dict(brf=dict(label=row["label"]))))))
    return str(root)


def test_a_study_row_on_bytes_equals_a_float64_reference(tmp_path):
    """study=<dir>:<corpus>: the byte-level loglikelihood under the study's calibrated row
    (here a linear pool between temperings, weights 0.25 / 0.75) equals a float64
    computation from each member's exact next-byte distributions; bad studies refused."""
    from tests.tiny_lm import tiny_cross_pair, tiny_pair, tiny_tokenizer
    members = tiny_cross_pair(tiny_tokenizer())
    row = dict(label="linear pool [calibrated]", method="linear", weights=[0.25, 0.75],
               params={"calib.member_temperature": [1.7, 0.8], "calib.temperature": 1.3})
    where = _fake_study(tmp_path, "c", ["a", "b"], row) + ":c"
    cache = {}
    lm = H.BRFLM(members=members, study=where, precision="exact", byte_cache=cache)
    ctx, cont = "the", " cat"
    (lp, _), = lm.loglikelihood([_req("loglikelihood", (ctx, cont))])
    assert sum(k[0] != "view" for k in cache) == 2  # each member's scores, read back
    import brf.bytes.lm
    with mock.patch.object(brf.bytes.lm, "score_text", side_effect=AssertionError("rescored")):
        again = H.BRFLM(members=members, study=where, precision="exact", byte_cache=cache)
        assert again.loglikelihood([_req("loglikelihood", (ctx, cont))])[0][0] == lp
    from brf.bytes.lm import score_text
    rows = [np.asarray(score_text(v, cont.encode(), context_ids=lm.ensemble.byte_context(
        m, v, ctx), beam=lm.ensemble.beam, threshold=0.0).logp, np.float64)
        for m, v in zip(members, lm.ensemble.views())]
    q = sum(wi * np.exp(_tempered64(r, t)) for wi, r, t in zip([0.25, 0.75], rows, [1.7, 0.8]))
    logq = _tempered64(np.log(q), 1.3)
    want = sum(logq[k, b] for k, b in enumerate(cont.encode()))
    assert abs(lp - want) < ATOL, (lp, want)
    for kw, says in [(dict(study=where, method="born"), "no method or phase"),
                     (dict(study=str(tmp_path / "none") + ":c"), "not a directory"),
                     (dict(study=str(tmp_path) + ":other"), "no byte-level report"),
                     (dict(study="results"), "<study dir>:<corpus>")]:
        with pytest.raises(HarnessInputError, match=says) as e:
            H.BRFLM(members=members, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(HarnessInputError, match="fitted on members"):
        H.BRFLM(members=members[::-1], study=where)
    pair = tiny_pair(tiny_tokenizer())
    other = _fake_study(tmp_path / "t", "c", [m.name for m in pair], row) + ":c"
    with pytest.raises(HarnessInputError, match="fitted per byte"):
        H.BRFLM(members=pair, study=other, level="tokens")


def test_paired_statistics_match_scipy():
    """Wilson intervals and the exact McNemar test against scipy; the paired bootstrap
    interval holds the mean difference; the comparison calls a clear difference and not
    a tie."""
    from scipy import stats
    from brf.harness.run import compare, mcnemar_exact, paired, wilson
    for k, n in [(0, 5), (3, 10), (47, 50), (20, 20)]:
        ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
        np.testing.assert_allclose(wilson(k, n), (ci.low, ci.high), atol=1e-12)
    for b, c in [(0, 0), (1, 0), (3, 9), (12, 12), (2, 20)]:
        want = 1.0 if b + c == 0 else stats.binomtest(b, b + c, 0.5).pvalue
        assert abs(mcnemar_exact(b, c) - want) < 1e-12, (b, c)
    rng = np.random.default_rng(0)
    a, p = (rng.random(200) < 0.8).astype(float), (rng.random(200) < 0.5).astype(float)
    st = paired(a, p)
    assert st["ci"][0] < st["difference"] < st["ci"][1] and st["p_value"] < 1e-6
    docs = lambda x: {"t": {"acc": list(x)}}  # noqa: E731
    rows = [dict(variant="linear", method="linear", members=["a", "b"], docs=docs(p)),
            dict(variant="loglinear", method="loglinear", members=["a", "b"],
                 docs=docs(p * (rng.random(200) < 0.9))),
            dict(variant="born", method="born", members=["a", "b"], docs=docs(a)),
            dict(variant="tie", method="born", members=["a", "b"], docs=docs(p)),
            dict(variant="study row", method="linear", members=["a", "b"], docs=docs(a),
                 study="s:c")]  # a BRF variant, never the pool
    got = {c["brf"]: c for c in compare(rows)}
    assert got["born"]["pool"] == "linear"  # the better pool
    assert got["born"]["verdict"] == "BRF higher"
    assert got["tie"]["verdict"] == "not distinguishable"
    assert got["study row"]["pool"] == "linear" and got["study row"]["verdict"] == "BRF higher"


def test_byte_level_rolling_reads_long_documents_in_windows():
    """loglikelihood_rolling across tokenizers: a document that fits is one window (the
    byte level's loglikelihood of the whole text after BOS); with a short max_length it
    is read in windows that cover every byte once, each window with its context within
    max_length tokens for every member, and the total is their fused sum."""
    from brf.bytes.lm import score_text
    from tests.tiny_lm import tiny_cross_pair, tiny_tokenizer
    members = tiny_cross_pair(tiny_tokenizer())
    doc = "the cat sat on the mat. " * 3 + "a hat in the house\nthe end"
    whole = H.BRFLM(members=members)
    (lp1,) = whole.loglikelihood_rolling([_req("loglikelihood_rolling", (doc,))])
    (lp_ll, _), = whole.loglikelihood([_req("loglikelihood", ("", doc))])
    assert abs(lp1 - lp_ll) < 1e-9, (lp1, lp_ll)
    short = H.BRFLM(members=members, max_length=24)
    e = short.ensemble
    windows = e.byte_windows(doc.encode())
    assert len(windows) > 3 and windows[0][0] == 0 and windows[-1][1] == len(doc.encode())
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    want = 0.0
    for start, end, contexts in windows:
        piece = doc.encode()[start:end]
        rows = []
        for lm, ids in zip(e.views(), contexts):
            assert len(ids) + len(lm.encode(piece)) <= 24
            rows.append(score_text(lm, piece, context_ids=ids, beam=e.beam,
                                   threshold=e.threshold).logp)
        p = 0.5 * np.exp(np.asarray(rows[0], np.float64)) + 0.5 * np.exp(
            np.asarray(rows[1], np.float64))
        want += sum(np.log(p[k, b]) for k, b in enumerate(piece))
    (lp,) = short.loglikelihood_rolling([_req("loglikelihood_rolling", (doc,))])
    assert abs(lp - want) < ATOL and abs(lp - lp1) > 1e-3, (lp, want, lp1)
    assert short.byte_reports[-1].n_bytes == len(doc.encode())
