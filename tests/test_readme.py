"""The README's examples, met the way a user meets them: every ```python block not marked
`# sketch:` is a cell of one notebook, run in order on 2 CPU engines (nbclient), and must succeed."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import nbformat
from notebook_run import run

README = Path(__file__).resolve().parents[1] / "README.md"
SKETCH = "# sketch:"  # the README's own marker (it says so) for a block not runnable as written
STOP = "%colossal stop"  # the test's last cell: the README leaves its engines running


def readme_blocks(text: str) -> list[str]:
    """Every ```python block, in order; one indented under a list item loses its indentation."""
    return [textwrap.dedent(body) for indent, body in
            re.findall(r"^([ \t]*)```python\n(.*?)^\1```[ \t]*$", text, re.M | re.S)]


def printed(cell: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in cell.outputs if output.output_type == "stream")


def test_readme_blocks_run_in_order_as_notebook_cells(kernel_path, tmp_path):
    blocks = readme_blocks(README.read_text())
    runnable = [block for block in blocks if SKETCH not in block]
    assert len(blocks) == README.read_text().count("```python"), "a ```python block the test cannot read"
    assert runnable and len(runnable) < len(blocks)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(block.rstrip("\n"))
                                               for block in [*runnable, STOP]])
    run(notebook, tmp_path)  # raises with the failing cell's traceback
    cells = {cell.source: cell for cell in notebook.cells}
    relayout = next(source for source in cells if source.startswith("%colossal relayout"))
    assert "colab_par: pm now runs as tp2" in printed(cells[relayout])
    assert list((tmp_path / "ckpt").glob("step-*")), "no checkpoint saved under the picker's choice"
    without_magics = next(source for source in cells if "colab_par.Cluster(n=2)" in source)
    assert "[0, 1]" in printed(cells[without_magics])
    assert "engines stopped" in printed(cells[STOP])
