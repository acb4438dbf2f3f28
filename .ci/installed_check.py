"""Every module of the source tree imports from the installed colab_par, not from the tree.

Run by .ci/run from outside the tree with the wheel's environment: ``python installed_check.py
TREE``. Compares the modules the tree has (colab_par/, and kernels/ as colab_par.kernels) with
those the installed package holds (pkgutil's walk), so a folder the wheel left out fails by name.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def tree_modules(root: Path) -> set[str]:
    """Module names of the .py files under colab_par/ and kernels/ (the latter as colab_par.kernels)."""
    names = set()
    for folder, package in ((root / "colab_par", "colab_par"), (root / "kernels", "colab_par.kernels")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            names.add(".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


def _raise(name: str) -> None:
    """pkgutil's walk skips a package that fails to import; here that is the failure."""
    raise ImportError(f"{name} does not import from the installed wheel") from sys.exc_info()[1]


def main(root: Path) -> None:
    import colab_par

    installed = Path(colab_par.__file__).resolve().parent
    assert root.resolve() not in installed.parents, \
        f"colab_par was imported from the source tree ({installed}), not from the wheel"
    walked = {"colab_par"} | {name for _, name, _ in pkgutil.walk_packages(colab_par.__path__, "colab_par.",
                                                                             onerror=_raise)}
    missing = tree_modules(root) - walked
    assert not missing, f"the wheel lacks these modules of the tree: {sorted(missing)}"
    for name in sorted(walked):
        importlib.import_module(name)
    data = [path.name for path in (root / "colab_par").rglob("*.json")]
    absent = [name for name in data if not any(installed.rglob(name))]
    assert not absent, f"the wheel lacks the package data {absent}"
    print(f"installed_check: {len(walked)} modules import from {installed}; package data {sorted(data)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
