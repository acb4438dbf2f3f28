"""What a sweep returns: per-trial results and the timeline of which shard ran where, and when."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Span", "TrialResult", "SweepResult"]


@dataclass(frozen=True)
class Span:
    """One task on one engine: `kind` is "init", "forward", "forward_backward" or "backward";
    times are seconds since the sweep started."""

    engine: int
    trial: str
    step: int
    shard: int
    kind: str
    start: float
    end: float


@dataclass
class TrialResult:
    name: str
    config: dict[str, Any]
    steps: int
    losses: list[float] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | done | failed | stopped | pruned (successive halving)
    error: str | None = None
    seconds: float = 0.0  # engine time spent on its tasks
    engines: set[int] = field(default_factory=set)
    shards: int = 1
    restarts: int = 0  # steps begun again because the engine running them died
    param_bytes: int = 0

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan

    @property
    def best_loss(self) -> float:
        return min(self.losses) if self.losses else math.nan


@dataclass
class SweepResult:
    trials: list[TrialResult]
    timeline: list[Span]
    makespan: float
    scheduler: str
    peak_resident: dict[int, int]  # engine rank -> most bytes of shards it held at once
    budget: int
    placement: str = "shard"
    lost_engines: list[int] = field(default_factory=list)  # engines that died during the sweep
    predicted_makespan: float | None = None  # the planner's figure, made before the sweep ran

    @property
    def prediction_error(self) -> float | None:
        """Predicted over measured makespan, minus one (None without a prediction)."""
        if self.predicted_makespan is None or not self.makespan:
            return None
        return self.predicted_makespan / self.makespan - 1

    def __getitem__(self, name: str) -> TrialResult:
        for trial in self.trials:
            if trial.name == name:
                return trial
        raise KeyError(f"no trial named {name!r}; the sweep has {', '.join(t.name for t in self.trials)}")

    def leaderboard(self) -> list[TrialResult]:
        """Best final loss first; trials pruned by successive halving (their losses are from
        fewer steps) after the others, the longest-lived first; failed ones last."""
        return sorted(self.trials, key=lambda t: (t.status == "failed", t.status == "pruned",
                                                  -len(t.losses) if t.status == "pruned" else 0,
                                                  math.isnan(t.final_loss), t.final_loss))
