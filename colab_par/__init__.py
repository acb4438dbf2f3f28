"""colab_par: interactive distributed training of PyTorch models from a Jupyter notebook.

Names are imported lazily so that ``import colab_par`` stays cheap and the pure-Python parts
(Layout, planner, picker) work in a kernel with no cluster and no torch.distributed.
"""
from __future__ import annotations

import importlib
from typing import Any

from colab_par import moved

__version__ = "0.1.0"
moved.install()  # the flat tree's module paths still import, with a warning (colab_par/moved.py)

_EXPORTS = {
    "Cluster": "colab_par.cluster",
    "EngineError": "colab_par.cluster",
    "running_clusters": "colab_par.cluster.persist",
    "Slurm": "colab_par.cluster.launchers",
    "SSH": "colab_par.cluster.launchers",
    "LauncherError": "colab_par.cluster.launchers",
    "Layout": "colab_par.layout",
    "LayoutError": "colab_par.layout",
    "parallelize": "colab_par.parallel",
    "memory_report": "colab_par.parallel",
    "ParallelModel": "colab_par.parallel",
    "plan": "colab_par.planning.planner",
    "Plan": "colab_par.planning.planner",
    "verify": "colab_par.planning.dry_run.verify",
    "Verification": "colab_par.planning.dry_run.verify",
    "LayoutPicker": "colab_par.notebook.picker",
    "Trainer": "colab_par.training.trainer",
    "Evaluation": "colab_par.training.options",
    "Checkpoints": "colab_par.training.options",
    "Logs": "colab_par.training.options",
    "GRPO": "colab_par.training.grpo",
    "Completions": "colab_par.training.grpo",
    "GrpoLossOptions": "colab_par.training.grpo",
    "Generators": "colab_par.cluster.generator_engines",
    "save": "colab_par.training.checkpoint",
    "from_pretrained": "colab_par.hf_io",
    "save_pretrained": "colab_par.hf_io",
    "load": "colab_par.training.checkpoint",
    "Trial": "colab_par.selection",
    "grid": "colab_par.selection",
    "select": "colab_par.selection",
    "train_alone": "colab_par.selection",
    "Halving": "colab_par.selection",
    "show": "colab_par.shard_map",
    "ShardMap": "colab_par.shard_map",
    "Timeline": "colab_par.profiling",
    "ProfileSteps": "colab_par.profiling",
}

__all__ = sorted(_EXPORTS) + ["load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str) -> Any:
    if name in moved.MOVED:  # colab_par.train... of the flat tree: its new home, with a warning
        return importlib.import_module(f"colab_par.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'colab_par' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext colab_par`` registers ``%colossal`` and ``%%colossal``, and starts the warm pool
    in the background, so that ``%colossal start`` forks engines whose imports are already done."""
    from colab_par.cluster import warm_pool
    from colab_par.notebook.magics import ColossalMagics

    ipython.register_magics(ColossalMagics(ipython))
    warm_pool.prestart()


def unload_ipython_extension(ipython: Any) -> None:
    from colab_par.cluster import warm_pool
    from colab_par.notebook.magics import shutdown_default_cluster

    shutdown_default_cluster()
    warm_pool.stop_shared_pool()
