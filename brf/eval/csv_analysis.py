"""brf's analyses on logit CSVs: phase coherence, cross-terms, fusion.

Two (or more) runs on the same text — two models, or one model under two
prompts — are read (:func:`brf.eval.logit_csv.read_csv`), put on common
positions (same tokenizer: the same (seq, position) rows; different
tokenizers: co-aligned byte offsets as in the validation experiment), and
turned into the validation's event table (:func:`brf.eval.logit_csv.event_table`):
each run's renormalised top-k distribution plus its tail mass, recovered from
the log-normaliser, on an OTHER event. Then, with the validation's own code:

* the Phase Coherence Test per phase map (:func:`brf.eval.hypotheses.phase_coherence`:
  Rayleigh z, R̄, Zar's p, permutation null);
* the Cross-Term Discrimination Test for one Born setting with uniform
  weights (:func:`brf.eval.hypotheses.cross_term_test`, with its equal-phase
  control);
* every registered fusion method (``brf.fusion.METHODS``) at its default
  parameters and uniform weights, and each run alone: NLL of the gold token
  (block-bootstrap CI), top-1 accuracy, positions floored.

Nothing is fitted here: for tuned comparisons run the validation experiment.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from brf import schema as S
from brf.errors import UserError
from brf.eval import hypotheses, report as report_lib
from brf.event_table import EventTable
from brf.eval.fitting import Fitted, evaluate
from brf.eval.logit_csv import (CsvError, LogitRun, align_bytes, align_positions,
                                content_digest, event_table, read_csv)
from brf.fusion import METHODS, FusionInputError, phase_map

DEFAULT_PHASE_MAPS = {
    "linear": "linear(scale=0.2)",
    "tanh": "tanh(scale=1.5, rate=0.5)",
    "arctan": "arctan(scale=1.5, rate=0.5)",
    "log1p": "log1p(scale=0.5, rate=1.0)",
    "token_tanh": "token_tanh(scale=1.5, rate=0.5)",
    "token_log1p": "token_log1p(scale=0.5, rate=1.0)",
}


def load_table(paths: Sequence[str], *, align: str = "auto",
               vocab_sizes: Sequence[int] | None = None, progress: bool = False):
    """Reads the CSVs and builds their event table.

    Args:
      paths: two or more logit CSVs on the same text.
      align: "position" (same tokenizer), "bytes" (different tokenizers) or
        "auto" (bytes when the runs' vocabulary sizes differ: ``vocab_sizes``
        where given, else each file's metadata).
      vocab_sizes: each run's V (one per path; 0 or None: the metadata's);
        needed when a CSV has no metadata line.
      progress: say on stderr which file is read, with a bar over the positions.

    Returns:
      (runs, rows_PxN, EventTable, align used).

    Raises:
      CsvError: unreadable files, missing columns, mismatched positions.
    """
    if len(paths) < 2:
        raise UserError(f"give at least two CSVs to compare; got {len(paths)}")
    if vocab_sizes and len(vocab_sizes) != len(paths):
        raise UserError(f"{len(vocab_sizes)} vocabulary sizes for {len(paths)} CSVs; give "
                        f"one per CSV (0: read it from the file's metadata)")
    runs = []
    for p in paths:
        _stage(progress, f"reading {p}")
        runs.append(read_csv(p, vocab_size=_given(vocab_sizes, len(runs))))
    check_distinct_runs(runs)
    if align == "auto":
        sizes = {(vocab_sizes[j] if vocab_sizes and vocab_sizes[j] else r.meta.get("vocab_size"))
                 for j, r in enumerate(runs)}
        align = "bytes" if len(sizes - {None}) > 1 else "position"
    if align == "position":
        rows = align_positions(runs)
        by = "id"
    elif align == "bytes":
        rows = align_bytes(runs)
        by = "bytes"
    else:
        raise UserError(f"align={align!r}; use auto, position or bytes")
    _stage(progress, f"event table: {len(rows)} {align}-aligned positions")
    table = event_table(runs, rows, by=by, vocab_sizes=vocab_sizes, progress=progress)
    return runs, rows, table, align


def check_distinct_runs(runs: Sequence[LogitRun]) -> None:
    """Refuses one run given twice (issue 71: one CSV given twice was analysed, with
    R-bar = 1.000 and AUROC 0.96, without a word): the same file by two paths, or two
    files whose rows say the same (`brf.eval.logit_csv.content_digest`).

    Raises:
      UserError: naming both files.
    """
    seen: dict[str, str] = {}
    for run in runs:
        for key in (f"file:{os.path.realpath(run.path)}", f"rows:{content_digest(run)}"):
            if key in seen:
                how = "is the same file as" if key.startswith("file:") else \
                    "holds the same rows as"
                raise UserError(f"{run.path} {how} {seen[key]}: one run given twice would be "
                                f"compared with itself; give the CSVs of different runs")
        for key in (f"file:{os.path.realpath(run.path)}", f"rows:{content_digest(run)}"):
            seen[key] = run.path


def _given(vocab_sizes, j: int) -> int | None:
    return int(vocab_sizes[j]) if vocab_sizes and vocab_sizes[j] else None


def _member_summary(run: LogitRun, rows: np.ndarray) -> dict:
    lp = run.top_logp()[rows].astype(np.float64)
    out = {"path": run.path, "model": run.meta.get("model"), "rows": run.n_rows,
           "k": run.k, "top_k_mass": float(np.exp(lp).sum(-1).mean()),
           "gap_mean": float(run.gap[rows].mean())}
    if run.entropy is not None:
        out["entropy_mean"] = float(run.entropy[rows].mean())
    for key in ("system", "prefix", "mode", "context_ids", "context_text"):
        if key in run.meta:
            out[key] = run.meta[key]
    return out


def default_methods() -> list[str]:
    """Registered methods whose parameters all have defaults (no required arrays)."""
    return [m for m in METHODS.names()
            if not any(p.kind == "array" for p in METHODS.get(m).params.values())]


def check_methods(methods: Sequence[str]) -> None:
    """Refuses a name that is not a registered method, or one a CSV cannot feed: the
    softmax-bottleneck methods need the members' unembeddings and full
    distributions, which a CSV does not carry."""
    usable = default_methods()
    for m in methods:
        METHODS.get(m)  # an unknown name, with the known ones
        if m not in usable:
            raise UserError(f"fusion method {m!r} needs the members' unembeddings and full "
                            f"distributions, which a logit CSV does not carry; the methods "
                            f"a CSV can feed: {', '.join(usable)}")


def _default_params(method: str) -> dict:
    """The method's phase map made explicit (the evaluation path reads a phase only
    when one is given: born_shuffled's per-token default was lost)."""
    p = METHODS.get(method).params.get("phase")
    return {"phase": p.default} if p is not None else {}


