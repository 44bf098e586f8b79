r"""Two study runs side by side: which verdicts moved, and every fitted row, old vs new.

Reads two study directories (a committed ``results/study`` and a fresh run
directory, say). First whether they ran on the same texts (each corpus's label,
characters and hash: where they differ, the verdicts on those corpora and the pooled
ones compare different data, and the comparison says so). Then the verdicts: from
each run's ``report.json``, every verdict both runs give at each level both ran
(co-aligned positions, every byte), with the answer in each run (where its 95% CI
lies, or the count it rests on), whether it was *fragile* there (rows tied on
calibration give another answer, ``brf.eval.analysis.TIE_MARGIN``, or that run's
stability check did, refitting the rows) and the fitted rows it rests on (a
difference's BRF and other row, chosen on calibration in each run; the cross-term
test's setting): those whose answer moved (standing in both runs,
or fragile in one), then those whose answer held while its rows changed, then each
run's own stability check. Where a run stopped before writing its study report (the
token level writes one before the byte level starts; a run stopped inside the token
level has none), the verdicts compared are each analysis's own, from the per-analysis
reports both runs have (no pooled or prompt-study verdicts, no check of the texts).
Then the per-analysis reports
(``report-*.json``, each level's): analyses matched by file name, rows by label
and variant, per analysis a Markdown table of calibration NLL old / new / new -
old and test NLL, and how many rows got worse on calibration by more than
``--tolerance``. Rows in only one run (controls, say) are listed as such.

  python experiments/compare_fits.py --old=results/study --new=runs/validate

To check that a run's answers do not hang on the last bits, refit it under a
perturbation (the score stores are reused; every fit is redone) and compare:

  cp -r runs/validate runs/perturbed
  python experiments/validate.py --config=configs/validate.py \
      --config.out_dir=runs/perturbed --config.fit.perturb=sincos+order
  python experiments/compare_fits.py --old=runs/validate --new=runs/perturbed
"""

import glob
import json
import math
import os

from absl import flags

from brf import cli
from brf.errors import UserError
from brf.eval import study_report
from brf.eval.compare import analysis_moves, run_moves
from brf.eval.report import SCHEMA as ANALYSIS_SCHEMA

FLAGS = flags.FLAGS
flags.DEFINE_string("old", "results/study", "the earlier study directory")
flags.DEFINE_string("new", "runs/validate", "the later study directory")
flags.DEFINE_float("tolerance", 1e-4, "calibration NLL worsening counted (nats)")
flags.DEFINE_string("analyses", "", "comma-separated substrings of report names to keep")


