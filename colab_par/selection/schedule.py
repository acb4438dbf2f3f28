"""Which trial's next task a free engine runs: the one scheduling brain, driven by the sweep with
real engines (`sweep.py`) and by the simulator with a clock (`simulate.py`).

A trial's step over shards 0..n-1 is a fixed sequence of tasks: n-1 forwards, the last shard's
forward+backward, n-1 backwards (see `worker.py`); only one task of a trial runs at a time.
`placement` says which engines may run a trial's next task:

- "shard" (Hydra's shard parallelism): any free engine, so a spilled trial's shards follow
  whichever engine frees up;
- "pinned": only the engine the trial first ran on (task parallelism without migration);
- "model-parallel" (Hydra's baseline): one trial at a time, in order, shard k on engine k.

Among the runnable trials the policy (`policies.py`) picks. When an engine dies, the trial it was
running goes back to the start of the step it was in (the store keeps every shard's weights as
they were there) and its shards run on the engines left.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from colab_par.selection.policies import POLICIES, pick
from colab_par.selection.results import Span, TrialResult

__all__ = ["PLACEMENTS", "TrialShape", "TrialRun", "Schedule"]

PLACEMENTS = ("shard", "pinned", "model-parallel")


@dataclass(frozen=True)
class TrialShape:
    """What the scheduler knows of a trial before it runs."""

    name: str
    steps: int
    shards: int
    size: int  # parameter bytes: how remaining time is estimated before the first measured step
    config: dict[str, Any] = field(default_factory=dict)


class TrialRun:
    """One trial's progress: the step and task it is at, its shards' versions, its timing."""

    def __init__(self, index: int, shape: TrialShape):
        self.index, self.shape = index, shape
        n = shape.shards
        self.tasks = ([("forward", k) for k in range(n - 1)] + [("forward_backward", n - 1)]
                      + [("backward", k) for k in range(n - 2, -1, -1)])
        self.result = TrialResult(shape.name, dict(shape.config), shape.steps, shards=n, param_bytes=shape.size)
        self.step, self.position, self.initialised = 0, 0, False
        self.versions = [0] * n  # steps each shard has taken; a shard's weights live in slot version % 2
        self.epoch = 0  # steps lost with an engine: tags resident copies made before as stale
        self.shapes: dict[str, list[int]] = {}
        self.in_flight, self.pinned = False, None
        self.step_seconds: list[float] = []
        self.current_step_seconds = 0.0

    @property
    def finished(self) -> bool:
        return self.result.status in ("done", "failed", "stopped")

    def remaining_seconds(self, seconds_per_byte: float) -> float:
        """Measured (or, before the first step, size-estimated) step time × the steps left."""
        per_step = (sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds
                    else self.shape.size * seconds_per_byte)
        done = self.position / len(self.tasks)
        return per_step * (self.shape.steps - self.step - done)

    def next_shard(self) -> int:
        """The shard the next task runs (init counts as shard 0)."""
        return self.tasks[self.position][1] if self.initialised else 0

    def next_task(self, prefetch: bool) -> dict[str, Any]:
        if not self.initialised:
            return {"trial": self.index, "kind": "init"}
        kind, k = self.tasks[self.position]
        task = {"trial": self.index, "kind": kind, "shard": k, "step": self.step,
                "version": self.versions[k], "epoch": self.epoch,
                "input_shape": self.shapes.get(f"act{k}"), "grad_shape": self.shapes.get(f"grad{k + 1}")}
        following = self.tasks[(self.position + 1) % len(self.tasks)][1]
        if prefetch and following != k:  # the shard this trial needs next: worth fetching beside this one
            task["prefetch"] = (following, self.versions[following])
        return task

    def complete(self, task: dict[str, Any], out: dict[str, Any], rank: int, t0: float) -> Span:
        self.in_flight = False
        seconds = out["end"] - out["start"]
        self.result.seconds += seconds
        self.result.engines.add(rank)
        if task["kind"] == "init":
            self.initialised = True
            return Span(rank, self.shape.name, 0, -1, "init", out["start"] - t0, out["end"] - t0)
        k = task["shard"]
        if "output_shape" in out:
            self.shapes[f"act{k + 1}"] = out["output_shape"]
        if "grad_shape" in out:
            self.shapes[f"grad{k}"] = out["grad_shape"]
        if task["kind"] != "forward":
            self.versions[k] += 1
        if out.get("loss") is not None:
            self.result.losses.append(out["loss"])
        self.current_step_seconds += seconds
        self.position += 1
        if self.position == len(self.tasks):
            self.position, self.step = 0, self.step + 1
            self.step_seconds.append(self.current_step_seconds)
            self.current_step_seconds = 0.0
            if self.step == self.shape.steps:
                self.result.status = "done"
        return Span(rank, self.shape.name, task["step"], k, task["kind"], out["start"] - t0, out["end"] - t0)

    def fail(self, error: str) -> None:
        self.in_flight = False
        self.result.status, self.result.error = "failed", error

    def restart_step(self) -> None:
        """Its engine died mid-step: go back to the start of that step, which every shard's store
        slot `step % 2` still holds (the lost step wrote only to the other slot)."""
        self.in_flight, self.pinned = False, None
        if self.initialised:
            self.position, self.current_step_seconds = 0, 0.0
            self.versions = [self.step] * len(self.versions)
            del self.result.losses[self.step:]
            self.epoch += 1
        self.result.restarts += 1


class Schedule:
    def __init__(self, shapes: list[TrialShape], *, scheduler: str, placement: str, engines: int,
                 seed: int = 0):
        if scheduler not in POLICIES:
            raise ValueError(f"scheduler={scheduler!r} is not one of {', '.join(POLICIES)}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is not one of {', '.join(PLACEMENTS)}")
        self.runs = [TrialRun(i, shape) for i, shape in enumerate(shapes)]
        self.scheduler, self.placement = scheduler, placement
        self.alive = list(range(engines))
        self.rng = random.Random(seed)

    @property
    def finished(self) -> bool:
        return all(run.finished for run in self.runs)

    def assign(self, rank: int) -> tuple[TrialRun, dict[str, Any]] | None:
        """The task engine `rank` (free) runs next, marked in flight; None if none may run there."""
        runnable = self._runnable(rank)
        if not runnable:
            return None
        rate = self._seconds_per_byte()
        run = pick(self.scheduler, [_Estimate(run, rate) for run in runnable], self.rng).run
        if self.placement == "pinned" and run.pinned is None:
            run.pinned = rank
        run.in_flight = True
        run.result.status = "running"
        return run, run.next_task(prefetch=self.placement != "model-parallel")

    def engine_lost(self, rank: int, run: TrialRun | None) -> None:
        """`rank` died, running `run`'s task (or idle): the others take over its trials."""
        if rank in self.alive:
            self.alive.remove(rank)
        if run is not None and not run.finished:
            run.restart_step()
        for other in self.runs:
            if other.pinned == rank:
                other.pinned = None

    def stop(self) -> None:
        """The stop button: nothing new starts; what has not finished is marked stopped."""
        for run in self.runs:
            if not run.finished:
                run.result.status = "stopped"

    def _runnable(self, rank: int) -> list[TrialRun]:
        waiting = [run for run in self.runs if not run.finished and not run.in_flight]
        if self.placement == "model-parallel":
            unfinished = [run for run in self.runs if not run.finished]
            first = unfinished[0] if unfinished else None
            if first is None or first.in_flight:
                return []
            owner = self.alive[first.next_shard() % len(self.alive)]
            return [first] if owner == rank else []
        if self.placement == "pinned":
            return [run for run in waiting if run.pinned in (None, rank)]
        return waiting

    def _seconds_per_byte(self) -> float:
        """From the trials measured so far: how step time grows with size, to estimate the others."""
        measured = [(sum(r.step_seconds) / len(r.step_seconds), r.shape.size)
                    for r in self.runs if r.step_seconds]
        return sum(t for t, _ in measured) / max(1, sum(b for _, b in measured)) if measured else 1e-9


class _Estimate:
    """A trial as the policy sees it: its order and its estimated remaining time."""

    def __init__(self, run: TrialRun, rate: float):
        self.run, self.index, self._rate = run, run.index, rate

    def remaining_seconds(self) -> float:
        return self.run.remaining_seconds(self._rate)
