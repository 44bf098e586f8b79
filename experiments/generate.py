"""Generates text with an ensemble of language models (fusion or mixture sampling).

  python experiments/generate.py --config=configs/generate.py
  python experiments/generate.py --config=configs/generate.py:prompts,me
  python experiments/generate.py --config=configs/generate.py:tiny --config.output=/tmp/g.jsonl
  python experiments/generate.py --config=configs/generate.py:bytes   # fused next-byte distributions
  python experiments/generate.py --config=configs/generate.py:prompts --config.speculative='ngram(n=3, k=6)'

Prints each prompt with its generated text; --config.stream=True prints the text
as it comes instead, --config.output=FILE writes one JSON row per prompt (and
--config.output=- prints those rows). See configs/generate.py for every field.
"""

from brf import cli  # first: Ctrl-C during the imports below ends in one line too

import contextlib
import json
import sys

from ml_collections import config_flags

from brf.ensemble.run import (Request, precision_line, print_stream, print_texts, run,
                              speculative_line)

_CONFIG = config_flags.DEFINE_config_file("config", cli.default_config("generate.py"))


def main(argv):
    del argv
    c = _CONFIG.value
    req = Request.from_config(c)  # every setting checked before any model loads
    if c.get("compilation_cache"):
        from brf.runtime import enable_compilation_cache
        enable_compilation_cache()
    to_file = c.output not in ("", "-")
    if to_file:
        cli.check_writable(c.output, "config.output")
    n = len(req.prompts)
    rows = run(req, on_piece=(lambda p: print_stream(p, n)) if c.stream else None)
    if c.output:
        with (open(c.output, "w", encoding="utf-8") if to_file
              else contextlib.nullcontext(sys.stdout)) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        if to_file:
            print(f"wrote {len(rows)} rows to {c.output}")
    elif not c.stream:
        print_texts(rows)
    for b, row in enumerate(rows):
        if row.get("level") == "bytes":  # what the byte-level views rest on
            print(precision_line(row))
        if "speculative" in row:  # how much of the drafts was kept
            print(speculative_line(row["speculative"], b if n > 1 else None))


if __name__ == "__main__":
    cli.run(main)
