"""Finding the notebook definitions a cell needs and making them picklable by value.

Engines are separate processes: a class defined in an ordinary notebook cell (module ``__main__``)
or a function from a module the engines cannot import (a test file, a local script) must travel
as code, not as a reference. cloudpickle does that for ``__main__``; we extend it to every module
that lives outside the installed packages.
"""
from __future__ import annotations

import ast
import builtins
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Callable, Iterable

import cloudpickle

__all__ = ["ship_by_value", "names_used", "names_assigned", "values_to_ship"]

# Names IPython puts in every user namespace; never worth shipping.
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open", "_", "__", "___", "_i", "_ii",
                  "_iii", "_oh", "_dh", "_sh"}


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(str(Path(__file__).resolve().parent))
    return [Path(root).resolve() for root in roots if root]


def _engines_can_import(module: types.ModuleType) -> bool:
    """Installed packages and the stdlib exist on the engines; anything else may not."""
    if module.__name__ == "__main__":
        return False
    file = getattr(module, "__file__", None)
    if file is None:  # builtin or namespace module: importable everywhere
        return True
    path = Path(file).resolve()
    return any(path.is_relative_to(root) for root in _installed_roots())


def ship_by_value(*objects: Any) -> None:
    """Make the modules defining these functions/classes pickle by value when not importable remotely."""
    for obj in objects:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        if module is not None and module.__name__ != "__main__" and not _engines_can_import(module):
            cloudpickle.register_pickle_by_value(module)


def names_used(cell: str) -> set[str]:
    """Every global-looking name the cell reads (load context), in any scope."""
    tree = ast.parse(cell)
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Load)}


def names_assigned(cell: str) -> set[str]:
    """Top-level names the cell defines; they then live on the engines for later cells."""
    defined: set[str] = set()
    for node in ast.parse(cell).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        else:
            for child in ast.walk(node):
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    defined.add(child.id)
    return defined


def values_to_ship(cell: str, user_ns: dict[str, Any], engine_names: Iterable[str] = (),
                   on_skip: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """The notebook values a cell uses, except those the engines defined themselves.

    A value that cannot be pickled (an open file, a widget, the cluster itself) is skipped and
    reported through ``on_skip(name, reason)`` instead of failing the whole cell.
    """
    skip = set(engine_names) | _IPYTHON_NAMES | set(dir(builtins))
    chosen: dict[str, Any] = {}
    for name in sorted(names_used(cell) - skip):
        if name not in user_ns or name.startswith("_"):
            continue
        value = user_ns[name]
        ship_by_value(value)
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means "don't ship"
            if on_skip is not None:
                on_skip(name, f"{type(exc).__name__}: {exc}")
            continue
        chosen[name] = value
    return chosen
