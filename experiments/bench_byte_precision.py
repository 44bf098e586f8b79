r"""Precision of byte-level settings against their cost, and what bounds it.

One fine *reference* walk (default beam 64, threshold 1e-6, no merging) over a
slice of a corpus keeps every next-token table it computed; every other setting is
then *replayed* on those tables (the same `brf.bytes.state.advance` the scorer runs,
no model calls), so each setting's next-byte distributions and the tables it would
have needed come out of one run, side by side. A replayed setting that needs a table
the reference never computed counts it as missing (none did in BENCHMARKS.md).

Per setting: ``extra tables`` (token sequences off the canonical tokenization it
reads: the forward passes it costs beyond the canonical pass, one token each), the
difference in bits per byte and the per-byte total variation (mean, p99, max)
against the reference (`brf.bytes.precision.compare`).

``--oracle``: what no pruning rule can beat on this slice. For each share tau, keep
exactly the alternative sequences whose lineage ever held at least tau of the
reference's mass (a sequence's share, or any descendant's: keeping a descendant
needs its ancestors), drop every other, and replay the reference walk on that:
the fewest tables any rule that looks at shares can use to keep those hypotheses.

  python experiments/bench_byte_precision.py --model=smollm2-135m-instruct \
      --corpus=pyparsing --skip_bytes=20000 --n_bytes=400 --cache=/tmp/ref.pkl \
      --settings=3e-3:16:2,3e-3:16:0,1e-3:16:0,3e-5:16:0,1e-5:32:0 --oracle=1e-4,1e-3

The reference walk is the slow part (SmolLM2, 400 bytes of code: about 15 minutes
on a 2-core CPU); ``--cache`` keeps its tables (a pickle) for later replays.
"""

import json
import os
import pickle
import time

import numpy as np
from absl import flags

from brf import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "a registered model")
flags.DEFINE_string("corpus", "pyparsing", "a brf.eval.corpus.CORPORA name")
flags.DEFINE_integer("skip_bytes", 20000, "bytes of the corpus skipped first")
flags.DEFINE_integer("n_bytes", 400, "bytes scored")
flags.DEFINE_string("reference", "1e-6:64", "threshold:beam of the reference walk")
flags.DEFINE_list("settings", ["3e-3:16:2", "3e-3:16:0", "1e-5:32:0"],
                  "threshold:beam:max_lag per replayed setting")
flags.DEFINE_list("oracle", [], "lineage shares tau for the oracle (e.g. 1e-4,1e-3)")
flags.DEFINE_string("cache", "", "pickle of the reference walk's tables (read if present)")
flags.DEFINE_string("out", "", "write the results as JSON here")


def reference_walk(lm, data: bytes, beam: int, threshold: float) -> dict:
    """The reference walk over ``data`` (after BOS): its rows and every table it made."""
    from brf.bytes.lm import _Text
    from brf.bytes.state import advance, initial_state, next_byte, pending
    tx = _Text(lm, data, lm.encode(data), lm.context(), beam, threshold, 256, 0, 4, 0)
    state = initial_state()
    tx.runner.live = lambda: tx.live(state)
    logp = np.zeros((len(data), 257))
    t0 = time.perf_counter()
    for k in range(len(data)):
        while pending(state, tx.tables):
            tx.fetch(tx.lookahead(state, 512))
        logp[k], _ = next_byte(state, tx.tables)
        state, _ = advance(state, data[k], tx.tables, lm.trie, tx.seqs, beam=beam,
                           threshold=threshold, max_lag=0)
    return dict(data=data, tables=dict(tx.tables), seqs=tx.seqs, logp=logp,
                seconds=time.perf_counter() - t0, tokens=int(tx.runner.tokens),
                canonical=len(tx.canon))


