r"""Byte-level scoring (brf.bytes) against token-level scoring of the same text, same run.

For each member: the corpus's first --n_bytes bytes, cut into --segment-byte
segments (at UTF-8 boundaries), are scored twice, each after one warm-up
segment (compilation excluded): token level (the canonical tokens,
`brf.models.score_tokens`, one padded shape) and byte level
(`brf.bytes.scoring.score_segments`, every byte's 257-event distribution with
--beam / --threshold pruning). Reported: forward tokens per byte (the canonical
pass + the alternative tokenizations' tree-attention tokens), wall time of
each and their ratio, the trie's memory, the pruned mass and the consistency
numbers (bits per byte: byte level, canonical tokenization, their gap).

  python experiments/bench_bytes.py --corpus=hamlet --n_bytes=4096
"""

import json
import time

from absl import flags

from brf import cli

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["smollm2-135m-instruct", "gemma3-270m"], "members")
flags.DEFINE_string("corpus", "hamlet", "a brf.eval.corpus.CORPORA name")
flags.DEFINE_integer("n_bytes", 4096, "bytes of the corpus scored")
flags.DEFINE_integer("segment", 512, "bytes per segment")
flags.DEFINE_integer("beam", 16, "hypotheses kept per byte")
flags.DEFINE_float("threshold", 1e-3, "prune threshold (fraction of the prefix mass)")


def segments_of(data: bytes, size: int) -> list[bytes]:
    """``data`` cut into pieces of about ``size`` bytes, never inside a UTF-8 character."""
    out, i = [], 0
    while i < len(data):
        j = min(len(data), i + size)
        while j < len(data) and (data[j] & 0xC0) == 0x80:
            j += 1
        out.append(data[i:j])
        i = j
    return out


def bench_member(name: str, segs: list[bytes], beam: int, threshold: float) -> dict:
    import numpy as np
    from brf.bytes.lm import ByteLM
    from brf.bytes.scoring import consistency, score_segments
    from brf.models import score_tokens

    lm = ByteLM.load(name)
    ctx = lm.context()
    rows = [ctx + lm.encode(s) for s in segs]
    width = -(-max(map(len, rows)) // 256) * 256
    toks = np.zeros((len(rows), width), np.int32)
    valid = np.zeros((len(rows), width), bool)
    for r, row in enumerate(rows):
        toks[r, :len(row)], valid[r, :len(row)] = row, True

    score_tokens(lm.params, lm.cfg, toks[:1], valid[:1])  # warm-up (compile)
    t0 = time.perf_counter()
    for r in range(len(rows)):  # batch 1, like the byte level
        score_tokens(lm.params, lm.cfg, toks[r:r + 1], valid[r:r + 1])
    token_s = time.perf_counter() - t0

    score_segments(lm, segs[:1], beam=beam, threshold=threshold, desc="warm-up")
    t0 = time.perf_counter()
    sc = score_segments(lm, segs, beam=beam, threshold=threshold, desc=f"{name} bytes")
    byte_s = time.perf_counter() - t0
    cons = consistency(sc)
    n = sc.n_bytes
    return dict(member=name, bytes=n, canonical_tokens=int(valid.sum()),
                token_forward_per_byte=float(valid.sum()) / n,
                byte_forward_per_byte=cons["forward_per_byte"],
                padded_per_byte=float(np.sum(sc["padded_tokens"])) / n,
                token_seconds=token_s, byte_seconds=byte_s, wall_ratio=byte_s / token_s,
                trie_mb=lm.trie.nbytes() / 2**20, trie_nodes=lm.trie.n_nodes,
                vocab=lm.trie.vocab_size, pruned_mean=cons["pruned_mean"],
                lost_bits_per_byte=cons["lost"], bpb_byte=cons["byte"],
                bpb_canonical=cons["canonical"], noncanonical_bits_per_byte=cons["noncanonical"],
                hyp_mean=cons["hyp_mean"])


def main(argv):
    del argv
    from brf.eval.corpus import CORPORA
    text = CORPORA.get(FLAGS.corpus)()[0]
    data = text.encode("utf-8")[:FLAGS.n_bytes]
    segs = segments_of(data, FLAGS.segment)
    out = [bench_member(m, segs, FLAGS.beam, FLAGS.threshold) for m in FLAGS.models]
    print(json.dumps(dict(corpus=FLAGS.corpus, beam=FLAGS.beam, threshold=FLAGS.threshold,
                          segment=FLAGS.segment, results=out), indent=1))


if __name__ == "__main__":
    cli.run(main)
