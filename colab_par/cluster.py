"""The engines' lifecycle: ipyparallel controller + engines, device binding, process group, health.

One `Cluster` owns one ipyparallel cluster whose engines are the ranks of one torch.distributed
world (rank = engine order). It knows nothing about models or layouts: it starts, runs code,
reports, interrupts, restarts and stops.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import cloudpickle
import ipyparallel as ipp
from traitlets.config import Config

from colab_par import engine
from colab_par.ship import ship_by_value

__all__ = ["Cluster", "EngineError", "DeadEngineError"]

LAUNCHERS = ("local", "mpi", "slurm", "ssh")
BACKENDS = ("nccl", "gloo")
_POLL_MAX_S = 0.25


class EngineError(RuntimeError):
    """Errors raised on engines, grouped: one traceback per distinct error with the ranks that hit it."""

    def __init__(self, groups: list[tuple[list[int], str, str, str]]):
        self.groups = groups  # (ranks, name, value, traceback text)
        summary = "; ".join(f"{name}: {value} (ranks {_ranks(ranks)})" for ranks, name, value, _ in groups)
        super().__init__(summary)

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the client-side traceback of the magic itself."""
        lines: list[str] = []
        for ranks, name, value, traceback in self.groups:
            lines.append(f"[ranks {_ranks(ranks)}] {name}: {value}")
            lines.extend(traceback.rstrip("\n").splitlines())
            lines.append("")
        return lines

    def __str__(self) -> str:
        return "\n".join([super().__str__(), ""] + self._render_traceback_())


class DeadEngineError(EngineError):
    """One or more engines died; the world is broken until a restart."""

    def __init__(self, dead: Sequence[int], detail: str):
        message = (f"rank(s) {_ranks(dead)} died ({detail}); the process group is broken. "
                   "Run `%colossal restart` (or `cluster.restart()`) to start fresh engines.")
        super().__init__([(list(dead), "DeadEngineError", message, "")])
        self.dead = list(dead)

    def __str__(self) -> str:
        return self.groups[0][2]


