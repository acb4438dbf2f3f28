"""A fresh engine's set-up, in the fewest round trips the order allows (run inside each engine).

Every round trip at start-up waits on engines that are still warming up and, through the
controller, costs 5-15 ms on a loaded host; a start used to take a dozen (serialization, stack
dumps, control thread, post-mortem, direct channel, host, device, seed, rendezvous, process
group, identity per rank). What needs no rank is one call, `prepare`; `bind` (device, seed and
rank 0's rendezvous socket) needs the ranks the client derives from every engine's host, and
`join` (process group and the rank's names) needs rank 0's port: three round trips in all.
"""
from __future__ import annotations

from typing import Any

from colab_par.cluster import direct, engine, postmortem, probe

__all__ = ["prepare", "bind", "join"]


def prepare(toward: str, client_host: str) -> dict[str, Any]:
    """Serialization by cloudpickle (as the client's), stack dumps, the control thread, post-mortem
    frames, and a direct channel when this engine is on the client's host; returns the engine's
    host (`engine.host_info`, toward the controller's address), its stack-dump file and the direct
    channel's URL (None: the client keeps ipyparallel's route)."""
    from ipyparallel.serialize import use_cloudpickle

    use_cloudpickle()
    host = engine.host_info(toward)
    stack_file = engine.enable_stack_dumps()
    probe.install()
    postmortem.install()
    url = direct.serve("127.0.0.1") if host["host"] == client_host else None
    return {"host": host, "stack_file": stack_file, "direct_url": url}


def bind(local_rank: int, local_world: int, backend: str, seed: int | None,
         rendezvous_on: str | None = None, device_index: int | None = None) -> tuple[str, int | None]:
    """Bind the device (before anything touches CUDA, `engine.bind_device`; `device_index` of the
    GPUs the engine sees, `backend.device_indices`), seed the generators unless `seed` is None,
    and on rank 0 (`rendezvous_on` its address) open the world's rendezvous socket; returns
    (device, that socket's port or None)."""
    device = engine.bind_device(local_rank, local_world, backend, device_index)
    if seed is not None:
        engine.seed_generators(seed)
    return device, engine.open_rendezvous(rendezvous_on) if rendezvous_on else None


def join(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float,
         own_address: str, identity: dict[str, Any] | None = None) -> None:
    """Join the world (`engine.init_process_group`), then give the namespace this rank's
    `identity` (rank, world_size, local_rank, device) when one is given."""
    engine.init_process_group(backend, addr, port, rank, world, timeout_s, own_address)
    if identity:
        from IPython import get_ipython

        get_ipython().user_ns.update(identity)
