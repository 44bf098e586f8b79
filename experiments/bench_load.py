r"""Loading a large checkpoint: peak host memory and time, against the model's size.

Writes a synthetic sharded safetensors checkpoint (random weights at
Qwen2.5-3B's shape with --layers layers; bfloat16, as such checkpoints are
published; brf.checkpoints.synthetic), then measures each step in a fresh
process (peak RSS: the process's VmHWM; wall time):

  read     brf.checkpoints.hf.load_hf: config + shards -> NumPy params (default dtype)
  convert  brf.checkpoints.registry.convert: read + the orbax checkpoint written
  restore  brf.checkpoints.registry.load(layout='stacked') from that checkpoint
  load     brf.checkpoints.registry.load() from it: per-layer params, ready to run
  python   the interpreter with jax and brf imported (the floor under every step)

and prints the line brf gives when the checkpoint would not fit (float32 against
this host's memory, and bfloat16 against half the model's size).

  python experiments/bench_load.py                       # 28 layers: 2.47e9 parameters
  python experiments/bench_load.py --layers=8 --steps=read,convert
  python experiments/bench_load.py --float32             # also read in float32 (2x memory)

Run it only when the host has about 2x the model's bfloat16 size free (`free -g`).
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time

from absl import flags

from brf import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("dir", "/tmp/brf-bench-load", "where the synthetic checkpoint goes")
flags.DEFINE_integer("layers", 28, "layers of the Qwen2.5-3B-shaped model (36 = the real one)")
flags.DEFINE_string("steps", "python,read,convert,restore,load", "comma-separated steps")
flags.DEFINE_bool("float32", False, "also read the checkpoint in float32")
flags.DEFINE_bool("keep", False, "keep the synthetic checkpoint and the orbax copy")
flags.DEFINE_string("child", None, "internal: run one step in this process")


def _step(name: str, src: str, ckpt: str) -> dict:
    """One measured step, in this (fresh) process."""
    import ml_dtypes
    import numpy as np
    t0 = time.perf_counter()
    out = {}
    if name in ("read", "read_f32"):
        from brf.checkpoints import hf
        dtype = np.float32 if name == "read_f32" else "default"
        cfg, params = hf.load_hf(src, dtype=dtype)
        out["dtype"] = str(params["embed"].dtype)
    elif name == "convert":
        from brf.checkpoints import registry
        registry.convert(src, ckpt, overwrite=True, progress=False)
    elif name in ("restore", "load"):
        import jax
        from brf.checkpoints import registry
        m = registry.load(ckpt, layout="stacked" if name == "restore" else "layers",
                          progress=False)
        jax.block_until_ready(m.params)
        out["dtype"] = str(m.params["embed"].dtype)
    elif name == "python":
        import jax  # noqa: F401
        from brf.checkpoints import registry  # noqa: F401
    del ml_dtypes, np
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss"] = _peak_rss()
    return out


def _peak_rss() -> int:
    """This process image's peak resident set (VmHWM), in bytes. (ru_maxrss would carry
    the parent's size across fork + exec.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(_):
    if FLAGS.child:
        name, src, ckpt = FLAGS.child.split(",")
        print(json.dumps(_step(name, src, ckpt)))
        return
    from brf.checkpoints import assemble, hf, synthetic
    src, ckpt = os.path.join(FLAGS.dir, "hf"), os.path.join(FLAGS.dir, "brf")
    spec = dict(synthetic.QWEN25_3B, num_hidden_layers=FLAGS.layers)
    t0 = time.perf_counter()
    n = synthetic.write_synthetic_hf(src, spec)
    print(f"wrote {n / 1e9:.2f}e9 parameters ({2 * n / 1e9:.2f} GB bfloat16) in "
          f"{time.perf_counter() - t0:.0f} s to {src}", flush=True)
    cfg = hf.read_config(src)
    size = 2 * assemble.n_params(cfg)
    rows = []
    steps = FLAGS.steps.split(",") + (["read_f32"] if FLAGS.float32 else [])
    for name in steps:
        res = subprocess.run([sys.executable, __file__, f"--child={name},{src},{ckpt}"],
                             capture_output=True, text=True)
        if res.returncode:
            print(f"{name}: failed\n{res.stderr[-2000:]}", flush=True)
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        itemsize = 4 if r.get("dtype") == "float32" else 2
        base = itemsize * assemble.n_params(cfg)
        rows.append((name, r.get("dtype", ""), r["peak_rss"] / 1e9, r["peak_rss"] / base,
                     r["seconds"]))
        print(f"{name:9s} {r.get('dtype', ''):9s} peak RSS {r['peak_rss'] / 1e9:6.2f} GB "
              f"= {r['peak_rss'] / base:.2f} x the model ({base / 1e9:.2f} GB)  "
              f"{r['seconds']:6.1f} s", flush=True)
    print("\n| step | dtype | peak RSS (GB) | / model size in that dtype | seconds |\n"
          "|---|---|---|---|---|")
    for name, dtype, peak, ratio, sec in rows:
        print(f"| {name} | {dtype} | {peak:.2f} | {ratio:.2f} | {sec:.1f} |")
    for dtype, avail in (("float32", None), ("bfloat16", size // 2)):
        try:
            assemble.check_fits(cfg, dtype, src, available=avail)
            print(f"\n{dtype}: fits this host")
        except assemble.CheckpointTooLargeError as e:
            print(f"\n{dtype} against {('this host' if avail is None else f'{avail / 1e9:.1f} GB')}"
                  f": {e}")
    if not FLAGS.keep:
        shutil.rmtree(FLAGS.dir, ignore_errors=True)


if __name__ == "__main__":
    cli.run(main)
