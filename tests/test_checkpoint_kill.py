"""An engine killed in the middle of a save leaves the previous checkpoint loadable, and fresh
engines (a new process group) resume from it with the losses of an uninterrupted run."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from colab_par import Cluster
from colab_par.training.checkpoint import COMMIT_MARKER, latest_checkpoint
from colab_par.training.options import Logs

# Big enough that writing the checkpoint takes a while (≈110 MB per rank), small enough for 2 cores.
BIG = dict(vocab_size=256, seq_len=16, n_layer=6, n_head=8, d_model=512, kernels="torch")
STEPS, SAVED_AT = 4, 2


def big_trainer(steps: int):
    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(3)
    pm = parallelize(GPT(GPTConfig(**BIG)), "dp2 zero3")
    return Trainer(pm, SyntheticDataset(256, 16, 2), steps=steps, logs=Logs(telemetry=False))


def uninterrupted() -> list[float]:
    trainer = big_trainer(STEPS)
    trainer.fit()
    return [row["loss"] for row in trainer.history]


def save_twice(root: str) -> None:
    """Save at SAVED_AT (committed), train one more step and save again: the test kills us there."""
    from colab_par import save

    trainer = big_trainer(STEPS)
    trainer.fit(stop_at=SAVED_AT)
    save(trainer.pm, root, trainer=trainer)
    trainer.fit(stop_at=SAVED_AT + 1)
    save(trainer.pm, root, trainer=trainer)


def resume(root: str) -> tuple[int, list[float]]:
    from colab_par import load

    trainer = big_trainer(STEPS)
    load(trainer.pm, root, trainer=trainer)
    step = trainer.step
    trainer.fit()
    return step, [row["loss"] for row in trainer.history]


def _second_save_writing(root: Path) -> Path | None:
    if not (root / "LATEST").exists():
        return None
    for staging in root.glob(".tmp-*"):
        if any(staging.glob("*.distcp")):
            return staging
    return None


@pytest.mark.slow
def test_engine_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    with Cluster(n=2, backend="gloo", timeout=60.0, dashboard=False) as cluster:
        expected = cluster.run(uninterrupted)[0]
        pids = cluster.run(os.getpid)
        failure: list[BaseException] = []

        def run_saves() -> None:
            try:
                cluster.run(save_twice, str(root))
            except BaseException as exc:  # noqa: BLE001 - the death of rank 1 is the point
                failure.append(exc)

        saver = threading.Thread(target=run_saves)
        saver.start()
        deadline = time.monotonic() + 120
        staging = None
        while staging is None and saver.is_alive() and time.monotonic() < deadline:
            staging = _second_save_writing(root)
            time.sleep(0.001)
        assert staging is not None, "the second save never started writing (or finished too fast)"
        os.kill(pids[1], signal.SIGKILL)
        saver.join(timeout=120)
        assert not saver.is_alive() and failure, "the run should fail once rank 1 is dead"

        assert staging.exists() and not (staging / COMMIT_MARKER).exists()
        committed = latest_checkpoint(root)
        assert committed.name.startswith(f"step-{SAVED_AT:08d}-")

        cluster.restart()  # fresh engines, fresh process group
        step, losses = cluster.run(resume, str(root))[0]
    assert step == SAVED_AT
    assert losses == expected[SAVED_AT:]  # bit for bit
