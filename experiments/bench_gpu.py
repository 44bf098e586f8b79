r"""brf at real model shapes with random weights: scoring, decoding, the fused pair, brf.fuse.

No checkpoint is needed (brf/models/shapes.py; brf/perf.py says what each
figure is and what it is set against). One JSON with everything:

  python experiments/bench_gpu.py --out=/tmp/bench_gpu.json            # on a GPU
  python experiments/bench_gpu.py --models=gemma-3-4b --parts=decode   # one model, one part
  python experiments/bench_gpu.py --tiny --out=/tmp/tiny.json          # toy sizes, CPU, seconds

Parts: 'score' (teacher-forced tokens/s and MFU), 'decode' (steps/s at batch 1
and 16 against the memory roofline: brf's per-step loop with full and bounded
cache reads, and the step looped on the device), 'pair' (--pair fused with
BRF through brf.ensemble.generate, host loop and compiled step, beside the
members' own steps; and greedy n-gram speculation with its rounds on the host
and compiled on the device, beside plain fused generation), 'fuse' (brf.fuse
from Python and inside jit at batch 64), 'attention' (brf's attention against
jax.nn.dot_product_attention at each model's head shapes: one decoding query
over --context keys, a causal prompt).
"""

import json
import platform

from absl import flags
import jax
import jax.numpy as jnp

from brf import cli, perf
from brf.errors import UserError
from brf.models.shapes import SHAPES, shrunk

FLAGS = flags.FLAGS
flags.DEFINE_bool("tiny", False, "toy sizes of every shape, float32: the code path in seconds")
flags.DEFINE_list("models", list(SHAPES), f"shapes to measure ({', '.join(SHAPES)})")
PARTS = ("score", "decode", "pair", "fuse", "attention")
flags.DEFINE_list("parts", list(PARTS), "what to measure")
flags.DEFINE_list("pair", ["llama-3.1-8b", "llama-3.2-1b"], "the fused pair (one vocabulary)")
flags.DEFINE_string("dtype", "bfloat16", "weights and compute dtype (--tiny: float32)")
flags.DEFINE_integer("context", 1024, "decoding: tokens in the cache before the timed steps")
flags.DEFINE_integer("cache_slots", 4096, "decoding: slots allocated (bounded reads read "
                     "fewer; 0: context + steps)")
flags.DEFINE_integer("steps", 64, "decoding steps timed")
flags.DEFINE_list("batches", ["1", "16"], "decoding and attention: batch sizes")
flags.DEFINE_string("phase", "tanh(rate=0.5, offset=[0, 0.5])", "BRF's phase map "
                    "(configs/generate.py's default)")
flags.DEFINE_string("out", "", "write the JSON here ('' prints it)")


def settings(tiny: bool, dtype="bfloat16", context=1024, cache_slots=4096, steps=64,
             phase="tanh(rate=0.5, offset=[0, 0.5])", batches=(1, 16)) -> dict:
    """What each part measures at: toy sizes (``tiny``) or the given ones."""
    if tiny:
        return dict(dtype=jnp.float32, score=dict(batch=2, length=64), contexts=32, slots=256,
                    steps=8, batches=(1, 2), pair_prompt=16, pair_steps=8, repeats=1,
                    fuse_vocab=4096, bandwidth=1 << 24, phase=phase)
    return dict(dtype=jnp.dtype(dtype), score=dict(batch=4, length=2048), contexts=context,
                slots=cache_slots, steps=steps, batches=tuple(batches), pair_prompt=128,
                pair_steps=steps, repeats=2, fuse_vocab=128256, bandwidth=1 << 30, phase=phase)


def run(models, parts, pair, tiny: bool, s: dict) -> dict:
    """Every requested measurement (settings ``s`` from :func:`settings`), as one
    JSON-ready dict."""
    cfgs = {name: shrunk(SHAPES[name]) if tiny else SHAPES[name] for name in models}
    dev = jax.devices()[0]
    out = {"device": dev.device_kind, "platform": dev.platform, "host": platform.processor()
           or platform.machine(), "jax": jax.__version__, "tiny": tiny,
           "dtype": jnp.dtype(s["dtype"]).name, "peak_flops": perf.peak_flops(),
           "bandwidth_bytes_per_s": perf.bandwidth_bytes_per_s(s["bandwidth"]), "models": {}}
    for name, cfg in cfgs.items():
        row = out["models"][name] = {}
        if "attention" in parts:
            row["attention"] = [perf.attention(cfg, batch=b, context=s["contexts"],
                                               prompt=s["score"]["length"], dtype=s["dtype"])
                                for b in s["batches"]]
            print(name, "attention", row["attention"], flush=True)
        if not {"score", "decode"} & set(parts):
            continue
        params = perf.random_params(cfg, s["dtype"])
        if "score" in parts:
            row["score"] = perf.scoring(cfg, params, dtype=s["dtype"], repeats=3, **s["score"])
            print(name, "score", row["score"], flush=True)
        if "decode" in parts:
            row["decode"] = [perf.decoding(cfg, params, batch=b, context=s["contexts"],
                                           steps=s["steps"], dtype=s["dtype"],
                                           bandwidth=out["bandwidth_bytes_per_s"],
                                           cache_slots=s["slots"] or None)
                             for b in s["batches"]]
            print(name, "decode", row["decode"], flush=True)
        del params
    if "pair" in parts:
        pcfgs = [shrunk(SHAPES[p]) if tiny else SHAPES[p] for p in pair]
        vocab = {c.vocab_size for c in pcfgs}
        if len(vocab) != 1:
            raise UserError(f"--pair {pair}: the members must share one vocabulary")
        tok = perf.word_tokenizer(vocab.pop())
        members = [perf.random_member(p, c, perf.random_params(c, s["dtype"], seed=i), tok,
                                      1.0 / len(pair))
                   for i, (p, c) in enumerate(zip(pair, pcfgs))]
        out["pair"] = {"members": list(pair), "runs": [
            perf.fused_pair(members, batch=b, prompt_len=s["pair_prompt"], steps=s["pair_steps"],
                            phase=s["phase"], repeats=s["repeats"], dtype=s["dtype"])
            for b in (1,)]}
        # drafted by the n-gram drafter, and by the smallest member (the classic pairing)
        for key, drafter in (("speculative", "ngram(n=3, k=4, cost=0)"),
                             ("speculative_member", "member(k=4, cost=0)")):
            out["pair"][key] = perf.speculative_pair(
                members, prompt_len=s["pair_prompt"], steps=s["pair_steps"], phase=s["phase"],
                repeats=s["repeats"], dtype=s["dtype"], drafter=drafter)
        print("pair", out["pair"], flush=True)
        del members
    if "fuse" in parts:
        out["fuse"] = perf.fuse_call(s["fuse_vocab"], phase=s["phase"])
        print("fuse", out["fuse"], flush=True)
    return out


def main(argv):
    del argv
    unknown = set(FLAGS.models) - set(SHAPES)
    if unknown:
        raise UserError(f"unknown model shape(s) {sorted(unknown)}; known: {', '.join(SHAPES)}")
    bad = set(FLAGS.parts) - set(PARTS)
    if bad:
        raise UserError(f"unknown part(s) {sorted(bad)}; use {', '.join(PARTS)}")
    s = settings(FLAGS.tiny, FLAGS.dtype, FLAGS.context, FLAGS.cache_slots, FLAGS.steps,
                 FLAGS.phase, [int(b) for b in FLAGS.batches])
    out = run(FLAGS.models, FLAGS.parts, FLAGS.pair, FLAGS.tiny, s)
    text = json.dumps(out, indent=1, default=str)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    cli.run(main)
