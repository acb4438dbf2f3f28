"""How a restartable cell is recovered after an engine died: what the notebook and the engines share.

A `Trainer(checkpoints=Checkpoints(dir, every=k, on_failure="restart"))` announces its policy under `RECOVERY_KEY` (through datapub);
`Cluster.execute` reads it, restarts the engines and calls `request_resume` on each, so the
Trainer's next `fit` resumes. This module sits below both sides and imports nothing of theirs.
"""
from __future__ import annotations

__all__ = ["RECOVERY_KEY", "request_resume", "resume_requested", "take_resume_request"]

RECOVERY_KEY = "colab_par.training.recovery"  # how a cell's restartable Trainer asks to be recovered

_RESUME_REQUESTS: set[str] = set()  # checkpoint folders whose next fit resumes


def request_resume(ckpt_dir: str) -> None:
    """Called by the notebook on fresh engines after one died: the next `fit` of a restartable
    Trainer with this `ckpt_dir` continues from its last committed checkpoint."""
    _RESUME_REQUESTS.add(str(ckpt_dir))


def resume_requested(ckpt_dir: str) -> bool:
    return str(ckpt_dir) in _RESUME_REQUESTS


def take_resume_request(ckpt_dir: str) -> None:
    """The request is being served: a later fit of the same Trainer does not resume again."""
    _RESUME_REQUESTS.discard(str(ckpt_dir))