def _load(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {what} {path!r}: {e}") from None


def _known_schema(rep, path: str, current: str) -> None:
    """Refuses a report whose ``schema`` is not ``current``'s family at a version up
    to ``current``'s (a later brf's report, or another file): read as this version,
    its fields would be misread without a word."""
    family, _, newest = current.rpartition("/")
    schema = rep.get("schema") if isinstance(rep, dict) else None
    got_family, _, version = str(schema).rpartition("/")
    if not (isinstance(schema, str) and got_family == family and version.isdigit()
            and 1 <= int(version) <= int(newest)):
        raise UserError(f"{path!r} is a report of format {schema!r}; this brf reads "
                        f"{family}/1 to {current} (a report of a later brf: compare it "
                        f"with that brf)")


def _reports(root: str) -> dict[str, dict]:
    paths = (glob.glob(os.path.join(root, "*", "report-*.json"))
             + glob.glob(os.path.join(root, "*", "bytes", "report-*.json")))
    if not paths:
        raise UserError(f"no per-analysis reports (*/report-*.json) under {root!r}")
    out = {}
    for p in sorted(paths):
        out[os.path.relpath(p, root)] = rep = _load(p, "the analysis report")
        _known_schema(rep, p, ANALYSIS_SCHEMA)
    return out


def _study(root: str) -> dict | None:
    """The study's report, or None where the run stopped before writing it."""
    path = os.path.join(root, "report.json")
    if not os.path.exists(path):
        return None
    rep = _load(path, "the study's report")
    _known_schema(rep, path, study_report.STUDY_SCHEMA)
    if not isinstance(rep, dict) or "per_corpus" not in rep:
        raise UserError(f"{path!r} is not a study report (no 'per_corpus')")
    return rep


def corpus_lines(old: dict, new: dict) -> tuple[list[str], set[str]]:
    """Markdown lines saying where the two runs' texts differ, and the labels of the
    corpora that differ (absent from one run, or other characters or text)."""
    key = lambda c: (c.get("chars"), c.get("sha256"), c.get("prefix"))  # noqa: E731
    o = {c["label"]: c for c in old.get("corpora", [])}
    n = {c["label"]: c for c in new.get("corpora", [])}
    differ = {label for label in o.keys() | n.keys()
              if label not in o or label not in n or key(o[label]) != key(n[label])}
    if not differ:
        return [f"Both runs read the same {len(o)} corpora (labels, characters, text)."], set()
    lines = ["**The runs differ in their texts**: verdicts on these corpora, and the "
             "pooled ones, compare different data:", ""]
    for label in sorted(differ):
        a, b = o.get(label), n.get(label)
        show = lambda c: "absent" if c is None else f"{c.get('chars')} characters"  # noqa: E731
        same_text = a and b and a.get("sha256") == b.get("sha256")
        lines.append(f"- {label}: old {show(a)}, new {show(b)}"
                     + ("" if same_text or not (a and b) else " (other text)"))
    return lines, differ


def verdict_lines(moves: dict, differ: set[str] = frozenset()) -> list[str]:
    """Markdown: the verdicts that moved between two runs (``compare.run_moves`` or
    ``compare.analysis_moves``), then those whose rows changed while the answer held;
    verdicts on ``differ``'s corpora and pooled ones are marked as comparing different
    data."""

    def rows(a) -> str:
        return "; ".join(a.rows) if a.rows else ""

    def answer(a) -> str:
        return f"{a.answer} ({a.value:+.4g})" + (" **fragile**" if a.fragile else "")

    def mark(k: str) -> str:
        where = k.split(": ")[1] if k.count(": ") >= 2 else ""
        data = where.split(" ")[0] in differ or (differ and where == "pooled")
        return k + (" (different data)" if data else "")

    def table(keys) -> list[str]:
        out = ["| verdict | old | new | rows it rests on, old | rows it rests on, new |",
               "|---|---|---|---|---|"]
        for k in keys:
            m = moves[k]
            out.append(f"| {mark(k)} | {answer(m.before)} | {answer(m.after)} | "
                       f"{rows(m.before)} | {rows(m.after)} |")
        return out

    moved = [k for k, m in moves.items() if m.moved]
    standing = [k for k in moved if not (moves[k].before.fragile or moves[k].after.fragile)]
    held = [k for k, m in moves.items() if not m.moved and m.rows_changed]
    fragile = [k for k, m in moves.items() if m.before.fragile or m.after.fragile]
    lines = [f"{len(moved)} of {len(moves)} verdicts both runs give moved ({len(standing)} of "
             f"them standing in both runs; the others fragile in one: rows tied on "
             f"calibration, or that run's stability check refitting them, answer "
             f"otherwise). {len(fragile)} verdicts are fragile in either run."]
    if moved:
        lines += [""] + table(moved)
    if held:
        lines += ["", f"{len(held)} held while the rows they rest on changed:", ""] + table(held)
    return lines


def stability_lines(label: str, rep: dict) -> list[str]:
    """Markdown: a run's own stability check (each level's), if it ran one."""
    out = []
    for level, sec in (("co-aligned", rep), ("every byte", rep.get("bytes") or {})):
        s = sec.get("stability")
        if not s:
            continue
        top = s.get("largest_row_move") or {}
        out.append(f"- {label}, {level}: refitted under {s['perturbation']!r}, "
                   f"{len(s['moved'])} of {s['verdicts']} verdicts moved "
                   f"({len(s.get('moved_untied', s.get('moved_standing', [])))} no tied "
                   f"row warned of); largest row move "
                   f"{top.get('move', float('nan')):+.2g} nats ({top.get('label', '-')})")
    return out


def compare(old: dict, new: dict, tolerance: float) -> tuple[list[str], dict]:
    """Markdown lines for one analysis and its counts."""
    key = lambda m: (m["label"], m["variant"])  # noqa: E731
    o = {key(m): m for m in old["methods"]}
    n = {key(m): m for m in new["methods"]}
    lines = ["| row | calib old | calib new | new - old | test old | test new |",
             "|---|---|---|---|---|---|"]
    worse = 0
    for k in [k for k in o if k in n]:
        a, b = o[k], n[k]
        d = b["calib_nll"] - a["calib_nll"]
        worse += d > tolerance
        lines.append(f"| {k[0]} | {a['calib_nll']:.4f} | {b['calib_nll']:.4f} | {d:+.4f} | "
                     f"{a['test']['nll']:.4f} | {b['test']['nll']:.4f} |")
    only_new = [k[0] for k in n if k not in o]
    only_old = [k[0] for k in o if k not in n]
    counts = {"rows": sum(k in n for k in o), "worse": int(worse), "only_new": only_new,
              "only_old": only_old}
    return lines, counts


def main(argv):
    del argv
    if not (math.isfinite(FLAGS.tolerance) and FLAGS.tolerance >= 0):
        raise UserError(f"--tolerance must be a finite number >= 0 (nats); got "
                        f"{FLAGS.tolerance}")
    old, new = _reports(FLAGS.old), _reports(FLAGS.new)
    studies = _study(FLAGS.old), _study(FLAGS.new)
    keep = [s.strip() for s in FLAGS.analyses.split(",") if s.strip()]
    names = [name for name in sorted(set(old) & set(new))
             if not keep or any(s in name for s in keep)]
    if keep and not names:
        raise UserError(f"--analyses={FLAGS.analyses!r} matches none of the analyses both "
                        f"runs have: {', '.join(sorted(set(old) & set(new))) or 'none'}")
    if None in studies:
        # a run stopped before its study report: its analyses' own verdicts only
        missing = [r for r, s in zip((FLAGS.old, FLAGS.new), studies) if s is None]
        print(f"No study report (report.json) in {' or '.join(map(repr, missing))}, a run "
              f"stopped part way: the verdicts of each analysis both runs have, not the "
              f"pooled or prompt-study ones, and the texts are not compared.\n")
        print("## Verdicts\n")
        brief = lambda reps: {k: study_report.brief(v) for k, v in reps.items()}  # noqa: E731
        print("\n".join(verdict_lines(analysis_moves(brief(old), brief(new)))))
        checks = [line for name in names for line in stability_lines(
            f"{name}, old", old[name]) + stability_lines(f"{name}, new", new[name])]
    else:
        lines, differ = corpus_lines(*studies)
        print("## Corpora\n")
        print("\n".join(lines))
        print("\n## Verdicts\n")
        print("\n".join(verdict_lines(run_moves(*studies), differ)))
        checks = stability_lines("old", studies[0]) + stability_lines("new", studies[1])
    if checks:
        print("\n## Each run's stability check\n")
        print("\n".join(checks))
    for name in names:
        lines, c = compare(old[name], new[name], FLAGS.tolerance)
        print(f"\n## {name}\n")
        print("\n".join(lines))
        print(f"\n{c['worse']} of {c['rows']} rows worse on calibration by more than "
              f"{FLAGS.tolerance:g} nats; only in the new run: {len(c['only_new'])} rows; "
              f"only in the old run: {len(c['only_old'])}")


if __name__ == "__main__":
    cli.run(main)
