r"""Do the fits repeat? Calibrated rows refitted under perturbations of the last bits.

Each row (a method spec, calibrated variant) is fitted on one table with the study's
fitter (``brf.eval.fitting.fit_method``) once as is and once under each perturbation
of ``--perturb`` (positions summed in another order, the table moved by float32 ulps,
Born's sin and cos from XLA: ``brf.eval.fitting.PERTURBATIONS``), for each number of
starts in ``--starts``. It prints each fit's calibration NLL, the spread of a row's
fits (the largest minus the smallest: the goal is at most ``FIT_TOLERANCE``, 1e-4
nats) and the seconds a fit took, as Markdown.

Tables: ``hamlet_bytes``, the committed real byte-level rows
(tests/data/byte_table_hamlet.npz: SmolLM2-135M-Instruct and Gemma 3 270M on 1,200
bytes of Hamlet, 257 events); ``planted``, the tests' two-member table
(``brf.eval.planted.two_members``: 1,500 positions, 12 events, a sharp and a noisy
member); ``tiny_study``, the calibration table of the tests' short study
(tests/data/tiny_study_table.npz: tests/test_validate.py's ``test_one_corpus_end_to_end``,
its two random 2-layer members on 5,000 characters of the default corpus, token
level: 1,088 positions, 33 events). ``--screen_positions``, ``--subsample``,
``--keep``, ``--polish`` and ``--screen_iter`` set the fitter's stages
(``FitSettings``; 0 positions: every position).

With ``--study=CORPUS/ANALYSIS`` (e.g. ``hamlet/swarm``) it refits instead one analysis
of the study (configs/validate.py, token level) as the study fits it: its calibration
table from the study's score stores under ``--study_out`` (scored first where README's
main command has not run), every row of ``--study_variant`` (calibrated by default)
whose label contains one of ``--study_rows`` (all by default) through both passes of
``brf.eval.analysis.fit_specs``, as is and under each perturbation; with
``--study_stages``, with ``--starts`` random starts (0: the structured starts alone)
and the stage flags' stages instead of the study's.

With ``--census``, each row's fits are taken apart instead: *every* start of the row
(the structured start and the first ``--starts`` seeded random ones, the fitter's own)
runs to convergence on every position with the fitter's float32 objective, then, with
``--float64`` (default), goes on with the same L-BFGS on the objective evaluated in
float64 (Born's sin and cos from XLA, the line search at float64 resolution), which
shows what float32 rounding hides; as is and under each perturbation. It prints the
distinct ends (within 1e-6 nats), how many starts reached each, and per run the best
end, how many starts reached it within ``FIT_TOLERANCE`` and how many distinct ends
lie within 2e-3 nats of it: whether any number of starts can make a refit repeat.

  python experiments/bench_fit_repeat.py
  python experiments/bench_fit_repeat.py --table=tiny_study --census --rows=born_token_tanh \
      --starts=30 --perturb=order+ulp+sincos
  python experiments/bench_fit_repeat.py --table=planted --starts=12,40 --rows=born_token_tanh
  python experiments/bench_fit_repeat.py --table=tiny_study --rows=born_token_tanh,born_tanh \
      --starts=8,24,64 --screen_positions=0 --subsample=0
  python experiments/bench_fit_repeat.py --study=hamlet/swarm --study_rows=born,pool --perturb=order+ulp+sincos
  python experiments/bench_fit_repeat.py --study=hamlet/corpus --study_variant=proposed \
      --study_rows=token_tanh --study_stages --starts=0 --perturb=
"""

import dataclasses
import math
import os
import platform
import time

from absl import flags
import numpy as np
from tqdm.auto import tqdm

from brf import cli
from brf.benchmark import markdown_table
from brf.errors import UserError
from brf.eval.planted import log_softmax, two_members
from brf.eval import lbfgs
from brf.eval.fitting import (FIT_TOLERANCE, PERTURBATIONS, FitSettings, MethodSpec,
                              _Problem, fit_method)
from brf.event_table import EventTable

