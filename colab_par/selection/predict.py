"""The sweep planner: a makespan predicted before any trial runs.

Each task's time comes from an analytic model over what the meta probe counted (`shards.py`): its
shard's matmul FLOPs over the engine's measured FLOP rate (forward F; the last shard's
forward+backward 3F; a backward recomputes the forward, 3F), plus, for a spilled trial, moving the
shard's weights and optimizer state in from the store and (after an optimizer step) back out at
the engine's measured copy speed, plus the measured round trip of one ipyparallel task. The
simulator (`simulate.py`) then schedules those tasks exactly as the sweep will. What the model
leaves out (element-wise ops, the allocator, a busy notebook kernel) is what the reported error
shows.
"""
from __future__ import annotations

from colab_par.selection.schedule import TrialShape
from colab_par.selection.shards import ShardPlan
from colab_par.selection.simulate import TrialProfile, simulate

__all__ = ["predict_makespan", "task_seconds", "slowest"]

_INIT_FLOPS_PER_PARAM = 20  # drawing a random weight costs about this many FLOP-equivalents


def slowest(speeds: list[dict[str, float]]) -> dict[str, float]:
    """The engines' speeds, each the slowest engine's: a sweep waits on the slowest."""
    return {key: min(s[key] for s in speeds) for key in speeds[0]}


def task_seconds(plan: ShardPlan, speeds: dict[str, float], round_trip: float) -> dict[tuple[str, int], float]:
    """(kind, shard) -> predicted seconds of that task, for one trial cut as `plan` says."""
    flops_rate, copy_rate = speeds["flops_per_s"], speeds["copy_bytes_per_s"]
    per_param = 1 + plan.state_tensors  # weights and optimizer state travel; gradients do not
    n = len(plan.shards)
    seconds = {("init", 0): round_trip + plan.param_bytes / 4 * _INIT_FLOPS_PER_PARAM / flops_rate}
    for k in range(n):
        compute = plan.shard_flops(k) / flops_rate
        moved = plan.shard_param_bytes(k) * per_param / copy_rate if n > 1 else 0.0
        if k < n - 1:
            seconds[("forward", k)] = round_trip + compute + moved
        seconds[("forward_backward" if k == n - 1 else "backward", k)] = round_trip + 3 * compute + 2 * moved
    return seconds


def predict_makespan(plans: list[ShardPlan], shapes: list[TrialShape], engines: int, scheduler: str,
                     placement: str, seed: int, speeds: dict[str, float], round_trip: float) -> float:
    """Seconds the sweep should take, by simulating its schedule over modelled task times."""
    profiles = [TrialProfile(shape, task_seconds(plan, speeds, round_trip))
                for plan, shape in zip(plans, shapes)]
    return simulate(profiles, engines, scheduler=scheduler, placement=placement, seed=seed).makespan
