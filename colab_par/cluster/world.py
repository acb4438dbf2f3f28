"""The torch.distributed world on running engines: ranks by host, device binding, seeding, rendezvous.

Engines that registered become ranks (ordered by host), report their host, get their device and
seed, then (re-)join one process group through a fresh store on rank 0's host
(`colab_par.cluster.engine_setup`). Used at every start, after a replaced engine and to repair a broken group.
"""
from __future__ import annotations

import socket
import sys
from typing import Any, Iterable

from colab_par.cluster import direct, engine, engine_setup
from colab_par.cluster.backend import choose_backend, device_indices, local_ranks
from colab_par.cluster.state import ClusterState
from colab_par.cluster.output import values


class World:
    """Forms (and re-forms) the process group of one cluster's engines (`state`)."""

    def __init__(self, state: ClusterState):
        self.state = state

    def bootstrap(self) -> None:
        """Choose the backend from the engines' own hosts, bind devices (before CUDA starts on the
        engines), then rendezvous on rank 0's host: three round trips (`colab_par.cluster.engine_setup`)."""
        state = self.state
        prepared = self.prepare(state.engine_ids)
        state.engine_ids, state.hosts = _ranked_by_host(state.engine_ids,
                                                        [prepared[eid]["host"] for eid in state.engine_ids])
        state.backend, note = choose_backend(state.requested_backend, state.hosts)
        if note:
            print(f"colab_par: {note}", file=sys.stderr)
        state.stack_files = [prepared[eid]["stack_file"] for eid in state.engine_ids]
        state.devices = [""] * state.n
        port = self.bind(range(state.n), rendezvous=True)
        self.join_world(port, identify=range(state.n))

    def prepare(self, engine_ids: list[int]) -> dict[int, dict[str, Any]]:
        """`engine_setup.prepare` on fresh engines, whose direct channels are then connected; what
        each engine reported, by engine id. The client serializes with cloudpickle from now on, as
        the engines do (what `DirectView.use_cloudpickle` does, in the same round trip)."""
        from ipyparallel.serialize import use_cloudpickle

        reports = self.state.client[engine_ids].apply_async(
            engine_setup.prepare, self._controller_address(), socket.gethostname()).get(timeout=self.state.timeout)
        use_cloudpickle()
        prepared = dict(zip(engine_ids, reports))
        self.state.direct.connect({eid: report["direct_url"] for eid, report in prepared.items()})
        return prepared

    def bind(self, ranks: Iterable[int], rendezvous: bool = False) -> int | None:
        """Bind each of `ranks` to its device and seed it (`engine_setup.bind`), concurrently; with
        `rendezvous`, rank 0 also opens the world's rendezvous socket, whose port is returned."""
        state = self.state
        hosts = [info["host"] for info in state.hosts]
        local_rank, index = local_ranks(state.hosts), device_indices(state.hosts)
        address = state.world_addresses()[0] if rendezvous else None
        calls = {r: state.direct.apply([state.engine_ids[r]], engine_setup.bind,
                                       (local_rank[r], hosts.count(hosts[r]), state.backend, state.seed,
                                        address if r == 0 else None, index[r]), {})
                 for r in ranks}
        port = None
        for rank, result in calls.items():
            state.devices[rank], opened = self._get(result, rank)
            port = opened if rank == 0 else port
        return port

    def open_direct(self, ranks: list[int]) -> None:
        """Direct channels to the engines of `ranks` on this host (`colab_par.cluster.direct`): those a
        persisted cluster's engines opened when they started."""
        state = self.state
        local = [r for r in ranks if state.is_local(state.hosts[r])]
        if local:
            ids = [state.engine_ids[r] for r in local]
            urls = state.client[ids].apply_async(direct.serve, "127.0.0.1").get(timeout=state.timeout)
            state.direct.connect(dict(zip(ids, urls)))

    def seed(self, ranks: Iterable[int]) -> None:
        if self.state.seed is not None:
            view = self.state.client[[self.state.engine_ids[r] for r in ranks]]
            view.apply_async(engine.seed_generators, self.state.seed).get(timeout=self.state.timeout)

    def join_world(self, port: int | None = None, identify: Iterable[int] = ()) -> None:
        """(Re-)initialise the process group on every rank through a fresh store that listens only
        on the address the world uses (`ClusterState.world_addresses`): rank 0's, at `port` when
        `bind` opened it, else opened here. The ranks in `identify` (fresh engines) also get their
        `rank`, `world_size`, `local_rank` and `device` names."""
        state = self.state
        addr = state.world_addresses()[0]
        single_host = addr == "127.0.0.1"
        if port is None:
            port = self._get(state.direct.apply([state.engine_ids[0]], engine.open_rendezvous, (addr,), {}), 0)
        identify, local_rank = set(identify), local_ranks(state.hosts)
        joins = [state.direct.apply([eid], engine_setup.join, (
            state.backend, addr, port, rank, state.n, state.timeout,
            addr if single_host else state.hosts[rank]["ip"],
            {"rank": rank, "world_size": state.n, "local_rank": local_rank[rank],
             "device": state.devices[rank]} if rank in identify else None), {})
            for rank, eid in enumerate(state.engine_ids)]
        for rank, result in enumerate(joins):
            self._get(result, rank)

    def _controller_address(self) -> str:
        """The address engines reach the controller at (this host's primary one if it listens on all)."""
        ip = self.state.ipp.controller_ip
        return engine.address_toward("192.0.2.1") if ip in ("", "*", "0.0.0.0", "::") else ip

    def _get(self, result: Any, rank: int) -> Any:
        if not result.wait(self.state.timeout):
            raise TimeoutError(f"rank {rank} did not answer within {self.state.timeout:.0f}s while joining "
                               "the process group")
        return values(result, self.state.engine_ids)[0]


def _ranked_by_host(ids: list[int], hosts: list[dict[str, Any]]) -> tuple[list[int], list[dict[str, Any]]]:
    """Ranks in host order (hosts in the order their first engine registered), engines of a host
    contiguous and in registration order: a host's local ranks are then consecutive world ranks,
    which keeps tensor-parallel groups (the innermost mesh dim) on one host."""
    first = {}
    for eid, info in zip(ids, hosts):
        first.setdefault(info["host"], eid)
    order = sorted(range(len(ids)), key=lambda i: (first[hosts[i]["host"]], ids[i]))
    return [ids[i] for i in order], [hosts[i] for i in order]


def served_store(host: str, timeout: float) -> Any:
    """A torch TCPStore served from this process, listening on `host` only (never on all interfaces):
    for groups other than the world (generator engines' bridge, survivors training on)."""
    from datetime import timedelta

    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                         master_listen_fd=listener.detach())
