"""Which backend the world uses and which device each engine computes on, decided from what the
engines report about their hosts (never from the notebook's host, which may be a login node).

nccl needs one CUDA GPU per engine; gloo computes on the CPU, also on a GPU host: the two backends
never mix devices (`bind_device`, `parallel.mesh.default_device`, telemetry and `rank_status` all
follow this), so a gloo world on a GPU box does not pile every engine onto cuda:0.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

__all__ = ["BACKENDS", "choose_backend", "device_for", "expected_devices", "local_ranks", "device_indices",
           "device_problems"]

BACKENDS = ("nccl", "gloo")


def local_ranks(hosts: Sequence[dict[str, Any]]) -> list[int]:
    """Each rank's order among the engines of its host (ranks in host order, as the cluster ranks them)."""
    names = [info["host"] for info in hosts]
    return [names[:rank].count(name) for rank, name in enumerate(names)]


def choose_backend(requested: str | None, hosts: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """(backend, note) for engines whose reports (`engine.host_info`: host, gpus) are `hosts`.

    ``requested=None`` picks nccl only when every engine has a GPU of its own to bind, else gloo (the
    note says why when some GPUs were there); an explicit "nccl" that some host cannot serve is
    refused, naming the hosts, before any process group forms.
    """
    engines = Counter(info["host"] for info in hosts)
    gpus: dict[str, set[str]] = {}
    for info in hosts:
        gpus.setdefault(info["host"], set()).update(_gpu_ids(info))
    indices = device_indices(hosts)
    short = {info["host"]: (len(gpus[info["host"]]), engines[info["host"]])
             for info, index in zip(hosts, indices) if index >= len(_gpu_ids(info))}
    if requested == "gloo" or not short:
        return requested or "nccl", None
    shortage = "; ".join(f"{host} has {have} GPU{'s' * (have != 1)} for {count} "
                         f"engine{'s' * (count != 1)}" for host, (have, count) in short.items())
    if requested == "nccl":
        raise ValueError(f"backend='nccl' needs one CUDA GPU per engine, as the engines report: "
                         f"{shortage}. Use backend='gloo' (CPU), fewer engines per host, or engines "
                         "on GPU hosts (e.g. Slurm(gpus_per_node=...))")
    if any(have for have, _ in short.values()):
        return "gloo", (f"using gloo on the CPU: {shortage}; start at most one engine per GPU for "
                        "nccl")
    return "gloo", None


def device_indices(hosts: Sequence[dict[str, Any]]) -> list[int]:
    """Which of the GPUs it sees each rank binds under nccl: its order among the engines of its host
    that see the same GPUs (`engine.visible_gpu_ids`). Engines sharing a host's GPUs take them by
    local order; an engine its launcher gave a GPU of its own (srun --gpus-per-task, a
    CUDA_VISIBLE_DEVICES per engine) sees only that one and binds its cuda:0."""
    keys = [(info["host"], tuple(_gpu_ids(info))) for info in hosts]
    return [keys[:rank].count(key) for rank, key in enumerate(keys)]


def _gpu_ids(info: dict[str, Any]) -> list[str]:
    """The GPUs an engine reported; by count alone (all its host's engines share them) for a
    report without names."""
    return info.get("gpu_ids") or [f"{info['host']}:{i}" for i in range(info["gpus"])]


def device_for(backend: str, index: int) -> str:
    """The device a rank computes on: the GPU `index` of those it sees under nccl
    (`device_indices`), the CPU under gloo."""
    return f"cuda:{index}" if backend == "nccl" else "cpu"


def expected_devices(backend: str, hosts: Sequence[dict[str, Any]]) -> list[str]:
    """`device_for` of every rank of engines reporting `hosts` (rank order)."""
    return [device_for(backend, index) for index in device_indices(hosts)]


def device_problems(backend: str, hosts: Sequence[dict[str, Any]], devices: Sequence[str],
                    reports: Sequence[dict[str, Any]]) -> list[str]:
    """What is wrong with where the engines of a `backend` world compute, from what each bound
    (`devices`) and reports (`engine.device_report`); empty when all is as this module says. The
    GPU check of a real GPU host runs it (`Cluster.check_devices`); the CPU tests run it too."""
    problems = []
    for rank, (want, bound, report) in enumerate(zip(expected_devices(backend, hosts), devices, reports)):
        on = f"rank {rank} on {hosts[rank]['host']}"
        if report["backend"] != backend:
            problems.append(f"{on} is in a {report['backend']} world, not {backend}")
        if bound != want or report["default_device"] != want:
            problems.append(f"{on} computes on {bound} (default_device() {report['default_device']}), "
                            f"not {want}")
        if want.startswith("cuda") and report["current_device"] != int(want.split(":")[1]):
            problems.append(f"{on}: its current CUDA device is {report['current_device']}, not {want}")
        if want == "cpu" and report["cuda_initialized"]:
            problems.append(f"{on} started CUDA although a {backend} world computes on the CPU")
        if backend == "nccl" and not report["nccl_socket_ifname"]:
            problems.append(f"{on} has no NCCL_SOCKET_IFNAME: NCCL picks its own interface")
    return problems
