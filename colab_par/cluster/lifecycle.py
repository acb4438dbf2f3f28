"""The engines' lifecycle: ipyparallel controller + engines, device binding, process group, health.

One `Cluster` owns one ipyparallel cluster whose engines are the ranks of one torch.distributed
world (rank = engine order). It knows nothing about models or layouts: it starts, runs code,
reports, interrupts, restarts and stops.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import ipyparallel as ipp
import psutil
from traitlets.config import Config

from colab_par import (compat, debugger, direct, engine, engine_setup, persist, postmortem, probe, recovery,
                       warm_pool)
from colab_par import pull as pulled
from colab_par.backend import BACKENDS, choose_backend, device_indices, device_problems, local_ranks
from colab_par.launchers import SSH, Launcher, Slurm, launcher_from, launcher_from_state, launcher_state
from colab_par.output import (CollectiveDeadlockError, DeadEngineError, EngineError, RecoveryError,
                              TaskOutput, busy_ranks, is_transport_error, per_rank_data, rank_errors,
                              rank_failure, ranks_text, size_text, values, where_waiting)
from colab_par.ship import payload, ship_by_value
from colab_par.task_watch import TaskWatch

__all__ = ["Cluster", "EngineError", "DeadEngineError", "RecoveryError"]

_POLL_MAX_S = 0.25
_HEARTBEAT_MS, _DEAD_AFTER_BEATS = 100, 50
# A task where some ranks failed while others still run: after this long, the others are taken to
# wait on the failed ones (in a collective they would wait for the whole process-group timeout).
_FAILURE_GRACE_S = 1.0
# Once every rank broke its connections, pending collectives fail at once; a rank still busy this
# long after that (or after an interrupt) is stuck, and only a restart frees it.
_ABORT_WAIT_S = 2.0


def _pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (killed, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        pass  # no /proc entry (or no /proc at all): ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return True


def descendant_pids(root: int | None = None) -> set[int]:
    """Every live process below `root` (default: this process), read from /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and _pid_alive(child):
                found.add(child)
                stack.append(child)
    return found


