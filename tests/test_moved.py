"""The flat tree's module paths still import for one release: the same module object as at its new
home, with a DeprecationWarning naming the new path; and the tree itself keeps its shape."""
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from colab_par.moved import MOVED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_module_at_its_new_home_with_a_warning(old):
    new = importlib.import_module(f"colab_par.{MOVED[old]}")
    sys.modules.pop(f"colab_par.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aliased = importlib.import_module(f"colab_par.{old}")
    assert aliased is new
    assert aliased.__spec__.name == new.__name__  # its own spec, not the alias's
    assert any(issubclass(w.category, DeprecationWarning) and f"colab_par.{MOVED[old]}" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert not (ROOT / "colab_par" / (old.replace(".", "/") + ".py")).exists()


def test_an_old_module_read_as_an_attribute_of_the_package_gives_its_new_home():
    """Notebooks of the flat tree wrote e.g. `colab_par.magics.default_cluster()` after `%load_ext`."""
    import colab_par

    sys.modules.pop("colab_par.magics", None)
    vars(colab_par).pop("magics", None)
    with pytest.warns(DeprecationWarning, match="colab_par.notebook.magics"):
        assert colab_par.magics is importlib.import_module("colab_par.notebook.magics")
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        colab_par.no_such_module


def test_a_path_that_never_existed_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("colab_par.no_such_module")


def test_the_tree_has_no_import_circles_of_files_or_folders():
    tool = ROOT.parent / "shared" / "tools" / "import_cycles.py"
    if not tool.exists():
        pytest.skip("../shared/tools is not beside this checkout")
    for flags in ([], ["--folders"]):
        done = subprocess.run([sys.executable, str(tool), *flags], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_module_of_the_kit_travels_to_engines_by_reference():
    """Functions of the kit's own modules are pickled by reference (the engines import the same
    module, whose state they keep), wherever in the tree the module lives."""
    import pkgutil

    import colab_par
    from colab_par.cluster import ship

    for info in pkgutil.walk_packages(colab_par.__path__, "colab_par."):
        if info.name.split(".")[1] == "moved" or info.name in MOVED:
            continue
        module = importlib.import_module(info.name)
        assert ship._engines_can_import(module), info.name
