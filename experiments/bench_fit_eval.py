r"""What one evaluation of a fit's objective costs, per method, side by side in one run.

Times the compiled value-and-gradient of the mean calibration NLL over every position
of a table (the unit every L-BFGS iteration spends), calibrated variant, for born (a
per-token map) and its controls; ``born_shuffled`` twice: as fits run it (the phase
shuffle's permutation computed once per table, ``brf.eval.fitting``) and sorting
every event at every evaluation (the kernel alone, on the same chunks, as fits ran
it before). The table: the committed real byte-level rows
(tests/data/byte_table_hamlet.npz, 1,200 positions x 2 members x 257 events)
repeated --repeat times.

  python experiments/bench_fit_eval.py --repeat=13
"""

import os
import platform
import time

from absl import flags
import numpy as np

from brf import cli
from brf.benchmark import markdown_table
from brf.eval import fitting
from brf.eval.controls import controls_for
from brf.eval.fitting import FitSettings, MethodSpec
from brf.event_table import EventTable

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeat", 13, "copies of the committed table's 1,200 positions")
flags.DEFINE_integer("runs", 3, "timed evaluations per row (after one untimed)")

TABLE = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "byte_table_hamlet.npz")


def _table(repeat: int) -> EventTable:
    d = np.load(TABLE)
    lp = d["logp"].astype(np.float64)
    m = lp.max(-1, keepdims=True)
    lp = (lp - m - np.log(np.exp(lp - m).sum(-1, keepdims=True))).astype(np.float32)
    tile = lambda a: np.concatenate([a] * repeat)
    return EventTable(tile(lp), tile(d["gold"].astype(np.int64)), tile(d["gap"]),
                      tile(d["gold_bytes"].astype(np.int64)), tile(d["segment"].astype(np.int64)))


def _time(fun, x, runs):
    fun(x)
    t0 = time.perf_counter()
    for _ in range(runs):
        fun(x)
    return (time.perf_counter() - t0) / runs


def main(argv):
    del argv
    table = _table(FLAGS.repeat)
    brf = MethodSpec("born token_tanh", "born", fit={"phase.scale": 1.5, "phase.rate": 0.5,
                                                     "phase.offset": [0.0, 0.5]},
                     phase="token_tanh", role="brf").in_variant("calibrated")
    specs = [brf, MethodSpec("linear (tuned)", "linear").in_variant("calibrated")]
    specs += list(controls_for(brf, 2, seed=0).values())
    rows, base = [], None
    for spec in specs:
        problem = fitting._Problem(spec, table, FitSettings())
        x = problem.layout.initial
        t = _time(problem.objective({}, problem.data()), x, FLAGS.runs)
        base = base or t
        rows.append([spec.label, spec.method, f"{t:.3f}", f"{t / base:.2f}"])
        if spec.method == "born_shuffled":
            t = _time(problem.objective({}, problem.data(), sort=True), x, FLAGS.runs)
            rows.append([spec.label + ", sorting per evaluation", spec.method, f"{t:.3f}",
                         f"{t / base:.2f}"])
    print(f"{table.logp.shape[0]} x {table.logp.shape[1]} x {table.logp.shape[2]} positions x "
          f"members x events; {platform.node()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}\n")
    print(markdown_table(["row", "method", "s per evaluation", "/ born"], rows))


if __name__ == "__main__":
    cli.run(main)
