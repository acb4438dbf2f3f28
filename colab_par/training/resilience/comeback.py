"""A restartable Trainer's side of losing an engine: announcing how its cell is recovered, and
coming back when the cell runs again on replaced engines (memory first, then the disk)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from colab_par.training import recovery
from colab_par.training import telemetry as telem
from colab_par.training.checkpoint import LATEST, CheckpointError
from colab_par.training.checkpoint_async import wait_for_saves
from colab_par.training.resilience.degraded import degradable, train_on
from colab_par.training.resilience.recover import recover

__all__ = ["announce", "come_back"]


def announce(trainer: Any) -> None:
    """Tell the notebook how to recover this cell if an engine dies (`Cluster.execute`), and whether
    the survivors can train on meanwhile (`degraded.degradable`)."""
    send = telem.engine_publisher()
    if send is not None:
        send({recovery.RECOVERY_KEY: {"ckpt_dir": str(trainer.ckpt_dir),
                                      "max_restarts": trainer.checkpoints.max_restarts,
                                      "degradable": degradable(trainer)}})


def come_back(trainer: Any, stop_at: int) -> None:
    """The cell runs again after an engine was replaced: go on from what the engines keep in
    memory (`recover`), else from the last committed checkpoint, else from the start. A peer lost
    meanwhile fails this rank here: it says so to the others, who may be waiting to train on
    without that peer (`degraded.train_on`, which re-raises: this rank holds no whole step)."""
    try:
        _come_back(trainer)
    except Exception as error:  # noqa: BLE001 - re-raised by train_on
        train_on(trainer, error, stop_at, None)


def _come_back(trainer: Any) -> None:
    recovery.take_resume_request(trainer.ckpt_dir)
    try:  # an asynchronous save the lost engine took part in cannot commit any more
        wait_for_saves()
    except CheckpointError as error:
        print(f"colab_par: {error}")
    from_memory = recover(trainer)
    if from_memory is not None:
        trainer._keeper.whole(trainer)  # a peer lost in the next step finds this step kept
        print(f"colab_par: {from_memory}")
        return
    if not (Path(trainer.ckpt_dir) / LATEST).is_file():
        print("colab_par: no checkpoint was committed before the engine was lost; training again from step 0")
        return
    meta = trainer.resume()
    print(f"colab_par: resumed from the checkpoint of step {meta['step']} in {trainer.ckpt_dir}")
