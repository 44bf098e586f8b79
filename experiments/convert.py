r"""Convert a model source into a brf (orbax) checkpoint directory and load it back.

A source is a registered name (smollm2-135m-instruct, gemma3-270m), a .gguf
file or a Hugging Face directory. Without --out the checkpoint goes to the cache
($BRF_CACHE, default ~/.cache/brf), where `brf.checkpoints.registry.load` finds it.

  python experiments/convert.py --source=smollm2-135m-instruct
  python experiments/convert.py --source=path/to/model.gguf --out=/tmp/ckpt --overwrite

An existing checkpoint at --out is replaced only with --overwrite (else one line,
exit status 2).
"""

import os
import time

from absl import flags

from brf import cli  # before jax: Ctrl-C while it loads ends in one line too
from brf.align.vocab import encode_text
from brf.checkpoints import registry, store
from brf.errors import UserError
import jax

FLAGS = flags.FLAGS
flags.DEFINE_string("source", "smollm2-135m-instruct", "model name, .gguf file or HF dir")
flags.DEFINE_string("out", None, "checkpoint directory (default: the cache path)")
flags.DEFINE_bool("overwrite", False, "replace an existing checkpoint at --out (without it, "
                  "an existing one is refused)")
flags.DEFINE_string("prompt", "The capital of France is", "tokenized as a smoke check")


def main(argv):
    del argv
    out = FLAGS.out or registry.cache_path(FLAGS.source)
    if os.path.lexists(out) and not FLAGS.overwrite:
        raise UserError(f"--out={out} exists; pass --overwrite to replace it")
    # The checkpoint is written next to `out` and renamed into place.
    cli.check_writable(os.path.dirname(os.path.abspath(out)), "the folder of --out",
                       directory=True)
    t0 = time.perf_counter()
    registry.convert(FLAGS.source, out, overwrite=FLAGS.overwrite)
    t1 = time.perf_counter()
    cfg, params, tok = store.restore(out)
    jax.block_until_ready(params)
    t2 = time.perf_counter()
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"converted {FLAGS.source} -> {out} in {t1 - t0:.1f}s; restored in {t2 - t1:.1f}s")
    print(f"{cfg.arch}: {cfg.n_layers} layers, d={cfg.d_model}, vocab={cfg.vocab_size}, "
          f"{n / 1e6:.1f}M params")
    if tok is not None:
        ids = encode_text(tok, FLAGS.prompt, add_special_tokens=True)
        print(f"tokens of {FLAGS.prompt!r}: {ids} -> {tok.decode(ids)!r}")


if __name__ == "__main__":
    cli.run(main)
