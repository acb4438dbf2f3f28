"""A sweep replayed with a clock instead of engines.

The same `Schedule` the sweep uses (placement, policy, remaining-time estimates) is fed each
task's duration: from the analytic model before a sweep runs (`predict.py`), or from a sweep's
measured timeline, replayed at a scale this machine does not have (Hydra's 8 devices, 12 models).
"""
from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass
from typing import Iterable

from colab_par.selection.results import Span, SweepResult
from colab_par.selection.halving import Halving
from colab_par.selection.schedule import Schedule, TrialRun, TrialShape

__all__ = ["TrialProfile", "simulate", "measured_profiles"]


@dataclass(frozen=True)
class TrialProfile:
    """A trial for the simulator: its shape and how long each of its tasks takes, by
    (kind, shard); ("init", 0) is the build."""

    shape: TrialShape
    task_seconds: dict[tuple[str, int], float]

    def seconds(self, task: dict) -> float:
        return self.task_seconds[(task["kind"], task.get("shard", 0))]


def simulate(profiles: list[TrialProfile], engines: int, *, scheduler: str = "lrtf",
             placement: str = "shard", seed: int = 0, halving: Halving | None = None) -> SweepResult:
    """The sweep's timeline and makespan if every task took its profiled time. A clock has no
    losses, so with `halving` the largest trials survive every rung: the makespan is an upper
    bound."""
    schedule = Schedule([p.shape for p in profiles], scheduler=scheduler, placement=placement,
                        engines=engines, seed=seed, halving=halving, score=_largest_first)
    running: list[tuple[float, int, float, dict]] = []  # (end, rank, start, task)
    timeline: list[Span] = []
    clock, free = 0.0, set(range(engines))
    while True:
        for rank in sorted(free):
            assigned = schedule.assign(rank)
            if assigned is not None:
                task = assigned[1]
                heapq.heappush(running, (clock + profiles[task["trial"]].seconds(task), rank, clock, task))
                free.discard(rank)
        if not running:
            break
        clock, rank, start, task = heapq.heappop(running)
        free.add(rank)
        timeline.append(schedule.runs[task["trial"]].complete(task, {"start": start, "end": clock}, rank, 0.0))
    return SweepResult([run.result for run in schedule.runs], timeline, clock, scheduler, {}, 0, placement)


def _largest_first(run: TrialRun, previous: int, rung: int) -> float:
    return -run.shape.size


def measured_profiles(result: SweepResult) -> list[TrialProfile]:
    """Each trial's median measured time per (kind, shard), from a finished sweep's timeline."""
    profiles = []
    for trial in result.trials:
        spans: dict[tuple[str, int], list[float]] = {}
        for span in _spans_of(result.timeline, trial.name):
            spans.setdefault((span.kind, max(span.shard, 0)), []).append(span.end - span.start)
        shape = TrialShape(trial.name, trial.steps, trial.shards, trial.param_bytes, dict(trial.config))
        profiles.append(TrialProfile(shape, {key: statistics.median(v) for key, v in spans.items()}))
    return profiles


def _spans_of(timeline: Iterable[Span], name: str) -> list[Span]:
    return [span for span in timeline if span.trial == name]