def _ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in ranks)


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

    ``n=None`` starts one engine per visible CUDA GPU, or 2 CPU engines when there is none;
    ``backend=None`` picks nccl on CUDA and gloo on CPU. ``timeout`` bounds every collective
    (the process group's timeout) and engine start-up, so nothing waits forever.
    """

    def __init__(self, n: int | None = None, *, backend: str | None = None, launcher: str = "local",
                 timeout: float = 300.0, interrupt_grace: float = 10.0, dashboard: bool = True,
                 **ipp_options: Any):
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher={launcher!r} is unknown; use one of {', '.join(LAUNCHERS)}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; use 'nccl' (CUDA) or 'gloo' (CPU)")
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"n={n!r} must be a positive number of engines, e.g. n=2")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, e.g. 300")
        self._requested_n, self._requested_backend = n, backend
        self.launcher, self.timeout, self.interrupt_grace = launcher, float(timeout), interrupt_grace
        self.dashboard = dashboard
        self._ipp_options = ipp_options
        self._ipp: ipp.Cluster | None = None
        self._client: ipp.Client | None = None
        self._ids: list[int] = []
        self._hosts: list[dict[str, Any]] = []
        self._pids: set[int] = set()
        self.devices: list[str] = []
        self.backend: str | None = None
        self.generation = 0  # bumped at every start: engine namespaces do not survive it

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def n(self) -> int:
        return len(self._ids)

    def start(self) -> "Cluster":
        """Start engines, bind devices and initialise the process group; a no-op when running."""
        if self.running:
            print(f"colab_par: {self.n} engines already running ({self.backend}); nothing to do. "
                  "Use restart() for fresh engines.")
            return self
        n, backend = self._resolve_n_backend()
        self._prepare_launcher_environment()
        before = descendant_pids()
        options = dict(n=n, engines=self.launcher, log_level=logging.ERROR, delay=0,
                       config=_engine_config(nanny=self.launcher not in ("local", "mpi")))
        # The hub registers an engine at its first heartbeat: ipyparallel's 3 s period would add up
        # to 3 s to every start, and 0.5 s also notices a dead remote engine within 5 s.
        options["controller_args"] = ["--HeartMonitor.period=500"]
        if self.launcher in ("local", "mpi"):
            options["controller_ip"] = "127.0.0.1"
        options.update(self._ipp_options)
        self._ipp = ipp.Cluster(**options)
        try:
            self._ipp.start_cluster_sync(n=n)
            self._client = self._ipp.connect_client_sync()
            self._client.wait_for_engines(n, timeout=self.timeout, interactive=False)  # no progress bar
            self._ids = sorted(self._client.ids)[:n]
            self._pids = descendant_pids() - before
            self._bootstrap(backend)
        except BaseException:
            self.stop()
            raise
        self.generation += 1
        _LIVE.add(self)
        return self

    def stop(self) -> None:
        """Stop controller and engines and make sure no process of theirs is left."""
        engine_pids = {info["pid"] for info in self._hosts if self._is_local(info)}
        started = self._pids | engine_pids
        if self._client is not None:
            self._shutdown_engines(engine_pids)
            self._client.close()
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception as exc:  # noqa: BLE001 - fall through to killing what is left
                print(f"colab_par: ipyparallel stop failed ({exc}); killing leftover processes",
                      file=sys.stderr)
        _reap(started, grace_s=10.0)
        self._ipp, self._client, self._ids, self._hosts, self._pids = None, None, [], [], set()
        self.devices = []
        _LIVE.discard(self)

    def _shutdown_engines(self, engine_pids: set[int]) -> None:
        """Ask engines to exit through ipyparallel first: much faster than the launcher's SIGTERM.

        Engines holding a process group can take seconds to die from SIGTERM, and ipyparallel
        then waits 5 s per engine set before escalating; a shutdown request ends them at once.
        """
        live = self._live_ids()
        if not live:
            return
        try:
            self._client.shutdown(targets=live, hub=False, block=False)
        except Exception:  # noqa: BLE001 - the stop path below still cleans up
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_pid_alive(p) for p in engine_pids):
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
        return f"Cluster({state}, launcher={self.launcher!r})"

    # ---- running code ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        view = self._view(None)
        ship_by_value(fn, *args, *kwargs.values())
        result = view.apply_async(fn, *args, **kwargs)
        self._wait(result, self._ranks_of(view.targets), stream=False)
        return self._values(result)

    def execute(self, code: str, *, targets: Sequence[int] | None = None, all_output: bool = False,
                namespace: dict[str, Any] | None = None) -> None:
        """Run a cell on the ranks (all by default): rank 0's output streams live.

        Other ranks' output is shown when it differs from rank 0's, or always with ``all_output``.
        ``namespace`` is pushed to the engines first (shipped notebook definitions).
        """
        view = self._view(targets)
        ranks = self._ranks_of(view.targets)
        if namespace:
            shipped = view.apply_async(engine.update_namespace, cloudpickle.dumps(namespace))
            self._wait(shipped, ranks, stream=False)
            self._values(shipped)
        result = view.execute(code, silent=False, block=False)
        self._wait(result, ranks, stream=True)
        self._show_other_output(result, ranks, all_output)
        self._values(result)
        first = result.execute_result[0]
        if first is not None and "text/plain" in first.get("data", {}):
            print(first["data"]["text/plain"])

    def status(self) -> list[dict[str, Any]]:
        """Per rank: host, pid, device, alive, memory in use (busy ranks report what is known)."""
        if not self.running:
            return []
        rows = []
        dead = set(self._dead_ranks())
        for rank, engine_id in enumerate(self._ids):
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

    def interrupt(self) -> None:
        """Send SIGINT to every engine (the notebook's stop button): directly on this host, through
        ipyparallel's nanny on others."""
        if not self.running:
            return
        remote = []
        for rank in set(range(self.n)) - set(self._dead_ranks()):
            info = self._hosts[rank]
            if self._is_local(info):
                try:
                    os.kill(info["pid"], signal.SIGINT)
                except ProcessLookupError:
                    pass
            else:
                remote.append(self._ids[rank])
        if remote:
            self._client.send_signal(signal.SIGINT.name, targets=remote, block=False)

    # ---- internals ------------------------------------------------------------------------------
    def _resolve_n_backend(self) -> tuple[int, str]:
        gpus = _visible_gpus()
        backend = self._requested_backend or ("nccl" if gpus else "gloo")
        if backend == "nccl" and not gpus:
            raise ValueError("backend='nccl' needs CUDA GPUs but none is visible; use backend='gloo'")
        n = self._requested_n or (gpus if backend == "nccl" else 2)
        if backend == "nccl" and self.launcher == "local" and n > gpus:
            raise ValueError(f"n={n} engines but only {gpus} GPUs are visible; use n<={gpus} or "
                             "backend='gloo'")
        self.backend = backend
        return n, backend

    def _prepare_launcher_environment(self) -> None:
        """OpenMPI refuses root and over-subscription by default; containers are often both."""
        if self.launcher == "mpi":
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
                os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            os.environ.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")

    def _bootstrap(self, backend: str) -> None:
        """Bind devices (before CUDA starts on the engines), then rendezvous on rank 0's host."""
        view = self._client[self._ids]
        view.use_cloudpickle().get(timeout=self.timeout)
        self._hosts = view.apply_async(engine.host_info).get(timeout=self.timeout)
        hosts = [info["host"] for info in self._hosts]
        local_rank = [hosts[:rank].count(host) for rank, host in enumerate(hosts)]
        bind = [self._client[[eid]].apply_async(engine.bind_device, local_rank[r], hosts.count(hosts[r]),
                                              backend) for r, eid in enumerate(self._ids)]
        self.devices = [self._get(result, rank) for rank, result in enumerate(bind)]
        single_host = all(self._is_local(info) for info in self._hosts)
        addr = "127.0.0.1" if single_host else self._hosts[0]["ip"]
        port = self._get(self._client[[self._ids[0]]].apply_async(engine.free_port), 0)
        joins = [self._client[[eid]].apply_async(engine.init_process_group, backend, addr, port, rank,
                                               len(self._ids), self.timeout, "lo" if single_host else None)
                 for rank, eid in enumerate(self._ids)]
        for rank, result in enumerate(joins):
            self._get(result, rank)
        for rank, eid in enumerate(self._ids):
            self._client[[eid]].push({"rank": rank, "world_size": len(self._ids),
                                    "local_rank": local_rank[rank], "device": self.devices[rank]},
                                   block=True)

    def _get(self, result: Any, rank: int) -> Any:
        if not result.wait(self.timeout):
            raise TimeoutError(f"rank {rank} did not answer within {self.timeout:.0f}s during start-up")
        return self._values(result)[0]

    @staticmethod
    def _is_local(info: dict[str, Any]) -> bool:
        return info["host"] == socket.gethostname()

    def _require_running(self) -> None:
        if not self.running:
            raise RuntimeError("no engines are running; start them with `%colossal start` "
                               "(or colab_par.Cluster(n=2).start())")

    def _view(self, targets: Sequence[int] | None) -> Any:
        self._require_running()
        ranks = list(range(self.n)) if targets is None else list(targets)
        bad = [r for r in ranks if not 0 <= r < self.n]
        if bad:
            raise ValueError(f"rank(s) {_ranks(bad)} do not exist; this cluster has ranks 0..{self.n - 1}")
        self._raise_if_dead(ranks)
        view = self._client[[self._ids[r] for r in ranks]]
        view.block = False
        return view

    def _ranks_of(self, engine_ids: Any) -> list[int]:
        ids = engine_ids if isinstance(engine_ids, list) else [engine_ids]
        return [self._ids.index(eid) for eid in ids]

    def _live_ids(self) -> list[int]:
        dead = set(self._dead_ranks())
        return [eid for rank, eid in enumerate(self._ids) if rank not in dead]

    def _dead_ranks(self) -> list[int]:
        registered = set(self._client.ids) if self._client is not None else set()
        dead = []
        for rank, eid in enumerate(self._ids):
            info = self._hosts[rank] if rank < len(self._hosts) else None
            if eid not in registered or (info and self._is_local(info) and not _pid_alive(info["pid"])):
                dead.append(rank)
        return dead

    def _raise_if_dead(self, ranks: Iterable[int]) -> None:
        dead = [r for r in self._dead_ranks() if r in set(ranks)]
        if dead:
            pids = ", ".join(f"rank {r}: pid {self._hosts[r]['pid']} on {self._hosts[r]['host']}"
                             for r in dead)
            raise DeadEngineError(dead, pids)

    def _wait(self, result: Any, ranks: list[int], *, stream: bool) -> None:
        """Wait without a deadline (training may be long) but never on a dead rank; stream rank 0."""
        poll, shown, dashboard = 0.002, 0, None
        try:
            while not result.ready():
                result.wait(poll)
                poll = min(poll * 2, _POLL_MAX_S)
                if stream:
                    shown = self._stream_first(result, shown)
                dashboard = self._feed_dashboard(result, dashboard)
                self._raise_if_dead(ranks)
        except KeyboardInterrupt:
            self._handle_interrupt(result)
            raise
        if stream:
            result.wait_for_output(timeout=5.0)  # iopub output can trail the reply
            self._stream_first(result, shown)
        if dashboard is not None:
            dashboard.finish(_per_rank(result.data))

    def _stream_first(self, result: Any, shown: int) -> int:
        stdout = result.stdout
        text = stdout[0] if isinstance(stdout, list) else stdout
        if text and len(text) > shown:
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            return len(text)
        return shown

    def _feed_dashboard(self, result: Any, dashboard: Any) -> Any:
        if not self.dashboard:
            return None
        data = _per_rank(result.data)
        if dashboard is None and any(data):
            from colab_par.dashboard import LiveDashboard

            dashboard = LiveDashboard()
        if dashboard is not None:
            dashboard.update(data)
        return dashboard

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

    def _show_other_output(self, result: Any, ranks: list[int], all_output: bool) -> None:
        outputs = result.stdout if isinstance(result.stdout, list) else [result.stdout]
        first = outputs[0]
        for rank, text in zip(ranks[1:], outputs[1:]):
            if text and (all_output or text != first):
                sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))

    def _values(self, result: Any) -> list[Any]:
        """Results of a list-targeted view (always a list, rank order), or the grouped errors."""
        try:
            return result.get()
        except ipp.error.CompositeError as exc:
            raise _grouped(exc.elist, self._ids) from None
        except ipp.error.RemoteError as exc:
            raise _grouped([(exc.ename, exc.evalue, exc.traceback, exc.engine_info)], self._ids) from None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL_NUMBER = re.compile(r"In\s*\[\d+\]")