class Cluster:
    """ipyparallel engines forming one torch.distributed world, usable from plain Python.

    ``n=None`` starts one engine per GPU of this host (2 on a host without one), one per SSH host
    slot, or gpus_per_node × nodes of a Slurm job. ``backend=None`` picks nccl when every engine
    reports a GPU of its own on its host, else gloo, which computes on the CPU (`colab_par.backend`);
    an explicit "nccl" that some engine's host cannot serve is refused before the world forms.
    ``timeout`` bounds every collective (the process group's timeout) and engine start-up, so
    nothing waits forever. Every engine's torch and Python generators start from ``seed`` at each
    start and restart, so a notebook run repeats (``seed=None`` leaves each process's own draw).
    ``launcher`` says where engines run:
    "local" (this host), "mpi", "slurm" or ``Slurm(partition=..., account=..., time=...)``, or
    ``SSH({"node1": 2, "node2": 2})``; ranks are grouped by host.
    ``persist=True`` leaves controller and engines running when this kernel exits; a later kernel
    joins them, variables and all, with `Cluster.attach` (`colab_par.persist`), and `stop` ends them.
    """

    def __init__(self, n: int | None = None, *, backend: str | None = None,
                 launcher: str | Launcher = "local",
                 timeout: float = 300.0, interrupt_grace: float = 10.0, dashboard: bool = True,
                 seed: int | None = 0, persist: bool = False, **ipp_options: Any):
        launcher = launcher_from(launcher)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; use 'nccl' (CUDA) or 'gloo' (CPU)")
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"n={n!r} must be a positive number of engines, e.g. n=2")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, e.g. 300")
        self._requested_n, self._requested_backend = n, backend
        self.launcher, self.timeout, self.interrupt_grace = launcher, float(timeout), interrupt_grace
        self.dashboard, self.seed, self.persist = dashboard, seed, persist
        self._ipp_options = ipp_options
        self._ipp: ipp.Cluster | None = None
        self._client: ipp.Client | None = None
        self._direct: direct.Channels | None = None  # calls to engines on this host, controller bypassed
        self._engine_ids: list[int] = []
        self._hosts: list[dict[str, Any]] = []
        self._pids: set[int] = set()
        self._stack_files: list[str] = []  # per rank: where SIGUSR1 makes the engine dump its stacks
        self.devices: list[str] = []
        self.backend: str | None = None
        self.generation = 0  # bumped at every start: engine namespaces do not survive it
        self.created: float | None = None  # when the engines started (time.time())
        self._recovery: dict[str, Any] | None = None  # the running cell's Trainer recovery policy

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def n(self) -> int:
        return len(self._engine_ids)

    @property
    def pids(self) -> set[int]:
        """The processes this cluster started on this host (controller, engines, launcher helpers)."""
        return self._pids | {info["pid"] for info in self._hosts if self._is_local(info)}

    def start(self) -> "Cluster":
        """Start engines, bind devices and initialise the process group; a no-op when running."""
        if self.running:
            print(f"colab_par: {self.n} engines already running ({self.backend}); nothing to do. "
                  "Use restart() for fresh engines.")
            return self
        n = self._resolve_n()
        self.launcher.check()
        # on this host, controller and engines fork from the warm pool (started before `before`:
        # it outlives this cluster); persisted engines must outlive the pool, which ends with this
        # kernel, so they start cold
        pool = warm_pool.shared_pool() if self.launcher.name == "local" and not self.persist else None
        before = descendant_pids()
        options = dict(n=n, engines=self.launcher.name, log_level=logging.ERROR, delay=0,
                       config=self._launch_config(pool), controller_ip=self.launcher.controller_ip())
        # The hub registers an engine one to two heartbeats after it connects: ipyparallel's 3 s
        # period would add up to 6 s to every start, 0.1 s adds at most 0.2 s (for 1.5 % of one
        # core more while idle than 0.5 s, benchmarks/RESULTS.md); 50 missed beats still take a
        # dead remote engine for dead within 5 s.
        options["controller_args"] = [f"--HeartMonitor.period={_HEARTBEAT_MS}",
                                      f"--HeartMonitor.max_heartmonitor_misses={_DEAD_AFTER_BEATS}"]
        if self.launcher.name == "local":
            # Engines on this host read the controller's connection file as soon as it exists, so
            # they can start with the controller instead of waiting for its connection info.
            options["send_engines_connection_env"] = False
        options.update({key: value for key, value in self._ipp_options.items() if key != "config"})
        options["shutdown_atexit"] = not self.persist
        self._ipp = ipp.Cluster(**options)
        try:
            self._ipp.start_cluster_sync(n=n)
            self._client = self._ipp.connect_client_sync()
            self._direct = direct.Channels(self._client)
            _warm_serialization()
            self._wait_for_engines(n)
            self._engine_ids = sorted(self._client.ids)[:n]
            self._pids = descendant_pids() - before
            self._bootstrap()
        except BaseException:
            self.stop()
            raise
        self.generation += 1
        self.created = time.time()
        if self.persist:
            self._save_record()
        else:
            _LIVE.add(self)
        return self

    def stop(self) -> None:
        """Stop controller and engines and make sure no process of theirs is left."""
        engine_pids = {info["pid"] for info in self._hosts if self._is_local(info)}
        started = self.pids
        if self._client is not None:
            self._shutdown_engines(engine_pids)
            self._direct.close()
            self._client.close()
        if self._ipp is not None:
            try:
                self.launcher.stop(self._ipp)
            except Exception as exc:  # noqa: BLE001 - fall through to killing what is left
                print(f"colab_par: ipyparallel stop failed ({exc}); killing leftover processes",
                      file=sys.stderr)
        _reap(started, grace_s=10.0)
        self._remove_stack_files(range(len(self._hosts)))
        if self._ipp is not None and self.persist:
            persist.remove_record(self._record_path())
        self._ipp, self._client, self._engine_ids, self._hosts, self._pids = None, None, [], [], set()
        self._direct = None
        self._stack_files = []
        self.devices = []
        _LIVE.discard(self)

    def _remove_stack_files(self, ranks: Iterable[int]) -> None:
        """The stack files of engines that have ended (on this host; a remote host's /tmp is its own)."""
        for rank in ranks:
            if rank < len(self._stack_files) and self._is_local(self._hosts[rank]):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._stack_files[rank])

    def _shutdown_engines(self, engine_pids: set[int]) -> None:
        """Ask engines to exit through ipyparallel first: much faster than the launcher's SIGTERM.

        Engines holding a process group can take seconds to die from SIGTERM, and ipyparallel
        then waits 5 s per engine set before escalating; a shutdown request ends them at once.
        """
        live = [self._engine_ids[rank] for rank in self._live_ranks()]
        if not live:
            return
        try:
            self._client.shutdown(targets=live, hub=False, block=False)
        except Exception:  # noqa: BLE001 - the stop path below still cleans up
            return
        # Engines on other hosts are gone once the hub has their nanny's unregistration: stopping
        # the controller before that leaves the nanny waiting forever to deliver it.
        remote = {eid for eid, info in zip(self._engine_ids, self._hosts) if not self._is_local(info)}
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (any(_pid_alive(p) for p in engine_pids)
                                               or remote & set(self._client.ids)):
            time.sleep(0.05)

    def restart(self) -> "Cluster":
        """Fresh engines and a fresh process group (after a dead rank or a stuck collective)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"{self.n} engines, {self.backend}" if self.running else "stopped"
        return f"Cluster({state}, launcher={self.launcher.name!r})"

    # ---- running code ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        ranks = self._checked_ranks(None)
        ship_by_value(fn, *args, *kwargs.values())
        result = self._apply(ranks, fn, *args, **kwargs)
        self._wait(result, ranks, stream=False, source=_source_file(fn))
        return values(result, self._engine_ids)

    def submit(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start ``fn(*args, **kwargs)`` on one rank and return at once (an ipyparallel
        AsyncResult): for independent work such as a sweep's tasks, outside the world's collectives."""
        self._require_running()
        ship_by_value(fn, *args, *kwargs.values())
        return self._client[self._engine_ids[rank]].apply_async(fn, *args, **kwargs)

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone."""
        return self._dead_ranks()

    def check_alive(self, ranks: Iterable[int]) -> None:
        """Raise DeadEngineError naming any of `ranks` whose engine died."""
        self._raise_if_dead(ranks)

    def execute(self, code: str, *, targets: Sequence[int] | None = None, all_output: bool = False,
                namespace: dict[str, Any] | None = None,
                fresh_namespace: Callable[[], dict[str, Any]] | None = None, cell_number: int | None = None) -> None:
        """Run a cell on the ranks (all by default): rank 0's output streams live.

        Other ranks' output is shown when it differs from rank 0's, or always with ``all_output``.
        ``namespace`` is pushed to the engines first (shipped notebook definitions). ``cell_number``
        names the cell on the engines as the notebook numbers it (``Cell In[N]`` in tracebacks).

        When an engine dies while the cell fits a ``Trainer(on_failure="restart")``, the dead
        engines are replaced (`replace_dead`; every engine restarted where engines cannot be
        replaced one by one) and the cell runs again (with ``fresh_namespace()``, default
        ``namespace``: a fresh engine holds nothing earlier cells defined), its fit resuming from
        the last committed checkpoint; after the Trainer's ``max_restarts`` the cell fails with
        what happened (RecoveryError).
        """
        attempts: list[str] = []
        while True:
            self._recovery = None
            try:
                return self._execute_once(code, targets, all_output, namespace, cell_number)
            except EngineError as error:
                dead, policy = self._dead_ranks(), self._recovery
                if not dead or policy is None:
                    raise
                attempts.append(f"rank(s) {ranks_text(dead)} died: {str(error).splitlines()[0]}")
                if len(attempts) > policy["max_restarts"]:
                    raise RecoveryError(attempts, policy["max_restarts"]) from error
                generation = self.generation
                if self.launcher.name == "local":
                    self.replace_dead()  # falls back to a restart when the others stay stuck
                else:
                    self.restart()
                how = ("restarted every engine" if self.generation != generation else
                       "replaced its engine (the other ranks kept theirs)")
                print(f"colab_par: rank(s) {ranks_text(dead)} died during the cell; {how}; running "
                      f"the cell again, resuming from the last checkpoint in {policy['ckpt_dir']} "
                      f"(restart {len(attempts)} of {policy['max_restarts']})", file=sys.stderr)
                self.run(recovery.request_resume, policy["ckpt_dir"])
                namespace = fresh_namespace() if fresh_namespace is not None else namespace

    def profile(self, code: str, *, trace_dir: str | os.PathLike | None = None, **execute: Any) -> Any:
        """Run a cell like `execute` with torch.profiler recording on every rank; returns the
        `colab_par.profiling.Timeline` (a lane block per rank; it draws itself in a notebook).
        Each rank writes its raw trace to `trace_dir` (default: a new folder under
        ./colab_par_traces) as ``rank<N>.pt.trace.json``, for Perfetto or TensorBoard."""
        from colab_par.profiling.session import profile_cell

        return profile_cell(self, code, trace_dir=trace_dir, **execute)

    def _execute_once(self, code: str, targets: Sequence[int] | None, all_output: bool,
                      namespace: dict[str, Any] | None, cell_number: int | None) -> None:
        ranks = self._checked_ranks(targets)
        if namespace or cell_number is not None:
            shipped = self._apply(ranks, engine.before_cell, payload(namespace or {}), cell_number)
            self._wait(shipped, ranks, stream=False)
            values(shipped, self._engine_ids)
        result = self._direct.execute([self._engine_ids[r] for r in ranks], code)
        try:
            output = self._wait(result, ranks, stream=True, cell=code)
        finally:  # a restartable Trainer in the cell said how to recover it
            self._recovery = _recovery_policy(result)
        output.show_other_ranks(ranks, all_output)
        values(result, self._engine_ids)
        output.show_result()

    def status(self) -> list[dict[str, Any]]:
        """Per rank: host, pid, device, alive, memory in use (busy ranks report what is known)."""
        if not self.running:
            return []
        rows = []
        dead = set(self._dead_ranks())
        for rank, engine_id in enumerate(self._engine_ids):
            row = {"rank": rank, "engine_id": engine_id, **self._hosts[rank],
                   "device": self.devices[rank], "alive": rank not in dead, "memory_bytes": None}
            if row["alive"]:
                reply = self._client[[engine_id]].apply_async(engine.rank_status)
                if reply.wait(5.0) and reply.successful():
                    row["memory_bytes"] = reply.get()[0]["memory_bytes"]
                else:
                    row["busy"] = True
            rows.append(row)
        return rows

    # ---- engines that outlive the kernel --------------------------------------------------------
    @classmethod
    def attach(cls, id: str | None = None, *, profile_dir: str | None = None) -> "Cluster":
        """Join a cluster started with ``persist=True`` on this host by an earlier (or another)
        kernel: the newest one, or the one with this `id` (`colab_par.running_clusters()`). Its
        engines keep every variable, their process group, device and rank."""
        _, record = persist.find_record(id, profile_dir)
        cluster = cls(record["requested_n"], backend=record["requested_backend"],
                      launcher=launcher_from_state(record["launcher"]), timeout=record["timeout"],
                      interrupt_grace=record["interrupt_grace"], dashboard=record["dashboard"],
                      seed=record["seed"], persist=True, **record["ipp_options"])
        cluster._ipp = ipp.Cluster.from_file(record["ipp_cluster_file"], log_level=logging.ERROR)
        cluster._client = cluster._ipp.connect_client_sync()
        cluster._engine_ids, cluster.backend, cluster.devices = record["ids"], record["backend"], record["devices"]
        cluster._hosts = [{k: v for k, v in info.items() if k != "local"} for info in record["hosts"]]
        cluster._stack_files, cluster._pids = record["stack_files"], persist.live_pids(record["pids"])
        cluster.generation, cluster.created = record["generation"], record["created"]
        cluster._direct = direct.Channels(cluster._client)
        cluster._open_direct(cluster._live_ranks())  # the engines' own, opened when they started
        return cluster

    @property
    def cluster_id(self) -> str | None:
        """ipyparallel's id of the running cluster (what `attach` and `running_clusters` name)."""
        return self._ipp.cluster_id if self._ipp is not None else None

    def _record_path(self) -> Any:
        return persist.record_path(self._ipp.profile_dir, self._ipp.cluster_id)

    def _save_record(self) -> None:
        """What a later kernel needs to join these engines (`colab_par.persist`)."""
        controller = self._ipp.controller.pid
        options = {key: value for key, value in self._ipp_options.items() if _json_able(value)}
        persist.write_record(self._record_path(), {
            "cluster_id": self._ipp.cluster_id, "host": socket.gethostname(), "created": self.created,
            "kernel_pid": os.getpid(), "ipp_cluster_file": self._ipp.cluster_file,
            "controller": {"pid": controller, "started": persist.process_times([controller])[str(controller)]},
            "ids": self._engine_ids, "hosts": [{**info, "local": self._is_local(info)} for info in self._hosts],
            "devices": self.devices, "backend": self.backend, "stack_files": self._stack_files,
            "pids": persist.process_times(self.pids), "generation": self.generation,
            "launcher": launcher_state(self.launcher), "requested_n": self._requested_n,
            "requested_backend": self._requested_backend, "timeout": self.timeout,
            "interrupt_grace": self.interrupt_grace, "dashboard": self.dashboard, "seed": self.seed,
            "ipp_options": options})

    # ---- losing one engine, not the session -----------------------------------------------------
    def replace_dead(self) -> str:
        """Fresh engines for the dead ranks only, each in its rank's place (same host, local rank
        and device), then the world re-formed with a fresh store; every other rank keeps its
        variables. Every rank's generators are re-seeded from `seed`, as at a start, so the ranks
        agree again. Returns what was done and what was lost (the dead ranks' variables, and
        everywhere the objects built on the old process group)."""
        self._require_running()
        dead = self._dead_ranks()
        if not dead:
            return "no engine is dead; nothing to replace (restart() gives every rank a fresh engine)"
        if self.launcher.name != "local":
            raise RuntimeError(f"replacing one engine needs engines on this host (launcher='local'); a "
                               f"{self.launcher.name} launcher starts its engines together (one job), and "
                               "a new one could land on another node. Use restart(): fresh engines for "
                               "every rank, engine variables gone")
        started = time.monotonic()
        survivors = [rank for rank in range(self.n) if rank not in dead]
        if not self._settle(survivors):
            self.restart()
            return (f"rank(s) {ranks_text(dead)} died and the others stayed busy after an abort and an "
                    "interrupt, so every engine was restarted: all engine variables are gone")
        fresh = self._start_engines(len(dead))
        self._direct.forget([self._engine_ids[rank] for rank in dead])
        self._remove_stack_files(dead)  # what they said of their end was read: DeadEngineError
        prepared = self._prepare(fresh)
        for rank, engine_id in zip(dead, fresh):
            self._engine_ids[rank], self._hosts[rank] = engine_id, prepared[engine_id]["host"]
            self._stack_files[rank] = prepared[engine_id]["stack_file"]
        self._bind(dead)
        if survivors:
            self._seed(survivors)
        held = sorted(set().union(*self._client[[self._engine_ids[r] for r in survivors]].apply_sync(
            engine.user_names)) - {"rank", "world_size", "local_rank", "device"}) if survivors else []
        stale = self._stale_names(survivors)
        self._join_world(identify=dead)
        if self.persist:
            self._save_record()
        places = ", ".join(f"rank {r} on {self._hosts[r]['host']} ({self.devices[r]})" for r in dead)
        lost = (f"; it lacks {_listed(held)}, which the other ranks hold: re-run the cells that "
                "define them" if held else "")
        return (f"replaced the dead engine of {places}; the process group was re-formed with a fresh "
                f"store in {time.monotonic() - started:.1f}s. The variables of rank(s) "
                f"{ranks_text(dead)} are gone{lost}. On the other ranks, "
                f"{_kept_text(stale, 'engine variables')}.")

    def _settle(self, ranks: list[int]) -> bool:
        """Free `ranks` still running a task (waiting on a dead peer): abort their collectives,
        then interrupt them; False when one stays busy."""
        busy = [rank for rank in ranks if rank not in self._idle_ranks(ranks)]
        if busy:
            self._answers(self._request(busy, probe.ABORT_REQUEST, {"addresses": self._world_addresses()}),
                          _ABORT_WAIT_S)
        for last in (False, True):
            deadline = time.monotonic() + _ABORT_WAIT_S
            while busy and time.monotonic() < deadline:
                time.sleep(0.05)
                busy = [rank for rank in busy if rank not in self._idle_ranks(busy)]
            if not busy or last:
                return not busy
            self.interrupt(busy)
        return False

    def _start_engines(self, count: int) -> list[int]:
        """`count` new engines on this host; their ids once registered."""
        known = set(self._client.ids) | set(self._engine_ids)
        self._ipp.start_engines_sync(n=count)
        deadline = time.monotonic() + self.timeout
        while len(fresh := sorted(set(self._client.ids) - known)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(fresh)} of {count} new engine(s) registered within the start "
                                   f"timeout ({self.timeout:.0f}s)")
            time.sleep(0.05)
        return fresh[:count]

    def _stale_names(self, ranks: list[int]) -> list[str]:
        """Engine variables on `ranks` built on the current process group (`engine.names_built_on_the_group`)."""
        if not ranks:
            return []
        view = self._client[[self._engine_ids[r] for r in ranks]]
        return sorted(set().union(*view.apply_sync(engine.names_built_on_the_group)))

    # ---- post-mortem debugging and pulling variables -------------------------------------------
    def debug(self, rank: int | None = None, commands: Sequence[str] | None = None) -> None:
        """A post-mortem debugger (pdb) on the frame where `rank`'s last error was raised, driven
        from here: `commands` in order (scripts, tests), or each command read with ``input()`` (a
        notebook's input box) until q. ``rank=None``: the first rank whose error is its own (not
        a broken connection or the kit's interrupt after another rank failed). Only that rank is
        asked, one short task per command (`colab_par.debugger`). A rank keeps its last error's
        frames, and their locals, until its next successful cell or `clear_errors`."""
        self._require_idle(range(self.n) if rank is None else [rank])
        if rank is None:
            rank = self._rank_to_debug()
            if rank is None:
                print("colab_par: no rank keeps an error to debug (a rank releases its last error at "
                      "its next successful cell)")
                return
        debugger.session(lambda fn, *args: self._call(rank, fn, *args), rank, commands)

    def clear_errors(self, ranks: Iterable[int] | None = None) -> list[int]:
        """Release the frames (and the local variables they keep alive) of each rank's last error,
        and any debugger on them; returns the ranks that had one."""
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        return [rank for rank in ranks if self._call(rank, postmortem.clear)]

    def _rank_to_debug(self) -> int | None:
        errors = {rank: self._call(rank, postmortem.last_error) for rank in self._live_ranks()}
        errors = {rank: error for rank, error in errors.items() if error is not None}
        own = [rank for rank, error in errors.items()
               if not is_transport_error(error["name"], error["value"]) and error["name"] != "KeyboardInterrupt"]
        candidates = own or list(errors)
        return candidates[0] if candidates else None

    def pull(self, name: str, rank: int = 0, *, max_bytes: int | None = None) -> Any:
        """Engine variable `name` (or a dotted path, "pm.model.lm_head.weight") of `rank`, here on
        the CPU: a DTensor gathered whole, a sharded model (ParallelModel, FSDP/DTensor module) as
        its full state dict, a module as its state dict, anything else as it is. Refused, before
        anything moves, when it is larger than `max_bytes` (default: a third of this host's
        available memory: the gathered copy, the message and the result coexist while it moves)."""
        self._require_idle([rank])
        described = self.run(pulled.describe, name)
        mine = described[rank]
        if mine["kind"] == "missing":
            raise NameError(f"rank {rank}: {mine['why']}; nothing pulled")
        sharded = mine["kind"] in pulled.SHARDED
        if sharded and (odd := [r for r, d in enumerate(described) if d["kind"] != mine["kind"]]):
            raise ValueError(f"{name} is a {mine['kind']} on rank {rank} but not on rank(s) "
                             f"{ranks_text(odd)}: gathering it needs every rank's part; nothing pulled")
        size = sum({d["share"]: d["bytes"] for d in described}.values()) if sharded else mine["bytes"]
        available = psutil.virtual_memory().available
        limit = available // 3 if max_bytes is None else max_bytes
        if size > limit:
            raise MemoryError(
                f"{name} ({mine['what']}) is {size_text(size)} whole; the limit is {size_text(limit)} "
                f"({'max_bytes' if max_bytes is not None else 'a third of'} this host's "
                f"{size_text(available)} available, as the gathered copy, the message and the result "
                "coexist while it moves). Pull a part (a dotted name, e.g. one tensor of the model) or "
                "save it instead (colab_par.save, save_pretrained); nothing pulled")
        if sharded:
            found = self.run(pulled.gather, name, rank)
        else:
            found = [self._call(rank, pulled.gather, name, rank)]
        return next(piece for piece in found if piece is not None)["value"]

    def _require_idle(self, ranks: Iterable[int], grace_s: float = 1.0) -> None:
        """Refuse ranks running a task (a `submit` still working): what is asked would queue
        behind it. The hub learns of a finished task a moment after its result, hence the grace."""
        ranks = list(ranks)
        self._checked_ranks(ranks)
        deadline = time.monotonic() + grace_s
        while busy := [rank for rank in ranks if rank not in self._idle_ranks(ranks)]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank(s) {ranks_text(busy)} are running a task; wait for it to "
                                   "finish (or interrupt it) and ask again")
            time.sleep(0.05)

    def names(self, rank: int = 0) -> list[str]:
        """The variables `rank`'s engine holds (its interactive namespace, hidden names left out)."""
        return self._call(rank, engine.user_names)

    def _call(self, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on one rank (the kit's own quick engine functions)."""
        result = self._apply(self._checked_ranks([rank]), fn, *args)
        if not result.wait(self.timeout):
            raise TimeoutError(f"rank {rank} did not answer within {self.timeout:.0f}s")
        return values(result, self._engine_ids)[0]

    def check_devices(self) -> list[str]:
        """What is wrong with where the engines compute (`backend.device_problems`): empty when each
        computes on its own GPU under nccl, or on the CPU (CUDA untouched) under gloo."""
        return device_problems(self.backend, self._hosts, self.devices, self.run(engine.device_report))

    def interrupt(self, ranks: Iterable[int] | None = None) -> None:
        """Send SIGINT to every engine (the notebook's stop button), or to `ranks`: directly on this
        host, through ipyparallel's nanny on others."""
        self._signal(signal.SIGINT, range(self.n) if ranks is None else ranks)

    def _signal(self, signum: signal.Signals, ranks: Iterable[int]) -> None:
        if not self.running:
            return
        remote = []
        for rank in set(ranks) - set(self._dead_ranks()):
            info = self._hosts[rank]
            if self._is_local(info):
                try:
                    os.kill(info["pid"], signum)
                except ProcessLookupError:
                    pass
            else:
                remote.append(self._engine_ids[rank])
        if remote:
            self._client.send_signal(signum.name, targets=remote, block=False)

    # ---- internals ------------------------------------------------------------------------------
    def _resolve_n(self) -> int:
        """How many engines: as asked, the SSH hosts' count, the Slurm job's GPUs, or one per GPU of
        this host (2 on a host without one) for engines started here. The backend is chosen later,
        from what the engines report about their own hosts (`backend.choose_backend`)."""
        if isinstance(self.launcher, SSH):
            if self._requested_n not in (None, self.launcher.n):
                raise ValueError(f"n={self._requested_n} engines but the SSH hosts ask for "
                                 f"{self.launcher.n}; leave n out or match the hosts")
            return self.launcher.n
        if self._requested_n is not None:
            return self._requested_n
        if isinstance(self.launcher, Slurm) and self.launcher.gpus_per_node and self.launcher.nodes:
            return self.launcher.gpus_per_node * self.launcher.nodes
        gpus = engine.visible_gpus() if self._requested_backend != "gloo" else 0
        return gpus or 2

    def _launch_config(self, pool: warm_pool.WarmPool | None = None) -> Config:
        """Our engine command, the launcher's settings, then any ipyparallel `config=` given."""
        config = _engine_config(nanny=self.launcher.nanny, pool=pool)
        self.launcher.configure(config)
        if "config" in self._ipp_options:
            config.merge(self._ipp_options["config"])
        return config

    def _wait_for_engines(self, n: int) -> None:
        """Wait up to the start timeout, saying why the launcher's engines have not come (a job
        pending in Slurm's queue) when they do not, and failing at once when they cannot."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._client.wait_for_engines(n, timeout=min(2.0, max(0.1, deadline - time.monotonic())),
                                              interactive=False)  # no progress bar
                return
            except TimeoutError:
                waiting = self.launcher.waiting(self._ipp)
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{len(self._client.ids)} of {n} engines started within the start timeout "
                        f"({self.timeout:.0f}s)" + (f": {waiting}" if waiting else "")
                        + "; stopped them. Pass a longer timeout=... or ask for fewer engines"
                    ) from None

    def _bootstrap(self) -> None:
        """Choose the backend from the engines' own hosts, bind devices (before CUDA starts on the
        engines), then rendezvous on rank 0's host: three round trips (`colab_par.engine_setup`)."""
        prepared = self._prepare(self._engine_ids)
        self._engine_ids, self._hosts = _ranked_by_host(self._engine_ids,
                                                        [prepared[eid]["host"] for eid in self._engine_ids])
        self.backend, note = choose_backend(self._requested_backend, self._hosts)
        if note:
            print(f"colab_par: {note}", file=sys.stderr)
        self._stack_files = [prepared[eid]["stack_file"] for eid in self._engine_ids]
        self.devices = [""] * self.n
        port = self._bind(range(self.n), rendezvous=True)
        self._join_world(port, identify=range(self.n))

    def _prepare(self, engine_ids: list[int]) -> dict[int, dict[str, Any]]:
        """`engine_setup.prepare` on fresh engines, whose direct channels are then connected; what
        each engine reported, by engine id. The client serializes with cloudpickle from now on, as
        the engines do (what `DirectView.use_cloudpickle` does, in the same round trip)."""
        from ipyparallel.serialize import use_cloudpickle

        reports = self._client[engine_ids].apply_async(
            engine_setup.prepare, self._controller_address(), socket.gethostname()).get(timeout=self.timeout)
        use_cloudpickle()
        prepared = dict(zip(engine_ids, reports))
        self._direct.connect({eid: report["direct_url"] for eid, report in prepared.items()})
        return prepared

    def _bind(self, ranks: Iterable[int], rendezvous: bool = False) -> int | None:
        """Bind each of `ranks` to its device and seed it (`engine_setup.bind`), concurrently; with
        `rendezvous`, rank 0 also opens the world's rendezvous socket, whose port is returned."""
        hosts = [info["host"] for info in self._hosts]
        local_rank, index = local_ranks(self._hosts), device_indices(self._hosts)
        address = self._world_addresses()[0] if rendezvous else None
        calls = {r: self._direct.apply([self._engine_ids[r]], engine_setup.bind,
                                       (local_rank[r], hosts.count(hosts[r]), self.backend, self.seed,
                                        address if r == 0 else None, index[r]), {})
                 for r in ranks}
        port = None
        for rank, result in calls.items():
            self.devices[rank], opened = self._get(result, rank)
            port = opened if rank == 0 else port
        return port

    def _open_direct(self, ranks: list[int]) -> None:
        """Direct channels to the engines of `ranks` on this host (`colab_par.direct`): those a
        persisted cluster's engines opened when they started."""
        local = [r for r in ranks if self._is_local(self._hosts[r])]
        if local:
            ids = [self._engine_ids[r] for r in local]
            urls = self._client[ids].apply_async(direct.serve, "127.0.0.1").get(timeout=self.timeout)
            self._direct.connect(dict(zip(ids, urls)))

    def _seed(self, ranks: Iterable[int]) -> None:
        if self.seed is not None:
            view = self._client[[self._engine_ids[r] for r in ranks]]
            view.apply_async(engine.seed_generators, self.seed).get(timeout=self.timeout)

    def _controller_address(self) -> str:
        """The address engines reach the controller at (this host's primary one if it listens on all)."""
        ip = self._ipp.controller_ip
        return engine.address_toward("192.0.2.1") if ip in ("", "*", "0.0.0.0", "::") else ip

    def _world_addresses(self) -> list[str]:
        """The addresses the world talks over: loopback on one host, each host's address on several."""
        if all(self._is_local(info) for info in self._hosts):
            return ["127.0.0.1"]
        return list(dict.fromkeys(info["ip"] for info in self._hosts))

    def _join_world(self, port: int | None = None, identify: Iterable[int] = ()) -> None:
        """(Re-)initialise the process group on every rank through a fresh store that listens only
        on the address the world uses (see `_world_addresses`): rank 0's, at `port` when `_bind`
        opened it, else opened here. The ranks in `identify` (fresh engines) also get their
        `rank`, `world_size`, `local_rank` and `device` names."""
        addr = self._world_addresses()[0]
        single_host = addr == "127.0.0.1"
        if port is None:
            port = self._get(self._direct.apply([self._engine_ids[0]], engine.open_rendezvous, (addr,), {}), 0)
        identify, local_rank = set(identify), local_ranks(self._hosts)
        joins = [self._direct.apply([eid], engine_setup.join, (
            self.backend, addr, port, rank, self.n, self.timeout,
            addr if single_host else self._hosts[rank]["ip"],
            {"rank": rank, "world_size": self.n, "local_rank": local_rank[rank],
             "device": self.devices[rank]} if rank in identify else None), {})
            for rank, eid in enumerate(self._engine_ids)]
        for rank, result in enumerate(joins):
            self._get(result, rank)

    def _get(self, result: Any, rank: int) -> Any:
        if not result.wait(self.timeout):
            raise TimeoutError(f"rank {rank} did not answer within {self.timeout:.0f}s while joining "
                               "the process group")
        return values(result, self._engine_ids)[0]

    @staticmethod
    def _is_local(info: dict[str, Any]) -> bool:
        return info["host"] == socket.gethostname()

    def _require_running(self) -> None:
        if not self.running:
            raise RuntimeError("no engines are running; start them with `%colossal start` "
                               "(or colab_par.Cluster(n=2).start())")

    def _checked_ranks(self, targets: Sequence[int] | None) -> list[int]:
        """`targets` (default: every rank), refused when one does not exist or its engine died."""
        self._require_running()
        ranks = list(range(self.n)) if targets is None else list(targets)
        bad = [r for r in ranks if not 0 <= r < self.n]
        if bad:
            raise ValueError(f"rank(s) {ranks_text(bad)} do not exist; this cluster has ranks "
                             f"0..{self.n - 1}")
        self._raise_if_dead(ranks)
        return ranks

    def _apply(self, ranks: list[int], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start ``fn(*args, **kwargs)`` on `ranks` (direct channel where there is one,
        `colab_par.direct`); an ipyparallel AsyncResult with one result per rank."""
        return self._direct.apply([self._engine_ids[r] for r in ranks], fn, args, kwargs)

    def _dead_ranks(self) -> list[int]:
        registered = set(self._client.ids) if self._client is not None else set()
        dead = []
        for rank, eid in enumerate(self._engine_ids):
            info = self._hosts[rank] if rank < len(self._hosts) else None
            if eid not in registered or (info and self._is_local(info) and not _pid_alive(info["pid"])):
                dead.append(rank)
        return dead

    def _raise_if_dead(self, ranks: Iterable[int]) -> None:
        dead = [r for r in self._dead_ranks() if r in set(ranks)]
        if dead:
            pids = ", ".join(f"rank {r}: pid {self._hosts[r]['pid']} on {self._hosts[r]['host']}"
                             f"{self._crash_of(r)}" for r in dead)
            raise DeadEngineError(dead, pids)

    def _crash_of(self, rank: int, lines: int = 12) -> str:
        """What a crashed rank's fatal signal left in its stack file (faulthandler's report): the
        signal, and the Python stacks of the thread that crashed and of the engine's main thread
        (the innermost `lines` calls of each), when the rank ran on this host."""
        if rank >= len(self._stack_files) or not self._is_local(self._hosts[rank]):
            return ""
        try:
            with open(self._stack_files[rank], errors="replace") as dump:
                text = dump.read()
        except OSError:
            return ""
        start = text.rfind("Fatal Python error")
        if start < 0:
            return ""
        signal_line, *threads = text[start:].strip().split("\n\n")
        shown = [t for t in threads if t.startswith("Current thread")]
        shown += [t for t in threads if compat.ENGINE_MAIN_FILE in t and t not in shown]
        stacks = ["\n".join(t.splitlines()[:lines + 1]) for t in shown]
        return "; it crashed:\n" + "\n".join([signal_line.splitlines()[0], *stacks]) + "\n"

    def _wait(self, result: Any, ranks: list[int], *, stream: bool, cell: str | None = None,
              source: str | None = None) -> TaskOutput:
        """Wait without a deadline (training may be long), but never on a dead rank, on ranks left
        waiting by another rank's error, nor on ranks stuck in collectives that can never complete
        (`TaskWatch`); stream rank 0 meanwhile."""
        output = TaskOutput(result, stream=stream, dashboard=self.dashboard)
        watch = TaskWatch(result, ranks, list(range(self.n)),
                          lambda asked: self._request(asked, probe.WHERE_REQUEST), self._idle_ranks,
                          what="the cell" if cell is not None else "the function")
        poll, failed_at = 0.002, None
        try:
            while not result.ready():
                result.wait(poll)
                poll = min(poll * 2, _POLL_MAX_S)
                output.poll()
                self._raise_if_dead(ranks)
                now = time.monotonic()
                if failed_at is None and rank_errors(result, ranks):
                    failed_at = now
                failure = None
                if failed_at is not None:
                    if now - failed_at > _FAILURE_GRACE_S and not result.ready():
                        failure = self._recover_from_rank_failure(result, ranks, cell, source)
                elif (stuck := watch.poll(now)) and not result.ready():
                    failure = self._recover_from_deadlock(result, ranks, stuck, watch.gone, cell, source)
                if failure is not None:
                    output.finish()
                    raise failure
        except KeyboardInterrupt:
            self._handle_interrupt(result)
            raise
        output.finish()
        self._repair_if_broken(result, ranks)
        return output

    def _handle_interrupt(self, result: Any) -> None:
        """Interrupt every engine; if one stays stuck (e.g. in a collective), restart the world."""
        print("colab_par: interrupting all engines…", file=sys.stderr)
        self.interrupt()
        deadline = time.monotonic() + self.interrupt_grace
        while time.monotonic() < deadline and not result.ready():
            result.wait(0.1)
        if not result.ready():
            print(f"colab_par: engines still busy {self.interrupt_grace:.0f}s after the interrupt "
                  "(stuck in a collective?); restarting engines and the process group. "
                  "Variables defined on the engines are gone.", file=sys.stderr)
            self.restart()

    def _recover_from_rank_failure(self, result: Any, ranks: list[int], cell: str | None,
                                   source: str | None) -> Exception:
        """Some ranks failed while others still run, most likely waiting for them in a collective."""
        errors = rank_errors(result, ranks)  # the causes (the others' errors come from freeing them)
        return self._stop_and_repair(result, ranks, cell, source, lambda waiting, repaired: rank_failure(
            errors or rank_errors(result, ranks), waiting, repaired))

    def _recover_from_deadlock(self, result: Any, ranks: list[int], stuck: dict[int, str],
                               gone: dict[int, str], cell: str | None, source: str | None) -> Exception:
        """Ranks wait in collectives that can never complete (`TaskWatch`)."""
        return self._stop_and_repair(result, ranks, cell, source, lambda waiting, repaired:
                                     CollectiveDeadlockError(stuck, waiting, gone, repaired))

    def _stop_and_repair(self, result: Any, ranks: list[int], cell: str | None, source: str | None,
                         failure: Callable[[dict[int, str], str], Exception]) -> Exception:
        """Busy ranks that can never finish (they wait on a rank that failed, or in collectives that
        can never complete): record where each is, free them and re-form the world
        (`_free_and_rejoin`); `failure(waiting, repaired)` is the error that says so."""
        started = time.monotonic()
        waiting = self._where(busy_ranks(result, ranks), cell, source)
        return failure(waiting, self._free_and_rejoin(result, ranks, started))

    def _free_and_rejoin(self, result: Any, ranks: list[int], started: float) -> str:
        """Make every pending collective fail now (each rank breaks its own connections, from its
        control thread: `probe.abort`), interrupt what still runs Python, then re-initialise the
        world; a rank still busy after all that is stuck where nothing reaches it, and only fresh
        engines free it. Returns what was done, and what it cost, in words."""
        self._answers(self._request(range(self.n), probe.ABORT_REQUEST,
                                    {"addresses": self._world_addresses()}), _ABORT_WAIT_S)
        result.wait(_ABORT_WAIT_S)
        if not result.ready():
            self.interrupt(busy_ranks(result, ranks))
            result.wait(_ABORT_WAIT_S)
        if not result.ready():
            stuck = busy_ranks(result, ranks)
            self._signal(signal.SIGKILL, stuck)  # stuck in C++: a polite shutdown would wait for them
            self.restart()
            return (f"rank(s) {ranks_text(stuck)} stayed busy after the group was aborted and an "
                    "interrupt, so the engines and the process group were restarted: every engine "
                    "variable is gone; re-run the cells that set them up.")
        return self._rejoin_and_report(started)

    def _repair_if_broken(self, result: Any, ranks: list[int]) -> None:
        """A task that ended in transport errors (a collective timed out, a peer left) leaves a
        broken group behind: re-initialise it now and say so, instead of failing the next cell."""
        errors = rank_errors(result, ranks)
        if any(is_transport_error(name, value) for name, value, _ in errors.values()):
            raise rank_failure(errors, {}, self._rejoin_and_report(time.monotonic()))

    def _rejoin_and_report(self, started: float) -> str:
        self._join_world()
        kept = _kept_text(self._stale_names(list(range(self.n))), "engine variables")
        return (f"the process group was torn down and re-initialised with a fresh store in "
                f"{time.monotonic() - started:.1f}s; {kept}.")

    # ---- asking engines from their control thread (answers while a task runs) -------------------
    def _request(self, ranks: Iterable[int], request: str, content: dict | None = None) -> dict[int, Any]:
        """Send a `probe` request to the live ones of `ranks`; one future per rank for its reply."""
        live = set(self._live_ranks())
        ranks = [rank for rank in ranks if rank in live]
        if not ranks:
            return {}
        futures = compat.send_control_requests(self._client, [self._engine_ids[r] for r in ranks], request,
                                               content or {})
        return dict(zip(ranks, futures))

    @staticmethod
    def _answers(futures: dict[int, Any], timeout: float) -> dict[int, dict[str, Any]]:
        """The replies that came within `timeout` and succeeded, by rank."""
        if futures:
            concurrent.futures.wait(list(futures.values()), timeout=timeout)
        replies = {rank: future.result()["content"] for rank, future in futures.items()
                   if future.done() and not future.exception()}
        return {rank: reply for rank, reply in replies.items() if reply.get("status") == "ok"}

    def _idle_ranks(self, ranks: list[int]) -> set[int]:
        """The live ones of `ranks` that have no task queued or running: none the hub knows of, and
        none of this client's still unanswered (the direct channel's pass the hub by)."""
        live = set(self._live_ranks())
        queues = self._client.queue_status(targets=[self._engine_ids[r] for r in ranks if r in live])
        waiting, calls = compat.unanswered(self._client), self._direct.unanswered()
        return {rank for rank in ranks if rank in live and queues[self._engine_ids[rank]]["queue"] == 0
                and not waiting.get(self._engine_ids[rank]) and not calls.get(self._engine_ids[rank])}

    def _live_ranks(self) -> list[int]:
        dead = set(self._dead_ranks())
        return [rank for rank in range(self.n) if rank not in dead]

    def _where(self, ranks: list[int], cell: str | None, source: str | None = None) -> dict[int, str]:
        """Where each busy rank is (`source`: the file of the function `run` shipped, whose code
        reaches the engines without its file name): asked from the engine's control thread; for a
        rank that cannot answer (its main thread holds the GIL), from the stack dump its SIGUSR1
        handler writes, on this host."""
        answers = self._answers(self._request(ranks, probe.WHERE_REQUEST), 1.0)
        found = {rank: where_waiting(answer["dump"], cell, source) for rank, answer in answers.items()}
        return {**found, **self._dumped_stacks([r for r in ranks if r not in found], cell, source)}

    def _dumped_stacks(self, ranks: list[int], cell: str | None, source: str | None) -> dict[int, str]:
        local = [r for r in ranks if self._is_local(self._hosts[r])]
        for rank in local:
            os.truncate(self._stack_files[rank], 0)
        self._signal(signal.SIGUSR1, ranks)
        dumps: dict[int, str] = {}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and len(dumps) < len(local):
            time.sleep(0.05)
            for rank in local:
                with open(self._stack_files[rank]) as dump:
                    text = dump.read()
                if compat.ENGINE_MAIN_FILE in text:  # the main thread's dump is complete
                    dumps[rank] = text
        remote = {r: f"on {self._hosts[r]['host']}: it did not answer, and SIGUSR1 asked it to dump its "
                     f"stacks to {self._stack_files[r]} there" for r in ranks if r not in local}
        return {**{r: where_waiting(dumps.get(r, ""), cell, source) for r in local}, **remote}


def _kept_text(stale: list[str], what: str) -> str:
    """`what` are kept, naming those of them that hold the old process group."""
    if not stale:
        return f"{what} are kept (none of them held the old group)"
    return (f"{what} are kept, but {', '.join(stale)} {'holds' if len(stale) == 1 else 'hold'} the old "
            "group and must be rebuilt (a ParallelModel, its optimizer and Trainer, DTensors, "
            "DeviceMesh and DDP/FSDP modules all live on one process group)")


def _listed(names: list[str], most: int = 12) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _source_file(fn: Callable[..., Any]) -> str | None:
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else None


def _recovery_policy(result: Any) -> dict[str, Any] | None:
    """What a cell's `Trainer(on_failure="restart")` published (ckpt_dir, max_restarts), if any."""
    try:
        published = per_rank_data(result.data)
    except Exception:  # noqa: BLE001 - a task lost with its engine may hold no data at all
        return None
    key = recovery.RECOVERY_KEY
    return next((data[key] for data in published if data and key in data), None)


