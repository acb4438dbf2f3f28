"""Running notebooks the way CI does: nbclient, a kernel of this interpreter, a working folder."""
from __future__ import annotations

import json
import re
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


# a last %%colossal cell that prints every step's loss, full precision, from rank 0
LOSSES_CELL = ('%%colossal\nimport json\nif rank == 0:\n'
               '    print("LOSSES " + json.dumps([row["loss"] for row in trainer.history]))')


def with_losses_printed(name: str) -> nbformat.NotebookNode:
    notebook = read(name)
    stop = next(i for i, cell in enumerate(notebook.cells) if "%colossal stop" in cell.source)
    notebook.cells.insert(stop, nbformat.v4.new_code_cell(LOSSES_CELL))
    return notebook


def printed_losses(text: str) -> list[float]:
    found = re.findall(r"^LOSSES (.+)$", text, re.M)
    assert len(found) == 1, text[-3000:]
    return json.loads(found[0])


def losses_in(executed: nbformat.NotebookNode) -> list[float]:
    """The losses a notebook run of `with_losses_printed` printed."""
    printed = next(cell for cell in executed.cells if cell.source == LOSSES_CELL)
    return printed_losses("".join(o.get("text", "") for o in printed.outputs if o.output_type == "stream"))
