"""Engines on two hosts (network and UTS namespaces this test makes, each with its own hostname,
address and sshd; see two_hosts.py) started through ipyparallel's SSH launcher: ranks grouped by
host, local ranks per host, devices bound, the rendezvous on rank 0's address (not loopback), a
training step under dp2 and tp2 across the hosts equal to one-process training, and a dead remote
engine reported within 15 s and replaced alone, on its host, also while the other replica trains on. A machine that cannot make the hosts fails these tests, never skips."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from parity import assert_parity, engine_run, reference_run
from resilience_cell import degraded_steps, run_cell
from two_hosts import CONTROLLER, HOSTS, CannotMakeHosts, TwoHosts

from colab_par import SSH, Cluster
from colab_par.cluster.engine import stack_file
from colab_par.cluster.output import CollectiveDeadlockError, DeadEngineError
from colab_par.models import GPTConfig

A, B = HOSTS.values()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    try:
        made = TwoHosts(tmp_path_factory.mktemp("hosts")).make()
    except CannotMakeHosts as error:
        pytest.fail(f"the multi-host tests need two hosts and cannot make them here: {error}")
    yield made
    made.remove()


def where_am_i() -> dict:
    import socket

    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    return {"host": socket.gethostname(), "rank": dist.get_rank(), "local_rank": os.environ["LOCAL_RANK"],
            "local_world": os.environ["LOCAL_WORLD_SIZE"], "master": os.environ["MASTER_ADDR"],
            "store_host": getattr(store, "underlying_store", store).host,
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
            "nccl_interface": os.environ.get("NCCL_SOCKET_IFNAME"), "threads": torch.get_num_threads()}


def all_reduced() -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


@pytest.fixture(scope="module")
def one_engine_per_host(hosts):
    with Cluster(launcher=SSH({A: 1, B: 1}, ssh_args=hosts.ssh_args), dashboard=False, timeout=60) as cluster:
        yield cluster


def test_nccl_is_refused_naming_hosts_without_gpus(hosts) -> None:
    # the backend comes from the engines' hosts: neither has a GPU, so nccl is refused naming them
    with pytest.raises(ValueError, match="colabpar-a has 0 GPUs for 1 engine; colabpar-b has 0 GPUs for 1 engine"):
        Cluster(launcher=SSH({A: 1, B: 1}, ssh_args=hosts.ssh_args), backend="nccl", dashboard=False,
                timeout=60).start()


def test_one_engine_per_host_trains_dp2_and_tp2_like_one_process(one_engine_per_host) -> None:
    cluster = one_engine_per_host
    assert [row["host"] for row in cluster.run(where_am_i)] == list(HOSTS)
    for layout in ("dp2", "tp2"):
        assert_parity(cluster.run(engine_run, layout, "gpt", 2), reference_run("gpt", 2))


def test_two_engines_per_host_rank_bind_and_meet_at_rank_0s_address(hosts) -> None:
    with Cluster(launcher=SSH({A: 2, B: 2}, ssh_args=hosts.ssh_args), dashboard=False, timeout=60) as cluster:
        placed = cluster.run(where_am_i)
        assert [row["rank"] for row in placed] == [0, 1, 2, 3]
        assert [row["host"] for row in placed] == [name for name in HOSTS for _ in range(2)]
        assert [row["local_rank"] for row in placed] == ["0", "1", "0", "1"]
        assert {row["local_world"] for row in placed} == {"2"}
        assert cluster.devices == ["cpu"] * 4
        assert all(os.path.exists(stack_file(row["pid"])) for row in cluster.status())
        assert {row["threads"] for row in placed} == {max(1, os.cpu_count() // 2)}  # cores shared per host
        # The world meets at rank 0's address on the hosts' network, never at loopback, and gloo
        # talks over each host's own interface on that network.
        assert {row["master"] for row in placed} == {A}
        assert {row["store_host"] for row in placed} == {A}
        assert {row["gloo_interface"] for row in placed} == {"eth0"}
        assert {row["nccl_interface"] for row in placed} == {"=eth0"}
        assert cluster._ipp.controller_ip == CONTROLLER
        assert_parity(cluster.run(engine_run, "dp2 tp2", "gpt", 2), reference_run("gpt", 2))

        # A rank on the second host alone in a collective: found from its engine's answers (no
        # stack file of another host to read), the world re-formed.
        started = time.monotonic()
        with pytest.raises(CollectiveDeadlockError) as info:
            cluster.execute("import torch, torch.distributed as dist\nif rank == 2:\n"
                            "    dist.all_reduce(torch.ones(1))\n")
        assert time.monotonic() - started < 10.0
        assert info.value.stuck.keys() == {2}
        assert info.value.waiting[2].endswith("at cell line 3: dist.all_reduce(torch.ones(1))")
        assert cluster.run(all_reduced) == [4.0] * 4

        # A remote engine dies while the others wait for it in a collective.
        victim = cluster.status()[3]
        assert victim["host"] == "colabpar-b"
        threading.Timer(1.0, os.kill, (victim["pid"], signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(DeadEngineError, match=r"rank\(s\) 3 died.*on colabpar-b"):
            cluster.execute("import time, torch.distributed as dist\nif rank == 3:\n    time.sleep(60)\n"
                            "dist.barrier()")
        assert time.monotonic() - started < 15.0
        survivors = [row["pid"] for row in cluster.status()[:3]]

        # Its engine alone is replaced, over SSH on its own host: the others keep theirs.
        generation = cluster.generation
        said = cluster.replace_dead()
        assert "replaced the dead engine of rank 3 on colabpar-b (cpu)" in said, said
        assert cluster.generation == generation and [row["pid"] for row in cluster.status()[:3]] == survivors
        placed = cluster.run(where_am_i)
        assert [(row["host"], row["local_rank"]) for row in placed] == [
            ("colabpar-a", "0"), ("colabpar-a", "1"), ("colabpar-b", "0"), ("colabpar-b", "1")]
        assert cluster.run(all_reduced) == [4.0] * 4
    # The engines that ended cleanly removed their stack files themselves: the client does so only
    # on its own host, and these hosts' temp folders are, in this test, one folder.
    assert not [pid for pid in survivors if os.path.exists(stack_file(pid))]


def relayout_across_hosts(shared: str) -> dict:
    """dp2 -> tp2 on ranks that run on two hosts: refused without a shared folder (each host has its
    own temp dir), then done through `shared`."""
    import torch

    from colab_par import parallelize
    from colab_par.training.checkpoint import CheckpointError, relayout
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16,
                                   kernels="torch")), "dp2")
    before = pm.full_state_dict()
    try:
        relayout(pm, "tp2")
        refused = None
    except CheckpointError as error:
        refused = str(error)
    moved = relayout(pm, "tp2", scratch_dir=shared)
    after = moved.full_state_dict()
    return {"refused": refused, "layout": str(moved.layout), "left": sorted(os.listdir(shared)),
            "same": sorted(after) == sorted(before) and all(torch.equal(before[k], after[k]) for k in before)}


def test_relayout_across_hosts_needs_a_shared_folder(one_engine_per_host, tmp_path) -> None:
    results = one_engine_per_host.run(relayout_across_hosts, str(tmp_path))
    assert results[0] == results[1]
    refused = results[0]["refused"]
    assert refused is not None
    assert "the ranks run on 2 hosts (colabpar-a: rank(s) 0; colabpar-b: rank(s) 1)" in refused
    assert "pass scratch_dir=" in refused and "--scratch-dir PATH" in refused
    assert results[0]["layout"] == "tp2" and results[0]["same"] and results[0]["left"] == []


def test_a_replica_on_the_other_host_trains_on_while_the_lost_one_is_replaced_over_ssh(one_engine_per_host,
                                                                                       tmp_path, capsys) -> None:
    """dp2 over the two hosts, rank 1 (colabpar-b) SIGKILLed in step 5's forward: rank 0 trains on
    at dp 1 of 2 (the survivors' store served on the notebook's address toward the hosts, not
    loopback) while a fresh engine starts over SSH on colabpar-b, which then takes rank 0's state;
    the losses equal an uninterrupted run's."""
    cluster = one_engine_per_host
    model = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch", dropout=0.1)
    reference, _ = run_cell(cluster, tmp_path, "uninterrupted", [], layout="dp2", model=model, seed=0)
    losses, _ = run_cell(cluster, tmp_path, "killed", [[1, "forward", 5]], layout="dp2", model=model, seed=0)
    said = capsys.readouterr()
    assert "rank(s) 1 died; ranks 0 trained on at dp 1 of 2 (steps 5.." in said.err, said.err
    assert "replaced the dead engine of rank 1 on colabpar-b (cpu)" in said.err, said.err
    assert "from live replicas (ranks 1<-0), no step lost" in said.out, said.out
    assert degraded_steps(tmp_path, "killed") and losses == pytest.approx(reference, rel=1e-6)
