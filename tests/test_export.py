"""`colab-par export`: the exported script, run by torchrun on 2 processes, trains exactly as the
notebook did under nbclient (every step's loss), and what only a notebook can run is named by
cell and line, never dropped silently."""
from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest
from notebook_run import losses_in, printed_losses, with_losses_printed

from colab_par.cli import main
from colab_par.notebook.export import ExportError, export_notebook

@pytest.mark.parametrize("name", ["01_quickstart", "03_checkpoint_relayout"])
def test_the_exported_script_trains_as_the_notebook_did(name, kernel_path, executed_notebooks,
                                                        tmp_path) -> None:
    notebook = with_losses_printed(name)
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(notebook, str(path))
    script = tmp_path / f"{name}.py"
    assert main(["export", str(path), "-o", str(script)]) == 0

    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    exported = printed_losses(ran.stdout)

    in_notebook = losses_in(executed_notebooks(name))
    assert len(exported) == len(in_notebook) >= 12
    assert exported == pytest.approx(in_notebook, rel=1e-6)


def notebook_of(*sources: str) -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_markdown_cell("# a notebook")]
    cells += [nbformat.v4.new_code_cell(source) for source in sources]
    return nbformat.v4.new_notebook(cells=cells)


def test_what_only_a_notebook_runs_is_named_by_cell_and_line(tmp_path) -> None:
    path = tmp_path / "mixed.ipynb"
    nbformat.write(notebook_of(
        "%load_ext colab_par\n%colossal start -n 2",
        "import torch\n%matplotlib inline\nsize = 8\n!nvidia-smi",
        "from colab_par.notebook.picker import LayoutPicker\npicker = LayoutPicker(world_size=2)",
        "%%time\nsize * 2",
        "%%colossal\nx = torch.ones(size)\n%colossal status",
        "%colossal stop"), str(path))
    with pytest.raises(ExportError) as refused:
        export_notebook(path)
    named = [(p.cell, p.line) for p in refused.value.problems]
    assert named == [(3, 2), (3, 4), (4, 1), (4, 2), (5, 1), (6, 3)]
    message = str(refused.value)
    assert "cell 3, line 2: '%matplotlib inline'" in message and "--drop-unsupported" in message
    assert "cell 5, line 1: '%%time'" in message

    dropped = export_notebook(path, drop_unsupported=True)
    assert [(p.cell, p.line) for p in dropped.dropped] == named
    assert "# %matplotlib inline" in dropped.script and "\nsize = 8" not in dropped.script
    assert "        size = 8" in dropped.script  # kept, inside rank 0's notebook block
    assert "share(globals(), ['size', 'torch'])" in dropped.script  # as %%colossal ships them
    compile(dropped.script, "exported", "exec")  # commented-out lines leave valid Python

    assert main(["export", str(path), "-o", str(tmp_path / "out.py")]) == 2
    assert not (tmp_path / "out.py").exists()


def test_slurm_export_writes_an_sbatch_file_for_torchrun(tmp_path, capsys) -> None:
    path = tmp_path / "two.ipynb"
    nbformat.write(notebook_of("%load_ext colab_par\n%colossal start -n 4 --seed 7",
                               "%%colossal --targets 0\nprint(rank)", "%colossal restart",
                               "%colossal relayout tp2 --scratch-dir /shared/run1"), str(path))
    script = tmp_path / "train.py"
    assert main(["export", str(path), "-o", str(script), "--slurm", "--nodes", "2", "--gpus-per-node", "4",
                 "--partition", "gpu", "--account", "proj", "--time", "02:00:00"]) == 0
    text = script.read_text()
    assert "join_world(seed=7)" in text and "restart(seed=7)" in text
    assert "pm = relayout(pm, 'tp2', trainer=globals().get('trainer'), scratch_dir='/shared/run1')" in text
    assert "with engine_cell('0', all_output=False) as runs:\n    if runs:\n        print(rank)" in text
    assert "--nproc-per-node 4" in text
    sbatch = (tmp_path / "train.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --time=02:00:00", "--nproc-per-node 4",
                 '--rdzv-endpoint "$head_node:29500"', str(script)):
        assert line in sbatch, line
    assert subprocess.run(["bash", "-n", str(tmp_path / "train.sbatch")]).returncode == 0
    assert "wrote" in capsys.readouterr().out
