"""Losing engines of `dp4` loses no step (training/resilience): on a real 4-engine cluster a rank
SIGKILLed mid-step is replaced and takes a live peer's state, and the run's losses equal an
uninterrupted run's; 20 kills at random moments (random ranks, in the forward or before the
optimizer step) leave the final loss of the uninterrupted run, and no process or staging file behind.
The model draws dropout masks, one stream per dp rank: a replaced rank must go on with its own
stream where the lost engine left it (its peers gathered it at the step's end), or its masks, and
so the losses, differ from the uninterrupted run's."""
from __future__ import annotations

import os
import random

import pytest

from colab_par import Cluster
from colab_par.models import GPTConfig
from resilience_cell import run_cell

STEPS = 24
MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch", dropout=0.1)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(n=4, backend="gloo", timeout=120.0, dashboard=False) as started:
        yield started


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> list[float]:
    cluster.restart()
    return run_cell(cluster, tmp_path_factory.mktemp("reference"), "dp4", [], layout="dp4", steps=STEPS, every=8,
                    batch=8, model=MODEL)[0]


def test_a_rank_killed_mid_step_takes_a_live_peers_state_and_no_step_is_lost(cluster, tmp_path, capsys,
                                                                              uninterrupted) -> None:
    cluster.restart()
    losses, _ = run_cell(cluster, tmp_path, "killed", [[2, "forward", 5]], layout="dp4", steps=STEPS, every=8,
                         batch=8, model=MODEL)
    assert "resumed at step 4 from live replicas (ranks 2<-0), no step lost" in capsys.readouterr().out
    assert losses == pytest.approx(uninterrupted, rel=1e-6)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie is gone but for its entry
    except FileNotFoundError:
        return False


def test_twenty_kills_at_random_moments_end_as_the_uninterrupted_run(cluster, tmp_path, uninterrupted) -> None:
    draw = random.Random(20261129)
    moments = sorted(draw.sample(range(2, 2 * STEPS + 2), 20))  # (step, forward or before the optimizer)
    kills = [[draw.randrange(4), ("forward", "optimizer")[moment % 2], moment // 2] for moment in moments]
    cluster.restart()
    losses, pids = run_cell(cluster, tmp_path, "killed", kills, layout="dp4", steps=STEPS, every=8, batch=8,
                            max_restarts=len(kills), model=MODEL)
    assert len(losses) == STEPS and losses[-1] == pytest.approx(uninterrupted[-1], rel=1e-6)
    live = {row["pid"] for row in cluster.status()}
    assert len(pids - live) == len(kills)  # every killed engine ran the cell ...
    assert not [pid for pid in pids - live if _alive(pid)]  # ... and is gone
    root = tmp_path / "killed"
    assert not list(root.glob(".tmp-*")) and len(list(root.glob("step-*"))) <= 2, os.listdir(root)
