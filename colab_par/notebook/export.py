"""`colab-par export`: a notebook's training as one standalone script for torchrun (and Slurm).

Every code cell becomes a block of the script, in order (`colab_par.cluster.script` explains the run-time
side):

- an ordinary cell runs on rank 0, as the notebook's kernel ran it once;
- a `%%colossal` cell runs on every rank (or its `--targets`), after the notebook values it uses
  are shared from rank 0, the names `%%colossal` would ship;
- `%colossal start/stop/restart/relayout` become `join_world()`, `leave_world()`, `restart()` and
  `colab_par.training.checkpoint.relayout(...)`; `%colossal status` and `%load_ext colab_par` mean nothing
  in a script and stay as comments.

What has no meaning outside a notebook (other magics and shell escapes, widgets, plots) is named
by cell and line, and the export stops, unless `drop_unsupported` comments those lines out (each
still named). Cells are counted from 1 over the whole notebook, markdown included, as they
appear; lines from 1 within the cell.
"""
from __future__ import annotations

import ast
import shlex
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from IPython.core.inputtransformer2 import TransformerManager

from colab_par.cluster.launchers import Slurm
from colab_par.notebook.magics import parse_cell_line, parse_line
from colab_par.cluster.ship import names_assigned, names_used

__all__ = ["Unsupported", "ExportError", "Export", "export_notebook", "sbatch_script"]

_FRONT_END_MODULES = ("ipywidgets", "IPython.display", "matplotlib", "colab_par.notebook.picker")
_FRONT_END_NAMES = {"display", "LayoutPicker", "plt", "widgets"}


@dataclass(frozen=True)
class Unsupported:
    cell: int
    line: int
    text: str
    reason: str

    def __str__(self) -> str:
        return f"cell {self.cell}, line {self.line}: {self.text.strip()!r}: {self.reason}"


class ExportError(ValueError):
    def __init__(self, problems: list[Unsupported]):
        self.problems = problems
        super().__init__("the notebook has lines a script cannot run (export with --drop-unsupported "
                         "to comment them out):\n" + "\n".join(f"  {p}" for p in problems))


@dataclass
class Export:
    """The script's text, what was left out of it, and the engines the notebook started."""

    script: str
    dropped: list[Unsupported] = field(default_factory=list)
    engines: int | None = None


def export_notebook(path: str | Path, *, drop_unsupported: bool = False) -> Export:
    """Translate the notebook at `path`; raises ExportError naming every unsupported line unless
    `drop_unsupported`."""
    with warnings.catch_warnings():  # cells without ids: nbformat fills them in, and warns
        warnings.simplefilter("ignore")
        notebook = nbformat.read(str(path), as_version=4)
    writer = _ScriptWriter(Path(path).name)
    for number, cell in enumerate(notebook.cells, start=1):
        if cell.cell_type == "code" and cell.source.strip():
            writer.cell(number, cell.source)
    if writer.problems and not drop_unsupported:
        raise ExportError(writer.problems)
    return Export(writer.finish(), writer.problems, writer.engines)


def sbatch_script(script: str, job: Slurm, *, procs_per_node: int, port: int = 29500) -> str:
    """An sbatch file running `script` with torchrun on every node of `job` (one srun task per
    node), the rendezvous on the job's first node."""
    options = [f"--job-name={Path(script).stem}", *job.sbatch_options(tasks_per_node=1)]
    header = "\n".join(f"#SBATCH {option}" for option in options)
    return f"""#!/bin/bash
{header}
# written by `colab-par export --slurm`; submit with: sbatch {Path(script).stem}.sbatch
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {procs_per_node} \\
  --rdzv-backend c10d --rdzv-endpoint "$head_node:{port}" --rdzv-id "$SLURM_JOB_ID" \\
  {shlex.quote(script)}
"""


