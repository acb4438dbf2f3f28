"""The sweep simulator and makespan prediction, against schedules worked out by hand and FLOP and
byte counts from the layer formulas (no cluster: the simulator drives the sweep's own Schedule)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from colab_par.selection import Halving, Trial
from colab_par.selection.costs import OpCounter
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


def test_the_op_counter_counts_ops_and_the_bytes_they_write() -> None:
    x = torch.randn(4, 4)
    cases = [(lambda: x * 2, 1, 64), (lambda: x.view(-1), 1, 0), (lambda: x.add_(1), 1, 64),
             (lambda: torch.mm(x, x).sum(), 2, 64 + 4)]
    for work, ops, written in cases:
        counter = OpCounter()
        with counter:
            work()
        assert (counter.ops, counter.written) == (ops, written)


def test_the_probe_counts_each_units_work_and_the_model_times_it() -> None:
    trial = Trial(mlp, features, 1, name="mlp", optimizer="adam")
    plan = plan_shards(trial, budget=2 ** 20, parts=2)
    assert [unit.flops for unit in plan.units] == [2 * 16 * 8 * 32, 0, 2 * 16 * 32 * 4]
    # the forward writes each layer's output; the last unit also log-softmax's (16, 4) and the
    # loss and total weight nll_loss returns
    assert [unit.written for unit in plan.units] == [16 * 32 * 4, 16 * 32 * 4, 2 * 16 * 4 * 4 + 4 + 4]
    assert [unit.tensors for unit in plan.units] == [2, 0, 2]
    assert all(unit.ops >= 1 and unit.backward_ops >= unit.ops for unit in plan.units)
    model, (inputs, targets), backward = trial.build(), features(0), OpCounter()
    loss = trial.loss(model(inputs), targets)
    with backward:  # the real backward writes what the probe's, shared out per unit, adds up to
        loss.backward()
    assert sum(unit.backward_written for unit in plan.units) == pytest.approx(backward.written, abs=3)
    assert [list(shard) for shard in plan.shards] == [[0], [1, 2]]

    speeds = {"flops_per_s": 1e6, "copy_bytes_per_s": 1e5, "ops_per_s": 1e4, "nograd_ops_per_s": 2e4,
              "init_params_per_s": 1e3, "store_tensors_per_s": 100.0, plan.optimizer: 1e3}
    seconds = task_seconds(plan, speeds, round_trip=0.01)
    first, second, last = plan.units
    # the build: 420 weights drawn, 1680 bytes copied, 4 tensors stored
    assert seconds[("init", 0)] == pytest.approx(0.01 + 420 / 1e3 + 1680 / 1e5 + 4 / 100)
    # the first Linear's weights and Adam's two states: 6 tensors of 1152 bytes in all, each way
    stored_0 = 6 / 100 + 1152 * 3 / 1e5
    assert seconds[("forward", 0)] == pytest.approx(
        0.01 + 8192 / 1e6 + 2048 / 1e5 + first.ops / 2e4 + stored_0)
    # Adam's step: 2 tensors, 7 passes (read weights and gradients, read and write weights and 2 states)
    assert seconds[("backward", 0)] == pytest.approx(
        0.01 + 3 * 8192 / 1e6 + (2048 + first.backward_written) / 1e5 + (first.ops + first.backward_ops) / 1e4
        + 2 / 1e3 + 7 * 1152 / 1e5 + 2 * stored_0)
    stored_1 = 6 / 100 + 528 * 3 / 1e5
    work_1 = [(unit.written + unit.backward_written) / 1e5 + (unit.ops + unit.backward_ops) / 1e4
              for unit in (second, last)]
    assert seconds[("forward_backward", 1)] == pytest.approx(
        0.01 + 3 * 4096 / 1e6 + sum(work_1) + 2 / 1e3 + 7 * 528 / 1e5 + 2 * stored_1)


def test_halving_rungs_grow_by_the_factor_and_keep_one_in_factor() -> None:
    assert Halving(first=2).rungs(10) == [2, 4, 8]
    assert Halving(first=3, factor=3).rungs(27) == [3, 9]
    assert Halving(first=4).rungs(4) == []
    assert [Halving(first=1).survivors(n) for n in (1, 2, 5, 8)] == [1, 1, 3, 4]
    assert Halving(first=1, factor=3).survivors(7) == 3
    for bad in (dict(first=0), dict(first=2, factor=1), dict(first=1.5)):
        with pytest.raises(ValueError, match="Halving"):
            Halving(**bad)


def test_halving_holds_each_rung_until_every_trial_reaches_it() -> None:
    """Four equal trials of 4 steps (3 s each) on 2 engines, rungs at steps 1 and 2: the clock keeps
    the largest (here, by index), so a and b go on after step 1 and a alone after step 2."""
    profiles = [profile(name, 1, 1.0, steps=4) for name in "abcd"]
    result = simulate(profiles, 2, halving=Halving(first=1))
    steps = {name: sum(s.trial == name and s.kind == "forward_backward" for s in result.timeline)
             for name in "abcd"}
    assert steps == {"a": 4, "b": 2, "c": 1, "d": 1}
    assert [t.status for t in result.trials] == ["done", "pruned", "pruned", "pruned"]
    # step 1 runs only once every trial has finished step 0, and step 2 once a and b finished step 1
    for step in (1, 2):
        assert min(s.start for s in result.timeline if s.step == step) >= max(
            s.end for s in result.timeline if s.step == step - 1)
    assert result.makespan == pytest.approx(2 * 3.0 + 3.0 + 2 * 3.0)


def test_a_trial_that_fits_one_engine_stays_on_it() -> None:
    """Four equal whole trials on 2 engines: each stays on the engine it started on. An engine
    switches trials only to start a longer one (LRTF) and then runs that one to its end, rather
    than alternate its trials step by step as their remaining times drop (each switch reloads)."""
    result = simulate([profile(name, 1, 1.0, steps=3) for name in "abcd"], 2, scheduler="lrtf")
    engines = {name: {s.engine for s in result.timeline if s.trial == name} for name in "abcd"}
    assert engines == {"a": {0}, "b": {1}, "c": {0}, "d": {1}}
    for engine, (first, second) in ((0, "ac"), (1, "bd")):
        steps = [s.trial for s in sorted(result.timeline, key=lambda s: s.start)
                 if s.engine == engine and s.kind != "init"]
        # `second` starts once `first` has one step left (9 s to go against 3 s), then runs to its end
        assert steps == [first, first, second, second, second, first], (engine, steps)
    assert result.makespan == pytest.approx(2 * 3 * 3.0)
