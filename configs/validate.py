"""The validation experiment: the paper's falsifiable tests on real models.

Run (the README's main job):
  python experiments/validate.py --config=configs/validate.py
Variants:
  python experiments/validate.py --config=configs/validate.py:short     # CI slice
  python experiments/validate.py --config=configs/validate.py --config.corpus=my.txt
  python experiments/validate.py --config=configs/validate.py --config.members=smollm2-135m-instruct,gemma3-270m
  python experiments/validate.py --config=configs/validate.py \
      --config.methods='linear, loglinear(temperature=fit(1.0))' --config.phase_maps='constant, tanh(rate=0.5)'

`arg`: None (full run), "short" (a short corpus slice, fewer resamples).
"""

import math

import ml_collections

from brf.errors import UserError
from brf.specs import format_spec


class ConfigArgError(UserError):
    """An unknown config argument (configs/validate.py:<arg>)."""


PI = math.pi
HAMLET_PREFIX = "The following is the text of Hamlet, a tragedy by William Shakespeare.\n\n"
SECOND_PREFIX = "Here is a passage of text.\n\n"


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    # Members, methods and phase maps are spec strings (brf/eval/config_specs.py),
    # so flags can set them: --config.members=smollm2-135m-instruct,gemma3-270m
    c.members = "smollm2-135m-instruct, gemma3-270m"
    # The study's corpora (brf.eval.corpus.CORPORA names or UTF-8 files), each with
    # optional max_chars / skip_chars / label and a steadying prefix for the
    # prompt study. See brf/eval/study.py.
    # Sizes give >= 10K co-aligned positions each (10.4K, 11.1K, 11.0K).
    c.corpora = ", ".join([
        format_spec("hamlet", dict(max_chars=42_000, prefix=HAMLET_PREFIX)),
        format_spec("pyparsing", dict(max_chars=62_000)),
        format_spec("ataturk-1920", dict(max_chars=57_000)),
    ])
    c.corpus = ""                      # a UTF-8 text file: the study on this text alone
    c.prompt_study = True              # prefix pair, same-model pair, swarm on corpora with a prefix
    c.second_prefix = SECOND_PREFIX    # the same-model pair: prefix vs this one
    c.swarm = True                     # four members: each model with and without the prefix
    # Variants in the prompt study's analyses (prefix pair, same-model pair, swarm);
    # its NLL question is BRF's gap to the calibrated baselines. "" = c.variants.
    c.prompt_variants = "calibrated"
    # Softmax-bottleneck rows (brf/eval/bottleneck_eval.py) for the same-model pair:
    # full logits recomputed at this many sampled test positions (0 = off).
    c.bottleneck_positions = 64
    # Support of the bottleneck methods there: each member's top bottleneck_top_k
    # tokens. At 256 (2 x 256 = 512 tokens, below the constraints' rank d + 1 = 577
    # for SmolLM2) the LP, QP and min-KL fall back at every position; 512 lets them
    # converge but costs minutes per method (README, "Softmax-bottleneck fusion").
    c.bottleneck_top_k = 256
    c.topk_sensitivity = 256           # event space from top-256 strings on corpus 1 (0 = off)
    c.default_plays = ("tragedies/hamlet",)
    c.min_chars = 2000
    c.max_chars = 42_000               # of the default corpus (~13K SmolLM2 tokens, ~10K co-aligned)
    c.segment_chars = 3000             # per forward context (SmolLM2's context is 8192)
    c.top_k = 64                       # per-position summaries kept per member
    c.chunk = 256                      # tokens per forward pass while scoring
    c.calibration_fraction = 0.5
    c.seed = 0
    c.out_dir = "runs/validate"
    # JAX persistent compilation cache, in compilation_cache_dir ("" = $BRF_CACHE/jax_cache).
    c.compilation_cache = True
    c.compilation_cache_dir = ""
    c.fit_steps = 150
    c.learning_rate = 0.05
    c.fit_batch = 2048                 # positions per Adam step (0 = all)
    c.n_perm = 2000
    c.n_boot = 2000
    # Baselines (brf.fusion.METHODS): a value is fixed, fit(x) is fitted from x,
    # grid(a, b, ...) is searched; member weights are fitted unless fit_weights=False.
    c.methods = ", ".join([
        'linear(label="linear (tuned)")',
        'loglinear(label="loglinear (tuned)", temperature=fit(1.0))',
        # Context for the tuned temperature: how much of its gain is calibration.
        'loglinear(label="loglinear (T=1)", temperature=1.0)',
        'power(label="power mean (tuned)", alpha=fit(0.5))',
        'max(label="max pool")',
        'min(label="min pool")',
        'routing(label="routing", fit_weights=False, '
        'criterion=grid("max_prob", "neg_entropy", "gap"))',
        'entropy_gated(label="entropy-gated", threshold=grid(0.5, 1.0, 1.5, 2.0, 3.0), '
        'primary=grid(0, 1))',
        'contrastive(label="contrastive", fit_weights=False, beta=grid(0.1, 0.3, 0.5, 1.0), '
        'plausibility=grid(0.0, 1e-3, 1e-2))',
        # PackLLM: logit fusion with per-position weights from each member's
        # perplexity on the segment so far (temperature fitted).
        'loglinear(label="PackLLM (perplexity weights)", weighting="perplexity", '
        'temperature=1.0)',
    ])
    c.nll_baselines = ("linear", "loglinear")
    # Every method (single members included) in each variant: as proposed, and
    # calibrated (a fitted post-fusion temperature and per-member temperatures);
    # verdicts compare like with like.
    c.variants = "proposed, calibrated"
    c.forking_top_fraction = 0.2     # the "forking tokens": top-20% entropy positions
    # BRF: one fitted setting per phase map (weights and map parameters tuned,
    # per-member offsets included), plus the two reference points kept fixed.
    c.phase_maps = ", ".join([
        'constant(label="hellinger (equal phases)", fixed=True)',
        'constant(label="linear pool (pi/2)", offset=[0, pi/2], fixed=True)',
        'constant(label="constant (fitted offset)")',
        "linear(scale=0.2)",
        "tanh(scale=1.5, rate=0.5)",
        "sigmoid(scale=1.5, rate=1.0, center=2.0)",
        "arctan(scale=1.5, rate=0.5)",
        "log1p(scale=0.5, rate=1.0)",
        "token_linear(scale=0.2)",
        "token_tanh(scale=1.5, rate=0.5)",
        "token_log1p(scale=0.5, rate=1.0)",
    ])
    # Sweep curves (uniform weights): the phase-difference family and the
    # scale of each curve.
    c.sweep = [
        dict(label="constant", phase_map="constant", param="offset_difference",
             values=[i * PI / 8 for i in range(9)]),
    ] + [
        dict(label=name, phase_map=name, param="scale",
             values=[0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0])
        for name in ("tanh", "arctan", "log1p", "token_tanh", "token_log1p")
    ]
    # Devices (brf/sharding.py): segments over 'data', a member's weights over
    # 'model'; -1 = every device of this process the other axis leaves. Multi-host:
    # --config.distributed.enabled=True (+ coordinator_address, num_processes,
    # process_id, or none of them on a TPU pod / SLURM): each host scores its share.
    # placement="apart": each member on its own group of devices (the members are
    # scored at the same time; data/model then size each group's mesh).
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, placement="shared"))
    c.distributed = ml_collections.ConfigDict(dict(
        enabled=False, coordinator_address="", num_processes=0, process_id=-1))
    if arg == "short":
        c.corpora = format_spec("hamlet", dict(max_chars=6000, prefix=HAMLET_PREFIX))
        c.topk_sensitivity = 128
        c.bottleneck_positions = 8
        c.max_chars = 6000
        c.segment_chars = 1500
        c.n_perm = 300
        c.n_boot = 300
        c.fit_steps = 60
        c.out_dir = "runs/validate-short"
    elif arg not in (None, ""):
        raise ConfigArgError(f"unknown config arg {arg!r}; use '' or 'short'")
    return c
