"""compare_fits on runs stopped before their study report: each analysis's own verdicts."""

import json
import os
import shutil
import subprocess
import sys

from brf.eval import study_report
from brf.eval.compare import analysis_moves

ROOT = os.path.join(os.path.dirname(__file__), "..")
NAME = "hamlet/report-hamlet-c3673d13-k64.json"


def _runs(tmp_path):
    """Two run directories holding the committed Hamlet analysis, the second with its
    calibrated NLL comparison's CI moved below 0 (BRF better instead of not
    distinguishable)."""
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        (d / "hamlet").mkdir(parents=True)
        shutil.copy(os.path.join(ROOT, "results", "study", NAME), d / NAME)
    rep = json.loads((new / NAME).read_text())
    c = rep["nll_comparison"]["calibrated"]
    assert c["ci"][0] < 0 < c["ci"][1], c  # the committed answer: not distinguishable
    c["ci"] = [c["ci"][0] - 1.0, -1e-6]
    (new / NAME).write_text(json.dumps(rep))
    return old, new


def test_analysis_moves_names_exactly_the_verdict_that_moved(tmp_path):
    old, new = _runs(tmp_path)
    load = lambda d: {NAME: study_report.brief(json.loads((d / NAME).read_text()))}  # noqa: E731
    moves = analysis_moves(load(old), load(new))
    assert len(moves) >= 8
    moved = [k for k, m in moves.items() if m.moved]
    assert moved == [f"{NAME}: nll [calibrated]"], moved
    m = moves[moved[0]]
    assert m.before.answer == "not distinguishable"
    assert m.after.answer == "BRF better than the best baseline"


def test_compare_fits_runs_without_study_reports(tmp_path):
    old, new = _runs(tmp_path)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "compare_fits.py"),
                          f"--old={old}", f"--new={new}"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert "No study report (report.json)" in out
    assert "1 of " in out and f"| {NAME}: nll [calibrated] |" in out


def test_a_report_of_an_unknown_format_version_is_refused(tmp_path):
    """Issue 71: compare_fits read a report of a format version it does not know as
    its own. A per-analysis or study report of a later (or no) schema ends in one
    line naming the file and its format, exit 2."""
    old, new = _runs(tmp_path)
    rep = json.loads((new / NAME).read_text())
    for schema in ("brf.analysis/99", "brf.study/3", None):
        if schema is None:
            rep.pop("schema", None)
        else:
            rep["schema"] = schema
        (new / NAME).write_text(json.dumps(rep))
        r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments",
                                                         "compare_fits.py"),
                            f"--old={old}", f"--new={new}"], capture_output=True, text=True,
                           cwd=ROOT)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert NAME in lines[0] and f"of format {schema!r}" in lines[0], lines[0]
        assert "brf.analysis/1 to brf.analysis/3" in lines[0], lines[0]
    shutil.copy(os.path.join(ROOT, "results", "study", "report.json"), old / "report.json")
    shutil.copy(os.path.join(ROOT, "results", "study", NAME), new / NAME)
    study = json.loads((old / "report.json").read_text())
    study["schema"] = "brf.study/4"
    shutil.copy(os.path.join(ROOT, "results", "study", "report.json"), new / "report.json")
    (old / "report.json").write_text(json.dumps(study))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "compare_fits.py"),
                        f"--old={old}", f"--new={new}"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "of format 'brf.study/4'" in r.stderr, r.stderr
