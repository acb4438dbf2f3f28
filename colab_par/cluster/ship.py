"""Finding the notebook definitions a cell needs and making them picklable by value.

Engines are separate processes: a class defined in an ordinary notebook cell (module ``__main__``)
or a function from a module the engines cannot import (a test file, a local script) must travel
as code, not as a reference. cloudpickle does that for ``__main__``; we extend it to every module
that lives outside the installed packages.
"""
from __future__ import annotations

import ast
import builtins
import linecache
import sys
import sysconfig
import types
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import cloudpickle

__all__ = ["ship_by_value", "names_used", "names_assigned", "values_to_ship", "payload", "unpack"]

# Names IPython puts in every user namespace; never worth shipping.
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open", "_", "__", "___", "_i", "_ii",
                  "_iii", "_oh", "_dh", "_sh"}


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(str(Path(__file__).resolve().parents[1]))  # colab_par/ itself (this file is in colab_par/cluster/)
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


# ---- one payload, with the source of the notebook code in it -----------------------------------
# cloudpickle names every code object it ships by value "<dynamic-code>": engines then show a
# notebook function's line numbers but none of its lines (tracebacks, pdb, inspect). The payload
# carries each shipped code's own name and file lines; `unpack` puts them back on the engine.
_DYNAMIC = "<dynamic-code>"
_WALK_DEPTH, _WALK_MAX = 6, 20_000


def payload(namespace: dict[str, Any]) -> bytes:
    """`namespace` as one cloudpickle payload, with the source of the notebook code it holds."""
    return cloudpickle.dumps({"values": namespace, "sources": _code_sources(namespace.values())})


def unpack(blob: bytes) -> dict[str, Any]:
    """On an engine: the names of a `payload`, their shipped functions named as in the notebook
    ("<notebook In[3]>", or the file of a module shipped by value) with its lines in linecache."""
    loaded = cloudpickle.loads(blob)
    names, lines = loaded["sources"]["names"], loaded["sources"]["lines"]
    for name, text in lines.items():
        linecache.cache[name] = (sum(map(len, text)), None, text, name)  # mtime None: kept
    for function in _functions(loaded["values"].values(), lambda module: module == "__main__"
                               or module not in sys.modules):
        if function.__code__.co_filename == _DYNAMIC:
            function.__code__ = _renamed(function.__code__, names)
    return loaded["values"]


def _code_sources(values: Iterable[Any]) -> dict[str, dict]:
    """For every code object shipped by value among `values`: its key -> the name engines show
    (`unpack`), and per name the file's lines."""
    def by_value(module: str) -> bool:
        found = sys.modules.get(module)
        return found is not None and not _engines_can_import(found)

    shown: dict[str, str] = {}
    names: dict[str, str] = {}
    for function in _functions(values, by_value):
        for code in _codes(function.__code__):
            names[_code_key(code)] = shown.setdefault(code.co_filename, _display_name(code.co_filename))
    lines = {name: linecache.getlines(original) for original, name in shown.items()}
    return {"names": names, "lines": {name: text for name, text in lines.items() if text}}


def _display_name(filename: str) -> str:
    """A notebook cell's file as "<notebook In[3]>" (IPython's own cell names); others as they are."""
    from IPython import get_ipython

    shell = get_ipython()
    compiler = getattr(shell, "compile", None)
    cell = compiler.format_code_name(filename) if hasattr(compiler, "format_code_name") else None
    return f"<notebook {cell[1]}>" if cell else filename


def _code_key(code: types.CodeType) -> str:
    """The same on both sides of a cloudpickle round trip (which renames only the file)."""
    return f"{getattr(code, 'co_qualname', code.co_name)}:{code.co_firstlineno}:{zlib.crc32(code.co_code)}"


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _renamed(code: types.CodeType, names: dict[str, str]) -> types.CodeType:
    consts = tuple(_renamed(c, names) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=names.get(_code_key(code), code.co_filename), co_consts=consts)


def _functions(values: Iterable[Any], by_value: Callable[[str], bool]) -> Iterable[types.FunctionType]:
    """Functions defined by value reachable from `values` (a few references deep: closures,
    methods of by-value classes, attributes of instances, items of containers)."""
    seen: set[int] = set()
    stack = [(value, 0) for value in values]
    while stack and len(seen) < _WALK_MAX:
        value, depth = stack.pop()
        if id(value) in seen or depth > _WALK_DEPTH or isinstance(value, (str, bytes, int, float, complex)):
            continue
        seen.add(id(value))
        children: list[Any] = []
        if isinstance(value, types.FunctionType):
            if not by_value(value.__module__ or ""):
                continue
            yield value
            children = [cell.cell_contents for cell in value.__closure__ or () if _filled(cell)]
            children += list(value.__defaults__ or ()) + [getattr(value, "__wrapped__", None)]
        elif isinstance(value, type):
            children = list(vars(value).values()) if by_value(value.__module__) else []
        elif isinstance(value, (staticmethod, classmethod)):
            children = [value.__func__]
        elif isinstance(value, property):
            children = [value.fget, value.fset, value.fdel]
        elif isinstance(value, dict):
            children = list(value.values())[:100]
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = list(value)[:100]
        elif not isinstance(value, types.ModuleType):
            children = [type(value), *list(getattr(value, "__dict__", {}).values())[:100]]
        stack.extend((child, depth + 1) for child in children if child is not None)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name not yet assigned)
        return False
    return True