class _ScriptWriter:
    def __init__(self, source_name: str):
        self.source_name = source_name
        self.blocks: list[str] = []
        self.problems: list[Unsupported] = []
        self.engines: int | None = None
        self.notebook_names: set[str] = set()  # assigned by ordinary cells (imports too)
        self.notebook_values: set[str] = set()  # of those, the ones not imported
        self.engine_names: set[str] = set()  # what the engines hold now (a restart clears it)
        self.stopped = False
        self.seed: int | None = 0  # `%colossal start --seed`, as the engines were seeded

    # ---- cells ----------------------------------------------------------------------------------
    def cell(self, number: int, source: str) -> None:
        if source.lstrip().startswith("%%colossal"):
            self._engine_cell(number, source)
        elif source.lstrip().startswith("%%"):
            self._refuse(number, 1, source.lstrip(), "a cell magic other than %%colossal runs only in a notebook")
            self.blocks.append(f"# ---- cell {number} ----\n"
                               + _commented(source.strip("\n"), f"not exported (cell {number})"))
        else:
            self._notebook_cell(number, source)

    def _notebook_cell(self, number: int, source: str) -> None:
        self.blocks.append(f"# ---- cell {number} ----")
        code: list[str] = []
        for line, text, node in _statements(source):
            magic = _line_magic(node)
            if magic is not None and magic[0] not in ("colossal", "load_ext"):
                self._refuse(number, line, text, f"the %{magic[0]} magic runs only in a notebook")
                code.append(_commented(text, f"not exported (cell {number}, line {line})"))
            elif magic is None and self._front_end(number, line, text, node):
                code.append(_commented(text, f"not exported (cell {number}, line {line})"))
            elif magic is None:
                code.append(text)
                self.notebook_names |= names_assigned(text)
                self.notebook_values |= names_assigned(text) - _imported(node)
            else:
                self._flush_notebook_code(code)
                code = []
                self._magic(number, line, text, *magic)
        self._flush_notebook_code(code)

    def _flush_notebook_code(self, code: list[str]) -> None:
        body = "\n".join(code).strip("\n")
        if body:
            self.blocks.append("if rank == 0:\n    with notebook_cell():\n"
                               + textwrap.indent(_with_statement(body), " " * 8))

    def _engine_cell(self, number: int, source: str) -> None:
        header, _, body = source.lstrip().partition("\n")
        try:
            args = parse_cell_line(header[len("%%colossal"):])
        except Exception as exc:  # noqa: BLE001 - the magic's own usage error, named here
            self._refuse(number, 1, header, f"not a %%colossal line the magic accepts: {exc}")
            return
        self.blocks.append(f"# ---- cell {number} (%%colossal) ----")
        kept, engine_imports = [], set()
        for line, text, node in _statements(body):
            engine_imports |= _imported(node)
            if _line_magic(node) is not None or self._front_end(number, line + 1, text, node):
                if _line_magic(node) is not None:
                    self._refuse(number, line + 1, text, "a magic inside a %%colossal cell runs only in a notebook")
                kept.append(_commented(text, f"not exported (cell {number}, line {line + 1})"))
            else:
                kept.append(text)
        python = TransformerManager().transform_cell(body)  # magics as the calls they stand for
        shipped = sorted((names_used(python) & self.notebook_names) - self.engine_names)
        clashes = sorted((names_assigned(python) - engine_imports) & self.notebook_values)
        for name in clashes:
            self._refuse(number, 1, header, f"{name!r} is both a notebook and an engine variable; a "
                         "script has one namespace: rename one of them")
        if shipped:
            self.blocks.append(f"share(globals(), {shipped!r})")
        if args.layout is not None:
            value = args.layout if args.layout in self.notebook_names else repr(args.layout)
            if args.layout in self.notebook_names and args.layout not in shipped:
                self.blocks.append(f"share(globals(), [{args.layout!r}])")
            self.blocks.append(f"layout = Layout.parse(getattr({value}, 'layout', {value})).validate(world_size)")
        body_text = _with_statement("\n".join(kept).strip("\n"))
        if args.targets == "all":
            opening = f"with engine_cell(all_output={args.all_output}):"
        else:
            opening = f"with engine_cell({args.targets!r}, all_output={args.all_output}) as runs:"
            body_text = "if runs:\n" + textwrap.indent(body_text, " " * 4)
        self.blocks.append(opening + "\n" + textwrap.indent(body_text, " " * 4))
        self.engine_names |= names_assigned(python)

    # ---- %colossal and other line magics --------------------------------------------------------
    def _magic(self, number: int, line: int, text: str, name: str, argument: str) -> None:
        if name == "load_ext":
            if argument.strip() == "colab_par":
                self.blocks.append(_commented(text, "the script imports colab_par.cluster.script instead"))
            else:
                self._refuse(number, line, text, "an IPython extension runs only in a notebook")
                self.blocks.append(_commented(text, f"not exported (cell {number}, line {line})"))
            return
        try:
            args = parse_line(argument)
        except Exception as exc:  # noqa: BLE001
            self._refuse(number, line, text, f"not a %colossal line the magic accepts: {exc}")
            return
        if args.command == "start":
            self.engines, self.seed = args.n or self.engines, args.seed
            self.blocks.append(_commented(text, "torchrun started this script's processes: see the top"))
        elif args.command == "status":
            self.blocks.append(_commented(text, "no engines to show in a script"))
        elif args.command == "stop":
            self.blocks.append(f"leave_world()  # {text.strip()}")
            self.stopped = True
        elif args.command == "restart":
            self.blocks.append(f"restart(seed={self.seed!r})  # {text.strip()}")
            self.engine_names = set()
        elif args.command == "relayout":
            scratch = "" if args.scratch_dir is None else f", scratch_dir={args.scratch_dir!r}"
            self.blocks.append(
                f"{args.model} = relayout({args.model}, {args.layout!r}, trainer=globals().get({args.trainer!r})"
                f"{scratch})"
                f"  # {text.strip()}\n"
                f"if rank == 0:\n    print(f\"colab_par: {args.model} now runs as {{{args.model}.layout}}\")")

    def _front_end(self, number: int, line: int, text: str, node: ast.stmt) -> bool:
        """Refuse (and report True for) a statement that needs the notebook's front end."""
        modules = _imported_modules(node)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if any(m == f or m.startswith(f + ".") for m in modules for f in _FRONT_END_MODULES) or \
                names & _FRONT_END_NAMES:
            self._refuse(number, line, text, "widgets, displays and plots need the notebook's front end")
            return True
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "get_ipython"
               for n in ast.walk(node)):
            self._refuse(number, line, text, "IPython syntax (a magic, a shell escape or help) runs "
                         "only in a notebook")
            return True
        return False

    def _refuse(self, number: int, line: int, text: str, reason: str) -> None:
        self.problems.append(Unsupported(number, line, text.splitlines()[0] if text else "", reason))

    # ---- the script ----------------------------------------------------------------------------
    def finish(self) -> str:
        uses = "\n".join(self.blocks)
        imports = ["from colab_par.cluster.script import engine_cell, join_world, leave_world, notebook_cell, "
                   "restart, share"]
        if "relayout(" in uses:
            imports.append("from colab_par.training.checkpoint import relayout")
        if "Layout.parse(" in uses:
            imports.append("from colab_par.layout import Layout")
        started = (f"the notebook started {self.engines} engines" if self.engines else
                   "one process per GPU, or 2 on CPU, as `%colossal start` starts engines")
        head = f'''"""{self.source_name} as a script, written by `colab-par export`.

Run it with torchrun ({started}):

    torchrun --nproc-per-node {self.engines or 2} {Path(self.source_name).stem}.py

Ordinary cells run once, on rank 0; %%colossal cells on every rank, with the notebook values they
use shared from rank 0 first (see colab_par/cluster/script.py).
"""
{chr(10).join(imports)}

rank, world_size, local_rank, device = join_world(seed={self.seed!r})
'''
        tail = "" if self.stopped else "\nleave_world()\n"
        return head + "\n" + "\n\n".join(self.blocks) + "\n" + tail


