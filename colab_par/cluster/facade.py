"""`Cluster`: the one object users hold, a façade over rooms with one job each.

The rooms share one `ClusterState` and are handed what they need when built here: `World`
(process group), `Lifecycle` (start/stop), `Calls` (reaching ranks), `Faults` (recovery),
`Execution` (running code), `Inspection` (status, debug, pull) and `persistence` (attach).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence

from colab_par.cluster.backend import BACKENDS
from colab_par.cluster.calls import Calls
from colab_par.cluster.execution import Execution
from colab_par.cluster.faults import Faults
from colab_par.cluster.health import dead_ranks as _dead_ranks, live_ranks, raise_if_dead
from colab_par.cluster.inspection import Inspection
from colab_par.cluster.lifecycle import Lifecycle
from colab_par.cluster.persistence import find_record, options_of, restore
from colab_par.cluster.state import ClusterState
from colab_par.cluster.world import World
from colab_par.cluster.launchers import Launcher, launcher_from


class _Shared:
    """A `Cluster` attribute kept in its rooms' shared state (read and set there)."""

    def __init__(self, name: str | None = None):
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, cluster: Any, owner: type | None = None) -> Any:
        return self if cluster is None else getattr(cluster._state, self.name)

    def __set__(self, cluster: Any, value: Any) -> None:
        setattr(cluster._state, self.name, value)


