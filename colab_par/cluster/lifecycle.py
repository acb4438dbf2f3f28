"""Starting and stopping engines: launch config, the wait for registration, shutdown and reaping.

`Lifecycle.start` launches controller and engines (forked from the warm pool on this host), waits
for them, then has `World` form the process group; `stop` leaves no process behind. Clusters that
are not persisted are stopped when the kernel exits.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from typing import Any, Iterable

import ipyparallel as ipp
from traitlets.config import Config

from colab_par.cluster import direct, engine, persist, warm_pool
from colab_par.cluster.health import live_ranks
from colab_par.cluster.persistence import record_path, save_record
from colab_par.cluster.processes import descendant_pids, pid_alive, reap
from colab_par.cluster.state import ClusterState
from colab_par.cluster.world import World
from colab_par.cluster.launchers import SSH, Slurm

_HEARTBEAT_MS, _DEAD_AFTER_BEATS = 100, 50


class Lifecycle:
    """Starts, stops and restarts one cluster's engines (`state`); `world` forms their process group."""

    def __init__(self, state: ClusterState, world: World):
        self.state, self.world = state, world

    def start(self) -> None:
        """Start engines, bind devices and initialise the process group; a no-op when running."""
        state = self.state
        if state.running:
            print(f"colab_par: {state.n} engines already running ({state.backend}); nothing to do. "
                  "Use restart() for fresh engines.")
            return
        n = self.resolve_n()
        state.launcher.check()
        # on this host, controller and engines fork from the warm pool (started before `before`:
        # it outlives this cluster); persisted engines must outlive the pool, which ends with this
        # kernel, so they start cold
        pool = warm_pool.shared_pool() if state.launcher.name == "local" and not state.persist else None
        before = descendant_pids()
        state.ipp = ipp.Cluster(**self._ipp_options(n, pool))
        try:
            state.ipp.start_cluster_sync(n=n)
            state.client = state.ipp.connect_client_sync()
            state.direct = direct.Channels(state.client)
            _warm_serialization()
            self._wait_for_engines(n)
            state.engine_ids = sorted(state.client.ids)[:n]
            state.launched_pids = descendant_pids() - before
            self.world.bootstrap()
        except BaseException:
            self.stop()
            raise
        state.generation += 1
        state.created = time.time()
        if state.persist:
            save_record(state)
        else:
            _LIVE.add(self)

    def _ipp_options(self, n: int, pool: warm_pool.WarmPool | None) -> dict:
        """ipyparallel's `Cluster` options: ours, then the user's."""
        state = self.state
        options = dict(n=n, engines=state.launcher.name, log_level=logging.ERROR, delay=0,
                       config=self._launch_config(pool), controller_ip=state.launcher.controller_ip())
        # The hub registers an engine one to two heartbeats after it connects: ipyparallel's 3 s
        # period would add up to 6 s to every start, 0.1 s adds at most 0.2 s (for 1.5 % of one
        # core more while idle than 0.5 s, benchmarks/RESULTS.md); 50 missed beats still take a
        # dead remote engine for dead within 5 s.
        options["controller_args"] = [f"--HeartMonitor.period={_HEARTBEAT_MS}",
                                      f"--HeartMonitor.max_heartmonitor_misses={_DEAD_AFTER_BEATS}"]
        if state.launcher.name == "local":
            # Engines on this host read the controller's connection file as soon as it exists, so
            # they can start with the controller instead of waiting for its connection info.
            options["send_engines_connection_env"] = False
        options.update({key: value for key, value in state.ipp_options.items() if key != "config"})
        options["shutdown_atexit"] = not state.persist
        return options

    def stop(self) -> None:
        """Stop controller and engines and make sure no process of theirs is left."""
        state = self.state
        engine_pids = {info["pid"] for info in state.hosts if state.is_local(info)}
        started = state.pids
        if state.client is not None:
            self._shutdown_engines(engine_pids)
            state.direct.close()
            state.client.close()
        if state.ipp is not None:
            try:
                state.launcher.stop(state.ipp)
            except Exception as exc:  # noqa: BLE001 - fall through to killing what is left
                print(f"colab_par: ipyparallel stop failed ({exc}); killing leftover processes",
                      file=sys.stderr)
        reap(started, grace_s=10.0)
        self.remove_stack_files(range(len(state.hosts)))
        if state.ipp is not None and state.persist:
            persist.remove_record(record_path(state))
        state.forget_engines()
        _LIVE.discard(self)

    def restart(self) -> None:
        """Fresh engines and a fresh process group (after a dead rank or a stuck collective)."""
        self.stop()
        self.start()

    def remove_stack_files(self, ranks: Iterable[int]) -> None:
        """The stack files of engines that have ended (on this host; a remote host's /tmp is its own)."""
        state = self.state
        for rank in ranks:
            if rank < len(state.stack_files) and state.is_local(state.hosts[rank]):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(state.stack_files[rank])

    def _shutdown_engines(self, engine_pids: set[int]) -> None:
        """Ask engines to exit through ipyparallel first: much faster than the launcher's SIGTERM.

        Engines holding a process group can take seconds to die from SIGTERM, and ipyparallel
        then waits 5 s per engine set before escalating; a shutdown request ends them at once.
        """
        state = self.state
        live = [state.engine_ids[rank] for rank in live_ranks(state)]
        if not live:
            return
        try:
            state.client.shutdown(targets=live, hub=False, block=False)
        except Exception:  # noqa: BLE001 - the stop path below still cleans up
            return
        # Engines on other hosts are gone once the hub has their nanny's unregistration: stopping
        # the controller before that leaves the nanny waiting forever to deliver it.
        remote = {eid for eid, info in zip(state.engine_ids, state.hosts) if not state.is_local(info)}
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (any(pid_alive(p) for p in engine_pids)
                                               or remote & set(state.client.ids)):
            time.sleep(0.05)

    def resolve_n(self) -> int:
        """How many engines: as asked, the SSH hosts' count, the Slurm job's GPUs, or one per GPU of
        this host (2 on a host without one) for engines started here. The backend is chosen later,
        from what the engines report about their own hosts (`backend.choose_backend`)."""
        state, launcher = self.state, self.state.launcher
        if isinstance(launcher, SSH):
            if state.requested_n not in (None, launcher.n):
                raise ValueError(f"n={state.requested_n} engines but the SSH hosts ask for "
                                 f"{launcher.n}; leave n out or match the hosts")
            return launcher.n
        if state.requested_n is not None:
            return state.requested_n
        if isinstance(launcher, Slurm) and launcher.gpus_per_node and launcher.nodes:
            return launcher.gpus_per_node * launcher.nodes
        gpus = engine.visible_gpus() if state.requested_backend != "gloo" else 0
        return gpus or 2

    def _launch_config(self, pool: warm_pool.WarmPool | None = None) -> Config:
        """Our engine command, the launcher's settings, then any ipyparallel `config=` given."""
        config = _engine_config(nanny=self.state.launcher.nanny, pool=pool)
        self.state.launcher.configure(config)
        if "config" in self.state.ipp_options:
            config.merge(self.state.ipp_options["config"])
        return config

    def _wait_for_engines(self, n: int) -> None:
        """Wait up to the start timeout, saying why the launcher's engines have not come (a job
        pending in Slurm's queue) when they do not, and failing at once when they cannot."""
        state = self.state
        deadline = time.monotonic() + state.timeout
        while True:
            try:
                state.client.wait_for_engines(n, timeout=min(2.0, max(0.1, deadline - time.monotonic())),
                                              interactive=False)  # no progress bar
                return
            except TimeoutError:
                waiting = state.launcher.waiting(state.ipp)
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{len(state.client.ids)} of {n} engines started within the start timeout "
                        f"({state.timeout:.0f}s)" + (f": {waiting}" if waiting else "")
                        + "; stopped them. Pass a longer timeout=... or ask for fewer engines"
                    ) from None

    def start_engines(self, places: list[dict[str, Any]]) -> list[int]:
        """New engines where those of `places` (their `engine.host_info`) ran, one each (the
        launcher's `replacement_sets`); their ids once registered."""
        state = self.state
        known = set(state.client.ids) | set(state.engine_ids)
        for count, options in state.launcher.replacement_sets(places):
            state.ipp.start_engines_sync(n=count, **options)
        count = len(places)
        deadline = time.monotonic() + state.timeout
        while len(fresh := sorted(set(state.client.ids) - known)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(fresh)} of {count} new engine(s) registered within the start "
                                   f"timeout ({state.timeout:.0f}s)")
            time.sleep(0.05)
        return fresh[:count]


