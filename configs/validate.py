"""The validation experiment: the paper's falsifiable tests on real models.

Run (the README's main job):
  python experiments/validate.py --config=configs/validate.py
Variants:
  python experiments/validate.py --config=configs/validate.py:short     # CI slice
  python experiments/validate.py --config=configs/validate.py --config.corpora=my.txt
  python experiments/validate.py --config=configs/validate.py --config.members=smollm2-135m-instruct,gemma3-270m
  python experiments/validate.py --config=configs/validate.py \
      --config.methods='linear, loglinear(temperature=fit(1.0))' --config.phase_maps='constant, tanh(rate=0.5)'

  python experiments/validate.py --config=configs/validate.py:full    # every analysis

`arg`: None (the main job), "full" (the main job plus the phase maps, analyses and
checks that answer no test of the paper: docs/study.md, "The default and :full"),
"short" (a short corpus slice, fewer resamples, as "full" otherwise).
"""

import math

import ml_collections

from brf.bytes import CHECK_BYTES, DEFAULT_BEAM, DEFAULT_MAX_LAG, DEFAULT_THRESHOLD, REFERENCE
from brf.errors import UserError
from brf.eval.config_specs import phase_map_entries
from brf.specs import format_spec


class ConfigArgError(UserError):
    """An unknown config argument (configs/validate.py:<arg>)."""


PI = math.pi
HAMLET_PREFIX = "The following is the text of Hamlet, a tragedy by William Shakespeare.\n\n"
SECOND_PREFIX = "Here is a passage of text.\n\n"
# The byte-level study (brf/eval/byte_scorer.py): each member's beam (hypotheses kept
# per byte), prune threshold (hypotheses below this fraction of the prefix mass
# are dropped; the mass they carried is reported) and merge lag (a hypothesis more
# than this many canonical tokens behind is merged into the canonical one; the mass
# merged is reported). The library's defaults (brf.bytes, their one home):
# BENCHMARKS.md, "Every byte", shows what they cost in speed and accuracy.
BYTE_BEAM = DEFAULT_BEAM
BYTE_PRUNE_THRESHOLD = DEFAULT_THRESHOLD
BYTE_MAX_LAG = DEFAULT_MAX_LAG