FLAGS = flags.FLAGS
flags.DEFINE_enum("table", "hamlet_bytes", ["hamlet_bytes", "planted", "tiny_study"],
                  "the table fitted")
_DEFAULT = FitSettings()
flags.DEFINE_integer("screen_positions", _DEFAULT.screen_positions,
                     "the screen's positions (0: every position)")
flags.DEFINE_integer("subsample", _DEFAULT.subsample,
                     "the middle stage's positions (0: none, every stage on every position)")
flags.DEFINE_integer("keep", _DEFAULT.keep, "screened candidates fitted to convergence")
flags.DEFINE_integer("polish", _DEFAULT.polish, "candidates polished on every position")
flags.DEFINE_integer("screen_iter", _DEFAULT.screen_iter, "the screen's iterations")
flags.DEFINE_list("rows", ["born_token_tanh", "born_tanh", "loglinear", "routing"],
                  "rows to fit (names of ROWS)")
flags.DEFINE_list("perturb", ["order", "ulp", "sincos", "order+ulp+sincos"],
                  "perturbations, each refitted beside the unperturbed fit")
flags.DEFINE_list("starts", ["12"], "numbers of starts per grid point to try")
flags.DEFINE_string("study", None, "CORPUS/ANALYSIS of the study to refit (e.g. hamlet/swarm) "
                    "instead of --table")
flags.DEFINE_string("study_out", "runs/validate", "the study's output directory (its score "
                    "stores)")
flags.DEFINE_bool("census", False, "every start of each row to convergence, its ends "
                  "counted (see above) instead of whole fits")
flags.DEFINE_bool("float64", True, "with --census: every end continued on the float64 "
                  "objective")
flags.DEFINE_list("study_rows", [], "with --study: fit the rows whose label "
                  "contains one of these (default: every row)")
flags.DEFINE_enum("study_variant", "calibrated", ["calibrated", "proposed"],
                  "with --study: the variant whose rows are refitted")
flags.DEFINE_bool("study_stages", False, "with --study: the fitter's starts and stages "
                  "from --starts (its first number) and the stage flags, not the study's")

_BORN = {"phase.scale": 1.5, "phase.rate": 0.5, "phase.offset": [0.0, 0.5]}
ROWS = {
    "born_token_tanh": MethodSpec("born token_tanh", "born", fit=_BORN, phase="token_tanh"),
    "born_tanh": MethodSpec("born tanh", "born", fit=_BORN, phase="tanh"),
    "loglinear": MethodSpec("loglinear", "loglinear", fit={"temperature": 1.0}),
    "routing": MethodSpec("routing", "routing", grid={"criterion": ["max_prob", "gap"]},
                          fit_weights=False),
}
HAMLET = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "byte_table_hamlet.npz")
TINY_STUDY = os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                          "tiny_study_table.npz")


def _spread_cells(nlls) -> list[str]:
    """A row's spread (the largest fit minus the smallest) and whether it is within
    FIT_TOLERANCE."""
    spread = max(nlls) - min(nlls)
    return [f"{spread:.1e}", "yes" if spread <= FIT_TOLERANCE else "no"]


def tiny_study_table() -> EventTable:
    d = np.load(TINY_STUDY)
    return EventTable(*(d[f] if f in d else None for f in EventTable._fields))


def hamlet_table() -> EventTable:
    d = np.load(HAMLET)
    lp = log_softmax(d["logp"].astype(np.float64)).astype(np.float32)
    return EventTable(lp, d["gold"].astype(np.int64), d["gap"],
                      d["gold_bytes"].astype(np.int64), d["segment"].astype(np.int64))