def _ranked_by_host(ids: list[int], hosts: list[dict[str, Any]]) -> tuple[list[int], list[dict[str, Any]]]:
    """Ranks in host order (hosts in the order their first engine registered), engines of a host
    contiguous and in registration order: a host's local ranks are then consecutive world ranks,
    which keeps tensor-parallel groups (the innermost mesh dim) on one host."""
    first = {}
    for eid, info in zip(ids, hosts):
        first.setdefault(info["host"], eid)
    order = sorted(range(len(ids)), key=lambda i: (first[hosts[i]["host"]], ids[i]))
    return [ids[i] for i in order], [hosts[i] for i in order]


def _engine_config(nanny: bool, pool: warm_pool.WarmPool | None = None) -> Config:
    """Engines import torch while the controller is still starting, instead of after it.

    ipyparallel waits a fixed second between controller and engines and imports torch only when
    the first task arrives; launching engines at once (they poll for the controller's connection
    file) with torch preloaded takes both off the critical path. Importing torch does not touch CUDA,
    so binding each engine to its GPU still happens first. Engines on this host need no nanny
    process (its one job, remote signalling, is a plain `os.kill` here), and starting one sits inside
    every engine's registration. With a warm `pool`, controller and engines are forked from it,
    their imports already done (`colab_par.warm_pool`). The controller registers an engine when
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
    its first call, and `Cluster._prepare` cloudpickle: done here, while the engines start,
    neither waits on engines that already registered."""
    import cloudpickle  # noqa: F401 - imported for its side effect: loaded before it is needed
    from ipyparallel.serialize import can, uncan

    can(None)
    uncan(None)


def _reap(pids: set[int], grace_s: float) -> None:
    """SIGTERM, wait, SIGKILL: nothing the cluster started survives stop()."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_LIVE: "set[Cluster]" = set()


def _stop_all_at_exit() -> None:
    for cluster in list(_LIVE):
        cluster.stop()


atexit.register(_stop_all_at_exit)