def _grouped(elist: list[tuple], engine_ids: list[int]) -> EngineError:
    """One group per distinct error; engines' own cell counters do not make errors distinct."""
    groups: dict[tuple[str, str, str], tuple[list[int], str]] = {}
    for name, value, traceback, info in elist:
        engine_id = (info or {}).get("engine_id")
        rank = engine_ids.index(engine_id) if engine_id in engine_ids else -1
        key = (name, str(value), _CELL_NUMBER.sub("In[]", _ANSI.sub("", traceback or "")))
        groups.setdefault(key, ([], traceback or ""))[0].append(rank)
    return EngineError([(sorted(ranks), name, value, shown)
                        for (name, value, _), (ranks, shown) in groups.items()])


def _per_rank(data: Any) -> list[dict[str, Any] | None]:
    if isinstance(data, list):
        return [d or None for d in data]
    return [data or None]


def _engine_config(nanny: bool) -> Config:
    """Engines import torch while the controller is still starting, instead of after it.

    ipyparallel waits a fixed second between controller and engines and imports torch only when
    the first task arrives; launching engines at once (they poll for the controller's connection
    file) with torch preloaded takes both off the critical path. Importing torch does not touch CUDA,
    so binding each engine to its GPU still happens first. Engines on this host need no nanny
    process (its one job, remote signalling, is a plain `os.kill` here), and starting one sits inside
    every engine's registration.
    """
    config = Config()
    config.EngineLauncher.engine_cmd = [
        sys.executable, "-c", "import torch.distributed; from ipyparallel.engine.app import main; main()",
        f"--IPEngine.enable_nanny={nanny}"]
    config.LocalEngineSetLauncher.delay = 0.0  # ranks come from sorted engine ids, not launch order
    return config


def _visible_gpus() -> int:
    """CUDA GPUs this process sees; a host without the NVIDIA driver answers without importing torch."""
    if sys.platform.startswith("linux") and not os.path.exists("/dev/nvidiactl"):
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable torch CUDA means no GPUs
        return 0


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
