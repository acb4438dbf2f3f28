"""`Trainer(logs=Logs(profile_steps=...))`: record a few steps of a run on every rank and show their timeline.

The Trainer calls `before_step` / `after_step` around each step; everything else (recording,
trace files, gathering the ranks' records, showing the picture on rank 0) happens here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Union

import torch.distributed as dist

from colab_par.profiling import recorder
from colab_par.profiling.session import trace_folder

__all__ = ["ProfileSteps", "StepProfiler"]


@dataclass(frozen=True)
class ProfileSteps:
    """Record Trainer steps `first` to `last` (both included; the step numbers of `history`) and
    write the traces to `trace_dir` (default: a new folder under ./colab_par_traces)."""

    first: int
    last: int
    trace_dir: Union[str, None] = None

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.first, self.last)) \
                or not 1 <= self.first <= self.last:
            raise ValueError(f"profile_steps=({self.first!r}, {self.last!r}) must be two step numbers "
                             "1 <= first <= last, e.g. profile_steps=(10, 12) for steps 10, 11 and 12")

    @classmethod
    def of(cls, value: "int | tuple[int, int] | ProfileSteps") -> "ProfileSteps":
        """A step number, a (first, last) pair or a ProfileSteps."""
        if isinstance(value, ProfileSteps):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value, value)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(*value)
        raise TypeError(f"profile_steps={value!r}: give a step number (12), a pair of them (10, 12) or "
                        "colab_par.profiling.ProfileSteps(10, 12, trace_dir='traces')")


class StepProfiler:
    """The recording of one ProfileSteps window inside a Trainer, on every rank."""

    def __init__(self, steps: ProfileSteps):
        self.steps = steps
        self.timeline: Any = None  # the Timeline of the window, on rank 0 once it ended
        self._recording: object = None  # the recording this window started (a profiled cell's is not)

    def before_step(self, step: int) -> None:
        if step == self.steps.first and not recorder.is_recording():
            self._recording = recorder.start(_shared(trace_folder(self.steps.trace_dir)))

    def after_step(self, step: int) -> None:
        """At the window's last step: stop, gather every rank's record on rank 0, show the picture."""
        if step != self.steps.last or self._recording is None:
            return
        mine, self._recording = self._recording, None
        if not recorder.is_recording(mine):  # dropped meanwhile (a profiled cell started its own)
            return
        record = recorder.stop()
        folder = os.path.dirname(record["trace"])
        if not dist.is_initialized() or dist.get_world_size() == 1:
            records = [record]
        else:
            gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(record, gathered, dst=0)
            records = gathered
        if records is not None:
            from colab_par.profiling.timeline import Timeline

            self.timeline = Timeline(records, folder)
            _show(self.timeline)


def _shared(folder: str) -> str:
    """Rank 0's folder on every rank (a default one is named after rank 0's clock)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return folder
    chosen = [folder]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _show(timeline: Any) -> None:
    """In a notebook or on an engine (whose notebook draws it): the picture; else its summary."""
    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = None  # type: ignore[assignment]
    if get_ipython is not None and get_ipython() is not None:
        from IPython.display import display

        display(timeline)
    else:
        print(timeline)
