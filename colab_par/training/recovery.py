"""How a restartable cell is recovered after an engine died: what the notebook and the engines share.

A `Trainer(checkpoints=Checkpoints(dir, every=k, on_failure="restart"))` announces its policy under `RECOVERY_KEY` (through datapub);
`Cluster.execute` reads it, restarts the engines and calls `request_resume` on each, so the
Trainer's next `fit` resumes. This module sits below both sides and imports nothing of theirs.

Where the policy says "degradable" (dp replicas that are whole copies), the surviving ranks train on
while the lost engine's replacement starts: the notebook's control requests (`cluster/probe.py`,
answered on the engine's control thread while the cell runs) leave a degrade message here, then a
rejoin flag; the Trainer (`training/resilience/degraded.py`) reads them between steps and leaves
what it did for the notebook to tell.
"""
from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["RECOVERY_KEY", "request_resume", "resume_requested", "take_resume_request", "request_degraded",
           "take_degrade_request", "request_rejoin", "rejoin_requested", "record_degraded", "degraded_record"]

RECOVERY_KEY = "colab_par.training.recovery"  # how a cell's restartable Trainer asks to be recovered
DEGRADE_FRESH_S = 60.0  # an older degrade message is stale: its episode is over

_RESUME_REQUESTS: set[str] = set()  # checkpoint folders whose next fit resumes
_LOCK = threading.Lock()  # the control thread writes, the main thread reads
_DEGRADE: dict[str, Any] = {}  # the notebook's degrade message, with "at" (when it came)
_ARRIVED = threading.Event()
_REJOIN = threading.Event()
_RECORD: dict[str, Any] = {}  # what this rank trained degraded, for the notebook


def request_resume(ckpt_dir: str) -> None:
    """Called by the notebook on fresh engines after one died: the next `fit` of a restartable
    Trainer with this `ckpt_dir` continues from its last committed checkpoint. Any degrade message
    of the episode is over (`_clear_degraded`)."""
    _RESUME_REQUESTS.add(str(ckpt_dir))
    _clear_degraded()


def resume_requested(ckpt_dir: str) -> bool:
    return str(ckpt_dir) in _RESUME_REQUESTS


def take_resume_request(ckpt_dir: str) -> None:
    """The request is being served: a later fit of the same Trainer does not resume again."""
    _RESUME_REQUESTS.discard(str(ckpt_dir))


def request_degraded(content: dict[str, Any]) -> None:
    """(engine, control thread) A dp peer died: train on with the survivors `content` names."""
    with _LOCK:
        _REJOIN.clear()
        _RECORD.clear()
        _DEGRADE.clear()
        _DEGRADE.update(content, at=time.monotonic())
        _ARRIVED.set()


def take_degrade_request(wait_s: float) -> dict[str, Any] | None:
    """(engine, main thread, after a collective failed) The degrade message, waiting up to `wait_s`
    for it: None when none came (the failure was not a lost peer's)."""
    _ARRIVED.wait(wait_s)
    with _LOCK:
        fresh = _DEGRADE and time.monotonic() - _DEGRADE["at"] < DEGRADE_FRESH_S
        message = dict(_DEGRADE) if fresh else None
        _DEGRADE.clear()
        _ARRIVED.clear()
    return message


def request_rejoin() -> None:
    """(engine, control thread) The replacement is ready: leave degraded training at a step boundary."""
    _REJOIN.set()


def rejoin_requested() -> bool:
    return _REJOIN.is_set()


def record_degraded(record: dict[str, Any]) -> None:
    """(engine) What this rank trained degraded: first and last step, dp, dp of the full world."""
    with _LOCK:
        _RECORD.clear()
        _RECORD.update(record)


def degraded_record() -> dict[str, Any] | None:
    """(the notebook asks each survivor) What `record_degraded` left, if anything."""
    with _LOCK:
        return dict(_RECORD) or None


def _clear_degraded() -> None:
    with _LOCK:
        _DEGRADE.clear()
        _RECORD.clear()
        _ARRIVED.clear()
        _REJOIN.clear()
