"""brf ensembles on lm-evaluation-harness tasks (needs `pip install -e .[harness]`).

The shipped pair on the shipped offline tasks (run from the repository root; tasks/):
  python experiments/harness.py --config=configs/harness.py
Other tasks, few-shot count, a limit, where the results go:
  python experiments/harness.py --config=configs/harness.py \
      --config.tasks=arc_easy,gsm8k --config.num_fewshot=5 --config.limit=100 --config.output=runs/arc
The study's question on the shipped tasks (results/harness/; docs/harness.md):
  python experiments/harness.py --config=configs/harness.py \
      --config.tasks=brf_hamlet_next_line --config.output=results/harness/hamlet
  python experiments/harness.py --config=configs/harness.py --config.limit=50 \
      --config.output=results/harness/limit50
Tiny random members sharing SmolLM2's tokenizer, 4 documents a task (what the tests run):
  python experiments/harness.py --config=configs/harness.py:tiny

Each variant (config.variants: 'members' = each member alone, method specs, and
study(corpus=...) = the study's calibrated BRF row of that corpus) runs through
lm_eval.simple_evaluate; <output>/<variant>.json is the harness's results JSON,
<output>/table.md the metrics of all variants with standard errors and intervals and
each BRF variant paired against the better pool (comparisons.json, documents.json).
`arg`: 'tiny'.
"""

import ml_collections

from brf.errors import UserError
from brf.specs import format_spec

DEFAULT_PAIR = ("smollm2-135m-instruct", "gemma3-270m")


def get_config(arg=None):
    flags = {a.strip() for a in (arg or "").split(",") if a.strip()}
    if flags - {"tiny"}:
        raise UserError(f"unknown config argument(s) {sorted(flags - {'tiny'})}; use tiny")
    c = ml_collections.ConfigDict()
    # brf member specs (configs/generate.py's form; commas as they are here).
    c.members = ", ".join(format_spec(m, dict(weight=0.5)) for m in DEFAULT_PAIR)
    # Method specs, one variant each; 'members' = each member alone; study(corpus=...) =
    # the calibrated BRF row that the study in config.study fitted on that corpus's bytes.
    c.variants = ("members, linear, loglinear, born, study(corpus=hamlet), "
                  "study(corpus=pyparsing)")
    c.study = "results/study"     # a study's out_dir (README's main command writes one)
    c.phase = "tanh(rate=0.5, offset=[0, 0.5])"  # for methods with a phase map; '' = default
    c.tasks = ("brf_hamlet_next_line", "brf_python_next_line")
    c.include_path = "tasks"      # task YAMLs beside the harness's own ('' = none)
    c.num_fewshot = -1            # -1: each task's own default
    c.limit = 0                   # documents per task (0 = all)
    c.log_samples = False         # the harness's per-document samples in the results JSON
    c.output = "runs/harness"
    # The harness model's settings (brf/harness/__init__.py): 'auto' level = tokens when
    # the members share a vocabulary, else bytes at `precision` (default | reference | exact).
    c.level = "auto"
    c.precision = "default"
    c.batch_size = 8
    c.max_length = 0              # 0: the members' context
    c.max_gen_toks = 256
    c.seed = 0
    c.dtype = "float32"
    # Speculative fused decoding in generate_until (a drafter spec: 'ngram(n=3, k=6)',
    # 'member(k=8)'; '' = off): the same greedy text, fewer fused steps.
    c.speculative = ""
    if "tiny" in flags:
        c.members = ", ".join(format_spec(f"random:{DEFAULT_PAIR[0]}:{i}", dict(weight=0.5))
                              for i in range(2))
        c.variants = "members, linear, loglinear, born"  # the study's members are real
        c.limit = 4
        c.max_gen_toks = 8
        c.output = "runs/harness-tiny"
    return c