def _engine_config(nanny: bool, pool: warm_pool.WarmPool | None = None) -> Config:
    """Engines import torch while the controller is still starting, instead of after it.

    ipyparallel waits a fixed second between controller and engines and imports torch only when
    the first task arrives; launching engines at once (they poll for the controller's connection
    file) with torch preloaded takes both off the critical path. Importing torch does not touch CUDA,
    so binding each engine to its GPU still happens first. Engines on this host need no nanny
    process (its one job, remote signalling, is a plain `os.kill` here), and starting one sits inside
    every engine's registration. With a warm `pool`, controller and engines are forked from it,
    their imports already done (`colab_par.cluster.warm_pool`). The controller registers an engine when
    its heart first answers, not a heartbeat later (`compat.prompt_heart_monitor`).
    """
    config = Config()
    config.EngineLauncher.engine_cmd = [
        *(pool.command("engine") if pool else warm_pool.cold_command("engine")),
        f"--IPEngine.enable_nanny={nanny}"]
    config.ControllerLauncher.controller_cmd = (pool.command("controller") if pool
                                                else warm_pool.cold_command("controller"))
    config.LocalEngineSetLauncher.delay = 0.0  # ranks come from sorted engine ids, not launch order
    return config


def _warm_serialization() -> None:
    """ipyparallel's serializer imports the types it special-cases (numpy's among them: 0.1 s) at
    its first call, and `World.prepare` cloudpickle: done here, while the engines start,
    neither waits on engines that already registered."""
    import cloudpickle  # noqa: F401 - imported for its side effect: loaded before it is needed
    from ipyparallel.serialize import can, uncan

    can(None)
    uncan(None)


_LIVE: "set[Lifecycle]" = set()


def _stop_all_at_exit() -> None:
    for lifecycle in list(_LIVE):
        lifecycle.stop()


atexit.register(_stop_all_at_exit)
