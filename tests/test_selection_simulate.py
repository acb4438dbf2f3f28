"""The sweep simulator and makespan prediction, against schedules worked out by hand and FLOP
counts from the layer formulas (no cluster: the simulator drives the sweep's own Schedule)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from colab_par.selection import Trial
from colab_par.selection.predict import task_seconds
from colab_par.selection.schedule import TrialShape
from colab_par.selection.shards import plan_shards
from colab_par.selection.simulate import TrialProfile, measured_profiles, simulate


def profile(name: str, shards: int, forward_s: float, steps: int = 2, init_s: float = 0.0) -> TrialProfile:
    """A trial whose forward of any shard takes `forward_s` and whose backwards take three times it."""
    seconds = {("init", 0): init_s}
    for k in range(shards - 1):
        seconds[("forward", k)], seconds[("backward", k)] = forward_s, 3 * forward_s
    seconds[("forward_backward", shards - 1)] = 3 * forward_s
    return TrialProfile(TrialShape(name, steps, shards, int(1000 * shards * forward_s)), seconds)


def step_seconds(shards: int, forward_s: float) -> float:
    return (shards - 1) * forward_s + 3 * forward_s + (shards - 1) * 3 * forward_s


def test_model_parallel_runs_one_task_at_a_time() -> None:
    profiles = [profile("a", 2, 1.0), profile("b", 3, 2.0, steps=3, init_s=0.5)]
    result = simulate(profiles, 4, placement="model-parallel")
    assert result.makespan == pytest.approx(2 * step_seconds(2, 1.0) + 0.5 + 3 * step_seconds(3, 2.0))
    assert all(span.engine == max(span.shard, 0) for span in result.timeline)


def test_lrtf_starts_the_longest_trial_first_fifo_does_not() -> None:
    profiles = [profile("short 1", 1, 1.0), profile("short 2", 1, 1.0), profile("long", 2, 4.0)]
    long_s, short_s = 2 * step_seconds(2, 4.0), 2 * step_seconds(1, 1.0)
    # FIFO: the two short trials take both engines first, the long one starts after them
    assert simulate(profiles, 2, scheduler="fifo").makespan == pytest.approx(short_s + long_s)
    # Sharded-LRTF: sizes say "long" is longest, so it starts at once and the shorts share the other engine
    assert simulate(profiles, 2, scheduler="lrtf").makespan == pytest.approx(long_s)


def test_shards_fill_every_engine_and_the_bound_is_the_longest_chain() -> None:
    profiles = [profile(f"m{i}", 4, 1.0, steps=3) for i in range(8)]
    one = 3 * step_seconds(4, 1.0)
    assert simulate(profiles, 8, scheduler="lrtf").makespan == pytest.approx(one)
    assert simulate(profiles, 8, placement="model-parallel").makespan == pytest.approx(8 * one)


def test_a_replayed_sweep_gives_back_its_task_times() -> None:
    profiles = [profile("a", 2, 0.25), profile("b", 1, 0.5, init_s=0.125)]
    replayed = measured_profiles(simulate(profiles, 2))
    assert [p.task_seconds for p in replayed] == [p.task_seconds for p in profiles]
    assert [p.shape.shards for p in replayed] == [2, 1]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def features(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def test_the_probe_counts_each_units_matmul_flops_and_the_model_times_them() -> None:
    plan = plan_shards(Trial(mlp, features, 1, name="mlp", optimizer="adam"), budget=2 ** 20, parts=2)
    assert [unit.flops for unit in plan.units] == [2 * 16 * 8 * 32, 0, 2 * 16 * 32 * 4]
    assert [list(shard) for shard in plan.shards] == [[0], [1, 2]]
    speeds = {"flops_per_s": 1e6, "copy_bytes_per_s": 1e5}
    seconds = task_seconds(plan, speeds, round_trip=0.01)
    moved_0 = (8 * 32 + 32) * 4 * 3 / 1e5  # weights and Adam's two states of the first Linear
    assert seconds[("forward", 0)] == pytest.approx(0.01 + 8192 / 1e6 + moved_0)
    assert seconds[("backward", 0)] == pytest.approx(0.01 + 3 * 8192 / 1e6 + 2 * moved_0)
    moved_1 = (32 * 4 + 4) * 4 * 3 / 1e5
    assert seconds[("forward_backward", 1)] == pytest.approx(0.01 + 3 * 4096 / 1e6 + 2 * moved_1)
