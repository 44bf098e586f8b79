r"""Fusion-kernel benchmark: brf kernels vs the memory floor and NumPy.

For each method, shape and dtype float32 it reports, measured in one run:
the jitted brf kernel, the memory floor (bytes read + written over the
bandwidth of a large jnp reduction), a straightforward NumPy implementation,
and for Born fusion the "obvious" jit of the formula (lax.top_k for the gap).

  python experiments/bench_fusion.py                 # full table
  python experiments/bench_fusion.py --quick         # tiny shapes (smoke)
  python experiments/bench_fusion.py --public        # the public call against jit (issue 52)

``--public`` times, side by side at B=64, n=2, V=49152 (``--quick``: V=4096),
for each method: ``brf.fuse(...)`` from Python (validated), the same call with
``validate=False``, a :func:`brf.fusion.compile`d fuser, the same computation
traced inside the caller's ``jax.jit``, and the path ``brf.fuse`` took before
issue 52 (parameters parsed and the logits checked with NumPy on the host at
every call), re-created here from the functions it called.
"""

import functools
import os
import platform

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from brf import cli
import brf
from brf.benchmark import markdown_table, memory_bandwidth, time_call

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "tiny shapes, few repeats")
flags.DEFINE_bool("public", False, "time the public call against jit (issue 52)")
flags.DEFINE_integer("rounds", 7, "--public: interleaved rounds (median kept)")
flags.DEFINE_string("methods", "born,born_token,linear,loglinear,power,max,min,"
                    "routing,entropy_gated,contrastive", "comma-separated")

PARAMS = {"born": dict(method="born", phase="tanh(rate=0.5, offset=0)"),
          "born_token": dict(method="born", phase="token_tanh(rate=0.5)")}


def numpy_born(x, w):
    """Straightforward NumPy: softmax, sorted top-2 gap, complex amplitudes."""
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top2 = -np.partition(-x, 1, axis=-1)[..., :2]
    phi = np.pi * np.tanh(0.5 * (top2[..., 0] - top2[..., 1]))
    amp = np.sqrt(w[:, None] * p) * np.exp(1j * phi)[..., None]
    s = np.abs(amp.sum(-2)) ** 2
    return np.log(s / s.sum(-1, keepdims=True))


def numpy_linear(x, w):
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.log((w[:, None] * p).sum(-2))


@jax.jit
def naive_born(x, w):
    """The obvious jit: log_softmax, lax.top_k for the gap, cos/sin sums."""
    logp = jax.nn.log_softmax(x, -1)
    top2 = jax.lax.top_k(x, 2)[0]
    phi = jnp.pi * jnp.tanh(0.5 * (top2[..., 0] - top2[..., 1]))
    a = jnp.exp(0.5 * (logp + jnp.log(w)[:, None]))
    re = jnp.sum(a * jnp.cos(phi)[..., None], -2)
    im = jnp.sum(a * jnp.sin(phi)[..., None], -2)
    s = re * re + im * im
    return jnp.log(s) - jnp.log(jnp.sum(s, -1, keepdims=True))


def _before(method, x, w, **params):
    """brf.fuse as it was before issue 52: every call resolves the parameters
    (phase map parsed), checks the logits' values with NumPy on the host, then
    calls the jitted kernel."""
    from brf.fusion import checks, methods
    from brf.fusion.phase import check_offset
    m = methods.get_method(method)
    resolved = methods.resolve_params(m, params)
    checks.check_inputs(x, w, None)
    if "phase" in resolved:
        check_offset(resolved["phase"], x.shape[-2])
    w = jnp.asarray(w, x.dtype)
    static, dynamic = methods.split_params(m, resolved)
    return brf.fusion.api._fuse_jit(x, w, None, dynamic, name=m.name, static=static)[0]


