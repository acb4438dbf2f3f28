"""The Python API of `Cluster` on real ipyparallel engines with real gloo process groups."""
from __future__ import annotations

import shutil
import socket
import time

import pytest

from colab_par import SSH, Cluster, Slurm
from colab_par.cluster import warm_pool
from colab_par.cluster.backend import choose_backend, device_problems
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
    with pytest.raises(RuntimeError, match="%colossal start"):
        Cluster(n=2).run(rank_and_sum, 0.0)


def engine_environment():
    import os

    return os.environ.get("NCCL_SOCKET_IFNAME"), os.environ.get("GLOO_SOCKET_IFNAME")


def wait_until_gone(pids):
    """The cluster's processes are gone; the warm pool's (started with it, or renewed when the
    environment changed) outlive every cluster by design (tests/test_warm_pool.py)."""
    pids = pids - warm_pool.pool_pids()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pids & descendant_pids():
        time.sleep(0.1)
    return not pids & descendant_pids()


def first_draws_and_identity():
    import random

    import torch
    from IPython import get_ipython

    names = get_ipython().user_ns
    return random.random(), torch.rand(2).tolist(), {key: names[key] for key in
                                                     ("rank", "world_size", "local_rank", "device")}


def test_context_manager_stop_leaves_no_process_behind_and_a_users_interface_is_kept(monkeypatch):
    """Also: a start seeds every rank's generators from `seed` and gives each its names."""
    import random

    import torch

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=ib0")  # the user's choice: the engines inherit it
    random.seed(7)
    torch.manual_seed(7)
    reference = (random.random(), torch.rand(2).tolist())  # one process seeded the same way
    before = descendant_pids()
    with Cluster(n=2, dashboard=False, seed=7) as cluster:
        assert cluster.run(first_draws_and_identity) == [
            (*reference, {"rank": rank, "world_size": 2, "local_rank": rank, "device": "cpu"})
            for rank in (0, 1)]
        started = descendant_pids() - before
        assert len(started) >= 3  # controller + 2 engines (+ nannies)
        assert cluster.run(rank_and_sum, 0.0)[1][2] == 1.0
        # backend=None: chosen from what the engines reported about their host (no GPU here)
        assert cluster.backend == "gloo" and [row["gpus"] for row in cluster.status()] == [0, 0]
        assert cluster.run(engine_environment) == [("=ib0", "lo")] * 2
    assert wait_until_gone(started)


def test_engines_pin_both_backends_sockets_to_the_worlds_interface(cluster2):
    # one host: the world talks over loopback; "=" makes NCCL match the name exactly, not as a prefix
    assert cluster2.run(engine_environment) == [("=lo", "lo")] * 2


def test_every_engine_computes_where_its_backend_says(cluster2):
    assert cluster2.devices == ["cpu", "cpu"]
    assert cluster2.check_devices() == []


def test_nccl_without_a_gpu_per_engine_is_refused_naming_the_engines_hosts():
    before = descendant_pids()
    with pytest.raises(ValueError, match=rf"backend='nccl' needs one CUDA GPU per engine, as the engines "
                                         rf"report: {socket.gethostname()} has 0 GPUs for 2 engines\. "
                                         r"Use backend='gloo'"):
        Cluster(n=2, backend="nccl", dashboard=False).start()
    assert wait_until_gone(descendant_pids() - before)  # the engines that reported were stopped


# ---- the decisions on their own, for hosts this machine cannot be --------------------------------
def reports(*hosts_gpus_engines):
    return [{"host": host, "gpus": gpus} for host, gpus, engines in hosts_gpus_engines
            for _ in range(engines)]


def test_the_backend_follows_the_engines_hosts_not_the_notebooks():
    # a login node without GPUs starting engines on two 4-GPU nodes gets nccl
    assert choose_backend(None, reports(("node1", 4, 4), ("node2", 4, 4))) == ("nccl", None)
    assert choose_backend("nccl", reports(("node1", 4, 4), ("node2", 4, 2))) == ("nccl", None)
    assert choose_backend("gloo", reports(("node1", 4, 4))) == ("gloo", None)
    # one engine without a GPU of its own: gloo, saying why; nccl asked for is refused by host
    backend, note = choose_backend(None, reports(("node1", 4, 4), ("node2", 2, 4)))
    assert backend == "gloo" and "node2 has 2 GPUs for 4 engines" in note
    assert choose_backend(None, reports(("login", 0, 2))) == ("gloo", None)
    with pytest.raises(ValueError, match=r"node2 has 1 GPU for 2 engines; node3 has 0 GPUs for 1 engine\."):
        choose_backend("nccl", reports(("node1", 2, 2), ("node2", 1, 2), ("node3", 0, 1)))


def test_engine_counts_come_from_the_launcher_where_this_host_cannot_tell():
    assert Cluster(launcher=Slurm(gpus_per_node=4, nodes=2))._lifecycle.resolve_n() == 8  # one engine per GPU
    assert Cluster(launcher=SSH({"node1": 3, "node2": 1}))._lifecycle.resolve_n() == 4
    assert Cluster()._lifecycle.resolve_n() == 2  # this host has no GPU


def gpu_engine(backend, current, default, cuda=True, ifname="=eth0"):
    return {"backend": backend, "cuda_initialized": cuda, "current_device": current,
            "default_device": default, "nccl_socket_ifname": ifname}


def test_device_problems_name_what_a_gpu_host_would_get_wrong():
    hosts = reports(("gpu1", 2, 2))
    assert device_problems("nccl", hosts, ["cuda:0", "cuda:1"],
                           [gpu_engine("nccl", 0, "cuda:0"), gpu_engine("nccl", 1, "cuda:1")]) == []
    # gloo engines of a GPU host that all computed on cuda:0 (what default_device once did)
    found = device_problems("gloo", hosts, ["cpu", "cpu"],
                            [gpu_engine("gloo", 0, "cuda:0"), gpu_engine("gloo", 0, "cuda:0")])
    assert found == [f"rank {r} on gpu1 {problem}" for r in (0, 1) for problem in (
        "computes on cpu (default_device() cuda:0), not cpu",
        "started CUDA although a gloo world computes on the CPU")]
    found = device_problems("nccl", hosts, ["cuda:0", "cuda:1"],
                            [gpu_engine("nccl", 0, "cuda:0", ifname=None), gpu_engine("nccl", 0, "cuda:1")])
    assert found == ["rank 0 on gpu1 has no NCCL_SOCKET_IFNAME: NCCL picks its own interface",
                     "rank 1 on gpu1: its current CUDA device is 0, not cuda:1"]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="OpenMPI not installed")
def test_mpi_launcher_starts_a_working_world():
    with Cluster(n=2, launcher="mpi", dashboard=False) as cluster:
        assert cluster.run(rank_and_sum, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]
