"""Per-rank timelines from torch.profiler: where each rank's time goes, and what overlaps what.

- ``%%colossal --profile [DIR]`` / `Cluster.profile(code)` records a cell on every engine
  (`session.py`); ``Trainer(logs=Logs(profile_steps=(10, 12)))`` records a few steps of a run (`steps.py`).
- Each rank writes its Chrome trace (``DIR/rank<N>.pt.trace.json``, for Perfetto or TensorBoard)
  and reduces it to a compact record (`events.py`, on the engine: `recorder.py`).
- The notebook lines the records up in a `Timeline` (`timeline.py`) and draws one lane block per
  rank (`picture.py`): the Trainer's phases, the host threads' time (compute, optimizer, data,
  communication calls, waiting, pipeline bubbles), and the collectives on each communication
  thread or CUDA stream.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Timeline", "ProfileSteps"]

_EXPORTS = {"Timeline": "colab_par.profiling.timeline", "ProfileSteps": "colab_par.profiling.steps"}


def __getattr__(name: str) -> Any:
    """Lazily, so the notebook side never imports the engine side's torch.profiler code."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'colab_par.profiling' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
