"""Profiling a cell from the notebook: start a recording on every engine, run the cell, stop, and
build the `Timeline` from the compact records the engines send back (`Cluster.profile`).

Pure Python on the notebook side: the engines import the recorder (and torch) themselves.
"""
from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["profile_cell", "trace_folder", "DEFAULT_FOLDER"]

DEFAULT_FOLDER = "colab_par_traces"


def trace_folder(trace_dir: str | os.PathLike | None) -> str:
    """The folder the ranks write their traces to: `trace_dir`, or a new one named after the time
    under ./colab_par_traces; an absolute path, so every engine writes where the caller meant."""
    if trace_dir is not None and str(trace_dir):
        return os.path.abspath(os.fspath(trace_dir))
    base = os.path.abspath(os.path.join(DEFAULT_FOLDER, time.strftime("%Y%m%d-%H%M%S")))
    folder, n = base, 1
    while os.path.exists(folder):
        n += 1
        folder = f"{base}-{n}"
    return folder


def profile_cell(cluster: Any, code: str, *, trace_dir: str | os.PathLike | None = None,
                 **execute: Any) -> Any:
    """Run `code` like `cluster.execute(code, **execute)` (`cluster`: a running `Cluster`) with
    torch.profiler recording on every rank; the `Timeline` (ranks the cell does not target show
    what they did meanwhile: nothing)."""
    from colab_par.profiling.timeline import Timeline

    folder = trace_folder(trace_dir)
    cluster.run(_start, folder)
    try:
        cluster.execute(code, **execute)
    except BaseException:
        _abandon_everywhere(cluster)
        raise
    return Timeline(cluster.run(_stop), folder)


def _abandon_everywhere(cluster: Any) -> None:
    """After a failed cell: stop the recordings still running, if the engines can be reached (the
    cell's own error is the one to show)."""
    try:
        if cluster.running and not cluster.dead_ranks():
            cluster.run(_abandon)
    except Exception:  # noqa: BLE001 - a broken world or fresh engines: nothing left to stop
        pass


def _start(folder: str) -> None:
    from colab_par.profiling import recorder

    recorder.start(folder)


def _stop() -> dict[str, Any]:
    from colab_par.profiling import recorder

    return recorder.stop()


def _abandon() -> None:
    from colab_par.profiling import recorder

    recorder.abandon()
