"""What the cluster's rooms share: what was asked for, and the engines that run.

One `ClusterState` per `Cluster`; each room (lifecycle, world, execution, faults, persistence,
inspection) reads and updates it, and none reaches back into the façade. Queries that need
nothing beyond it (how many ranks, which are on this host, the world's addresses) live here.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from ipyparallel import Client
from ipyparallel import Cluster as IppCluster

from colab_par.cluster.direct import Channels
from colab_par.cluster.engine import address_toward
from colab_par.cluster.launchers import Launcher


@dataclass(eq=False)
class ClusterState:
    """The options a `Cluster` was made with, then the running engines' ids, hosts and devices."""

    requested_n: int | None
    requested_backend: str | None
    launcher: Launcher
    timeout: float
    interrupt_grace: float
    dashboard: bool
    seed: int | None
    persist: bool
    ipp_options: dict[str, Any]
    ipp: IppCluster | None = None
    client: Client | None = None
    direct: Channels | None = None  # calls to engines on this host, controller bypassed
    engine_ids: list[int] = field(default_factory=list)
    hosts: list[dict[str, Any]] = field(default_factory=list)
    launched_pids: set[int] = field(default_factory=set)  # what start forked (controller, helpers)
    stack_files: list[str] = field(default_factory=list)  # per rank: where SIGUSR1 makes it dump stacks
    devices: list[str] = field(default_factory=list)
    backend: str | None = None
    generation: int = 0  # bumped at every start: engine namespaces do not survive it
    created: float | None = None  # when the engines started (time.time())

    @property
    def running(self) -> bool:
        return self.client is not None

    @property
    def n(self) -> int:
        return len(self.engine_ids)

    @property
    def pids(self) -> set[int]:
        """The processes this cluster started on this host (controller, engines, launcher helpers)."""
        return self.launched_pids | {info["pid"] for info in self.hosts if self.is_local(info)}

    @staticmethod
    def is_local(info: dict[str, Any]) -> bool:
        return info["host"] == socket.gethostname()

    def require_running(self) -> None:
        if not self.running:
            raise RuntimeError("no engines are running; start them with `%colossal start` "
                               "(or colab_par.Cluster(n=2).start())")

    def world_addresses(self) -> list[str]:
        """The addresses the world talks over: loopback on one host, each host's address on several."""
        if all(self.is_local(info) for info in self.hosts):
            return ["127.0.0.1"]
        return list(dict.fromkeys(info["ip"] for info in self.hosts))

    def notebook_address(self) -> str:
        """The address engines reach a store this process serves at: loopback on one host, else
        this host's address toward rank 0's host."""
        addresses = self.world_addresses()
        return addresses[0] if addresses == ["127.0.0.1"] else address_toward(addresses[0])

    def forget_engines(self) -> None:
        """Nothing runs any more (after a stop)."""
        self.ipp, self.client, self.engine_ids, self.hosts, self.launched_pids = None, None, [], [], set()
        self.direct = None
        self.stack_files = []
        self.devices = []