def fusion_rows(table: EventTable, methods: Sequence[str] | None = None, *,
                seed: int = 0, progress: bool = False) -> list[dict]:
    """Every method (default: all registered that need no extra input) at default
    parameters, uniform weights. The softmax-bottleneck methods need the members'
    unembeddings and full distributions, which a CSV does not carry: they are left
    out by default and refused by name (:func:`check_methods`)."""
    n = table.logp.shape[1]
    w = np.full(n, 1.0 / n)
    specs = [(f"member {i} alone", "linear", np.eye(n)[i]) for i in range(n)]
    specs += [(m, m, w) for m in (methods or default_methods())]
    out = []
    for label, method, weights in _bar(specs, progress, "fusing", "method"):
        try:
            ev = evaluate(Fitted(label, method, _default_params(method), weights,
                                 float("nan")), table)
        except FusionInputError as e:
            out.append({"label": label, "method": method, "error": str(e)})
            continue
        mean, ci = hypotheses.mean_ci(ev["nll"], seed=seed)
        out.append({"label": label, "method": method, "nll": mean, "nll_ci": ci,
                    "perplexity": math.exp(mean),
                    "top1_accuracy": float(ev["top1_credit"].mean()),
                    "floored_positions": int(ev["floored"].sum())})
    return out


def _bar(items, progress: bool, desc: str, unit: str):
    """``items`` with a progress bar on stderr when ``progress`` (the main's runs on
    large CSVs take minutes)."""
    if not progress:
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, unit=unit, dynamic_ncols=True, leave=False)


