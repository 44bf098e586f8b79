"""Dumps one model's logits to a logit CSV (teacher-forced scoring or generation).

  python experiments/dump_logits.py --config=configs/dump_logits.py --config.output=runs/x.csv

See configs/dump_logits.py for every field and brf/eval/logit_csv.py for the format.
"""

from brf import cli  # first: Ctrl-C during the imports below ends in one line too

from ml_collections import config_flags

from brf.eval.dump import check_config, run

_CONFIG = config_flags.DEFINE_config_file("config", cli.default_config("dump_logits.py"))


def main(argv):
    del argv
    check_config(_CONFIG.value)  # every key's type, range and names
    cli.check_writable(_CONFIG.value.output, "config.output")  # before the model loads
    out = run(_CONFIG.value)
    print(f"wrote {out['rows_written']} rows ({out['rows']} in the file) to {out['path']} "
          f"in {out['seconds']:.1f} s")
    for i, t in enumerate(out.get("texts") or []):
        if t is not None:
            print(f"[{i}] {t!r}")


if __name__ == "__main__":
    cli.run(main)