def public_table(methods, quick: bool, rounds: int) -> str:
    """The public call against the same computation inside jit, interleaved rounds."""
    import time
    b, n, v = 64, 2, (4096 if quick else 49152)
    rng = np.random.default_rng(0)
    x = jnp.asarray((rng.standard_normal((b, n, v)) * 3).astype(np.float32))
    w = jnp.asarray(np.full(n, 1.0 / n, np.float32))
    rows = []
    for name in methods:
        kw = dict(PARAMS.get(name, {"method": name}))
        method = kw.pop("method")
        fuser = brf.fusion.compile(method, **kw)
        inside = jax.jit(lambda x, w: brf.fuse(method, x, w, validate=False, **kw))
        calls = {"brf.fuse": lambda: brf.fuse(method, x, w, **kw),
                 "validate=False": lambda: brf.fuse(method, x, w, validate=False, **kw),
                 "compiled": lambda: fuser(x, w),
                 "inside jit": lambda: inside(x, w),
                 "before": lambda: _before(method, x, w, **kw)}
        times = {k: [] for k in calls}
        for f in calls.values():  # compile
            jax.block_until_ready(f())
        for _ in range(rounds):
            for k, f in calls.items():
                t0 = time.perf_counter()
                for _ in range(3):
                    jax.block_until_ready(f())
                times[k].append((time.perf_counter() - t0) / 3)
        med = {k: float(np.median(t)) * 1e3 for k, t in times.items()}
        rows.append([name] + [med[k] for k in calls]
                    + [f"{med['brf.fuse'] / med['inside jit']:.2f}x",
                       f"{med['before'] / med['inside jit']:.2f}x"])
        print(rows[-1], flush=True)
    return markdown_table(["method"] + [f"{k} ms" for k in calls]
                          + ["brf.fuse / jit", "before / jit"], rows)


def main(argv):
    del argv
    if FLAGS.public:
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"jax {jax.__version__} on {jax.devices()[0].platform}; B=64, n=2")
        print(public_table(FLAGS.methods.split(","), FLAGS.quick, FLAGS.rounds))
        return
    shapes = ([(8, 2, 4096)] if FLAGS.quick else
              [(8, 2, 49152), (8, 4, 49152), (8, 2, 262144), (8, 4, 262144)])
    repeats = 3 if FLAGS.quick else 10
    bw = memory_bandwidth(1 << (24 if FLAGS.quick else 28), repeats)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"bandwidth of a jnp.sum: {bw / 1e9:.1f} GB/s")
    rows = []
    rng = np.random.default_rng(0)
    for b, n, v in shapes:
        x_np = (rng.standard_normal((b, n, v)) * 3).astype(np.float32)
        w_np = np.full(n, 1.0 / n, np.float32)
        x, w = jnp.asarray(x_np), jnp.asarray(w_np)
        floor = (x_np.nbytes + b * v * 4) / bw
        for name in FLAGS.methods.split(","):
            kw = dict(PARAMS.get(name, {"method": name}))
            method = kw.pop("method")
            m = brf.fusion.get_method(method)
            kw = brf.fusion.methods.resolve_params(m, kw)
            static, dynamic = brf.fusion.methods.split_params(m, kw)
            call = functools.partial(brf.fusion.api._fuse_jit, x, w, None, dynamic,
                                     name=method, static=static)
            t = time_call(call, repeats=repeats)
            ref_t = None
            if name == "born":
                ref_t = time_call(lambda: numpy_born(x_np, w_np), repeats=3, warmup=1)
                naive = time_call(lambda: naive_born(x, w), repeats=3, warmup=1)
            elif name == "linear":
                ref_t = time_call(lambda: numpy_linear(x_np, w_np), repeats=3, warmup=1)
            rows.append([name, f"{b}x{n}x{v}", t * 1e3, floor * 1e3, t / floor,
                         "" if ref_t is None else f"{ref_t * 1e3:.1f}",
                         "" if ref_t is None else f"{ref_t / t:.1f}x",
                         f"{naive * 1e3:.1f}" if name == "born" else ""])
            print(rows[-1], flush=True)
    print(markdown_table(
        ["method", "BxnxV", "brf ms", "floor ms", "x floor", "NumPy ms",
         "speedup vs NumPy", "naive jit ms"], rows))


if __name__ == "__main__":
    cli.run(main)