# ---- reading cells ------------------------------------------------------------------------------
def _statements(source: str) -> list[tuple[int, str, ast.stmt]]:
    """(first line, original text with the comments before it, parsed node) per top-level
    statement; IPython syntax is parsed as the `get_ipython()` calls it stands for."""
    original = source.splitlines()
    transformed = TransformerManager().transform_cell(source)
    tree = ast.parse(transformed)
    out, cursor = [], 0
    for node in tree.body:
        end = node.end_lineno or node.lineno
        text = "\n".join(original[cursor:end])
        out.append((node.lineno, text, node))
        cursor = end
    if out and cursor < len(original):  # trailing comments stay with the last statement
        line, text, node = out[-1]
        out[-1] = (line, text + "\n" + "\n".join(original[cursor:]), node)
    return out


def _line_magic(node: ast.stmt) -> tuple[str, str] | None:
    """(name, argument) when the statement is exactly `get_ipython().run_line_magic(name, arg)`."""
    call = node.value if isinstance(node, ast.Expr) else None
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "run_line_magic" and len(call.args) == 2
            and all(isinstance(a, ast.Constant) for a in call.args)):
        return call.args[0].value, call.args[1].value
    return None


def _imported(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return set()


def _imported_modules(node: ast.stmt) -> set[str]:
    modules = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Import):
            modules |= {alias.name for alias in child.names}
        elif isinstance(child, ast.ImportFrom) and child.module:
            modules |= {child.module} | {f"{child.module}.{alias.name}" for alias in child.names}
    return modules


def _commented(text: str, why: str) -> str:
    return f"# {why}:\n" + "\n".join(f"# {line}" for line in text.splitlines())


def _with_statement(body: str) -> str:
    """`body` as a block: a block of comments alone (every line left out) needs a `pass`."""
    code = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return body if code else (body + "\npass").lstrip("\n")
