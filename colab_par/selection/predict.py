"""The sweep planner: a makespan predicted before any trial runs.

Each task's time is a sum over what the meta probe counted (`shards.py`, `costs.py`) divided by
the slowest engine's measured rate for it: matmul FLOPs over FLOP/s (forward F; a training task,
the last shard's forward+backward or a backward that recomputes its forward, 3F), bytes the ops
write over copy bytes/s, dispatched ops over ops/s (without autograd for a forward-only task),
and the optimizer's tensor steps and its passes over weights, gradients and state. Every step
writes a shard's weights and optimizer state to the store (so a lost engine's step can be
replayed), per tensor and per byte; a spilled shard also reads them in first. A build draws every
weight and stores it. Every task pays the measured round trip of one ipyparallel task. The simulator
(`simulate.py`) then schedules those tasks exactly as the sweep will. What the model leaves out
(caches, the allocator, the notebook kernel sharing the CPUs) is what the reported error shows.
"""
from __future__ import annotations

from colab_par.selection.halving import Halving
from colab_par.selection.schedule import TrialShape
from colab_par.selection.shards import ShardPlan
from colab_par.selection.simulate import TrialProfile, simulate

__all__ = ["predict_makespan", "task_seconds", "slowest"]


def slowest(speeds: list[dict[str, float]]) -> dict[str, float]:
    """The engines' rates, each the slowest engine's: a sweep waits on the slowest."""
    return {key: min(s[key] for s in speeds) for key in speeds[0]}


def task_seconds(plan: ShardPlan, speeds: dict[str, float], round_trip: float) -> dict[tuple[str, int], float]:
    """(kind, shard) -> predicted seconds of that task, for one trial cut as `plan` says."""
    flops_rate, copy_rate = speeds["flops_per_s"], speeds["copy_bytes_per_s"]
    n = len(plan.shards)

    def total(k: int, field: str) -> int:
        return plan.shard_total(k, field)

    def forward(k: int) -> float:  # without autograd
        return (total(k, "flops") / flops_rate + total(k, "written") / copy_rate
                + total(k, "ops") / speeds["nograd_ops_per_s"])

    def train(k: int) -> float:  # forward and backward with autograd, then the optimizer's step
        passes = 3 + 2 * plan.state_tensors  # read weights and gradients, read and write the rest
        return (3 * total(k, "flops") / flops_rate
                + (total(k, "written") + total(k, "backward_written")) / copy_rate
                + (total(k, "ops") + total(k, "backward_ops")) / speeds["ops_per_s"]
                + total(k, "tensors") / speeds[plan.optimizer] + passes * total(k, "param_bytes") / copy_rate)

    def stored(k: int) -> float:  # weights and optimizer state to (or from) the store
        tensors = total(k, "tensors") * (1 + plan.state_tensors)
        return (tensors / speeds["store_tensors_per_s"]
                + total(k, "param_bytes") * (1 + plan.state_tensors) / copy_rate)

    def loaded(k: int) -> float:  # a spilled shard comes in from the store (a whole trial stays)
        return stored(k) if n > 1 else 0.0

    build = (plan.param_bytes / 4 / speeds["init_params_per_s"] + plan.param_bytes / copy_rate
             + sum(unit.tensors for unit in plan.units) / speeds["store_tensors_per_s"])
    seconds = {("init", 0): round_trip + build}
    for k in range(n):
        if k < n - 1:
            seconds[("forward", k)] = round_trip + forward(k) + loaded(k)
        seconds[("forward_backward" if k == n - 1 else "backward", k)] = (round_trip + loaded(k) + train(k)
                                                                           + stored(k))
    return seconds


def predict_makespan(plans: list[ShardPlan], shapes: list[TrialShape], engines: int, scheduler: str,
                     placement: str, seed: int, speeds: dict[str, float], round_trip: float,
                     halving: Halving | None = None) -> float:
    """Seconds the sweep should take, by simulating its schedule over modelled task times (with
    `halving`, an upper bound: the largest trials survive)."""
    profiles = [TrialProfile(shape, task_seconds(plan, speeds, round_trip))
                for plan, shape in zip(plans, shapes)]
    return simulate(profiles, engines, scheduler=scheduler, placement=placement, seed=seed,
                    halving=halving).makespan
