"""The one checkpoint write a process runs beside training, and what became of it.

An asynchronous save (`checkpoint_async.py`) hands its write and commit to one background thread
here; every later save, synchronous or not, first waits for it (two writers would race for
`LATEST`, and a commit's prune would delete the other's staging folder). A write that failed is
raised once, by the next save or by `wait_for_saves()`, naming the checkpoint it did not commit.
This module sits below `checkpoint.py` so that the synchronous save can wait here too.
"""
from __future__ import annotations

import threading
from typing import Callable

from colab_par.training.checkpoint_format import CheckpointError

__all__ = ["start", "in_flight", "wait_for_saves"]

_lock = threading.Lock()
_writing: "_Write | None" = None


class _Write:
    """One background write: its thread, its label (the checkpoint it commits) and its error."""

    def __init__(self, work: Callable[[], object], label: str, root_state: Callable[[], str]):
        self.label, self.error, self._root_state = label, None, root_state
        self.thread = threading.Thread(target=self._run, args=(work,), name="colab_par-checkpoint", daemon=True)

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as error:  # raised on the training thread by the next wait
            self.error = error

    def failure(self) -> CheckpointError:
        return CheckpointError(f"the asynchronous save of {self.label} was not committed "
                               f"({type(self.error).__name__}: {self.error}); {self._root_state()}")


def start(work: Callable[[], object], label: str, root_state: Callable[[], str]) -> None:
    """Run `work` (a save's write and commit) in the background; the caller has waited for the
    previous one. `root_state()` says, when it failed, what the checkpoint folder still holds."""
    global _writing
    with _lock:
        if _writing is not None:
            raise RuntimeError("a checkpoint write is still in flight: call wait_for_saves() first")
        _writing = _Write(work, label, root_state)
        _writing.thread.start()


def in_flight() -> bool:
    """Whether a background write has not finished yet."""
    writing = _writing
    return writing is not None and writing.thread.is_alive()


def wait_for_saves() -> None:
    """Wait for the background write, if any; raise CheckpointError if it failed (once)."""
    global _writing
    writing = _writing
    if writing is None:
        return
    writing.thread.join()
    with _lock:
        _writing = None
    if writing.error is not None:
        raise writing.failure() from writing.error
