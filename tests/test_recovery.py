"""Training that survives a lost engine: a `Trainer(on_failure="restart")` cell whose rank 1 is
SIGKILLed mid-step, mid-save or before any save has that engine alone replaced (rank 0 keeps its
process) and ends with every step's loss equal to an uninterrupted run; a cell that keeps losing
engines stops after `max_restarts` with what happened."""
from __future__ import annotations

import json
import re

import pytest

from colab_par import Cluster
from colab_par.models import GPTConfig
from colab_par.cluster.output import RecoveryError
from colab_par.training.options import Checkpoints

# Rank 1 kills itself once (the marker file is removed first), in the step or in the save named by
# KILL_IN; then every step's loss is printed from rank 0.
CELL = '''
import json, os, signal
import torch
import colab_par
import colab_par.training.checkpoint as checkpoint
from colab_par.data import SyntheticDataset
from colab_par.models import GPT

def die_once(where):
    if rank == 1 and KILL_IN == where and os.path.exists(MARKER):
        if not KEEP_MARKER:
            os.remove(MARKER)
        os.kill(os.getpid(), signal.SIGKILL)

def schedule(step):  # called at the start of every step
    if step == 5:
        die_once("step")
    if step == 1:
        die_once("before any save")
    return 1.0

save_rng = getattr(checkpoint, "undying_rng_state", checkpoint._rng_state)  # the cell may run twice
checkpoint.undying_rng_state = save_rng
def rng_state_of_a_dying_save(stream):  # called by every rank in the middle of a save
    if trainer.step == 4:
        die_once("save")
    return save_rng(stream)
checkpoint._rng_state = rng_state_of_a_dying_save

torch.manual_seed(0)  # every run starts from the same weights, on fresh or reused engines
pm = colab_par.parallelize(GPT(config), LAYOUT)
trainer = colab_par.Trainer(pm, SyntheticDataset(vocab_size=64, seq_len=16, batch_size=4), steps=8,
                            lr_schedule=schedule, ckpt_dir=CKPT, ckpt_every=2, on_failure="restart",
                            max_restarts=MAX_RESTARTS, telemetry=False)
trainer.fit()
if rank == 0:
    print("LOSSES " + json.dumps([row["loss"] for row in trainer.history]))
'''


@pytest.fixture(scope="module")
def cluster():
    with Cluster(n=2, backend="gloo", timeout=120.0, dashboard=False) as started:
        yield started


def run(cluster, tmp_path, name: str, kill_in: str | None, capsys, *, keep_marker: bool = False,
        max_restarts: int = 3, layout: str = "dp2") -> tuple[list[float], str, str]:
    """Every step's loss, and what the notebook was told (stdout, stderr)."""
    marker = tmp_path / f"{name}.kill"
    marker.write_text("once")
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
    cluster.execute(CELL, namespace={"config": config, "CKPT": str(tmp_path / name), "MARKER": str(marker),
                                     "KILL_IN": kill_in, "KEEP_MARKER": keep_marker,
                                     "MAX_RESTARTS": max_restarts, "LAYOUT": layout})
    printed = capsys.readouterr()
    return json.loads(re.findall(r"^LOSSES (.+)$", printed.out, re.M)[-1]), printed.out, printed.err


# dp2: the survivor's live state is the lost rank's, no step lost (rank 1 dies as step 6 begins: rank 0
# keeps step 5, its last whole step, trains on alone, saving at steps 6 and 8, until the replacement
# takes its state); dp2 zero3 without snapshots: the disk checkpoint (a kill in the middle of the save at
# step 4 leaves step 2's; a kill in step 2, before the save, leaves none)
@pytest.mark.parametrize("kill_in, layout, resumed", [
    ("step", "dp2", r"resumed at step [5-8] from live replicas \(ranks 1<-0\), no step lost"),
    ("save", "dp2 zero3", r"resumed from the checkpoint of step 2\b"),
    ("before any save", "dp2 zero3", "training again from step 0")])
def test_a_fit_that_loses_an_engine_ends_as_an_uninterrupted_one(cluster, tmp_path, capsys, kill_in, layout,
                                                                  resumed) -> None:
    uninterrupted, _, _ = run(cluster, tmp_path, "reference", None, capsys, layout=layout)
    generation, rank0 = cluster.generation, cluster.status()[0]["pid"]
    recovered, out, err = run(cluster, tmp_path, "killed", kill_in, capsys, layout=layout)
    assert cluster.generation == generation and cluster.status()[0]["pid"] == rank0  # rank 1 alone replaced
    assert re.search(r"rank\(s\) 1 died during the cell; replaced its engine \(the other ranks kept "
                     r"theirs\); running the cell again, .* \(restart 1 of 3\)", err), err
    assert re.search(resumed, out), out
    assert len(recovered) == len(uninterrupted) == 8
    assert recovered == pytest.approx(uninterrupted, rel=1e-6)


def test_a_cell_that_keeps_losing_engines_stops_with_its_story(cluster, tmp_path, capsys) -> None:
    with pytest.raises(RecoveryError) as stopped:
        run(cluster, tmp_path, "doomed", "step", capsys, keep_marker=True, max_restarts=1, layout="dp2 zero3")
    assert len(stopped.value.attempts) == 2
    assert "lost an engine 2 times" in str(stopped.value) and "max_restarts=1" in str(stopped.value)
    assert all(attempt.startswith("rank(s) 1 died") for attempt in stopped.value.attempts)
    cluster.restart()
    assert cluster.run(lambda: 1) == [1, 1]


def test_restart_needs_a_checkpoint_folder_and_cadence() -> None:
    from colab_par.training.trainer import Trainer

    with pytest.raises(ValueError, match="on_failure=.restart. resumes from the last checkpoint: pass every="):
        Trainer(None, [], steps=1, checkpoints=Checkpoints("somewhere", on_failure="restart"))
    with pytest.raises(ValueError, match="on_failure='retry' is not one of raise, restart"):
        Trainer(None, [], steps=1, on_failure="retry")
