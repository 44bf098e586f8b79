"""Tokens/s of the default pair: every member each step (linear, BRF) vs mixture sampling.

  python experiments/bench_ensemble.py                          # default pair, 32 tokens
  python experiments/bench_ensemble.py --max_new_tokens=64 --repeats=2
  python experiments/bench_ensemble.py --members=random:smollm2-135m-instruct:0,random:smollm2-135m-instruct:1
  python experiments/bench_ensemble.py --engines --max_new_tokens=64 --repeats=2
      # fused generation (BRF, greedy) on the host loop and on the compiled step,
      # beside the members' own forward passes (issue 52)

Prints a markdown table (see brf/ensemble/bench.py for what each row means).
"""

import platform

from absl import flags
import jax

from brf import cli
from brf.ensemble.bench import bench, bench_engines
from brf.ensemble.run import auto_aligner, load_members

FLAGS = flags.FLAGS
flags.DEFINE_list("members", ["smollm2-135m-instruct", "gemma3-270m"], "member sources")
flags.DEFINE_list("weights", [], "member weights (default uniform)")
flags.DEFINE_integer("max_new_tokens", 32, "events per prompt")
flags.DEFINE_integer("repeats", 1, "timed runs per row (best is kept)")
flags.DEFINE_integer("seed", 0, "seed")
flags.DEFINE_bool("engines", False, "time the host loop against the compiled step")
flags.DEFINE_string("phase", "tanh(rate=0.5, offset=[0, 0.5])", "--engines: BRF's phase map "
                    "(configs/generate.py's default)")
flags.DEFINE_list("prompts", ["The history of the printing press begins"], "prompts (a batch)")


def main(argv):
    del argv
    members = load_members([dict(model=m) for m in FLAGS.members])
    n = len(members)
    weights = [float(w) for w in FLAGS.weights] or [1.0 / n] * n
    aligner = auto_aligner(members)
    if FLAGS.engines:
        table, nums = bench_engines(members, FLAGS.prompts, weights, aligner=aligner,
                                    max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
                                    method_params={"phase": FLAGS.phase})
        print(f"device: {jax.devices()[0].device_kind} "
              f"({platform.processor() or platform.machine()}), batch {len(FLAGS.prompts)}, "
              f"{FLAGS.max_new_tokens} new tokens, greedy, BRF {FLAGS.phase}, aligner "
              f"{aligner}, weights {weights}\n")
        print(table)
        print(f"\nsame text on both engines: {nums['same_text']}")
        return
    table, nums = bench(members, FLAGS.prompts, weights, aligner=aligner,
                        max_new_tokens=FLAGS.max_new_tokens, seed=FLAGS.seed,
                        repeats=FLAGS.repeats)
    print(f"device: {jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}),"
          f" batch {len(FLAGS.prompts)}, {FLAGS.max_new_tokens} tokens, aligner {aligner}, "
          f"weights {weights}\n")
    print(table)
    print(f"\nME: {nums['speedup']:.2f}x of linear, expected {nums['expected']:.2f}x "
          f"({100 * nums['me_fraction']:.0f}%; goal >= 80%). "
          f"BRF vs linear: {100 * nums['brf_overhead']:+.1f}% time (goal <= +10%).")


if __name__ == "__main__":
    cli.run(main)
