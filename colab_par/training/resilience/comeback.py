"""A restartable Trainer's side of losing an engine: announcing how its cell is recovered, and
coming back when the cell runs again on replaced engines (memory first, then the disk)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from colab_par.training import recovery
from colab_par.training import telemetry as telem
from colab_par.training.checkpoint import LATEST, CheckpointError
from colab_par.training.checkpoint_async import wait_for_saves
from colab_par.training.resilience.recover import recover

__all__ = ["announce", "come_back"]


def announce(trainer: Any) -> None:
    """Tell the notebook how to recover this cell if an engine dies (`Cluster.execute`)."""
    send = telem.engine_publisher()
    if send is not None:
        send({recovery.RECOVERY_KEY: {"ckpt_dir": str(trainer.ckpt_dir),
                                      "max_restarts": trainer.checkpoints.max_restarts}})


def come_back(trainer: Any) -> None:
    """The cell runs again after an engine was replaced: go on from what the engines keep in
    memory (`recover`), else from the last committed checkpoint, else from the start."""
    recovery.take_resume_request(trainer.ckpt_dir)
    try:  # an asynchronous save the lost engine took part in cannot commit any more
        wait_for_saves()
    except CheckpointError as error:
        print(f"colab_par: {error}")
    from_memory = recover(trainer)
    if from_memory is not None:
        print(f"colab_par: {from_memory}")
        return
    if not (Path(trainer.ckpt_dir) / LATEST).is_file():
        print("colab_par: no checkpoint was committed before the engine was lost; training again from step 0")
        return
    meta = trainer.resume()
    print(f"colab_par: resumed from the checkpoint of step {meta['step']} in {trainer.ckpt_dir}")
