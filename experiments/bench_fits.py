r"""The study's fits, side by side in one run: brf's fitter, an earlier brf fitter and Adam.

For every event table of the default study (read from the score stores of a run
directory: run the study once first), every method spec is fitted on the
calibration split by each fitter, in one process:

  * ``adam``: the fitter brf used first (150 Adam steps of size 0.05 on random
    batches of 2048 positions per grid point, member weights and temperatures
    in log space, unbounded), frozen below;
  * ``reference``: brf's fitter as of the commit ``--reference`` (its
    brf/eval/fitting.py, lbfgs.py and analysis.py, read from git history into a
    package of their own), with the study's settings and its second round;
  * ``lbfgs``: today's fitter (brf.eval.analysis.fit_specs with the study's
    settings: calibration temperatures bounded to [1/10, 10], the second round);
  * ``lbfgs_unbounded``: today's fitter on Adam's objective (calib_range=0), so
    that calibration NLLs compare like with like with Adam's;
  * ``lbfgs_fisher``: today's fitter with each run's inverse-Hessian estimate
    started from the empirical Fisher information (``FitSettings.precondition``).

With ``--trace`` every L-BFGS run of the ``lbfgs`` fitters is recorded (its value at
each evaluation), and a table shows what a looser stopping rule (``ftol``) would
have saved and how far such a stop lies above the run's end.

The tables are loaded first; then each fitter fits every table in turn, after
JAX's in-memory caches (and brf's compiled fitting programs) are cleared: each
fitter pays for its own compilations, once per run where its programs serve
several tables (the persistent compilation cache is not used). It reports each
table's fitting time per fitter (with its compilations' count and time), every
method's calibration NLL under each (per gold string, the table's gold offsets
included, for every fitter), and the rows where ``lbfgs`` is worse than
``reference`` or ``adam`` by more than 1e-4 nats, as Markdown (stdout) and JSON
(--out).

  python experiments/bench_fits.py --run_dir=runs/validate
  python experiments/bench_fits.py --run_dir=runs/validate --tables=hamlet/corpus \
      --fitters=adam,reference,lbfgs
"""

import collections
import dataclasses
import importlib
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
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
from brf.eval.fitting import (Fitted, MethodSpec, clear_programs, context_nll, fused_logq,
                              gold_nll, perplexity_weights_for)
from brf.fusion import get_method

FITTERS = ("adam", "reference", "lbfgs", "lbfgs_unbounded", "lbfgs_fisher")

FLAGS = flags.FLAGS
flags.DEFINE_string("run_dir", "runs/validate", "a study's run directory (its score stores)")
flags.DEFINE_string("config", "configs/validate.py", "the study's config file")
flags.DEFINE_list("tables", [], "corpus/analysis pairs to fit (default: every table)")
flags.DEFINE_list("levels", ["tokens"], "the study's levels whose tables are fitted: tokens, "
                  "bytes (the byte level reads the run's byte stores)")
flags.DEFINE_list("fitters", ["adam", "reference", "lbfgs"],
                  f"which fitters to run, in this order ({', '.join(FITTERS)})")
flags.DEFINE_string("reference", "64302e9",
                    "the commit whose fitter 'reference' runs (default: the host-driven "
                    "L-BFGS with one evaluation per call, before the chunked programs)")
flags.DEFINE_string("out", "", "write the results as JSON here")
flags.DEFINE_bool("trace", False, "record every L-BFGS run and show what looser ftol "
                  "stopping rules would have saved")
flags.DEFINE_float("calib_range", None, "lbfgs's bound on the calibration temperatures, "
                   "[1/r, r] (default: the study's config.fit.calib_range)")


# --------------------------------------------------------------------------- adam

_POSITIVE = {"temperature", "threshold", "beta", "phase.rate", "phase.scale",
             "calib.temperature", "calib.member_temperature", "weighting.temperature"}


def adam_reference(spec: MethodSpec, table, *, steps=150, learning_rate=0.05, batch=2048,
                   seed=0) -> Fitted:
    """brf's first fitter (frozen): per grid point, ``steps`` Adam steps on random
    batches, one compiled step per grid point."""
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
    # Like brf's fitter, report the NLL per gold string: the table's gold offsets (a
    # constant per table that no fit sees) are added back.
    return Fitted(spec.label, spec.method, {**best[1], **({"phase": spec.phase}
                                                          if spec.phase else {})},
                  best[2], best[0] - float(np.mean(table.offset)))


# --------------------------------------------------------------------------- reference

