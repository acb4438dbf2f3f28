"""GRPO with generator engines apart from the trainer engines, driven from the notebook: a single
controller (verl's shape) over two clusters, each its own torch.distributed world.

    gens = Generators(generator_cluster, max_offpolicy_steps=1)
    run = gens.start(trainer_cluster, build)   # returns at once; build(role) -> GRPO on every engine,
                                               # or "grpo": the engine variable cells made on each side
    rows = run.wait()                          # trainer rank 0's rows

The controller serves the bridge's store (`training/grpo/bridge.py`) on this host, then runs
`generators.run_side` on both clusters at once (one thread each, through `Cluster.run`, so each
side keeps its cluster's own fault handling: dead engines, ranks stuck after another's error).
When one side fails, the other learns it from the bridge within milliseconds (the failed side
closes its bridge; a peer waiting on it fails at once); as a safety net the controller then
closes the store (which fails a side still joining) and, if that side still runs after a few
seconds, interrupts its engines. `wait` raises the error of the side that failed first for a
reason of its own (not the other side's "bridge closed"), with a note saying which side it was.
Both clusters stay usable afterwards: only the run's functions ended, no engine was restarted
unless a cluster's own fault handling had to.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any, Callable

from colab_par.cluster.world import served_store
from colab_par.cluster.facade import Cluster
from colab_par.cluster.output import EngineError
from colab_par.training.grpo.bridge import BridgeLink
from colab_par.training.grpo.generators import ROLES, run_side

__all__ = ["Generators", "GeneratorRun"]

Loop = str | Callable[[str], Any]  # an engine variable's name, or build(role) -> GRPO
_STOP_GRACE_S = 3.0  # after one side failed, how long the other may take to notice before it is interrupted


@dataclasses.dataclass(frozen=True)
class Generators:
    """Engines that only generate (`cluster`, a Cluster of their own), and how many optimizer steps
    behind the trainers' weights a rollout may be sampled (`max_offpolicy_steps`: 0 is fully
    synchronous, rollout k from the weights after step k - 1; n lets the generators sample up to n
    rollouts ahead while the trainers train). `timeout` bounds every bridge operation (None: the
    trainers' cluster timeout)."""

    cluster: Cluster
    max_offpolicy_steps: int = 0
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, Cluster):
            raise TypeError(f"cluster={self.cluster!r} must be a colab_par.Cluster of generator engines, e.g. "
                            "Generators(Cluster(n=1).start(), max_offpolicy_steps=1)")
        steps = self.max_offpolicy_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"max_offpolicy_steps={steps!r} must be a whole number >= 0 (0: every rollout "
                             "from the newest weights; 1: the generators may run one step ahead)")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r} must be a number of seconds > 0, or None for the "
                             "trainers' cluster timeout")

    def start(self, trainers: Cluster, loop: Loop) -> "GeneratorRun":
        """Start the run on both clusters and return at once (`GeneratorRun.wait` for its rows).
        `loop`: a function of the role ("trainer" or "generator") that builds the GRPO on each
        engine, or the name of the engine variable holding it on both clusters' engines; both
        sides' GRPO have the same prompts, rewards and settings, their ParallelModels the same
        model (the trainers' weights are sent to the generators first)."""
        return GeneratorRun(trainers, self, loop)

    def fit(self, trainers: Cluster, loop: Loop) -> list[dict[str, Any]]:
        """`start` and `wait`: trainer rank 0's rows."""
        return self.start(trainers, loop).wait()


