"""Cost of dumping logits to CSV over scoring alone, same positions, same run.

  python experiments/bench_dump.py                      # both shipped models, 10K positions, k=20
  python experiments/bench_dump.py --models=smollm2-135m-instruct --positions=2000 --repeats=1

For each model: "scoring alone" is the validation's scoring
(:func:`brf.eval.scoring.score_segments`, top-k summaries kept in memory) of
the first ``--positions`` tokens of the default corpus cut into segments of
``--segment_tokens``; "dump" is :func:`brf.eval.dump.dump_scores` of the same
tokens (same segments, chunks and cache shape) into a CSV file. Both are
compiled first on one segment; then the two run in turn ``--repeats`` times
and the best of each is kept. Also timed: formatting the dumped rows alone
(:func:`brf.eval.logit_csv.format_rows`) and reading the file back.
Prints a markdown table (goal: dump <= 1.2x scoring).
"""

import os
import platform
import tempfile
import time

from absl import flags
import jax
import numpy as np

from brf import cli
from brf.align.vocab import encode_text
from brf.benchmark import markdown_table

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["smollm2-135m-instruct", "gemma3-270m"], "model sources")
flags.DEFINE_integer("positions", 10_000, "text tokens scored per run")
flags.DEFINE_integer("k", 20, "top logits per row")
flags.DEFINE_integer("segment_tokens", 2048, "text tokens per forward context")
flags.DEFINE_integer("chunk", 256, "tokens per forward pass")
flags.DEFINE_integer("repeats", 2, "timed runs of each (best kept)")


def bench_model(source: str, text: str, tmp: str) -> list:
    from brf.eval.dump import context_ids, dump_scores, load_model
    from brf.eval.logit_csv import RowBlock, format_rows, read_csv, vocab_texts
    from brf.eval.scoring import score_segments
    m = load_model(source)
    ids = np.asarray(encode_text(m.tokenizer, text), np.int32)
    ids = ids[:FLAGS.positions]
    if len(ids) < FLAGS.positions:
        raise SystemExit(f"{source}: the corpus has only {len(ids)} tokens")
    ctx = np.asarray(context_ids(m), np.int32)
    segs = [np.concatenate([ctx, ids[a:a + FLAGS.segment_tokens]])
            for a in range(0, len(ids), FLAGS.segment_tokens)]
    path = os.path.join(tmp, "bench.csv")

    def score():
        return score_segments(m.params, m.cfg, segs, top_k=FLAGS.k, chunk=FLAGS.chunk,
                              desc=f"scoring {source}")

    def dump():
        return dump_scores(m, text, path, k=FLAGS.k, segment_tokens=FLAGS.segment_tokens,
                           chunk=FLAGS.chunk, max_positions=FLAGS.positions, resume=False,
                           desc=f"dumping {source}")

    # Compile both on one full-length segment (same shapes as the timed runs).
    score_segments(m.params, m.cfg, segs[:1], top_k=FLAGS.k, chunk=FLAGS.chunk,
                   desc="warm-up")
    dump_scores(m, text, path, k=FLAGS.k, segment_tokens=FLAGS.segment_tokens,
                chunk=FLAGS.chunk, max_positions=FLAGS.segment_tokens, resume=False,
                desc="warm-up")
    t_score, t_dump = [], []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        sc = score()
        t_score.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = dump()
        t_dump.append(time.perf_counter() - t0)
    n_score = int(sc.row_starts[-1])
    t0 = time.perf_counter()
    run = read_csv(path)
    t_read = time.perf_counter() - t0
    texts = vocab_texts(m.tokenizer, m.cfg.vocab_size)
    block = RowBlock(run.seq, run.position, run.token_id, run.token_logit, run.lse,
                     run.entropy, run.gap, run.top_logits, run.top_ids)
    t0 = time.perf_counter()
    format_rows(block, texts)
    t_fmt = time.perf_counter() - t0
    size = os.path.getsize(path)
    best_s, best_d = min(t_score), min(t_dump)
    return [source, n_score, out["rows"], best_s, best_d, best_d / best_s,
            f"{t_fmt:.2f} s ({100 * t_fmt / best_s:.1f}%)", f"{t_read:.2f}",
            f"{size / 2**20:.1f} MiB"]


def main(argv):
    del argv
    from brf.eval import corpus
    from brf.runtime import enable_compilation_cache
    enable_compilation_cache()
    text = corpus.load_default_corpus()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in FLAGS.models:
            rows.append(bench_model(source, text, tmp))
    print(f"\ndevice: {jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores), {FLAGS.positions} positions, k={FLAGS.k}, segments of "
          f"{FLAGS.segment_tokens}, chunk {FLAGS.chunk}, best of {FLAGS.repeats}\n")
    print(markdown_table(["model", "scored rows", "CSV rows", "scoring alone (s)", "dump (s)",
                          "dump / scoring", "format rows alone", "read back (s)",
                          "CSV size"], rows))
    worst = max(r[5] for r in rows)
    print(f"\nworst overhead {100 * (worst - 1):+.1f}% (goal <= +20%)")


if __name__ == "__main__":
    cli.run(main)