def load_reference(commit: str):
    """brf's fitter as of ``commit``: its brf/eval/{fitting,lbfgs,analysis}.py from git
    history, imported as the package ``brf_reference`` (the rest of brf is today's).
    Returns (its analysis module, its fitting module)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pkg = os.path.join(tempfile.mkdtemp(prefix="bench_fits_"), "brf_reference")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for name in ("fitting", "lbfgs", "analysis"):
        src = subprocess.run(["git", "show", f"{commit}:brf/eval/{name}.py"], cwd=root,
                             check=True, capture_output=True, text=True).stdout
        src = (src.replace("from brf.eval import lbfgs", "from brf_reference import lbfgs")
               .replace("from brf.eval.fitting import", "from brf_reference.fitting import"))
        with open(os.path.join(pkg, f"{name}.py"), "w") as f:
            f.write(src)
    sys.path.insert(0, os.path.dirname(pkg))
    return (importlib.import_module("brf_reference.analysis"),
            importlib.import_module("brf_reference.fitting"))


def reference_fits(specs, calib, settings):
    analysis, fitting = load_reference(FLAGS.reference)
    own = [fitting.MethodSpec.coerce({f.name: getattr(s, f.name)
                                      for f in dataclasses.fields(s)}) for s in specs]
    names = {f.name for f in dataclasses.fields(fitting.FitSettings)}
    ref_settings = fitting.FitSettings(**{k: v for k, v in dataclasses.asdict(settings).items()
                                          if k in names})
    return analysis.fit_specs(own, calib, ref_settings, desc="reference")


# --------------------------------------------------------------------------- the run

_COMPILES = collections.Counter()
_RUNS = collections.defaultdict(list)  # fitter -> each L-BFGS run's values, one per evaluation


def _traced(minimize, fitter: list):
    """lbfgs.minimize, recording each run's value at every evaluation under the fitter
    now running (``fitter[0]``)."""
    def run(fun, x0, **kw):
        values = []
        def recorded(x):
            v, g = fun(x)
            values.append(float(v))
            return v, g
        r = minimize(recorded, x0, **kw)
        _RUNS[fitter[0]].append(values)
        return r
    return run


def _stopping_table(runs: list[list[float]]) -> str:
    """What each ftol would have saved: a run stops once two accepted iterations in a
    row lower the value by less than ftol (relative), as brf.eval.lbfgs does; the
    accepted values are read off the evaluations (an evaluation below the last
    accepted value, within float32 resolution, is accepted)."""
    from brf.eval.lbfgs import NOISE
    total = sum(len(v) for v in runs)
    rows = []
    for ftol in (1e-8, 1e-7, 1e-6, 1e-5):
        used, worst = 0, 0.0
        for values in runs:
            f, quiet, stop = values[0], 0, None
            for i, v in enumerate(values[1:], 1):
                if v > f + NOISE * abs(f):
                    continue
                quiet = quiet + 1 if f - v <= ftol * max(abs(f), 1.0) else 0
                f = v
                if quiet >= 2:
                    stop = i
                    break
            used += len(values) if stop is None else stop + 1
            if stop is not None:
                worst = max(worst, values[stop] - min(values))
        rows.append([f"{ftol:g}", used, f"{used / max(total, 1):.2f}", f"{worst:.2e}"])
    return "\n" + markdown_table(["ftol", "evaluations", "of all", "worst stop above the run's end"],
                                 rows)


def _count_compiles(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["n"] += 1
        _COMPILES["seconds"] += duration


def fit_table(plan, specs, calib, fitter: str) -> dict:
    """Every spec fitted by ``fitter``: seconds, compilations, label -> (calib NLL, info)."""
    _COMPILES.clear()
    t0 = time.perf_counter()
    if fitter == "adam":
        fits = [fit_spec(s, calib, plan.fit) if s.fixed_weights is not None
                and s.variant == "proposed" else adam_reference(s, calib) for s in specs]
    elif fitter == "reference":
        fits = reference_fits(specs, calib, plan.fit)
    else:
        settings = {"lbfgs": plan.fit,
                    "lbfgs_unbounded": dataclasses.replace(plan.fit, calib_range=0.0),
                    "lbfgs_fisher": dataclasses.replace(plan.fit, precondition=True)}[fitter]
        fits = fit_specs(specs, calib, settings, desc=f"{fitter}")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "compilations": _COMPILES["n"], "runs": _RUNS.pop(fitter, []),
            "compile_seconds": _COMPILES["seconds"], "load": os.getloadavg()[0],
            "fits": {f.label: (f.calib_nll, dict(f.info)) for f in fits}}


def main(argv):
    del argv
    import importlib.util
    spec = importlib.util.spec_from_file_location("validate_config", FLAGS.config)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config()
    cfg.out_dir = FLAGS.run_dir
    if FLAGS.calib_range is not None:  # checked with the rest of the plan
        cfg.fit.calib_range = FLAGS.calib_range
    plan = plan_lib.from_config(cfg)
    bad = [f for f in FLAGS.fitters if f not in FITTERS]
    if bad:
        raise UserError(f"--fitters: unknown {bad}; use {', '.join(FITTERS)}")
    if not os.path.isdir(FLAGS.run_dir):
        raise UserError(f"--run_dir={FLAGS.run_dir!r} does not exist; run the study first")
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    now = [None]
    if FLAGS.trace:
        from brf.eval import lbfgs
        lbfgs.minimize = _traced(lbfgs.minimize, now)
    which = lambda corpus, a: not FLAGS.tables or f"{corpus}/{a.kind}" in FLAGS.tables
    tables = []
    bad = [lv for lv in FLAGS.levels if lv not in plan_lib.LEVELS]
    if bad:
        raise UserError(f"--levels: unknown {bad}; use {', '.join(plan_lib.LEVELS)}")
    for corpus, analysis, table, n_seg in study.study_tables(
            plan, which=which, level_names=tuple(FLAGS.levels)):
        calib, _ = plan_lib.split(plan.scoring, table, n_seg)
        tag = "" if analysis.level == "tokens" else f" ({analysis.level})"
        tables.append((f"{corpus}/{analysis.kind}{tag}", calib,
                       plan.method_specs(table.logp.shape[1], analysis.variants)))
    results = [{"table": name, "positions": int(calib.n_positions),
                "shape": list(calib.logp.shape), "specs": len(specs), "fitters": {}}
               for name, calib, specs in tables]
    # Each fitter fits every table in turn after the caches are cleared: it pays for
    # its own compilations, and keeps what it compiled for the tables after the first.
    for fitter in FLAGS.fitters:
        jax.clear_caches()
        clear_programs()
        now[0] = fitter
        for entry, (name, calib, specs) in zip(results, tables):
            r = entry["fitters"][fitter] = fit_table(plan, specs, calib, fitter)
            print(f"{name} {fitter}: {r['seconds']:.1f} s for {len(specs)} specs "
                  f"({r['compilations']} compilations, {r['compile_seconds']:.1f} s; "
                  f"load {r['load']:.1f})", flush=True)
    for entry in results:
        print(_nll_table(entry), flush=True)
        for fitter, r in entry["fitters"].items():
            if r["runs"]:
                print(f"\n{entry['table']} {fitter}: {len(r['runs'])} L-BFGS runs, "
                      f"{sum(map(len, r['runs']))} evaluations", _stopping_table(r["runs"]))
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
          f"load {os.getloadavg()[0]:.1f}\n")
    ratios = [f"adam / {f}" for f in FLAGS.fitters if f != "adam" and "adam" in FLAGS.fitters]
    rows = [_time_row(entry) for entry in results]
    if len(results) > 1:
        rows.append(_time_row({"table": "total", "shape": None,
                               "specs": sum(e["specs"] for e in results),
                               "fitters": {f: {"seconds": sum(e["fitters"][f]["seconds"]
                                                              for e in results)}
                                           for f in FLAGS.fitters}}))
    print(markdown_table(["table", "calibration P x n x E", "specs"]
                         + [f"{f} (s)" for f in FLAGS.fitters] + ratios, rows))
    for a, b in (("reference", "lbfgs"), ("adam", "lbfgs"), ("adam", "lbfgs_unbounded"),
                 ("lbfgs", "lbfgs_fisher")):
        if {a, b} <= set(FLAGS.fitters):
            worse = [(r["table"], label, x[0], r["fitters"][b]["fits"][label][0])
                     for r in results for label, x in r["fitters"][a]["fits"].items()
                     if r["fitters"][b]["fits"][label][0] > x[0] + 1e-4]
            total = sum(len(r["fitters"][a]["fits"]) for r in results)
            print(f"\n{b} worse than {a} by more than 1e-4 nats: {len(worse)} of {total} fits")
            for w in worse:
                print(f"  {w[0]} {w[1]}: {a} {w[2]:.6f}, {b} {w[3]:.6f}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"machine": platform.node(), "load": os.getloadavg()[0],
                       "reference": FLAGS.reference, "tables": results}, f, indent=1,
                      default=float)


def _time_row(entry: dict) -> list:
    t = {f: r["seconds"] for f, r in entry["fitters"].items()}
    shape = " x ".join(map(str, entry["shape"])) if entry["shape"] else ""
    return ([entry["table"], shape, entry["specs"]] + [f"{t[f]:.1f}" for f in t]
            + [f"{t['adam'] / t[f]:.2f}x" for f in t if f != "adam" and "adam" in t])


def _nll_table(entry: dict) -> str:
    """Every row's calibration NLL under each fitter (and lbfgs minus each other one)."""
    fitters = list(entry["fitters"])
    labels = list(entry["fitters"][fitters[0]]["fits"])
    others = [f for f in ("adam", "reference", "lbfgs_fisher") if "lbfgs" in fitters
              and f in fitters]
    rows = []
    for label in labels:
        nll = {f: entry["fitters"][f]["fits"][label][0] for f in fitters}
        rows.append([label] + [f"{nll[f]:.6f}" for f in fitters]
                    + [f"{nll['lbfgs'] - nll[f]:+.6f}" for f in others])
    return "\n" + markdown_table(["row"] + fitters + [f"lbfgs - {f}" for f in others], rows)


if __name__ == "__main__":
    cli.run(main)
