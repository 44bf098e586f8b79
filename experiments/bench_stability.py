r"""What the study's stability check costs: one corpus's default pair, at several reaches.

Runs the study (``brf.eval.study.run``, the config of ``--config``) on one corpus of it
(``--corpus``, its index), token level, its default pair only (no prompt study, no
top-k check, no byte level), once per reach of ``--reaches`` (nats; 0: every calibrated
row), each time after deleting the check's fit caches so that the check refits, into
``--config.out_dir``. The analysis's own fits are cached by the first run (their time
shows there: scoring, fits, the cross-term test) and read by the others, so the runs
differ only in the check. Prints, per reach, the check's seconds, the rows it refitted
and left out, how far the reach was widened, the verdicts that moved and the largest
row move, and the whole run's wall time, as Markdown and one JSON line.

  python experiments/bench_stability.py --config=configs/validate.py \
      --config.out_dir=runs/bench-stability --reaches=0.02,0
"""

from brf import cli  # first: Ctrl-C during the imports below ends in one line too

import dataclasses
import glob
import json
import math
import os
import platform
import time

from absl import flags
from ml_collections import config_flags

from brf.benchmark import markdown_table
from brf.errors import UserError
from brf.eval import plan as plan_lib
from brf.eval.study import run

_CONFIG = config_flags.DEFINE_config_file("config", cli.default_config("validate.py"))
flags.DEFINE_list("reaches", ["0.02", "0"], "the check's reaches (nats; 0: every row)")
flags.DEFINE_integer("corpus", 0, "the index of the config's corpus to run")
FLAGS = flags.FLAGS


def _reaches(values) -> list[float]:
    try:
        out = [float(v) for v in values]
    except ValueError:
        raise UserError(f"--reaches: numbers (nats) expected, got {','.join(values)!r}")
    if not out or any(not v >= 0 or not math.isfinite(v) for v in out):
        raise UserError(f"--reaches: finite numbers >= 0 expected, got {','.join(values)!r}")
    return out


def main(argv):
    del argv
    cfg = _CONFIG.value
    plan_lib.check_config(cfg)
    reaches = _reaches(FLAGS.reaches)
    plan = plan_lib.from_config(cfg)
    if not plan.stability:
        raise UserError("config.stability is off: there is no check to measure")
    if not 0 <= FLAGS.corpus < len(plan.corpora):
        raise UserError(f"--corpus={FLAGS.corpus}: the config has {len(plan.corpora)} "
                        f"corpora (0 to {len(plan.corpora) - 1})")
    cli.check_writable(plan.out_dir, "config.out_dir", directory=True)
    plan = dataclasses.replace(
        plan, corpora=(plan.corpora[FLAGS.corpus],), topk_sensitivity=0,
        bytes=plan_lib.BYTES_OFF, prompts=dataclasses.replace(plan.prompts, enabled=False))
    rows, out = [], []
    for reach in reaches:
        for path in glob.glob(os.path.join(plan.out_dir, "**", "fits-*.stability.json"),
                              recursive=True):
            os.remove(path)
        t0 = time.time()
        rep = run(dataclasses.replace(plan, stability_reach=reach or math.inf))
        wall = time.time() - t0
        s = rep["stability"]
        (per,) = s["per_analysis"].values()
        top = s["largest_row_move"] or {}
        out.append({"reach": reach, "reach_reached": per["reach"], "wall_s": wall,
                    "check_s": s["seconds"], "refitted": s["refitted_rows"],
                    "not_refitted": per["not_refitted"], "moved": s["moved"],
                    "largest_row_move": top})
        rows.append([f"{reach:g}" if reach else "every row",
                     "—" if per["reach"] is None else f"{per['reach']:.3g}",
                     f"{s['refitted_rows']}", f"{len(per['not_refitted'])}",
                     f"{s['seconds']:.0f}", f"{wall:.0f}",
                     f"{len(s['moved'])} of {s['verdicts']}",
                     f"{top.get('move', 0.0):+.1e} ({top.get('label', '-')})"])
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs; corpus "
          f"{plan.corpora[0].label}, default pair, token level\n")
    print(markdown_table(["reach", "reached", "refitted", "left out", "check s", "run s",
                          "moved", "largest row move"], rows))
    print(json.dumps(out))


if __name__ == "__main__":
    cli.run(main)
