"""examples/explore.ipynb runs top to bottom without an error (its plot drawn by the kernel's inline
backend, Agg: no display needed), in a kernel that is this Python (the
venv's, with this process's PYTHONPATH) and imports this globaltensor; it is stored without outputs."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="running the notebook needs nbclient, a dev extra "
                                                  "(pip install -e '.[dev]'; make test installs it)")
nbformat = pytest.importorskip("nbformat", reason="reading the notebook needs nbformat, a dev extra "
                                                  "(pip install -e '.[dev]'; make test installs it)")

import globaltensor as gt  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "explore.ipynb"
CELL_TIMEOUT_S = 120
KERNEL = "globaltensor-test"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernel spec that starts ``sys.executable`` (not whatever ``python`` is first on PATH), found
    through JUPYTER_PATH. The kernel inherits this environment, with PYTHONPATH made absolute (the
    kernel runs in examples/) and led by the directory this globaltensor was imported from."""
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "globaltensor test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    paths = [str(Path(gt.__file__).resolve().parents[1])]
    paths += [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return KERNEL


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has code cells"
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the outputs before committing"


def test_notebook_runs(kernel_name):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    check = nbformat.v4.new_code_cell(
        "import sys, globaltensor\n"
        f"assert sys.executable == {sys.executable!r}, sys.executable\n"
        f"assert globaltensor.__file__ == {gt.__file__!r}, globaltensor.__file__")
    nb.cells.insert(0, check)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()                                    # raises CellExecutionError naming the cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the loss plot was drawn"
    text = "".join(o.get("text", "") for o in outputs)
    assert "step 20/20" in text and "all_gather" in text and "Plan (S(0), S(1))" in text
