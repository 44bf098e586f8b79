r"""The study's fits, side by side in one run: L-BFGS (brf) vs the earlier Adam fitter.

For every event table of the default study (read from the score stores of a run
directory: run the study once first), every method spec is fitted on the
calibration split three ways, in one process:

  * ``adam``: the fitter brf used before (150 Adam steps of size 0.05 on random
    batches of 2048 positions per grid point, member weights and temperatures
    in log space, unbounded), frozen below as the reference;
  * ``lbfgs``: today's fitter (brf.eval.fitting.fit_method, the study's settings:
    calibration temperatures bounded to [1/10, 10]);
  * ``lbfgs_unbounded``: today's fitter on Adam's objective (calib_range=0), so
    that calibration NLLs compare like with like.

It reports each table's total fitting time per fitter and every method's
calibration NLL under each, as Markdown (stdout) and JSON (--out).

  python experiments/bench_fits.py --run_dir=runs/validate
  python experiments/bench_fits.py --run_dir=runs/validate --tables=hamlet/topk,hamlet/swarm
"""

import dataclasses
import itertools
import json
import math
import os
import platform
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from brf import cli
from brf.benchmark import markdown_table
from brf.errors import UserError
from brf.eval import plan as plan_lib, study
from brf.eval.analysis import fit_spec, fit_specs
from brf.eval.fitting import (Fitted, MethodSpec, context_nll, fused_logq, gold_nll,
                              perplexity_weights_for)
from brf.fusion import get_method

FLAGS = flags.FLAGS
flags.DEFINE_string("run_dir", "runs/validate", "a study's run directory (its score stores)")
flags.DEFINE_string("config", "configs/validate.py", "the study's config file")
flags.DEFINE_list("tables", [], "corpus/analysis pairs to fit (default: every table)")
flags.DEFINE_list("fitters", ["adam", "lbfgs", "lbfgs_unbounded"], "which fitters to run")
flags.DEFINE_string("out", "", "write the results as JSON here")


# --------------------------------------------------------------------------- reference

_POSITIVE = {"temperature", "threshold", "beta", "phase.rate", "phase.scale",
             "calib.temperature", "calib.member_temperature", "weighting.temperature"}


def adam_reference(spec: MethodSpec, table, *, steps=150, learning_rate=0.05, batch=2048,
                   seed=0) -> Fitted:
    """brf's fitter before L-BFGS (frozen): per grid point, ``steps`` Adam steps on
    random batches, one compiled step per grid point."""
    to_free = lambda k, v: (jnp.log(jnp.asarray(v, jnp.float32)) if k in _POSITIVE
                            else jnp.asarray(v, jnp.float32))
    from_free = lambda k, v: jnp.exp(v) if k in _POSITIVE else v
    declared = get_method(spec.method).params
    n = table.logp.shape[1]
    fixed, init = dict(spec.fixed), dict(spec.fit)
    if spec.variant == "calibrated":
        init.setdefault("calib.temperature", 1.0)
        if n > 1:
            init.setdefault("calib.member_temperature", [1.0] * n)
    ctx_nll = None
    if spec.weighting == "perplexity":
        init.setdefault("weighting.temperature", 1.0)
        ctx_nll = np.asarray(context_nll(table), np.float32)
    fit_weights = (spec.fit_weights and n > 1 and spec.weighting is None
                   and spec.fixed_weights is None)
    base_w = (jnp.full((n,), 1.0 / n) if spec.fixed_weights is None
              else jnp.asarray(spec.fixed_weights, jnp.float32))
    grid = dict(spec.grid)
    logp, gold = jnp.asarray(table.logp), jnp.asarray(table.gold)
    ctx = jnp.asarray(ctx_nll) if ctx_nll is not None else jnp.zeros((table.n_positions, n))
    keys = sorted(init)
    is_float = {k: k in declared and declared[k].kind == "float" for k in grid}
    opt = optax.adam(learning_rate)
    best = None
    for values in itertools.product(*grid.values()) if grid else [()]:
        point = dict(zip(grid.keys(), values))
        static = tuple(sorted((k, v) for k, v in point.items() if not is_float[k]))
        dyn = {k: jnp.float32(v) for k, v in point.items() if is_float[k]}

        def loss(free, dyn, logp_b, gold_b, ctx_b, static=static):
            params = {**fixed, **dict(static), **dyn, **{k: from_free(k, free[k]) for k in keys}}
            w = jax.nn.softmax(free["_w"]) if fit_weights else base_w
            if ctx_nll is not None:
                w = jax.nn.softmax(-ctx_b / params["weighting.temperature"], axis=-1)
            return jnp.mean(gold_nll(fused_logq(spec.method, params, w, logp_b, spec.phase),
                                     gold_b))

        @jax.jit
        def step(free, state, dyn, logp_b, gold_b, ctx_b, loss=loss):
            val, g = jax.value_and_grad(loss)(free, dyn, logp_b, gold_b, ctx_b)
            g = jax.tree_util.tree_map(lambda x: jnp.where(jnp.isfinite(x), x, 0.0), g)
            upd, state = opt.update(g, state, free)
            return optax.apply_updates(free, upd), state, val

        free = {k: to_free(k, init[k]) for k in keys}
        free["_w"] = jnp.zeros((n,), jnp.float32)
        if keys or fit_weights:
            state = opt.init(free)
            rng = np.random.default_rng(seed)
            for _ in range(steps):
                if batch >= table.n_positions:
                    free, state, _ = step(free, state, dyn, logp, gold, ctx)
                else:
                    idx = jnp.asarray(rng.choice(table.n_positions, batch, replace=False))
                    free, state, _ = step(free, state, dyn, logp[idx], gold[idx], ctx[idx])
        value = float(jax.jit(loss)(free, dyn, logp, gold, ctx))
        if math.isfinite(value) and (best is None or value < best[0]):
            params = {**fixed, **point,
                      **{k: np.asarray(from_free(k, free[k])).tolist() for k in keys}}
            w = np.asarray(jax.nn.softmax(free["_w"])) if fit_weights else np.asarray(base_w)
            if ctx_nll is not None:
                w = np.asarray(perplexity_weights_for(table, params["weighting.temperature"])
                               ).mean(0)
            best = (value, params, w)
    return Fitted(spec.label, spec.method, {**best[1], **({"phase": spec.phase}
                                                          if spec.phase else {})},
                  best[2], best[0])