def replay(ref: dict, trie, beam: int, threshold: float, max_lag: int,
           tables: dict | None = None,
           shares: dict | None = None) -> tuple[np.ndarray, int, int]:
    """One setting walked on the reference's tables: its rows, the alternative
    sequences it read, and how many hypotheses needed a table the reference lacks.
    With ``shares``, each sequence's largest share of the kept mass after a byte is
    recorded there."""
    from brf.bytes.state import ByteState, advance, initial_state, next_byte
    data, seqs = ref["data"], ref["seqs"]
    tables = ref["tables"] if tables is None else tables
    state, used, miss = initial_state(), set(), 0
    logp = np.zeros((len(data), 257))
    for k in range(len(data)):
        have = tuple(h for h in state.hyps if h.seq in tables)
        miss += len(state.hyps) - len(have)
        state = ByteState(state.offset, have)
        used.update(h.seq for h in state.hyps)
        logp[k], _ = next_byte(state, tables)
        state, _ = advance(state, data[k], tables, trie, seqs, beam=beam, threshold=threshold,
                           max_lag=max_lag)
        if shares is not None:
            w = np.array([h.logp + (tables[h.seq].total(k + 1 - h.start, h.node)
                                    if h.node else 0.0) for h in state.hyps])
            for h, x in zip(state.hyps, np.exp(w - np.logaddexp.reduce(w))):
                shares[h.seq] = max(shares.get(h.seq, 0.0), float(x))
    return logp, sum(1 for s in used if not seqs.is_protected(s)), miss


def lineage_shares(ref: dict, trie, beam: int, threshold: float) -> dict[int, float]:
    """Per sequence, the largest share of the reference's mass it or any descendant held."""
    share: dict[int, float] = {}
    replay(ref, trie, beam, threshold, 0, shares=share)
    seqs = ref["seqs"]
    lineage = dict(share)
    for s in sorted(share, reverse=True):  # a child's id is larger than its parent's
        p = seqs.parent[s]
        while p >= 0 and lineage.get(p, 0.0) < lineage[s]:
            lineage[p] = lineage[s]
            p = seqs.parent[p]
    return lineage


def main(argv):
    del argv
    from brf.bytes.lm import ByteLM
    from brf.bytes.precision import compare
    from brf.eval.corpus import load_named
    rthr, rbeam = FLAGS.reference.split(":")
    rthr, rbeam = float(rthr), int(rbeam)
    data = load_named(FLAGS.corpus)[0].encode("utf-8")[FLAGS.skip_bytes:
                                                      FLAGS.skip_bytes + FLAGS.n_bytes]
    lm = ByteLM.load(FLAGS.model)
    if FLAGS.cache and os.path.exists(FLAGS.cache):
        with open(FLAGS.cache, "rb") as f:
            ref = pickle.load(f)
        if ref["data"] != data:
            raise cli.UserError(f"{FLAGS.cache} holds another text; remove it or pick another")
    else:
        ref = reference_walk(lm, data, rbeam, rthr)
        if FLAGS.cache:
            with open(FLAGS.cache, "wb") as f:
                pickle.dump(ref, f)
    gold = np.frombuffer(data, np.uint8).astype(np.int64)
    canonical = ref.get("canonical", sum(1 for s in ref["tables"] if ref["seqs"].is_protected(s)))
    out = dict(model=FLAGS.model, corpus=FLAGS.corpus, skip_bytes=FLAGS.skip_bytes,
               bytes=len(data), reference=FLAGS.reference, canonical_tokens=canonical,
               reference_tables=len(ref["tables"]), reference_seconds=ref.get("seconds"),
               settings=[], oracle=[])
    print(f"{FLAGS.model} {FLAGS.corpus} {len(data)} bytes from {FLAGS.skip_bytes}: "
          f"{canonical} canonical tokens; reference {FLAGS.reference} computed "
          f"{len(ref['tables'])} tables")
    keys = ("dbpb", "tv_mean", "tv_p99", "tv_max", "over_1e3", "over_5e2")
    for s in FLAGS.settings:
        thr, beam, lag = s.split(":")
        logp, extra, miss = replay(ref, lm.trie, int(beam), float(thr), int(lag))
        row = dict(setting=s, extra_tables=extra, per_canonical=extra / canonical, missing=miss,
                   **{k: compare(logp, ref["logp"], gold)[k] for k in keys})
        out["settings"].append(row)
        print(json.dumps(row), flush=True)
    if FLAGS.oracle:
        lineage = lineage_shares(ref, lm.trie, rbeam, rthr)
        seqs = ref["seqs"]
        for tau in map(float, FLAGS.oracle):
            keep = {s for s, x in lineage.items() if x >= tau and not seqs.is_protected(s)}
            tables = {s: t for s, t in ref["tables"].items()
                      if seqs.is_protected(s) or s in keep}
            logp, extra, _ = replay(ref, lm.trie, rbeam, rthr, 0, tables)
            row = dict(tau=tau, extra_tables=extra, per_canonical=extra / canonical,
                       **{k: compare(logp, ref["logp"], gold)[k] for k in keys})
            out["oracle"].append(row)
            print(json.dumps(row), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
