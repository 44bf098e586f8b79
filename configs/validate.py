"""The validation experiment: the paper's falsifiable tests on real models.

Run (the README's main job):
  python experiments/validate.py --config=configs/validate.py
Variants:
  python experiments/validate.py --config=configs/validate.py:short     # CI slice
  python experiments/validate.py --config=configs/validate.py --config.corpus=my.txt
  python experiments/validate.py --config=configs/validate.py --config.members='("smollm2-135m-instruct", "gemma3-270m")'

`arg`: None (full run), "short" (a short corpus slice, fewer resamples).
"""

import math

import ml_collections

PI = math.pi


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.members = ("smollm2-135m-instruct", "gemma3-270m")
    c.corpus = ""                      # a UTF-8 text file; "" = the default corpus
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
    # Baselines; member weights are always fitted unless fit_weights=False.
    c.methods = [
        dict(label="linear (tuned)", method="linear"),
        dict(label="loglinear (tuned)", method="loglinear", fit=dict(temperature=1.0)),
        # Context for the tuned temperature: how much of its gain is calibration.
        dict(label="loglinear (T=1)", method="loglinear", fixed=dict(temperature=1.0)),
        dict(label="power mean (tuned)", method="power", fit=dict(alpha=0.5)),
        dict(label="max pool", method="max"),
        dict(label="min pool", method="min"),
        dict(label="routing", method="routing", fit_weights=False,
             grid=dict(criterion=["max_prob", "neg_entropy", "gap"])),
        dict(label="entropy-gated", method="entropy_gated",
             grid=dict(threshold=[0.5, 1.0, 1.5, 2.0, 3.0], primary=[0, 1])),
        dict(label="contrastive", method="contrastive", fit_weights=False,
             grid=dict(beta=[0.1, 0.3, 0.5, 1.0], plausibility=[0.0, 1e-3, 1e-2])),
    ]
    c.nll_baselines = ("linear", "loglinear")
    # BRF: one fitted setting per phase map (weights and map parameters tuned,
    # per-member offsets included), plus the two reference points kept fixed.
    c.phase_maps = {
        "hellinger (equal phases)": "constant",
        "linear pool (pi/2)": f"constant(offset=[0, {PI / 2}])",
        "constant (fitted offset)": "constant",
        "linear": "linear(scale=0.2)",
        "tanh": "tanh(scale=1.5, rate=0.5)",
        "sigmoid": "sigmoid(scale=1.5, rate=1.0, center=2.0)",
        "arctan": "arctan(scale=1.5, rate=0.5)",
        "log1p": "log1p(scale=0.5, rate=1.0)",
        "token_linear": "token_linear(scale=0.2)",
        "token_tanh": "token_tanh(scale=1.5, rate=0.5)",
        "token_log1p": "token_log1p(scale=0.5, rate=1.0)",
    }
    c.fixed_phase_maps = ("hellinger (equal phases)", "linear pool (pi/2)")
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
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))
    c.distributed = ml_collections.ConfigDict(dict(
        enabled=False, coordinator_address="", num_processes=0, process_id=-1))
    if arg == "short":
        c.max_chars = 6000
        c.segment_chars = 1500
        c.n_perm = 300
        c.n_boot = 300
        c.fit_steps = 60
        c.out_dir = "runs/validate-short"
    elif arg not in (None, ""):
        raise ValueError(f"unknown config arg {arg!r}; use '' or 'short'")
    return c