# --------------------------------------------------------------------------- the run

def fit_table(plan, specs, calib, fitter: str) -> tuple[float, dict]:
    """Every spec fitted by ``fitter``; (seconds, label -> (calib NLL, info))."""
    t0 = time.perf_counter()
    if fitter == "adam":
        fits = [fit_spec(s, calib, plan.fit) if s.fixed_weights is not None
                and s.variant == "proposed" else adam_reference(s, calib) for s in specs]
    else:
        settings = (plan.fit if fitter == "lbfgs"
                    else dataclasses.replace(plan.fit, calib_range=0.0))
        fits = fit_specs(specs, calib, settings, desc=f"{fitter}")
    return time.perf_counter() - t0, {f.label: (f.calib_nll, dict(f.info)) for f in fits}


def main(argv):
    del argv
    from ml_collections import config_flags  # noqa: F401  (the config file is Python)
    import importlib.util
    spec = importlib.util.spec_from_file_location("validate_config", FLAGS.config)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config()
    cfg.out_dir = FLAGS.run_dir
    plan = plan_lib.from_config(cfg)
    bad = [f for f in FLAGS.fitters if f not in ("adam", "lbfgs", "lbfgs_unbounded")]
    if bad:
        raise UserError(f"--fitters: unknown {bad}; use adam, lbfgs, lbfgs_unbounded")
    if not os.path.isdir(FLAGS.run_dir):
        raise UserError(f"--run_dir={FLAGS.run_dir!r} does not exist; run the study first")
    results, rows = [], []
    which = lambda corpus, a: not FLAGS.tables or f"{corpus}/{a.kind}" in FLAGS.tables
    for corpus, analysis, table, n_seg in study.study_tables(plan, which=which):
        name = f"{corpus}/{analysis.kind}"
        calib, _ = plan_lib.split(plan.scoring, table, n_seg)
        specs = plan.method_specs(table.logp.shape[1], analysis.variants)
        entry = {"table": name, "positions": int(calib.n_positions),
                 "shape": list(calib.logp.shape), "fitters": {}}
        for fitter in FLAGS.fitters:
            seconds, fits = fit_table(plan, specs, calib, fitter)
            entry["fitters"][fitter] = {"seconds": seconds, "fits": fits}
            print(f"{name} {fitter}: {seconds:.1f} s for {len(specs)} specs", flush=True)
        results.append(entry)
        t = {f: entry["fitters"][f]["seconds"] for f in FLAGS.fitters}
        rows.append([name, f"{calib.n_positions} x {calib.logp.shape[1]} x {calib.logp.shape[2]}",
                     len(specs)] + [f"{t[f]:.1f}" for f in FLAGS.fitters]
                    + ([f"{t['adam'] / t['lbfgs']:.2f}x"] if {"adam", "lbfgs"} <= set(t) else []))
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
          f"load {os.getloadavg()[0]:.1f}\n")
    print(markdown_table(["table", "calibration P x n x E", "specs"] +
                         [f"{f} (s)" for f in FLAGS.fitters] +
                         (["adam / lbfgs"] if {"adam", "lbfgs"} <= set(FLAGS.fitters) else []),
                         rows))
    if {"adam", "lbfgs_unbounded"} <= set(FLAGS.fitters):
        worse = [(r["table"], label, a[0], b[0])
                 for r in results
                 for label, a in r["fitters"]["adam"]["fits"].items()
                 for lbl, b in [(label, r["fitters"]["lbfgs_unbounded"]["fits"][label])]
                 if b[0] > a[0] + 1e-4]
        print(f"\nL-BFGS (unbounded, Adam's objective) worse than Adam by more than 1e-4 nats: "
              f"{len(worse)} of {sum(len(r['fitters']['adam']['fits']) for r in results)} fits")
        for w in worse:
            print(f"  {w[0]} {w[1]}: adam {w[2]:.6f}, lbfgs {w[3]:.6f}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"machine": platform.node(), "load": os.getloadavg()[0],
                       "tables": results}, f, indent=1, default=float)


if __name__ == "__main__":
    cli.run(main)
