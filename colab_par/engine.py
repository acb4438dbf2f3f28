"""Code that runs inside each ipyparallel engine: device binding, rendezvous, health.

These functions are sent by reference (the engines import colab_par), so they stay small and
free of client state. Each is called through ipyparallel by `colab_par.cluster.Cluster`.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

__all__ = ["host_info", "bind_device", "free_port", "init_process_group", "rank_status",
           "update_namespace"]


def host_info() -> dict[str, Any]:
    """Where this engine lives, so the client can derive local ranks and the rendezvous address."""
    host = socket.gethostname()
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        ip = "127.0.0.1"
    return {"host": host, "ip": ip, "pid": os.getpid()}


def bind_device(local_rank: int, local_world: int, backend: str) -> str:
    """Bind this engine to its device before anything touches CUDA, and share the CPU fairly.

    Called first on a fresh engine: on CUDA, `set_device` precedes any allocation, so each engine
    owns exactly one GPU; on CPU each engine gets an equal share of the cores instead of every
    engine spawning a thread per core and thrashing.
    """
    import torch

    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"local rank {local_rank} has no GPU: this host shows {count}; "
                               f"start at most {count} engines per host")
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def free_port() -> int:
    """A TCP port that is free on this host right now (rank 0 hosts the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def init_process_group(backend: str, addr: str, port: int, rank: int, world: int,
                       timeout_s: float, gloo_ifname: str | None) -> dict[str, Any]:
    """Join the torch.distributed world; idempotent so a re-run cell never re-initialises into a hang."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_rank() == rank and dist.get_world_size() == world:
            return {"rank": rank, "already": True}
        dist.destroy_process_group()
    if gloo_ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": addr,
                       "MASTER_PORT": str(port)})
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    return {"rank": rank, "already": False}


def rank_status() -> dict[str, Any]:
    """Health of this engine: identity, device and the memory it holds right now."""
    import resource

    import torch
    import torch.distributed as dist

    info = host_info()
    info["rank"] = dist.get_rank() if dist.is_initialized() else None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        info["device"] = f"cuda:{device}"
        info["memory_bytes"] = torch.cuda.memory_allocated(device)
    else:
        info["device"] = "cpu"
        info["memory_bytes"] = _rss_bytes() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return info


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def update_namespace(blob: bytes) -> None:
    """Unpickle shipped notebook names into the engine's interactive namespace, in one piece.

    One cloudpickle payload keeps the objects' identities consistent (a class and the ``__class__``
    cell its methods' ``super()`` uses are the same object), which per-name pushes do not.
    """
    import cloudpickle
    from IPython import get_ipython

    get_ipython().user_ns.update(cloudpickle.loads(blob))