class Cluster:
    """ipyparallel engines forming one torch.distributed world, usable from plain Python.

    ``n=None`` starts one engine per GPU of this host (2 on a host without one), one per SSH host
    slot, or gpus_per_node × nodes of a Slurm job. ``backend=None`` picks nccl when every engine
    reports a GPU of its own on its host, else gloo, which computes on the CPU (`colab_par.cluster.backend`);
    an explicit "nccl" that some engine's host cannot serve is refused before the world forms.
    ``timeout`` bounds every collective (the process group's timeout) and engine start-up, so
    nothing waits forever. Every engine's torch and Python generators start from ``seed`` at each
    start and restart, so a notebook run repeats (``seed=None`` leaves each process's own draw).
    ``launcher`` says where engines run:
    "local" (this host), "mpi", "slurm" or ``Slurm(partition=..., account=..., time=...)``, or
    ``SSH({"node1": 2, "node2": 2})``; ranks are grouped by host.
    ``persist=True`` leaves controller and engines running when this kernel exits; a later kernel
    joins them, variables and all, with `Cluster.attach` (`colab_par.cluster.persist`), and `stop` ends them.
    """

    launcher, timeout, interrupt_grace = _Shared(), _Shared(), _Shared()
    dashboard, seed, persist = _Shared(), _Shared(), _Shared()
    devices, backend, generation, created = _Shared(), _Shared(), _Shared(), _Shared()
    _ipp, _client = _Shared("ipp"), _Shared("client")  # ipyparallel's cluster and client, for tools

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
        self._state = state = ClusterState(
            requested_n=n, requested_backend=backend, launcher=launcher, timeout=float(timeout),
            interrupt_grace=interrupt_grace, dashboard=dashboard, seed=seed, persist=persist,
            ipp_options=ipp_options)
        self._calls, self._world = Calls(state), World(state)
        self._lifecycle = Lifecycle(state, self._world)
        self._faults = Faults(state, self._calls, self._world, self._lifecycle)
        self._execution = Execution(state, self._calls, self._lifecycle, self._faults)
        self._inspection = Inspection(state, self._calls, self._execution)

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._state.running

    @property
    def n(self) -> int:
        return self._state.n

    @property
    def pids(self) -> set[int]:
        """The processes this cluster started on this host (controller, engines, launcher helpers)."""
        return self._state.pids

    def start(self) -> "Cluster":
        """Start engines, bind devices and initialise the process group; a no-op when running."""
        self._lifecycle.start()
        return self

    def stop(self) -> None:
        """Stop controller and engines and make sure no process of theirs is left."""
        self._lifecycle.stop()

    def restart(self) -> "Cluster":
        """Fresh engines and a fresh process group (after a dead rank or a stuck collective)."""
        self._lifecycle.restart()
        return self

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
        return self._execution.run(fn, *args, **kwargs)

    def submit(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start ``fn(*args, **kwargs)`` on one rank and return at once (an ipyparallel
        AsyncResult): for independent work such as a sweep's tasks, outside the world's collectives."""
        return self._execution.submit(rank, fn, *args, **kwargs)

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone."""
        return _dead_ranks(self._state)

    def check_alive(self, ranks: Iterable[int]) -> None:
        """Raise DeadEngineError naming any of `ranks` whose engine died."""
        raise_if_dead(self._state, ranks)

    def execute(self, code: str, *, targets: Sequence[int] | None = None, all_output: bool = False,
                namespace: dict[str, Any] | None = None,
                fresh_namespace: Callable[[], dict[str, Any]] | None = None, cell_number: int | None = None) -> None:
        """Run a cell on the ranks (all by default): rank 0's output streams live.

        Other ranks' output is shown when it differs from rank 0's, or always with ``all_output``.
        ``namespace`` is pushed to the engines first (shipped notebook definitions). ``cell_number``
        names the cell on the engines as the notebook numbers it (``Cell In[N]`` in tracebacks).

        When an engine dies while the cell fits a ``Trainer(checkpoints=Checkpoints(..., on_failure="restart"))``, the dead
        engines are replaced (`replace_dead`; every engine restarted where engines cannot be
        replaced one by one) and the cell runs again (with ``fresh_namespace()``, default
        ``namespace``: a fresh engine holds nothing earlier cells defined), its fit resuming from
        the last committed checkpoint; after the Trainer's ``max_restarts`` the cell fails with
        what happened (RecoveryError).
        """
        return self._execution.execute(code, targets, all_output, namespace, fresh_namespace, cell_number)

    def profile(self, code: str, *, trace_dir: str | os.PathLike | None = None, **execute: Any) -> Any:
        """Run a cell like `execute` with torch.profiler recording on every rank; returns the
        `colab_par.profiling.Timeline` (a lane block per rank; it draws itself in a notebook).
        Each rank writes its raw trace to `trace_dir` (default: a new folder under
        ./colab_par_traces) as ``rank<N>.pt.trace.json``, for Perfetto or TensorBoard."""
        from colab_par.profiling.session import profile_cell

        return profile_cell(self, code, trace_dir=trace_dir, **execute)

    def status(self) -> list[dict[str, Any]]:
        """Per rank: host, pid, device, alive, memory in use (busy ranks report what is known)."""
        return self._inspection.status()

    def interrupt(self, ranks: Iterable[int] | None = None) -> None:
        """Send SIGINT to every engine (the notebook's stop button), or to `ranks`: directly on this
        host, through ipyparallel's nanny on others."""
        self._calls.interrupt(ranks)

    # ---- engines that outlive the kernel --------------------------------------------------------
    @classmethod
    def attach(cls, id: str | None = None, *, profile_dir: str | None = None) -> "Cluster":
        """Join a cluster started with ``persist=True`` on this host by an earlier (or another)
        kernel: the newest one, or the one with this `id` (`colab_par.running_clusters()`). Its
        engines keep every variable, their process group, device and rank."""
        record = find_record(id, profile_dir)
        cluster = cls(**options_of(record))
        cluster._join(record)
        return cluster

    def _join(self, record: dict[str, Any]) -> None:
        """Connect to the recorded engines and their direct channels (opened when they started)."""
        restore(self._state, record)
        self._world.open_direct(live_ranks(self._state))

    @property
    def cluster_id(self) -> str | None:
        """ipyparallel's id of the running cluster (what `attach` and `running_clusters` name)."""
        return self._ipp.cluster_id if self._ipp is not None else None

    # ---- losing one engine, not the session -----------------------------------------------------
    def replace_dead(self) -> str:
        """Fresh engines for the dead ranks only, each in its rank's place (same host, local rank
        and device), then the world re-formed with a fresh store; every other rank keeps its
        variables. Every rank's generators are re-seeded from `seed`, as at a start, so the ranks
        agree again. Returns what was done and what was lost (the dead ranks' variables, and
        everywhere the objects built on the old process group)."""
        return self._faults.replace_dead()

    # ---- post-mortem debugging and pulling variables -------------------------------------------
    def debug(self, rank: int | None = None, commands: Sequence[str] | None = None) -> None:
        """A post-mortem debugger (pdb) on the frame where `rank`'s last error was raised, driven
        from here: `commands` in order (scripts, tests), or each command read with ``input()`` (a
        notebook's input box) until q. ``rank=None``: the first rank whose error is its own (not
        a broken connection or the kit's interrupt after another rank failed). Only that rank is
        asked, one short task per command (`colab_par.cluster.debugger`). A rank keeps its last error's
        frames, and their locals, until its next successful cell or `clear_errors`."""
        self._inspection.debug(rank, commands)

    def clear_errors(self, ranks: Iterable[int] | None = None) -> list[int]:
        """Release the frames (and the local variables they keep alive) of each rank's last error,
        and any debugger on them; returns the ranks that had one."""
        return self._inspection.clear_errors(ranks)

    def pull(self, name: str, rank: int = 0, *, max_bytes: int | None = None) -> Any:
        """Engine variable `name` (or a dotted path, "pm.model.lm_head.weight") of `rank`, here on
        the CPU: a DTensor gathered whole, a sharded model (ParallelModel, FSDP/DTensor module) as
        its full state dict, a module as its state dict, anything else as it is. Refused, before
        anything moves, when it is larger than `max_bytes` (default: a third of this host's
        available memory: the gathered copy, the message and the result coexist while it moves)."""
        return self._inspection.pull(name, rank, max_bytes)

    def names(self, rank: int = 0) -> list[str]:
        """The variables `rank`'s engine holds (its interactive namespace, hidden names left out)."""
        return self._inspection.names(rank)

    def check_devices(self) -> list[str]:
        """What is wrong with where the engines compute (`backend.device_problems`): empty when each
        computes on its own GPU under nccl, or on the CPU (CUDA untouched) under gloo."""
        return self._inspection.check_devices()
