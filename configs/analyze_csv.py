"""Run brf's analyses on two (or more) logit CSVs of the same text.

  python experiments/analyze_csv.py --config=configs/analyze_csv.py \
      --config.csvs=runs/smollm2.csv,runs/smollm2-pirate.csv --config.out_dir=runs/analysis

Writes analysis.json, analysis.md, phase_differences.png and fusion_nll.png
(brf/eval/csv_analysis.py says what each number is). Two tokenizers
(--config.align=bytes, the default 'auto' picks it when the vocabulary sizes
differ) are compared on co-aligned byte offsets, as in the validation run.

`arg`: 'tiny' (fewer resamples; what the tests run).
"""

import ml_collections

from brf.eval.csv_analysis import DEFAULT_PHASE_MAPS


def get_config(arg=None):
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown config arg {arg!r}; use '' or 'tiny'")
    c = ml_collections.ConfigDict()
    c.csvs = ""                   # comma-separated CSV paths (two or more)
    c.out_dir = "runs/analysis"
    c.align = "auto"              # auto | position | bytes
    c.vocab_sizes = ""            # comma-separated V per CSV when its metadata lacks one
    c.phase_maps = dict(DEFAULT_PHASE_MAPS)
    c.born_phase = "tanh(scale=1.5, rate=0.5)"  # the Born setting of the cross-term test
    c.fusion_methods = ""         # comma-separated; "" = every registered method
    c.n_perm = 2000
    c.n_boot = 1000
    c.seed = 0
    if arg == "tiny":
        c.n_perm = 100
        c.n_boot = 100
    return c
