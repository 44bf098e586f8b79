"""The validation study on the real default pair (slow; a short corpus slice)."""

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from brf.checkpoints import registry  # noqa: E402
from brf.eval import plan as plan_lib, scorer  # noqa: E402
from brf.eval.corpus import load_default_corpus  # noqa: E402
from brf.eval.scoring import score_segments  # noqa: E402

from test_real_parity import _reference_model  # noqa: E402

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "validate_config", pathlib.Path(__file__).parent.parent / "configs" / "validate.py")
validate_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate_config)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_member_nll_matches_transformers(name):
    """Our stored gold log-probs equal transformers' on the same tokens."""
    text = load_default_corpus(min_chars=100)[:1500]
    model = registry.load(name, progress=False)
    ids = scorer.encode(model.tokenizer, model.cfg, text)
    scores = score_segments(model.params, model.cfg, [ids], top_k=8, chunk=256)
    ref = _reference_model(registry.resolve(name))
    with torch.no_grad():
        logits = ref(torch.tensor(ids[None], dtype=torch.long)).logits[0].double()
    logp = torch.log_softmax(logits, -1).numpy()
    want = logp[np.arange(len(ids) - 1), ids[1:]]
    got = scores.gold_logp.astype(np.float64)
    # Per-token log-probs agree to float32 rounding of logits (~1e-3 at most,
    # see test_real_parity); the mean NLL far tighter.
    np.testing.assert_allclose(got, want, atol=5e-3)
    assert abs(got.mean() - want.mean()) < 2e-4, (got.mean(), want.mean())
    np.testing.assert_array_equal(scores.topk_ids[:, 0], logp[:-1].argmax(-1))


@pytest.mark.extended  # test_runtime_install runs the study on the real pair, and
def test_study_on_the_default_pair(tmp_path):  # test_validate its prompt study on tiny ones
    """The study's short variant on the real pair: one corpus slice with the prompt
    study (prefix pair, same-model pair, swarm of four) and the event-space check."""
    from brf.eval import study
    cfg = validate_config.get_config("short")
    cfg.corpora = ('hamlet(max_chars=2500, prefix="The following is the text of Hamlet, a '
                   'tragedy by William Shakespeare.\n\n")')
    cfg.scoring.segment_chars = 1300  # two segments: one to fit on, one to test on
    cfg.out_dir = str(tmp_path / "run")
    cfg.methods = 'linear(label="linear (tuned)"), loglinear(label="loglinear (tuned)", ' \
                  'temperature=fit(1.0))'
    cfg.phase_maps = ('constant(label="hellinger (equal phases)", fixed=True), '
                      'constant(label="linear pool (pi/2)", offset=[0, pi/2], fixed=True), tanh')
    cfg.sweep = cfg.sweep[:1]
    rep = study.run(plan_lib.from_config(cfg))
    data = json.load(open(os.path.join(cfg.out_dir, "report.json")))
    main = data["per_corpus"]["hamlet"]
    assert main["members"][0]["vocab_size"] == 49152
    assert main["members"][1]["vocab_size"] == 262144
    # Real tokenizers agree on most of plain English text.
    assert main["coverage"]["fraction_of_bytes"] > 0.5, main["coverage"]
    by = {(m["label"], m["variant"]): m["test_nll"] for m in main["methods"]}
    for v in ("proposed", "calibrated"):
        lin = by[("linear (tuned)" + ("" if v == "proposed" else " [calibrated]"), v)]
        members = [by[(f"member {i} alone" + ("" if v == "proposed" else " [calibrated]"), v)]
                   for i in range(2)]
        # Fusing two real models beats the weaker one alone on these positions.
        assert lin < max(members)
    pr = data["prompts"]["hamlet"]
    assert pr["effect"]["paired"]
    assert pr["with_prefix"]["members"][0]["prefix_tokens"] > 5
    assert len(pr["swarm"]["members"]) == 4
    # One model under two prefixes: one tokenizer, every position co-aligned.
    assert pr["same_model"]["coverage"]["fraction_of_member_positions"] == [1.0, 1.0]
    assert data["topk_sensitivity"]["top_k"] == [64, 128]
    # Softmax-bottleneck rows on the same-model pair: W_1 = W_2 makes every sampled
    # position infeasible unless the prompts agree; least squares converges there.
    b = {r["method"]: r for r in pr["bottleneck"]["rows"]}
    assert set(b) == {"linear", "loglinear", "bottleneck_lsq", "bottleneck_lp",
                      "bottleneck_qp", "bottleneck_maxent"}
    assert b["bottleneck_lsq"]["regimes"]["infeasible"] == pr["bottleneck"]["positions"] == 8
    assert b["bottleneck_lsq"]["converged_fraction"] == 1.0
    assert "nll: pooled (calibrated)" in rep["verdict"] and "event space" in rep["verdict"]