def study_table(which: str):
    """(the calibration table of the study's analysis ``which``, 'corpus/kind', and the
    study's plan)."""
    import importlib.util
    from brf.eval import plan as plan_lib, study
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "validate.py")
    spec = importlib.util.spec_from_file_location("validate_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.out_dir = FLAGS.study_out
    plan = plan_lib.from_config(cfg)
    for _, _, table, nseg in study.study_tables(
            plan, which=lambda corpus, a: f"{corpus}/{a.kind}" == which):
        return plan_lib.split(plan.scoring, table, nseg)[0], plan
    raise UserError(f"--study={which!r}: no such analysis at the token level (corpus/kind, "
                    f"e.g. hamlet/swarm)")


def refit_study(perturbs: list[str], stages: dict, starts: int) -> None:
    """--study: the analysis's rows of --study_variant fitted as the study fits them, or
    with ``stages`` and ``starts`` random starts under --study_stages."""
    from brf.eval.analysis import fit_specs
    table, plan = study_table(FLAGS.study)
    n = table.logp.shape[1]
    want = FLAGS.study_variant
    specs = [s for s in plan.method_specs(n, (want,) if n > 2 else plan.variants)
             if s.variant == want and s.role != "member"
             and (not FLAGS.study_rows or any(r in s.label for r in FLAGS.study_rows))]
    if not specs:
        raise UserError(f"--study_rows: no {want} row of {FLAGS.study} contains any of "
                        f"{FLAGS.study_rows}")
    fit = plan.fit
    if FLAGS.study_stages:
        fit = dataclasses.replace(fit, starts=starts, **stages)
    print(f"{FLAGS.study}: {' x '.join(map(str, table.logp.shape))} positions x members x "
          f"events, {len(specs)} rows; {platform.node()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}\n", flush=True)
    nll, secs = {}, []
    for p in perturbs:
        t0 = time.perf_counter()
        fits = fit_specs(specs, table, dataclasses.replace(fit, perturb=p),
                         desc=p or "as is")
        secs.append(time.perf_counter() - t0)
        for f in fits:
            nll.setdefault(f.label, []).append(f.calib_nll)
    header = ["row"] + [p or "as is" for p in perturbs] + ["spread", "<= 1e-4"]
    rows = []
    for label, v in sorted(nll.items(), key=lambda kv: kv[1][0]):
        rows.append([label] + [f"{x:.6f}" for x in v] + _spread_cells(v))
    print()
    print(markdown_table(header, rows))
    print("\nseconds, both passes: " + ", ".join(
        f"{p or 'as is'} {s:.0f}" for p, s in zip(perturbs, secs)))


# --census: two ends within SAME nats are one end; NEAR: how far above the best the
# distinct ends are counted
SAME, NEAR = 1e-6, 2e-3


def census_ends(problem: _Problem, n_starts: int, float64: bool) -> list[tuple[float, float]]:
    """(float64 end or nan, float32 end) of every start, in the starts' order (nats,
    the table's offset removed)."""
    table, settings = problem.table, problem.settings
    full, point = problem.data(), problem.grid_points()[0]
    offset = float(np.mean(table.offset))
    xs = problem.starts(None, []) + problem.random_starts(n_starts, 0)
    fun64 = problem.objective(point, full, float64=True) if float64 else None
    args = problem.lbfgs_args(dataclasses.replace(settings, ftol=1e-12, gtol=1e-8,
                                                  max_iter=3000))
    out = []
    for x in tqdm(xs, desc=settings.perturb or "as is", unit="start"):
        r = problem.minimize(point, x, full, "converge", [], settings)
        # continued with the line search at float64 resolution
        v64 = (lbfgs.minimize(fun64, r.x, noise=1e-13, **args).value - offset if float64
               else math.nan)
        out.append((v64, r.value - offset))
    return out


def distinct_ends(values) -> list[tuple[float, int]]:
    """Distinct ends (within SAME), lowest first, with how many starts reached each."""
    out: list[list] = []
    for v in sorted(values):
        if out and v - out[-1][0] <= SAME:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return [(v, k) for v, k in out]


def census(table: EventTable, n_starts: int, perturbs: list[str]) -> None:
    """--census: each row's starts run to convergence, their ends counted."""
    which = 0 if FLAGS.float64 else 1
    for name in FLAGS.rows:
        spec = ROWS[name].in_variant("calibrated")
        summary = []
        for p in perturbs:
            t0 = time.perf_counter()
            ends = census_ends(_Problem(spec, table, FitSettings(perturb=p)), n_starts,
                               FLAGS.float64)
            secs = time.perf_counter() - t0
            found = distinct_ends(e[which] for e in ends)
            best = found[0][0]
            print(f"\n{spec.label}, {p or 'as is'} ({secs:.0f} s): the ends "
                  f"{'continued in float64' if FLAGS.float64 else 'in float32'}, and how "
                  f"many starts reached each")
            print(markdown_table(["end (nats)", "starts", "above the best"],
                                 [[f"{v:.7f}", k, f"{v - best:.1e}"] for v, k in found[:8]]),
                  flush=True)
            summary.append([spec.label, p or "as is", f"{min(e[1] for e in ends):.7f}",
                            f"{best:.7f}" if FLAGS.float64 else "-",
                            sum(1 for e in ends if e[which] <= best + FIT_TOLERANCE),
                            sum(1 for v, _ in found if v <= best + NEAR), f"{secs:.0f}"])
        print()
        print(markdown_table(["row", "run", "best float32 end", "best float64 end",
                              "starts within 1e-4 of the best", "distinct ends within 2e-3",
                              "s"], summary))


def _stages() -> dict:
    """The fitter's stages from the flags (a bad one is the user's mistake)."""
    stages = dict(screen_positions=FLAGS.screen_positions, subsample=FLAGS.subsample,
                  keep=FLAGS.keep, polish=FLAGS.polish, screen_iter=FLAGS.screen_iter)
    if min(stages.values()) < 0 or min(FLAGS.keep, FLAGS.polish, FLAGS.screen_iter) < 1:
        raise UserError(f"the fitter's stages: positions >= 0, keep, polish and "
                        f"screen_iter >= 1; got {stages}")
    return stages


def main(argv):
    del argv
    unknown = [r for r in FLAGS.rows if r not in ROWS]
    if unknown:
        raise UserError(f"--rows: unknown row {unknown[0]!r} (known: {', '.join(ROWS)})")
    for p in FLAGS.perturb:
        bad = [k for k in p.split("+") if k not in PERTURBATIONS]
        if bad:
            raise UserError(f"--perturb: unknown perturbation {bad[0]!r} "
                            f"(known: {', '.join(PERTURBATIONS)})")
    try:
        starts = [int(s) for s in FLAGS.starts]
    except ValueError:
        raise UserError(f"--starts: integers, got {','.join(FLAGS.starts)!r}") from None
    if any(s < 0 for s in starts):
        raise UserError("--starts: each at least 0 (0: the structured starts alone)")
    stages = _stages()
    if FLAGS.study:
        return refit_study([""] + list(FLAGS.perturb), stages, starts[0])
    table = {"planted": two_members, "hamlet_bytes": hamlet_table,
             "tiny_study": tiny_study_table}[FLAGS.table]()
    if FLAGS.census:
        print(f"{FLAGS.table}: {' x '.join(map(str, table.logp.shape))} positions x "
              f"members x events; {starts[0] + 1} starts per row; {platform.node()}, "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
        return census(table, starts[0], [""] + list(FLAGS.perturb))
    print(f"{FLAGS.table}: {' x '.join(map(str, table.logp.shape))} positions x members x "
          f"events; stages {stages}; {platform.node()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}\n")
    perturbs = [""] + list(FLAGS.perturb)
    header = (["row", "starts"] + [p or "as is" for p in perturbs]
              + ["spread", "<= 1e-4", "s per fit (median)"])
    rows = []
    for name in FLAGS.rows:
        spec = ROWS[name].in_variant("calibrated")
        for n in starts:
            nlls, secs = [], []
            for p in perturbs:
                t0 = time.perf_counter()
                f = fit_method(spec, table,
                               settings=FitSettings(starts=n, perturb=p, **stages))
                secs.append(time.perf_counter() - t0)
                nlls.append(f.calib_nll)
            rows.append([spec.label, n] + [f"{v:.6f}" for v in nlls] + _spread_cells(nlls)
                        + [f"{np.median(secs):.1f}"])
            print(markdown_table(header, rows[-1:]), flush=True)  # progress, row by row
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    cli.run(main)