class GeneratorRun:
    """One run in flight (module docstring). After `wait`: `rows` (trainer rank 0's, as
    `GRPO.history`) and `weights_bytes` (version -> tensor bytes sent to the generators)."""

    def __init__(self, trainers: Cluster, generators: Generators, loop: Loop):
        _check(trainers, generators, loop)
        self.rows: list[dict[str, Any]] = []
        self.weights_bytes: dict[int, int] = {}
        self._clusters = {"trainer": trainers, "generator": generators.cluster}
        timeout = generators.timeout or trainers.timeout
        host = _store_host(trainers, generators.cluster)
        self._store = served_store(host, timeout)
        link = BridgeLink(host, self._store.port, f"grpo-{uuid.uuid4().hex[:12]}/", trainers.n,
                          generators.cluster.n, float(timeout))
        self._results: dict[str, Any] = {}
        self._errors: dict[str, BaseException] = {}
        self._failed_at: dict[str, float] = {}
        self._aborted: set[str] = set()
        self._threads = {role: threading.Thread(target=self._side, name=f"grpo-{role}s", daemon=True,
                                                args=(role, loop, link, generators.max_offpolicy_steps))
                         for role in ROLES}
        for thread in self._threads.values():
            thread.start()

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads.values())

    def wait(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Wait for both sides (at most `timeout` seconds: TimeoutError, the run goes on); trainer
        rank 0's rows, or the first side's own error (module docstring)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self.done():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run is still going after {timeout}s; wait() again, or stop it")
                self._stop_the_other_side()
                time.sleep(0.02)
        except KeyboardInterrupt:
            self._abort(list(ROLES))
            raise
        self._store = None
        if self._errors:
            raise self._first_error()
        trainer_zero = self._results["trainer"][0]
        self.rows, self.weights_bytes = trainer_zero["rows"], trainer_zero["weights_bytes"]
        return self.rows

    # ---- the two sides -----------------------------------------------------------------------------
    def _side(self, role: str, loop: Loop, link: BridgeLink, staleness: int) -> None:
        try:
            self._results[role] = self._clusters[role].run(run_side, role, loop, link, staleness)
        except BaseException as error:  # noqa: BLE001 - handed to wait(), which raises it
            self._errors[role], self._failed_at[role] = error, time.monotonic()

    def _stop_the_other_side(self) -> None:
        if not self._failed_at:
            return
        self._store = None  # a side still joining the bridge fails at once
        first = min(self._failed_at.values())
        running = [role for role, thread in self._threads.items() if thread.is_alive() and role not in self._aborted]
        if running and time.monotonic() - first > _STOP_GRACE_S:
            self._abort(running)

    def _abort(self, roles: list[str]) -> None:
        """Interrupt `roles`' engines once, the generators first: their loop closes the bridge on
        the way out, and the trainers then stop at their next bridge operation, every rank at the
        same point, rather than wherever an interrupt finds them (perhaps inside a collective of
        their own world). The trainers are interrupted too only if they are still running after
        `_STOP_GRACE_S`; what then still waits in a bridge operation ends at the bridge's timeout."""
        self._store = None
        self._aborted.update(roles)
        for role in [role for role in reversed(ROLES) if role in roles]:
            if not self._threads[role].is_alive():
                continue
            cluster = self._clusters[role]
            cluster.interrupt()
            ends = time.monotonic() + (_STOP_GRACE_S if role == "generator" else cluster.interrupt_grace + 10.0)
            for thread in self._threads.values():
                thread.join(max(0.0, ends - time.monotonic()))

    def _first_error(self) -> BaseException:
        """The error of the side that failed for a reason of its own, else the first one."""
        by_time = sorted(self._errors, key=lambda role: self._failed_at.get(role, 0.0))
        own = [role for role in by_time if not _only_the_other_side_gone(self._errors[role])]
        role = (own or by_time)[0]
        error = self._errors[role]
        error.add_note(f"(raised on the {role} engines of a GRPO run with separate generators; the other side "
                       "stopped because of it)")
        return error


def _only_the_other_side_gone(error: BaseException) -> bool:
    """An error that only follows the other side stopping: the bridge closed, or its connection
    lost (which a side can meet before the other's own error has come back)."""
    return isinstance(error, EngineError) and all(name in ("BridgeClosed", "BrokenProcessGroup")
                                                  for _, name, _, _ in error.groups)


def _check(trainers: Any, generators: Generators, loop: Any) -> None:
    if not isinstance(trainers, Cluster):
        raise TypeError(f"trainers={trainers!r} must be the colab_par.Cluster whose engines train")
    if trainers is generators.cluster:
        raise ValueError("the trainers and the generators are the same Cluster: generators need engines of "
                         "their own (a second Cluster); for one cluster, run the colocated loop GRPO.fit()")
    for role, cluster in (("trainers", trainers), ("generators", generators.cluster)):
        if not cluster.running:
            raise RuntimeError(f"the {role}' cluster is not running; start it first (cluster.start())")
    if not (callable(loop) or (isinstance(loop, str) and loop.isidentifier())):
        raise TypeError(f"loop={loop!r} must be a function of the role ('trainer' or 'generator') returning that "
                        "engine's GRPO, or the name of the engine variable holding it (e.g. 'grpo')")


def _store_host(*clusters: Cluster) -> str:
    """Loopback when every engine runs on this host, else this host's address toward the engines."""
    remote = [address for address in (cluster._state.notebook_address() for cluster in clusters)
              if address != "127.0.0.1"]
    return remote[0] if remote else "127.0.0.1"
