"""examples/quickstart.ipynb runs top to bottom, and its figures come out as images, not as text."""

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="running the notebook needs nbformat (the [dev] extra)")
nbclient = pytest.importorskip("nbclient", reason="running the notebook needs nbclient (the [dev] extra)")
pytest.importorskip("ipykernel", reason="running the notebook needs ipykernel (the [dev] extra)")
pytest.importorskip("matplotlib", reason="the notebook's plots need matplotlib (pip install 'eigenhooks[plot]')")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"
ROOT = NOTEBOOK.parents[1]


def test_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None


def test_notebook_runs_and_shows_its_figures_inline(tmp_path, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own (inline) backend, as in Jupyter
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this tree's eigenhooks in the kernel
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    pngs, figure_texts = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                pngs.append(data["image/png"])
            elif "<Figure size" in data.get("text/plain", ""):
                figure_texts.append(data["text/plain"])
    assert not figure_texts, f"figures shown as text, not images: {figure_texts}"
    assert len(pngs) == 3  # eigenvalue plane, rho by layer with its null band, token heat map
    assert all(len(p) > 1000 for p in pngs)
    steer_out = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "lambda_1" in steer_out and "p(' return')" in steer_out
