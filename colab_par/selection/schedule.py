"""Which trial's next task a free engine runs: the one scheduling brain, driven by the sweep with
real engines (`sweep.py`) and by the simulator with a clock (`simulate.py`).

A trial's step over shards 0..n-1 is a fixed sequence of tasks: n-1 forwards, the last shard's
forward+backward, n-1 backwards (see `worker.py`); only one task of a trial runs at a time.
`placement` says which engines may run a trial's next task:

- "shard" (Hydra's shard parallelism): a spilled trial's next shard runs on any free engine. A
  trial that fits one engine runs task-parallel: it stays on the engine it started on, and that
  engine keeps running the one it ran last (its weights are resident) rather than switch to
  another of its own, which would reload both for no gain; the policy still chooses between
  that one, trials not started yet and spilled trials. An engine with nothing of its own to run
  takes over another's trial;
- "pinned": only the engine the trial first ran on (task parallelism without migration);
- "model-parallel" (Hydra's baseline): one trial at a time, in order, shard k on engine k.

Among the runnable trials the policy (`policies.py`) picks; with successive halving
(`halving.py`) a trial at a rung is not runnable until the rung is decided. When an engine dies,
the trial it was running goes back to the start of the step it was in (the store keeps every shard's weights as
they were there) and its shards run on the engines left.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from colab_par.selection.halving import Halving
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
        return self.result.status in ("done", "failed", "stopped", "pruned")

    def step_estimate(self, seconds_per_byte: float) -> float:
        """Measured (or, before the first step, size-estimated) seconds of one step."""
        return (sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds
                else self.shape.size * seconds_per_byte)

    def remaining_seconds(self, seconds_per_byte: float) -> float:
        """Step time × the steps left."""
        done = self.position / len(self.tasks)
        return self.step_estimate(seconds_per_byte) * (self.shape.steps - self.step - done)

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


def mean_loss_since(run: TrialRun, previous: int, rung: int) -> float:
    """A trial's score at a rung: its mean loss over the steps since the previous rung (lower is
    better; a diverged trial, with a non-finite loss, ranks last)."""
    losses = run.result.losses[previous:rung]
    mean = sum(losses) / len(losses) if losses else math.inf
    return mean if math.isfinite(mean) else math.inf


class Schedule:
    def __init__(self, shapes: list[TrialShape], *, scheduler: str, placement: str, engines: int,
                 seed: int = 0, halving: Halving | None = None,
                 score: Callable[[TrialRun, int, int], float] = mean_loss_since):
        if scheduler not in POLICIES:
            raise ValueError(f"scheduler={scheduler!r} is not one of {', '.join(POLICIES)}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is not one of {', '.join(PLACEMENTS)}")
        self.runs = [TrialRun(i, shape) for i, shape in enumerate(shapes)]
        self.scheduler, self.placement = scheduler, placement
        self.alive = list(range(engines))
        self.rng = random.Random(seed)
        self.last: dict[int, TrialRun] = {}  # the trial each engine ran last
        self.halving, self.score, self.previous_rung = halving, score, 0
        self.rungs = halving.rungs(max(shape.steps for shape in shapes)) if halving and shapes else []

    @property
    def finished(self) -> bool:
        return all(run.finished for run in self.runs)

    def assign(self, rank: int) -> tuple[TrialRun, dict[str, Any]] | None:
        """The task engine `rank` (free) runs next, marked in flight; None if none may run there."""
        runnable = self._runnable(rank)
        if not runnable:
            return None
        rate = self._seconds_per_byte()
        candidates = [_Estimate(run, rate) for run in runnable]
        stay = next((c for c in candidates if c.run is self.last.get(rank)), None)
        run = pick(self.scheduler, candidates, self.rng, stay).run
        if self.placement == "pinned" and run.pinned is None or self.placement == "shard" and run.shape.shards == 1:
            run.pinned = rank  # "shard": where it is resident now; taking it over moves it
        run.in_flight = True
        run.result.status = "running"
        self.last[rank] = run
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

    def _decide_rung(self) -> None:
        """Successive halving (`halving.py`): once every trial in the race has reached the rung,
        prune all but the best; until then, the ones there wait."""
        while self.rungs:
            rung = self.rungs[0]
            race = [run for run in self.runs if run.shape.steps > rung
                    and run.result.status not in ("failed", "stopped", "pruned")]
            if any(run.step < rung or run.in_flight for run in race):
                return
            ranked = sorted(race, key=lambda run: (self.score(run, self.previous_rung, rung), run.index))
            for run in ranked[self.halving.survivors(len(race)):]:
                run.result.status = "pruned"
            self.previous_rung = self.rungs.pop(0)

    def _at_rung(self, run: TrialRun) -> bool:
        return bool(self.rungs) and run.step >= self.rungs[0] and run.shape.steps > self.rungs[0]

    def _runnable(self, rank: int) -> list[TrialRun]:
        self._decide_rung()
        waiting = [run for run in self.runs if not run.finished and not run.in_flight and not self._at_rung(run)]
        if self.placement == "model-parallel":
            unfinished = [run for run in self.runs if not run.finished]
            first = next((run for run in unfinished if not self._at_rung(run)), None)
            if first is None or first.in_flight:
                return []
            owner = self.alive[first.next_shard() % len(self.alive)]
            return [first] if owner == rank else []
        if self.placement == "pinned":
            return [run for run in waiting if run.pinned in (None, rank)]
        own = [run for run in waiting if run.pinned == rank]
        if self.last.get(rank) in own:
            own = [self.last[rank]]
        here = own + [run for run in waiting if run.pinned is None]
        return here or waiting

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

    def step_seconds(self) -> float:
        return self.run.step_estimate(self._rate)
