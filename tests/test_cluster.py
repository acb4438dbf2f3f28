"""The Python API of `Cluster` on real ipyparallel engines with real gloo process groups."""
from __future__ import annotations

import shutil
import time

import pytest

from colab_par import SSH, Cluster, Slurm
from colab_par.cluster import descendant_pids


def rank_and_sum(offset):
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([dist.get_rank() + offset], dtype=torch.float64)
    dist.all_reduce(tensor)
    return dist.get_rank(), dist.get_world_size(), tensor.item()


def test_run_returns_one_result_per_rank_in_rank_order(cluster2):
    assert cluster2.run(rank_and_sum, 10.0) == [(0, 2, 21.0), (1, 2, 21.0)]


def test_run_ships_closures_by_value(cluster2):
    factor = 6

    def scaled(x):
        import torch.distributed as dist

        return (dist.get_rank() + x) * factor

    assert cluster2.run(scaled, 1) == [6, 12]


def test_engines_are_bound_and_share_the_cores(cluster2):
    def binding():
        import os

        import torch

        return os.environ["LOCAL_RANK"], torch.get_num_threads()

    results = cluster2.run(binding)
    assert [local for local, _ in results] == ["0", "1"]
    assert all(threads >= 1 for _, threads in results)
    assert cluster2.devices == ["cpu", "cpu"]


def test_start_twice_is_a_no_op_that_says_so(cluster2, capsys):
    generation = cluster2.generation
    cluster2.start()
    assert "already running" in capsys.readouterr().out
    assert cluster2.generation == generation
    assert cluster2.run(rank_and_sum, 0.0)[0][2] == 1.0  # same world, no re-init hang


def test_status_reports_every_rank(cluster2):
    rows = cluster2.status()
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        assert row["alive"] and row["device"] == "cpu" and row["memory_bytes"] > 0
        assert row["pid"] > 0 and row["host"]


def test_bad_arguments_fail_before_any_work():
    with pytest.raises(ValueError, match="launcher='pbsx' is unknown"):
        Cluster(launcher="pbsx")
    with pytest.raises(ValueError, match="positive number of engines"):
        Cluster(n=0)
    with pytest.raises(ValueError, match=r"launcher='ssh' needs the hosts.*SSH\(\{'node1': 2"):
        Cluster(launcher="ssh")
    with pytest.raises(ValueError, match="must map each host to a positive number of engines"):
        SSH({"node1": 0})
    with pytest.raises(ValueError, match="n=3 engines but the SSH hosts ask for 4"):
        Cluster(n=3, launcher=SSH({"node1": 2, "node2": 2})).start()
    with pytest.raises(ValueError, match="gpus_per_node=0 must be a positive integer"):
        Slurm(gpus_per_node=0)
    with pytest.raises(ValueError, match="use backend='gloo'"):
        Cluster(n=2, backend="nccl").start()  # no GPU on this machine
    with pytest.raises(RuntimeError, match="%colossal start"):
        Cluster(n=2).run(rank_and_sum, 0.0)


def test_context_manager_stop_leaves_no_process_behind():
    before = descendant_pids()
    with Cluster(n=2, dashboard=False) as cluster:
        started = descendant_pids() - before
        assert len(started) >= 3  # controller + 2 engines (+ nannies)
        assert cluster.run(rank_and_sum, 0.0)[1][2] == 1.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and started & descendant_pids():
        time.sleep(0.1)
    assert not started & descendant_pids()


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="OpenMPI not installed")
def test_mpi_launcher_starts_a_working_world():
    with Cluster(n=2, launcher="mpi", dashboard=False) as cluster:
        assert cluster.run(rank_and_sum, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]