def _stage(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def analyze(paths: Sequence[str], *, align: str = "auto",
            phase_maps: Mapping[str, Any] | None = None,
            born_phase: str = "tanh(scale=1.5, rate=0.5)", methods: Sequence[str] | None = None,
            vocab_sizes: Sequence[int] | None = None, n_perm: int = 2000,
            n_boot: int = 1000, seed: int = 0, progress: bool = False) -> tuple[dict, dict]:
    """All analyses on two or more CSVs.

    Args:
      progress: say on stderr what runs (reading, the event table, each test), with
        a bar over the positions and the methods.

    Returns:
      (report dict, arrays for plots: {"coherence": rows with "diffs"}).
    """
    phase_maps = dict(phase_maps or DEFAULT_PHASE_MAPS)
    for label, spec in phase_maps.items():
        try:
            phase_map(spec)
        except ValueError as e:
            raise UserError(f"phase map {label!r}: {e}") from None
    try:
        phase_map(born_phase)
    except ValueError as e:
        raise UserError(f"born_phase={born_phase!r}: {e}") from None
    if n_perm < 1 or n_boot < 2:
        raise UserError(f"n_perm must be >= 1 and n_boot >= 2; got n_perm={n_perm}, "
                        f"n_boot={n_boot}")
    check_methods(methods or ())
    runs, rows, table, align = load_table(paths, align=align, vocab_sizes=vocab_sizes,
                                          progress=progress)
    n = len(runs)
    _stage(progress, f"phase coherence: {len(phase_maps)} maps, {n_perm} permutations")
    coherence = hypotheses.phase_coherence(table, phase_maps, n_perm=n_perm, seed=seed)
    born = Fitted(f"born {born_phase}", "born", {"phase": born_phase}, np.full(n, 1.0 / n),
                  float("nan"))
    _stage(progress, f"cross-term test: {n_boot} bootstrap replicates")
    cross = hypotheses.cross_term_test(table, born, n_boot=n_boot, seed=seed)
    ids = [r.top_ids[rows[:, i], 0] for i, r in enumerate(runs)]
    report = {
        "inputs": [_member_summary(r, rows[:, i]) for i, r in enumerate(runs)],
        "align": align, "positions": int(table.n_positions),
        "top1_agreement": float(np.mean(ids[0] == ids[1])) if align == "position" else None,
        "phase_coherence": hypotheses.coherence_summary(coherence),
        "cross_term": {k: v for k, v in cross.items() if k != "scores"},
        "fusion": fusion_rows(table, methods, seed=seed, progress=progress),
        "settings": {"phase_maps": phase_maps, "born_phase": born_phase, "n_perm": n_perm,
                     "n_boot": n_boot, "seed": seed},
    }
    return report, {"coherence": coherence, "table": table}


def markdown(report: dict) -> str:
    """A short human-readable summary of :func:`analyze`'s report."""
    lines = ["# Logit CSV analysis", "",
             f"{report['positions']} common positions ({report['align']} alignment).", ""]
    lines += ["| run | model | prompt | top-k mass | mean gap | mean entropy |",
              "|---|---|---|---|---|---|"]
    for i, m in enumerate(report["inputs"]):
        prompt = m.get("system") or m.get("prefix") or ""
        # The entropy column is optional in a CSV (another tool's may lack it).
        entropy = (f"{m['entropy_mean']:.3f}" if "entropy_mean" in m
                   else "not available (no entropy column)")
        lines.append(f"| {i}: `{os.path.basename(m['path'])}` | {m.get('model')} | "
                     f"{prompt[:40]!r} | {m['top_k_mass']:.4f} | {m['gap_mean']:.3f} | "
                     f"{entropy} |")
    if report.get("top1_agreement") is not None:
        lines += ["", f"Top-1 agreement: {report['top1_agreement']:.3f}."]
    lines += ["", "## Phase coherence", "",
              "| map | pair | n | R̄ | Rayleigh z | Rayleigh p | permutation p | null R̄ |",
              "|---|---|---|---|---|---|---|---|"]
    for c in report["phase_coherence"]:
        lines.append(f"| {c['phase_map']} | {c['pair']} | {c['n']} | "
                     f"{c['mean_resultant_length']:.4f} | {c['rayleigh_z']:.1f} | "
                     f"{c['rayleigh_p']:.3g} | {c['permutation_p']:.3g} | "
                     f"{c['null_mean_resultant_length']:.4f} |")
    ct = report["cross_term"]
    lines += ["", f"## Cross-term discrimination ({ct['setting']}, uniform weights)", "",
              "| score | AUROC | 95% CI | gold | competitors |", "|---|---|---|---|---|"]
    for key in ("cross", "rel", "rel_equal_phases"):
        v = ct[key]
        lines.append(f"| {key} | {v['auroc']:.4f} | [{v['ci'][0]:.4f}, {v['ci'][1]:.4f}] | "
                     f"{v['n_gold']} | {v['n_competitors']} |")
    lines += ["", "## Fusion (default parameters, uniform weights; nothing fitted)", "",
              "| method | NLL | 95% CI | top-1 acc | floored |", "|---|---|---|---|---|"]
    for f in report["fusion"]:
        if "error" in f:
            lines.append(f"| {f['label']} | error: {f['error']} | | | |")
        else:
            lines.append(f"| {f['label']} | {f['nll']:.4f} | [{f['nll_ci'][0]:.4f}, "
                         f"{f['nll_ci'][1]:.4f}] | {f['top1_accuracy']:.3f} | "
                         f"{f['floored_positions']} |")
    return "\n".join(lines) + "\n"


def plot(out_dir: str, report: dict, coherence: list[dict]) -> list[str]:
    """Phase-difference histograms and the fusion NLLs as PNGs; returns the paths."""
    ok = [f for f in report["fusion"] if "error" not in f]
    return [report_lib.plot_phase_differences(os.path.join(out_dir, "phase_differences.png"),
                                              coherence),
            report_lib.plot_nll_ci(os.path.join(out_dir, "fusion_nll.png"),
                                   [f["label"] for f in ok], [f["nll"] for f in ok],
                                   [f["nll_ci"] for f in ok],
                                   "NLL of the gold token (nats), 95% block-bootstrap CI",
                                   dpi=110)]


def write_report(out_dir: str, report: dict, coherence: list[dict]) -> dict:
    """analysis.json, analysis.md and the plots under out_dir; returns their paths."""
    from brf.eval.caches import write_json
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "analysis.json"),
             "markdown": os.path.join(out_dir, "analysis.md")}
    write_json(paths["json"], report, indent=1)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(report))
    paths["plots"] = plot(out_dir, report, coherence)
    return paths


