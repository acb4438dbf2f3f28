"""Module paths of the flat tree before the regroup (0.2), still importable for one release.

``import colab_par.train`` (or ``from colab_par.train import Trainer``) gives the module at its new
home, `colab_par.training.trainer`, with a DeprecationWarning that names it: notebooks written for
the flat tree keep running while their imports are updated. The table is also the changelog of
the move. Names a user imports from ``colab_par`` itself (README) never moved.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

# old path under colab_par -> new path under colab_par
MOVED = {
    "engine": "cluster.engine",
    "engine_setup": "cluster.engine_setup",
    "launchers": "cluster.launchers",
    "warm_pool": "cluster.warm_pool",
    "persist": "cluster.persist",
    "ship": "cluster.ship",
    "direct": "cluster.direct",
    "direct_call": "cluster.direct_call",
    "lean_wire": "cluster.lean_wire",
    "deadlock": "cluster.deadlock",
    "task_watch": "cluster.task_watch",
    "backend": "cluster.backend",
    "ranks": "cluster.ranks",
    "probe": "cluster.probe",
    "postmortem": "cluster.postmortem",
    "script": "cluster.script",
    "debugger": "cluster.debugger",
    "pull": "cluster.pull",
    "magics": "notebook.magics",
    "widgets": "notebook.picker",
    "output": "cluster.output",
    "export": "notebook.export",
    "dashboard": "views.dashboard",
    "svg_plot": "views.svg_plot",
    "remote_view": "views.remote_view",
    "train": "training.trainer",
    "loggers": "training.loggers",
    "telemetry": "training.telemetry",
    "recovery": "training.recovery",
    "checkpoint": "training.checkpoint",
    "checkpoint_format": "training.checkpoint_format",
    "checkpoint_ties": "training.checkpoint_ties",
    "memory_tiers.checkpoint_pages": "training.checkpoint_pages",
    "data_sources": "data.sources",
    "data_workers": "data.workers",
    "eval_rows": "data.eval_rows",
    "parallel.batch": "data.batch",
    "generation": "parallel.inference.generation",
    "sampling": "parallel.inference.sampling",
    "inference": "parallel.inference.state",
    "evaluation": "parallel.inference.evaluation",
    "planner": "planning.planner",
    "tensor_costs": "planning.tensor_costs",
    "tier_costs": "planning.tier_costs",
    "expert_costs": "planning.expert_costs",
    "flops": "planning.flops",
    "devices": "planning.devices",
    "largest_model": "planning.largest_model",
    "module_spec": "planning.module_spec",
    "host_heap": "memory_tiers.host_heap",
    "device_catalogue": "layout.device_catalogue",
    "tier_options": "layout.tier_options",
    "hf_io.weights": "models.hf_weights",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new home (the same object)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        prefix, _, old = fullname.partition(".")
        if prefix != "colab_par" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = "colab_par." + MOVED[spec.name.partition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in the next "
                      "release)", DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system has just set the alias's spec on the module: give it its own back
        for old, spec in list(self._specs.items()):
            if spec.name == module.__name__:
                module.__spec__ = self._specs.pop(old)


def install() -> None:
    """Called once by colab_par/__init__.py, before any submodule import runs."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
