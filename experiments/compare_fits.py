r"""Two study runs side by side: which verdicts moved, and every fitted row, old vs new.

Reads two study directories (a committed ``results/study`` and a fresh run
directory, say). First the verdicts: from each run's ``report.json``, every
verdict both runs give at each level both ran (co-aligned positions, every
byte), with the answer in each run (where its 95% CI lies, or the count it
rests on) and the fitted rows it rests on (a difference's BRF and other row,
chosen on calibration in each run; the cross-term test's setting): those whose
answer moved, then those whose answer held while its rows changed. Then the per-analysis reports
(``report-*.json``, each level's): analyses matched by file name, rows by label
and variant, per analysis a Markdown table of calibration NLL old / new / new -
old and test NLL, and how many rows got worse on calibration by more than
``--tolerance``. Rows in only one run (controls, say) are listed as such.

  python experiments/compare_fits.py --old=results/study --new=runs/validate
"""

import glob
import json
import os

from absl import flags

from brf import cli
from brf.errors import UserError
from brf.eval.compare import run_moves

FLAGS = flags.FLAGS
flags.DEFINE_string("old", "results/study", "the earlier study directory")
flags.DEFINE_string("new", "runs/validate", "the later study directory")
flags.DEFINE_float("tolerance", 1e-4, "calibration NLL worsening counted (nats)")
flags.DEFINE_string("analyses", "", "comma-separated substrings of report names to keep")


def _reports(root: str) -> dict[str, dict]:
    paths = (glob.glob(os.path.join(root, "*", "report-*.json"))
             + glob.glob(os.path.join(root, "*", "bytes", "report-*.json")))
    if not paths:
        raise UserError(f"no per-analysis reports (*/report-*.json) under {root!r}")
    out = {}
    for p in sorted(paths):
        with open(p) as f:
            out[os.path.relpath(p, root)] = json.load(f)
    return out


def _study(root: str) -> dict:
    path = os.path.join(root, "report.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the study's report {path!r}: {e}") from None


def verdict_lines(old: dict, new: dict) -> list[str]:
    """Markdown: the verdicts that moved between two study reports, then those whose
    rows changed while the answer held."""
    moves = run_moves(old, new)

    def rows(a) -> str:
        return "; ".join(a.rows) if a.rows else ""

    def table(keys) -> list[str]:
        out = ["| verdict | old | new | rows it rests on, old | rows it rests on, new |",
               "|---|---|---|---|---|"]
        for k in keys:
            m = moves[k]
            out.append(f"| {k} | {m.before.answer} ({m.before.value:+.4g}) | {m.after.answer} "
                       f"({m.after.value:+.4g}) | {rows(m.before)} | {rows(m.after)} |")
        return out

    moved = [k for k, m in moves.items() if m.moved]
    held = [k for k, m in moves.items() if not m.moved and m.rows_changed]
    lines = [f"{len(moved)} of {len(moves)} verdicts both runs give moved."]
    if moved:
        lines += [""] + table(moved)
    if held:
        lines += ["", f"{len(held)} held while the rows they rest on changed:", ""] + table(held)
    return lines


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
    studies = _study(FLAGS.old), _study(FLAGS.new)
    old, new = _reports(FLAGS.old), _reports(FLAGS.new)
    print("## Verdicts\n")
    print("\n".join(verdict_lines(*studies)))
    keep = [s.strip() for s in FLAGS.analyses.split(",") if s.strip()]
    for name in sorted(set(old) & set(new)):
        if keep and not any(s in name for s in keep):
            continue
        lines, c = compare(old[name], new[name], FLAGS.tolerance)
        print(f"\n## {name}\n")
        print("\n".join(lines))
        print(f"\n{c['worse']} of {c['rows']} rows worse on calibration by more than "
              f"{FLAGS.tolerance:g} nats; only in the new run: {len(c['only_new'])} rows; "
              f"only in the old run: {len(c['only_old'])}")


if __name__ == "__main__":
    cli.run(main)