__all__ = ["CsvError", "DEFAULT_PHASE_MAPS", "analyze", "fusion_rows", "load_table", "run",
           "markdown", "plot", "write_report"]


def _paths(value) -> list[str]:
    from brf.specs import split_list
    return split_list(value) if isinstance(value, str) else list(value)


def _csvs_check(value) -> None:
    if not isinstance(value, (str, list, tuple)):
        raise UserError(f"give the CSV paths comma-separated; got {value!r}")
    paths = _paths(value)
    if len(paths) < 2:
        raise UserError(f"give at least two CSVs to compare (comma-separated); got "
                        f"{len(paths)}")


def _sizes(value) -> list[int] | None:
    from brf.specs import split_list
    if not value:
        return None
    try:
        sizes = [int(v) for v in split_list(str(value))]
    except ValueError:
        raise UserError(f"config.vocab_sizes={value!r}: give integers, comma-separated (0: "
                        f"the CSV's metadata)") from None
    for v in sizes:
        if v != 0 and not 2 <= v <= 2**24:
            raise UserError(f"config.vocab_sizes={value!r}: each must be 0 (the CSV's "
                            f"metadata) or a vocabulary size in [2, {2**24}]; got {v}")
    return sizes


def _phase_check(value) -> None:
    phase_map(value)


def _phase_maps_check(value) -> None:
    if not len(value):
        raise UserError("names no phase map")
    for label, spec in dict(value).items():
        if not isinstance(spec, str) and not hasattr(spec, "items"):
            raise UserError(f"phase map {label!r} must be a spec string such as "
                            f"'tanh(rate=0.5)'; got {spec!r}")
        try:
            phase_map(spec if isinstance(spec, str) else dict(spec))
        except ValueError as e:
            raise UserError(f"phase map {label!r}: {e}") from None


def _methods_check(value) -> None:
    from brf.specs import split_list
    check_methods(split_list(value))


# configs/analyze_csv.py, every key (brf.schema): checked by run before any CSV is read.
SCHEMA = {
    "csvs": S.custom(_csvs_check),
    "out_dir": S.text(empty=False),
    "align": S.text(choices=("auto", "position", "bytes")),
    "vocab_sizes": S.text(check=_sizes),
    "phase_maps": S.mapping(check=_phase_maps_check),
    "born_phase": S.text(empty=False, check=_phase_check),
    "fusion_methods": S.text(check=_methods_check, note="'': every method a CSV can feed"),
    "n_perm": S.integer(1, S.RESAMPLES_MAX),
    "n_boot": S.integer(2, S.RESAMPLES_MAX),
    "seed": S.seed(),
}


def check_config(c) -> None:
    """Every key of an analysis config against :data:`SCHEMA`.

    Raises:
        UserError: the first key that is wrong, named.
    """
    S.check(c, SCHEMA, error=UserError)


def run(c) -> dict:
    """What experiments/analyze_csv.py runs, for a configs/analyze_csv.py config
    (progress on stderr when it is a terminal: large CSVs take minutes)."""
    from brf.specs import split_list
    check_config(c)
    methods = split_list(c.fusion_methods) if c.fusion_methods else None
    report, arrays = analyze(_paths(c.csvs), align=c.align, phase_maps=dict(c.phase_maps),
                             born_phase=c.born_phase, methods=methods,
                             vocab_sizes=_sizes(c.vocab_sizes), n_perm=c.n_perm,
                             n_boot=c.n_boot, seed=c.seed, progress=sys.stderr.isatty())
    return write_report(c.out_dir, report, arrays["coherence"])