# BRF rows (":full", ":short"): one fitted setting per phase map (weights and map
# parameters tuned, per-member offsets included), plus the two reference points kept
# fixed. The main job keeps MAIN_PHASE_MAPS of them.
PHASE_MAPS = (
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
)


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    # Members, methods and phase maps are spec strings (brf/eval/config_specs.py),
    # so flags can set them: --config.members=smollm2-135m-instruct,gemma3-270m
    c.members = "smollm2-135m-instruct, gemma3-270m"
    # The study's corpora (brf.eval.corpus.CORPORA names or UTF-8 files), each with
    # optional max_chars / skip_chars / label and a steadying prefix for the
    # prompt study (brf/eval/study.py). Sizes give >= 10K co-aligned positions each.
    c.corpora = ", ".join([
        format_spec("hamlet", dict(max_chars=42_000, prefix=HAMLET_PREFIX)),
        format_spec("pyparsing", dict(max_chars=62_000)),
        format_spec("ataturk-1920", dict(max_chars=57_000)),
    ])
    c.out_dir = "runs/validate"
    # Every method (single members included) in each variant: as proposed, and
    # calibrated (a fitted post-fusion temperature and per-member temperatures);
    # verdicts compare like with like.
    c.variants = "proposed, calibrated"
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
    c.nll_baselines = "linear, loglinear"   # the methods BRF is compared with
    # Controls for the best per-token BRF row of each variant (brf/eval/controls.py):
    # its phases shuffled, per-token reshaping then a pool, per-member power mean.
    c.controls = True
    # The stability check (brf/eval/stability.py): the calibrated rows refitted under
    # a perturbation of the last bits ('+'-joined: order, ulp, chunk, sincos; '' = off),
    # and the verdicts that move reported (the goal: none).
    c.stability = "order+ulp+sincos"
    # It refits the rows within this many nats of the best row of some set a verdict
    # chooses from, and every control (widened when a refit moves a row further; 0:
    # every calibrated row).
    c.stability_reach = 0.02
    c.phase_maps = ", ".join(PHASE_MAPS)
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
    # Teacher-forced scoring and the calibration/test split.
    c.scoring = ml_collections.ConfigDict(dict(
        segment_chars=3000,           # per forward context (SmolLM2's context is 8192)
        top_k=64,                     # per-position summaries kept per member
        chunk=256,                    # tokens per forward pass
        min_chars=2000,               # a corpus shorter than this is refused
        calibration_fraction=0.5,     # the first half of the segments fits, the rest tests
    ))
    # Fits: full-batch L-BFGS on the calibration NLL (brf/eval/fitting.py). The
    # calibrated variant's temperatures lie in [1/calib_range, calib_range] (0 =
    # unbounded; docs/study.md, "Fits").
    # Each fit starts from its initial values (its proposed fit, for a calibrated row) and
    # `starts` random points, screened and polished (brf/eval/fitting.py); every other
    # positive parameter lies in [1/param_range, param_range]. `perturb` refits under
    # other last bits (order, ulp, chunk, sincos, '+'-joined: compare_fits' check).
    c.fit = ml_collections.ConfigDict(dict(max_iter=200, ftol=1e-8, gtol=1e-5,
                                           calib_range=1000.0, param_range=1000.0,
                                           starts=8, perturb=""))
    c.stats = ml_collections.ConfigDict(dict(
        n_boot=2000, n_perm=2000, seed=0,
        forking_top_fraction=0.2,     # the "forking tokens": top-20% entropy positions
    ))
    # The prompt study on corpora with a prefix: the prefix pair, one model under two
    # prefixes (the prefix vs second_prefix), the swarm of four (each model with and
    # without the prefix). Its NLL question is BRF's gap to the calibrated baselines.
    c.prompts = ml_collections.ConfigDict(dict(
        enabled=True, second_prefix=SECOND_PREFIX, swarm=True, variants="calibrated"))
    # Softmax-bottleneck rows (brf/eval/bottleneck_eval.py) for the same-model pair:
    # full logits recomputed at `positions` sampled test positions (0 = off), on a
    # support of each member's top `top_k` tokens.
    c.bottleneck = ml_collections.ConfigDict(dict(positions=64, top_k=256))
    c.topk_sensitivity = 256           # event space from top-256 strings on corpus 1 (0 = off)
    # The study on every byte (docs/study.md, "The study on every byte"): every member's
    # next-byte distributions over every byte of a span of each corpus (max_chars,
    # below), the same analyses as on co-aligned positions (default pair; with
    # prompts=True the prefix pair, same-model pair and swarm), and which verdicts
    # move. beam >= 1, threshold in [0, 1), max_lag >= 0 (0 = never merge, the
    # default: merging keeps no bound; brf.bytes.lm.score_text).
    # swarm=False leaves the swarm out at the byte level only (four members on every
    # byte: the study's longest fits, about an hour on a 2-core machine).
    # check_bytes: the precision check (brf/eval/byte_precision.py): that many bytes of
    # each corpus's first test segment rescored by each member with the reference
    # settings (reference_beam, reference_threshold, no merging; brf.bytes.REFERENCE),
    # the members' distance from them and how far it could move each byte-level
    # verdict (0 = no check).
    # max_chars: the byte level reads each corpus's first segments up to that many
    # characters (whole segments, at least two: one calibrates, one tests; 0 = every
    # segment). At these settings a member scores 8.5-83 bytes a second on a 2-core
    # CPU (BENCHMARKS.md, "The study's time"), so every byte of the three corpora for
    # both members would take about 4 hours of scoring alone; 6,000 characters per
    # corpus took 24 minutes. prompts: the prompt study (prefix pair, same-model
    # pair, swarm) at the byte level too (three more stores of Hamlet's span; False
    # keeps it to co-aligned positions).
    c.bytes = ml_collections.ConfigDict(dict(
        enabled=True, beam=BYTE_BEAM, threshold=BYTE_PRUNE_THRESHOLD, max_lag=BYTE_MAX_LAG,
        swarm=True, check_bytes=CHECK_BYTES, reference_beam=REFERENCE.beam,
        reference_threshold=REFERENCE.threshold, max_chars=6000, prompts=False))
    # JAX persistent compilation cache, in compilation_cache_dir ("" = $BRF_CACHE/jax_cache).
    c.compilation_cache = True
    c.compilation_cache_dir = ""
    # Devices (brf/sharding.py): segments over 'data', a member's weights over
    # 'model'; -1 = every device of this process the other axis leaves. Multi-host:
    # --config.distributed.enabled=True (+ coordinator_address, num_processes,
    # process_id, or none of them on a TPU pod / SLURM): each host scores its share.
    # placement="apart": each member on its own group of devices (the members are
    # scored at the same time; data/model then size each group's mesh).
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, placement="shared"))
    c.distributed = ml_collections.ConfigDict(dict(
        enabled=False, coordinator_address="", num_processes=0, process_id=-1))
    if arg in (None, ""):
        _main_job(c)
    if arg == "short":
        c.corpora = format_spec("hamlet", dict(max_chars=6000, prefix=HAMLET_PREFIX))
        c.topk_sensitivity = 128
        c.bottleneck.positions = 8
        c.scoring.segment_chars = 1500
        c.stats.n_perm = 300
        c.stats.n_boot = 300
        # Byte-level scoring of the real models is far slower than token-level
        # scoring (docs/study.md, "The study on every byte"): CI's short run keeps it off;
        # the tests run the byte level on tiny models.
        c.bytes.enabled = False
        c.out_dir = "runs/validate-short"
    elif arg not in (None, "", "full"):
        raise ConfigArgError(f"unknown config arg {arg!r}; use '', 'full' or 'short'")
    return c


# The main job's BRF rows: the two reference points, the fitted constant offset, one
# saturating per-position map and one per-token map (the controls' row). The other
# curves (linear, sigmoid, arctan, log1p and their per-token forms) answer no test of
# the paper that these do not, and are kept for ":full" (docs/study.md, "The default
# and :full", says how far their fits end from these).
MAIN_PHASE_MAPS = ("hellinger (equal phases)", "linear pool (pi/2)", "constant (fitted offset)",
                   "tanh", "token_tanh")


def _main_job(c) -> None:
    """The main job: every test of the paper (phase coherence, cross-term
    discrimination, BRF against the pools as proposed and calibrated, the controls) on
    the three corpora, the swarm and both levels, without what answers none of them
    (the other phase maps, the top-256 event space, the same-model pair and its
    softmax-bottleneck rows): ":full" runs those too."""
    c.phase_maps = ", ".join(spec for spec in PHASE_MAPS
                             if next(iter(phase_map_entries(spec))) in MAIN_PHASE_MAPS)
    c.topk_sensitivity = 0
    c.prompts.second_prefix = ""
