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
