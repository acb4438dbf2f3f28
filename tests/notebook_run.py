"""Running notebooks the way CI does: nbclient, a kernel of this interpreter, a working folder."""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
KERNEL = "colab-par-test"  # registered by the `kernel_path` fixture (conftest.py)
CELL_TIMEOUT_S = 300


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def run(notebook: nbformat.NotebookNode, workdir: Path) -> nbformat.NotebookNode:
    """Execute `notebook` in place in `workdir`; any cell error fails the test with its traceback."""
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                   resources={"metadata": {"path": str(workdir)}}).execute()
    return notebook


def execute(name: str, workdir: Path) -> nbformat.NotebookNode:
    """Run notebooks/<name>.ipynb in `workdir`."""
    return run(read(name), workdir)
