r"""A/B of a model-code change in one process: the working tree's
`brf/models/transformer.py` against the same file at a git revision.

The file at --ref is loaded as a second, independent module (its own jit
caches) and both run the same weights, prompt and decoding loop, alternating
repeat by repeat so that the VM's drift hits both alike. Reports the largest
logit difference between the two and the median pairwise time ratio (ref time
/ working-tree time: above 1 means the working tree is faster).

  python experiments/ab_models.py --model=smollm2-135m-instruct --ref=HEAD --repeats=10

Only the transformer module is swapped: both sides share the checkpoint
loader, so a change that needs a different parameter layout cannot be
compared with this script.
"""

import importlib.util
import os
import subprocess
import tempfile
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from brf import cli
from brf.checkpoints import registry
from brf.models import init_cache
from brf.models import transformer as work_tr

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name or checkpoint path")
flags.DEFINE_string("ref", "HEAD", "git revision of brf/models/transformer.py to compare with")
flags.DEFINE_integer("prompt_len", 512, "prefill length")
flags.DEFINE_integer("new_tokens", 16, "decoding steps timed per repeat")
flags.DEFINE_integer("repeats", 8, "alternations")

_MODULE = "brf/models/transformer.py"


def load_at(ref: str):
    """brf/models/transformer.py at git revision `ref`, as a separate module."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{ref}:{_MODULE}"],
                         capture_output=True, text=True, check=True).stdout
    fd, path = tempfile.mkstemp(suffix=".py", prefix="brf_transformer_ref_")
    with os.fdopen(fd, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("brf_transformer_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(path)
    return mod


def main(argv):
    del argv
    mods = {"ref": load_at(FLAGS.ref), "work": work_tr}
    m = registry.load(FLAGS.model, progress=False)
    T, n = FLAGS.prompt_len, FLAGS.new_tokens
    ids = jnp.asarray(np.random.RandomState(0).randint(100, 1000, (1, T)), jnp.int32)

    def prefill(tr):
        cache = init_cache(m.cfg, 1, T + n + 1)
        return jax.block_until_ready(tr.prefill_donated(m.params, m.cfg, ids, None, cache,
                                                        logits="last"))

    def decode(tr):
        logits, cache = prefill(tr)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            logits, cache = tr.decode_step_donated(m.params, m.cfg, tok, cache)
        jax.block_until_ready(logits)
        return (time.perf_counter() - t0) / n, logits

    outs = {k: (np.asarray(prefill(tr)[0]), np.asarray(decode(tr)[1])) for k, tr in mods.items()}
    print(f"{FLAGS.model}: ref={FLAGS.ref} vs working tree, {FLAGS.repeats} alternations")
    print("max |logit diff|: prefill %.3g, after %d decoding steps %.3g" % (
        np.abs(outs["ref"][0] - outs["work"][0]).max(), n,
        np.abs(outs["ref"][1] - outs["work"][1]).max()))
    pre = {k: [] for k in mods}
    dec = {k: [] for k in mods}
    for _ in range(FLAGS.repeats):
        for k, tr in mods.items():
            t0 = time.perf_counter()
            prefill(tr)
            pre[k].append(time.perf_counter() - t0)
            dec[k].append(decode(tr)[0])
    for k in mods:
        print("%-4s prefill %.0f tok/s (median), decode %.1f ms a step (median)" % (
            k, T / np.median(pre[k]), 1e3 * np.median(dec[k])))
    ratio = lambda d: float(np.median(np.array(d["ref"]) / np.array(d["work"])))  # noqa: E731
    print("pairwise ref/work time, median: prefill %.3f, decode %.3f" % (ratio(pre), ratio(dec)))


if __name__ == "__main__":
    cli.run(main)
