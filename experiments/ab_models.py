r"""A/B of the model code in one process: `brf/models/transformer.py` at a git
revision ("ref") against the working tree, run as functions ("work") and as a
flax.nnx module ("module": `brf.models.from_params` over the same arrays, what
`registry.load_module` returns).

The file at --ref is loaded as a second, independent module (its own jit
caches). Every side runs the same weights, prompt, decoding loop and scoring
text, alternating repeat by repeat so that the VM's drift hits all alike.
Timed: a prefill of --prompt_len tokens; --new_tokens greedy decoding steps
(cache donated); teacher-forced scoring of --score_len tokens in chunks of
--chunk (`brf.models.score_tokens`, run with ref's transformer for ref).
Reports each side's largest logit (log-prob) difference from ref, whether a
decoding step lowers to the same program at ref and in the working tree, and
the median pairwise time ratio ref / side (above 1: the side is faster than
ref). The sides run in a fresh random order in every repeat.

  python experiments/ab_models.py --model=smollm2-135m-instruct --ref=HEAD --repeats=8

Only the transformer module is swapped: all sides share the checkpoint loader,
so a change that needs a different parameter layout cannot be compared here.
"""

import importlib.util
import os
import subprocess
import tempfile
import time
from typing import Callable, NamedTuple

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from brf import cli
from brf.checkpoints import registry
from brf.models import from_params, init_cache, scoring
from brf.models import transformer as work_tr

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name or checkpoint path")
flags.DEFINE_string("ref", "HEAD", "git revision of brf/models/transformer.py to compare with")
flags.DEFINE_integer("prompt_len", 512, "prefill length")
flags.DEFINE_integer("new_tokens", 16, "decoding steps timed per repeat")
flags.DEFINE_integer("score_len", 1024, "tokens scored per repeat")
flags.DEFINE_integer("chunk", 256, "scoring chunk")
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


class Side(NamedTuple):
    """What one side runs: prefill(ids, cache) and decode_step(token, cache) ->
    (last logits, cache), with the cache donated; score(ids) -> log-probs."""
    prefill: Callable
    decode_step: Callable
    score: Callable


def functional(tr, m) -> Side:
    """The functions of transformer module `tr` on the loaded model `m`."""
    def score(ids):
        saved = scoring.prefill_donated  # score_tokens' engine, swapped for tr's
        scoring.prefill_donated = tr.prefill_donated
        try:
            return scoring.score_tokens(m.params, m.cfg, ids, chunk=FLAGS.chunk)
        finally:
            scoring.prefill_donated = saved

    return Side(lambda ids, c: tr.prefill_donated(m.params, m.cfg, ids, None, c, logits="last"),
                lambda tok, c: tr.decode_step_donated(m.params, m.cfg, tok, c), score)


def module(model) -> Side:
    """The nnx module's entry points."""
    return Side(lambda ids, c: model.prefill(ids, None, c, logits="last", donate=True),
                lambda tok, c: model.decode_step(tok, c, donate=True),
                lambda ids: model.score_tokens(ids, chunk=FLAGS.chunk))


def same_decode_program(trs, m) -> bool:
    """Whether the transformer modules `trs` lower a decoding step (all layers in one
    jitted call, what `decode_step` runs on the per-layer layout) to the same program."""
    params = jax.eval_shape(lambda p: p, m.params)
    cache = jax.eval_shape(lambda: init_cache(m.cfg, 1, FLAGS.prompt_len + FLAGS.new_tokens + 1))
    token = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    texts = {tr._compute_jit.lower(params, m.cfg, token, None, cache, dtype=jnp.dtype("float32"),
                                   logits="last").as_text() for tr in trs}
    return len(texts) == 1


def main(argv):
    del argv
    m = registry.load(FLAGS.model, progress=False)
    sides_tr = (load_at(FLAGS.ref), work_tr)
    sides = {"ref": functional(sides_tr[0], m), "work": functional(work_tr, m),
             "module": module(from_params(m.cfg, m.params))}
    T, n = FLAGS.prompt_len, FLAGS.new_tokens
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(100, 1000, (1, T)), jnp.int32)
    text = rng.randint(100, 1000, (1, FLAGS.score_len)).astype(np.int32)

    def prefill(side):
        return jax.block_until_ready(side.prefill(ids, init_cache(m.cfg, 1, T + n + 1)))

    def decode(side):
        logits, cache = prefill(side)
        t0 = time.perf_counter()
        for _ in range(n):
            logits, cache = side.decode_step(jnp.argmax(logits, -1).astype(jnp.int32), cache)
        jax.block_until_ready(logits)
        return (time.perf_counter() - t0) / n, logits

    outs = {k: [np.asarray(prefill(s)[0]), np.asarray(decode(s)[1]), s.score(text)]
            for k, s in sides.items()}
    print(f"{FLAGS.model}: ref={FLAGS.ref} vs the working tree, {FLAGS.repeats} alternations")
    for k in ("work", "module"):
        d = [np.nanmax(np.abs(a - b)) for a, b in zip(outs[k], outs["ref"])]
        print(f"{k:<6} max |diff| from ref: prefill logits {d[0]:.3g}, after {n} decoding "
              f"steps {d[1]:.3g}, scored log-probs {d[2]:.3g}")
    print("decoding-step program identical to ref's:", same_decode_program(sides_tr, m))
    times = {k: {"prefill": [], "decode": [], "score": []} for k in sides}
    for _ in range(FLAGS.repeats):
        for k in rng.permutation(list(sides)):  # no side always runs after the same one
            s = sides[k]
            t0 = time.perf_counter()
            prefill(s)
            times[k]["prefill"].append(time.perf_counter() - t0)
            times[k]["decode"].append(decode(s)[0])
            t0 = time.perf_counter()
            s.score(text)
            times[k]["score"].append(time.perf_counter() - t0)
    for k, t in times.items():
        print("%-6s prefill %.0f tok/s, decode %.1f ms a step, scoring %.0f tok/s (medians)" % (
            k, T / np.median(t["prefill"]), 1e3 * np.median(t["decode"]),
            FLAGS.score_len / np.median(t["score"])))
    for k in ("work", "module"):
        ratio = {part: float(np.median(np.array(times["ref"][part]) / np.array(times[k][part])))
                 for part in ("prefill", "decode", "score")}
        print("pairwise ref/%s time, median: prefill %.3f, decode %.3f, scoring %.3f" % (
            k, ratio["prefill"], ratio["decode"], ratio["score"]))


if __name__ == "__main__":
    cli.run(main)
