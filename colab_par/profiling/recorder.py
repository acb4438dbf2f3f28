"""A torch.profiler recording on one rank: started, marked, stopped, written, reduced.

Runs on the engines (or in any process of a torch.distributed world). One recording at a time per
process; `start` and `stop` may be separate calls (the notebook starts it, runs a cell, stops it),
so the state lives here. Each rank writes its Chrome trace as ``rank<N>.pt.trace.json`` in the
folder it is given (Perfetto and TensorBoard's profiler plugin open these) and hands back the
compact record `events.reduce_trace` makes of it, which is all that travels to the notebook.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

from colab_par.profiling.events import STEP_MARK, SYNC_MARK, reduce_trace

__all__ = ["start", "stop", "abandon", "is_recording", "open_mark", "close_mark", "trace_file"]

_recording: "_Recording | None" = None


class _Recording:
    def __init__(self, folder: str, sync: bool):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.folder = folder
        self.host_thread = threading.get_native_id()
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()
        if sync and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank leaves the barrier at about the same moment: the ranks' clocks are lined up
            # on its end where they run on different hosts (`timeline.py`)
            with torch.profiler.record_function(SYNC_MARK):
                dist.barrier()


def trace_file(folder: str, rank: int) -> str:
    """Where rank `rank` writes its trace in `folder`."""
    return os.path.join(folder, f"rank{rank}.pt.trace.json")


def start(folder: str, *, sync: bool = True) -> object:
    """Start recording this rank (a recording left running is dropped first); returns a handle that
    `is_recording` recognises. With `sync`, every rank of the world must call this together: they
    pass one barrier."""
    global _recording
    abandon()
    os.makedirs(folder, exist_ok=True)
    _recording = _Recording(folder, sync)
    return _recording


def is_recording(handle: object = None) -> bool:
    """Whether a recording runs (with `handle`: whether it is still the one `start` returned)."""
    return _recording is not None and (handle is None or _recording is handle)


def stop() -> dict[str, Any]:
    """Stop recording, write this rank's trace file and return its compact record."""
    global _recording
    if _recording is None:
        raise RuntimeError("no profile is being recorded on this rank; start one first "
                           "(colab_par.profiling.recorder.start)")
    recording, _recording = _recording, None
    recording.profiler.stop()
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = trace_file(recording.folder, rank)
    recording.profiler.export_chrome_trace(path)
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    return reduce_trace(trace, host_thread=recording.host_thread, rank=rank, host=socket.gethostname(),
                        path=path)


def abandon() -> None:
    """Stop a recording without writing anything (after an error, or before a new one)."""
    global _recording
    if _recording is not None:
        recording, _recording = _recording, None
        recording.profiler.stop()


def open_mark(step: int) -> Any:
    """Open the mark of Trainer step `step` while recording (None otherwise); `close_mark` ends it.
    Two calls rather than a context manager, so the step's code keeps its shape."""
    if _recording is None:
        return None
    mark = torch.profiler.record_function(f"{STEP_MARK}{step}")
    mark.__enter__()
    return mark


def close_mark(mark: Any) -> None:
    if mark is not None:
        mark.__exit__(None, None, None)
