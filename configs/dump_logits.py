"""Dump one model's logits to a logit CSV (format: brf/eval/logit_csv.py, docs/csv.md).

Score a text (teacher-forced; default: the validation's Hamlet slice):
  python experiments/dump_logits.py --config=configs/dump_logits.py --config.output=runs/smollm2.csv
The same with a system prompt, another model, your own text:
  python experiments/dump_logits.py --config=configs/dump_logits.py \
      --config.system="You are a pirate." --config.output=runs/smollm2-pirate.csv
  python experiments/dump_logits.py --config=configs/dump_logits.py \
      --config.model=gemma3-270m --config.text_file=my.txt --config.output=runs/gemma.csv
Generate from prompts (greedy, or any sampler such as "temperature=0.7,top_p=0.9"):
  python experiments/dump_logits.py --config=configs/dump_logits.py:generate \
      --config.prompts="What is the capital of France?" --config.output=runs/gen.csv
A model split over 4 devices (tensor-parallel):
  python experiments/dump_logits.py --config=configs/dump_logits.py --config.mesh.model=4
Tiny (200 positions; what the tests run):
  python experiments/dump_logits.py --config=configs/dump_logits.py:tiny --config.output=/tmp/t.csv

`arg`: comma-separated 'generate' (mode generate), 'tiny' (200 positions / 8 tokens).
A file that exists with the same settings is resumed (an interrupted dump
continues after its last complete row); --config.overwrite=True starts anew.
"""

import ml_collections


def get_config(arg=None):
    flags = {a.strip() for a in (arg or "").split(",") if a.strip()}
    unknown = flags - {"generate", "tiny"}
    if unknown:
        raise ValueError(f"unknown config argument(s) {sorted(unknown)}; use generate, tiny")
    c = ml_collections.ConfigDict()
    c.model = "smollm2-135m-instruct"  # registry name, .gguf file, HF directory or brf checkpoint
    c.mode = "generate" if "generate" in flags else "score"
    c.output = "runs/logits.csv"
    c.overwrite = False
    c.k = 20                      # top logits per row
    c.system = ""                 # system prompt (chat template; generate mode: chat members)
    c.prefix = ""                 # raw text before the scored text / the prompt
    # Score mode.
    c.text = ""                   # the text to score; "" = text_file, else the default corpus
    c.text_file = ""
    c.max_chars = 42_000          # of the default corpus (the validation's slice)
    c.max_positions = 0           # stop after this many text tokens (0 = all)
    c.segment_tokens = 2048       # text tokens per forward context
    c.chunk = 256                 # tokens per forward pass
    # Generate mode.
    c.prompts = "Write one sentence about the sea.\nWhat is the capital of France?"  # one per line
    c.prompts_file = ""           # one prompt a line, or JSONL {"prompt": ...}; replaces prompts
    c.chat = True                 # wrap prompts in the tokenizer's chat template
    c.template = ""               # or a format string with {prompt} (Gemma: no chat template)
    c.sampler = "greedy"          # brf.fusion.Sampler spec
    c.max_new_tokens = 64
    c.seed = 0
    c.compilation_cache = True
    # Devices (brf/sharding.py): the weights split over `model` devices (one
    # sequence at a time, so no data axis): for a model larger than one device.
    c.mesh = ml_collections.ConfigDict(dict(model=1))
    if "tiny" in flags:
        c.max_positions = 200
        c.max_new_tokens = 8
    return c
