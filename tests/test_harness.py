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

Skipped when lm_eval (the ``harness`` extra) or torch is not installed.
"""

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
