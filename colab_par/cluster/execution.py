"""Running code on the ranks: functions and cells, the wait that never hangs, interrupts, re-runs.

`wait` streams rank 0 while a task runs and never waits on a dead rank, on ranks left waiting by
another rank's error, nor on ranks stuck in collectives (`Faults` frees them). A cell whose
restartable Trainer lost an engine is run again on replaced engines, resuming from the engines'
memory or its checkpoint; where its dp replicas are whole copies ("degradable"), the survivors
train on while the replacement starts (`Faults.replace_dead_training_on`).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

from colab_par.cluster import engine, probe
from colab_par.training import recovery
from colab_par.cluster.calls import Calls
from colab_par.cluster.faults import Faults
from colab_par.cluster.health import dead_ranks, raise_if_dead
from colab_par.cluster.lifecycle import Lifecycle
from colab_par.cluster.state import ClusterState
from colab_par.cluster.output import (EngineError, RecoveryError, TaskOutput, per_rank_data, rank_errors, ranks_text,
                              values)
from colab_par.cluster.ship import payload, ship_by_value
from colab_par.cluster.task_watch import TaskWatch

_POLL_MAX_S = 0.25
# A task where some ranks failed while others still run: after this long, the others are taken to
# wait on the failed ones (in a collective they would wait for the whole process-group timeout).
_FAILURE_GRACE_S = 1.0


class Execution:
    """Runs functions and cells on one cluster's ranks (`state`)."""

    def __init__(self, state: ClusterState, calls: Calls, lifecycle: Lifecycle, faults: Faults):
        self.state, self.calls, self.lifecycle, self.faults = state, calls, lifecycle, faults
        self.recovery: dict[str, Any] | None = None  # the running cell's Trainer recovery policy

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        ranks = self.calls.checked_ranks(None)
        ship_by_value(fn, *args, *kwargs.values())
        result = self.calls.apply(ranks, fn, *args, **kwargs)
        self.wait(result, ranks, stream=False, source=_source_file(fn))
        return values(result, self.state.engine_ids)

    def submit(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start ``fn(*args, **kwargs)`` on one rank and return at once (an ipyparallel AsyncResult)."""
        self.state.require_running()
        ship_by_value(fn, *args, *kwargs.values())
        return self.state.client[self.state.engine_ids[rank]].apply_async(fn, *args, **kwargs)

    def execute(self, code: str, targets: Sequence[int] | None, all_output: bool,
                namespace: dict[str, Any] | None, fresh_namespace: Callable[[], dict[str, Any]] | None,
                cell_number: int | None) -> None:
        """Run a cell; when an engine dies under a restartable Trainer, replace it and run again."""
        attempts: list[str] = []
        while True:
            self.recovery = None
            try:
                return self._execute_once(code, targets, all_output, namespace, cell_number)
            except EngineError as error:
                dead, policy = dead_ranks(self.state), self.recovery
                if not dead or policy is None:
                    raise
                attempts.append(f"rank(s) {ranks_text(dead)} died: {str(error).splitlines()[0]}")
                if len(attempts) > policy["max_restarts"]:
                    raise RecoveryError(attempts, policy["max_restarts"]) from error
                generation = self.state.generation
                if self.state.launcher.cannot_replace:
                    self.lifecycle.restart()
                elif policy.get("degradable") and targets is None and len(dead) < self.state.n:
                    print(f"colab_par: {self.faults.replace_dead_training_on(dead)}", file=sys.stderr)
                else:
                    self.faults.replace_dead()  # falls back to a restart when the others stay stuck
                how = ("restarted every engine" if self.state.generation != generation else
                       "replaced its engine (the other ranks kept theirs)")
                print(f"colab_par: rank(s) {ranks_text(dead)} died during the cell; {how}; running "
                      f"the cell again, resuming from the engines' memory or the last checkpoint in "
                      f"{policy['ckpt_dir']} (restart {len(attempts)} of {policy['max_restarts']})", file=sys.stderr)
                self.run(recovery.request_resume, policy["ckpt_dir"])
                namespace = fresh_namespace() if fresh_namespace is not None else namespace

    def _execute_once(self, code: str, targets: Sequence[int] | None, all_output: bool,
                      namespace: dict[str, Any] | None, cell_number: int | None) -> None:
        state = self.state
        ranks = self.calls.checked_ranks(targets)
        if namespace or cell_number is not None:
            shipped = self.calls.apply(ranks, engine.before_cell, payload(namespace or {}), cell_number)
            self.wait(shipped, ranks, stream=False)
            values(shipped, state.engine_ids)
        result = state.direct.execute([state.engine_ids[r] for r in ranks], code)
        try:
            output = self.wait(result, ranks, stream=True, cell=code)
        finally:  # a restartable Trainer in the cell said how to recover it
            self.recovery = _recovery_policy(result)
        output.show_other_ranks(ranks, all_output)
        values(result, state.engine_ids)
        output.show_result()

    def wait(self, result: Any, ranks: list[int], *, stream: bool, cell: str | None = None,
             source: str | None = None) -> TaskOutput:
        """Wait without a deadline (training may be long), but never on a dead rank, on ranks left
        waiting by another rank's error, nor on ranks stuck in collectives that can never complete
        (`TaskWatch`); stream rank 0 meanwhile."""
        output = TaskOutput(result, stream=stream, dashboard=self.state.dashboard)
        watch = TaskWatch(result, ranks, list(range(self.state.n)),
                          lambda asked: self.calls.request(asked, probe.WHERE_REQUEST), self.calls.idle_ranks,
                          what="the cell" if cell is not None else "the function")
        poll, failed_at = 0.002, None
        try:
            while not result.ready():
                result.wait(poll)
                poll = min(poll * 2, _POLL_MAX_S)
                output.poll()
                raise_if_dead(self.state, ranks)
                now = time.monotonic()
                if failed_at is None and rank_errors(result, ranks):
                    failed_at = now
                failure = None
                if failed_at is not None:
                    if now - failed_at > _FAILURE_GRACE_S and not result.ready():
                        failure = self.faults.recover_from_rank_failure(result, ranks, cell, source)
                elif (stuck := watch.poll(now)) and not result.ready():
                    failure = self.faults.recover_from_deadlock(result, ranks, stuck, watch.gone, cell, source)
                if failure is not None:
                    output.finish()
                    raise failure
        except KeyboardInterrupt:
            self._handle_interrupt(result)
            raise
        output.finish()
        self.faults.repair_if_broken(result, ranks)
        return output

    def _handle_interrupt(self, result: Any) -> None:
        """Interrupt every engine; if one stays stuck (e.g. in a collective), restart the world."""
        print("colab_par: interrupting all engines…", file=sys.stderr)
        self.calls.interrupt()
        grace = self.state.interrupt_grace
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not result.ready():
            result.wait(0.1)
        if not result.ready():
            print(f"colab_par: engines still busy {grace:.0f}s after the interrupt "
                  "(stuck in a collective?); restarting engines and the process group. "
                  "Variables defined on the engines are gone.", file=sys.stderr)
            self.lifecycle.restart()


def _source_file(fn: Callable[..., Any]) -> str | None:
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else None


def _recovery_policy(result: Any) -> dict[str, Any] | None:
    """What a cell's `Trainer` with `Checkpoints(on_failure="restart")` published (ckpt_dir, max_restarts), if any."""
    try:
        published = per_rank_data(result.data)
    except Exception:  # noqa: BLE001 - a task lost with its engine may hold no data at all
        return None
    key = recovery.RECOVERY_KEY
    return next((data[key] for data in published if data and key in data), None)
