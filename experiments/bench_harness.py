"""The harness model's token-level loglikelihood throughput against brf's own forward
passes on the same tokens (brf/harness/bench.py; needs the harness extra).

  python experiments/bench_harness.py                 # SmolLM2 under two prompts, BRF
  python experiments/bench_harness.py --method=linear --docs=100
  python experiments/bench_harness.py --tiny          # tiny random members (a minute)
  python experiments/bench_harness.py --docs=20 --bytes_trim=on    # byte-level memory
  python experiments/bench_harness.py --docs=20 --bytes_trim=off   #   (one mode a process)

Prints one markdown row per method: requests, padded tokens, seconds of each side,
tokens per second, and the ratio harness / forward (the issue's bound: at most 1.5).
"""

import platform

from absl import flags
import jax

from brf import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("members", "smollm2-135m-instruct(weight=0.5), "
                    "smollm2-135m-instruct(weight=0.5, name=story, prefix=\"A story: \")",
                    "members sharing one vocabulary (brf member specs)")
flags.DEFINE_list("methods", ["linear", "born"], "fusion methods, one row each")
flags.DEFINE_string("phase", "tanh(rate=0.5, offset=[0, 0.5])", "BRF's phase map")
flags.DEFINE_string("task", "tasks/data/hamlet_next_line.jsonl", "a multiple-choice task file")
flags.DEFINE_integer("docs", 50, "documents of the task (4 requests each)")
flags.DEFINE_integer("batch_size", 8, "requests per forward pass")
flags.DEFINE_integer("repeats", 3, "timed runs per side (the best is kept)")
flags.DEFINE_bool("tiny", False, "tiny random members with SmolLM2's tokenizer, 8 documents")
flags.DEFINE_enum("bytes_trim", None, ["on", "off"], "instead: the byte level's memory, "
                  "SmolLM2 alone scoring --docs documents' requests with the C heap trimmed "
                  "after each request (on) or not (off); one mode per process")


def main(argv):
    del argv
    from brf.ensemble.run import load_members
    from brf.harness.bench import bench, task_pairs
    from brf.harness.lm import BRFLM
    members = FLAGS.members
    docs = FLAGS.docs
    if FLAGS.tiny:
        members = ("random:smollm2-135m-instruct:0(weight=0.5), "
                   "random:smollm2-135m-instruct:1(weight=0.5)")
        docs = min(docs, 8)
    if FLAGS.bytes_trim:
        from brf.bytes import DEFAULT
        from brf.harness.bench import byte_memory
        from brf.harness.ensemble import Ensemble
        e = Ensemble(load_members("smollm2-135m-instruct"), "linear", {}, level="bytes",
                     beam=DEFAULT.beam, threshold=DEFAULT.threshold, batch_size=8,
                     max_length=2048)
        r = byte_memory(e, task_pairs(FLAGS.task, docs), trim=FLAGS.bytes_trim == "on")
        print(f"trim {FLAGS.bytes_trim}: {r['requests']} requests in {r['seconds']:.1f} s, "
              f"RSS after {r['rss_gb']:.2f} GB")
        return
    mems = load_members(members)
    pairs = task_pairs(FLAGS.task, docs)
    print(f"device: {jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}),"
          f" members {', '.join(m.name for m in mems)}, {len(pairs)} requests of "
          f"{FLAGS.task}, batch {FLAGS.batch_size}\n")
    print("| method | requests | padded tokens | harness s | forward s | harness tok/s "
          "| forward tok/s | harness / forward |")
    print("|---|---|---|---|---|---|---|---|")
    for method in FLAGS.methods:
        lm = BRFLM(members=mems, method=method, batch_size=FLAGS.batch_size,
                   phase=FLAGS.phase if method == "born" else "", level="tokens")
        r = bench(lm, pairs, repeats=FLAGS.repeats)
        print(f"| {method} | {r['requests']} | {r['padded_tokens']} | {r['harness_s']:.2f} "
              f"| {r['forward_s']:.2f} | {r['harness_tokens_per_s']:.0f} "
              f"| {r['forward_tokens_per_s']:.0f} | {r['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    cli.run(main)
