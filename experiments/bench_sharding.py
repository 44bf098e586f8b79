"""Teacher-forced scoring throughput on 1, 2, 4, 8 (virtual) devices.

  python experiments/bench_sharding.py                          # synthetic SmolLM2-width model, 4 layers
  python experiments/bench_sharding.py --model=smollm2-135m-instruct --devices=1,8
  python experiments/bench_sharding.py --devices=1 --repeats=5  # the 1-device overhead alone
  python experiments/bench_sharding.py --members=2 --devices=2,8  # members shared vs apart

Each device count runs in its own process (brf/eval/scaling.py). Rows: the
single-device path (no mesh) and data-, model- and mixed-parallel meshes over
all N devices, side by side in one process; the ratio column is each row's
throughput over the single-device path in the same process. On a CPU host the N
devices are virtual and share its cores: no speedup is expected there, the
point is correctness and overhead (goal: <= 10% at 1 device).
"""

import json
import platform

import jax
from absl import flags

from brf import cli
from brf.benchmark import markdown_table
from brf.eval import scaling

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "synthetic", "'synthetic[:layers]' or a brf.checkpoints source")
flags.DEFINE_list("devices", ["1", "2", "4", "8"], "device counts (one process each)")
flags.DEFINE_integer("segments", 8, "segments scored per timed run")
flags.DEFINE_integer("seg_len", 128, "tokens per segment")
flags.DEFINE_integer("chunk", 128, "tokens per forward pass")
flags.DEFINE_integer("repeats", 2, "timed rounds (best kept)")
flags.DEFINE_integer("members", 0, "> 0: score an ensemble of this many members, shared "
                     "(every member on every device, in turn) vs apart (each on its own "
                     "devices, at once)")
flags.DEFINE_integer("worker_devices", 0, "internal: run as the worker for N devices")


def main(argv):
    del argv
    kw = dict(n_segments=FLAGS.segments, seg_len=FLAGS.seg_len, chunk=FLAGS.chunk,
              repeats=FLAGS.repeats)
    if FLAGS.worker_devices:
        n = FLAGS.worker_devices
        assert jax.device_count() == n, jax.devices()
        rows = (scaling.measure_members(FLAGS.model, FLAGS.members, **kw) if FLAGS.members
                else scaling.measure(FLAGS.model, scaling.default_meshes(n), **kw))
        print("ROWS " + json.dumps(rows))
        return
    argv = [f"--members={FLAGS.members}", f"--model={FLAGS.model}", f"--segments={FLAGS.segments}",
            f"--seg_len={FLAGS.seg_len}", f"--chunk={FLAGS.chunk}", f"--repeats={FLAGS.repeats}"]
    table = []
    for n in map(int, FLAGS.devices):
        rows = scaling.spawn(__file__, n, argv)
        base = rows[0]["tokens_per_s"]
        for r in rows:
            table.append([n, r["label"], int(round(r["tokens_per_s"])),
                          f"{r['tokens_per_s'] / base:.3f}"])
        print(f"{n} device(s) done", flush=True)
    what = f"{FLAGS.members} members of " if FLAGS.members else ""
    print(f"\n{what}model {FLAGS.model}, {FLAGS.segments} segments x {FLAGS.seg_len} tokens, "
          f"chunk {FLAGS.chunk}, best of {FLAGS.repeats}; host {platform.machine()}, "
          f"{jax.devices()[0].platform}\n")
    print(markdown_table(["devices", "row", "tokens/s", "vs one device (same process)"], table))


if __name__ == "__main__":
    cli.run(main)
