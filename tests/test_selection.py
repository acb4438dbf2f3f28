"""Model selection on a real 2-engine cluster: every trial's losses equal training it alone in one
process, whatever the scheduler, placement, migration or spilling; the tensors engines hold, counted
on the engines themselves, stay within their budget; bad trials are refused before any work; errors
and the stop button end only what they must; successive halving keeps the trials solo runs rank
best."""
from __future__ import annotations

import random

import pytest
import torch
from halving_reference import halving_lifetimes
from torch import nn

from colab_par.models.gpt import GPT, GPTConfig
from colab_par.selection import Halving, Trial, grid, select, train_alone
from colab_par.selection.policies import pick
from colab_par.selection.shards import plan_shards

RELATIVE = 1e-5
BUDGET = 2_000_000  # bytes per engine: the small GPT and the MLP fit, the others spill


def gpt(d_model: int, n_layer: int):
    def build() -> GPT:
        return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, d_model=d_model,
                             kernels="torch"))
    return build


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    sample = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
    return sample[:, :-1], sample[:, 1:]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def features(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def mixed_trials() -> list[Trial]:
    return [Trial(gpt(32, 2), tokens, 4, name="gpt small"),
            Trial(gpt(64, 4), tokens, 3, name="gpt big", lr=3e-3, seed=1),
            Trial(gpt(48, 3), tokens, 3, name="gpt mid sgd", optimizer="sgd",
                  optimizer_kwargs={"momentum": 0.9}, lr=0.05),
            Trial(mlp, features, 5, name="mlp", optimizer="adam")]


# ---- memory measured on the engines -----------------------------------------------------------------
_PROBE = "_colab_par_test_memory_probe"  # the engine-side module holding the probe between calls


def _start_memory_probe() -> None:
    """Engine side: until `_stop_memory_probe`, count the bytes of every tensor storage this process
    holds, at the end of each outermost module forward under autograd (a shard's activations are
    all saved then) and before and after each optimizer step of a module that ran forward (its
    gradients, then its optimizer state, are all there); keep the largest count. Forwards without
    autograd (a spilled trial's first pass) hold less than the training pass of the same shard.

    What is counted, independently of the worker's own bookkeeping: every tensor Python can reach
    (`gc`; parameters with their gradients, optimizer state, batches, boundary activations) and
    every tensor autograd saved for backward (a saved-tensor hook; autograd holds those without a
    Python object). Excluded: storages alive before the probe started (kept alive here, so their
    addresses are not reused), the spill store's files mapped from shared memory, meta tensors.
    """
    import gc
    import sys
    import types
    import weakref

    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    gc.collect()
    probe = types.ModuleType(_PROBE)
    probe.baseline = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    probe.peak, probe.samples, probe.depth = 0, 0, 0
    probe.trained = weakref.WeakValueDictionary()  # id -> parameter of a module that ran forward
    saved = weakref.WeakSet()

    def storage(tensor):
        if tensor is None or tensor.is_meta or tensor.device.type != "cpu":
            return None
        try:
            found = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return None if found.filename is not None or not found.data_ptr() else found

    before = {s.data_ptr() for s in map(storage, probe.baseline) if s is not None}

    def sample() -> None:
        held = {}
        tensors = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
        tensors += [t.grad for t in tensors if t.is_leaf and t.requires_grad]
        tensors += [holder.tensor for holder in list(saved)]
        for tensor in tensors:
            found = storage(tensor)
            if found is not None and found.data_ptr() not in before:
                held[found.data_ptr()] = found.nbytes()
        probe.peak, probe.samples = max(probe.peak, sum(held.values())), probe.samples + 1

    class Saved:
        __slots__ = ("tensor", "__weakref__")

    def pack(tensor):
        holder = Saved()
        holder.tensor = tensor
        saved.add(holder)
        return holder

    def enter(module, args) -> None:
        if probe.depth == 0:
            probe.trained.update((id(p), p) for p in module.parameters())
        probe.depth += 1

    def leave(module, args, output) -> None:
        probe.depth -= 1
        if probe.depth == 0 and torch.is_grad_enabled():
            sample()

    def stepped(optimizer, args, kwargs) -> None:
        if any(id(p) in probe.trained for group in optimizer.param_groups for p in group["params"]):
            sample()

    probe.saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.tensor)
    probe.saved_hooks.__enter__()  # the worker's tasks run on this (main) thread, one at a time
    probe.handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave),
                     register_optimizer_step_pre_hook(stepped), register_optimizer_step_post_hook(stepped)]
    sys.modules[_PROBE] = probe


def _stop_memory_probe() -> dict[str, int]:
    """Engine side: remove the probe; the largest count and how many samples it took."""
    import sys

    probe = sys.modules.pop(_PROBE)
    for handle in probe.handles:
        handle.remove()
    probe.saved_hooks.__exit__(None, None, None)
    return {"peak": probe.peak, "samples": probe.samples}


def measured_select(cluster, trials, **options):
    """`select`, with the engines' tensor bytes counted throughout (`_start_memory_probe`)."""
    cluster.run(_start_memory_probe)
    try:
        result = select(trials, cluster=cluster, **options)
    finally:
        measured = cluster.run(_stop_memory_probe)
    # the probe samples where gradients are on: every engine that ran such a task took samples (the
    # scheduler may leave an engine nothing but builds and no-grad forwards: "random" on a busy machine)
    trained = {span.engine for span in result.timeline if span.kind in ("forward_backward", "backward")}
    assert trained and all(measured[rank]["samples"] > 0 for rank in trained), (trained, measured)
    return result, [measured[rank]["peak"] for rank in sorted(trained)]


# Besides the shards the budget covers (parameters, gradients, optimizer state, saved activations),
# a task holds its step's batch and the shard's input copy, output and input gradient; Adam keeps
# a 4-byte step count per parameter tensor. Here at most 4 boundary-sized tensors of the widest
# trial (batch 4 × seq 16 × 64 wide, fp32: its logits are as wide), the batches (< 1 KiB each) and
# 4 bytes for each of < 64 parameter tensors.
OVERHEAD = 4 * (4 * 16 * 64 * 4) + 2 * 1024 + 64 * 4


def assert_within_budget(measured: list[int], budget: int) -> None:
    assert all(0 < peak <= budget + OVERHEAD for peak in measured), (measured, budget + OVERHEAD)


def assert_equals_alone(result, trials) -> None:
    for trial in trials:
        alone = train_alone(trial)
        got = result[trial.name]
        assert got.status == "done", (trial.name, got.status, got.error)
        assert len(got.losses) == trial.steps
        for step, (a, b) in enumerate(zip(got.losses, alone)):
            assert abs(a - b) <= RELATIVE * abs(b), (trial.name, step, a, b)


@pytest.mark.parametrize("scheduler", ["lrtf", "fifo", "random"])
def test_every_trial_equals_training_it_alone(cluster2, scheduler: str) -> None:
    trials = mixed_trials()
    result, measured = measured_select(cluster2, trials, budget=BUDGET, scheduler=scheduler, view=None)
    assert [result[t.name].shards > 1 for t in trials] == [False, True, True, False]
    assert_equals_alone(result, trials)
    assert_within_budget(measured, BUDGET)
    assert {span.engine for span in result.timeline} == {0, 1}


def test_a_model_three_times_the_budget_trains_within_it(cluster2) -> None:
    trial = Trial(gpt(64, 6), tokens, 3, name="gpt 3x", lr=2e-3)
    plan = plan_shards(trial, BUDGET)
    need = sum(plan.shard_bytes)
    assert need >= 3 * BUDGET and len(plan.shards) >= 3
    result, measured = measured_select(cluster2, [trial, Trial(mlp, features, 10, name="mlp")],
                                       budget=BUDGET, scheduler="random", view=None)
    assert_equals_alone(result, [trial])
    assert_within_budget(measured, BUDGET)
    # the big trial's shards ran on both engines: a shard follows whichever engine is free
    assert len(result["gpt 3x"].engines) == 2


def test_without_migration_each_trial_stays_on_its_engine(cluster2) -> None:
    trials = mixed_trials()
    result = select(trials, cluster=cluster2, budget=BUDGET, placement="pinned", view=None)
    assert_equals_alone(result, trials)
    assert all(len(result[t.name].engines) == 1 for t in trials)


def test_model_parallel_baseline_runs_one_trial_at_a_time_shard_k_on_engine_k(cluster2) -> None:
    trials = mixed_trials()
    result = select(trials, cluster=cluster2, budget=2 * BUDGET, placement="model-parallel", view=None)
    assert_equals_alone(result, trials)
    assert all(result[t.name].shards == 2 for t in trials)
    work = [span for span in result.timeline if span.kind != "init"]
    assert all(span.engine == span.shard for span in work)
    order = sorted(result.timeline, key=lambda span: span.start)
    for before, after in zip(order, order[1:]):  # never two tasks at once
        assert after.start >= before.end - 1e-6, (before, after)
    assert [span.trial for span in order if span.kind == "init"] == [t.name for t in trials]


def test_a_failing_trial_is_recorded_and_the_others_finish(cluster2) -> None:
    def breaks_at_step_2(step: int):
        if step == 2:
            raise RuntimeError("corrupt shard of the dataset")
        return tokens(step)

    trials = [Trial(gpt(32, 2), breaks_at_step_2, 4, name="broken"), Trial(mlp, features, 4, name="mlp")]
    result = select(trials, cluster=cluster2, budget=BUDGET, view=None)
    assert result["broken"].status == "failed"
    assert "corrupt shard of the dataset" in result["broken"].error
    assert result["broken"].losses == train_alone(Trial(gpt(32, 2), tokens, 2, name="x"))
    assert_equals_alone(result, trials[1:])


class _StopAfter:
    """The stop button, pressed after `updates` view updates (where a notebook's interrupt lands)."""

    def __init__(self, updates: int):
        self.left, self.finished = updates, None

    def update(self, result) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt

    def finish(self, result) -> None:
        self.finished = result


def test_the_stop_button_ends_the_sweep_and_keeps_the_results(cluster2) -> None:
    trials = mixed_trials()
    stop = _StopAfter(12)
    result = select(trials, cluster=cluster2, budget=BUDGET, view=stop)
    assert stop.finished is result
    statuses = {t.status for t in result.trials}
    assert "stopped" in statuses and statuses <= {"stopped", "done"}
    for trial in trials:  # what ran is kept, and it is right
        alone = train_alone(trial)
        losses = result[trial.name].losses
        assert losses == pytest.approx(alone[:len(losses)], rel=RELATIVE)
    again = select([Trial(mlp, features, 2, name="after")], cluster=cluster2, budget=BUDGET, view=None)
    assert again["after"].status == "done"


def test_bad_input_is_refused_before_any_work(cluster2) -> None:
    with pytest.raises(ValueError, match="no trials"):
        select([], cluster=cluster2, budget=BUDGET, view=None)
    with pytest.raises(ValueError, match="axis lr has no values"):
        grid(lambda lr: Trial(mlp, features, 1, lr=lr), lr=[])

    def fails() -> nn.Module:
        raise ImportError("no module named 'mymodels'")

    with pytest.raises(ValueError, match="trial 'bad': its model factory failed: ImportError"):
        select([Trial(fails, features, 1, name="bad")], cluster=cluster2, budget=BUDGET, view=None)
    with pytest.raises(ValueError, match=r"unit 'layers.1' alone needs 1\.\d\d MiB .* budget per engine "
                                         r"is 0\.95 MiB"):
        select([Trial(gpt(64, 2), tokens, 1, name="wide")], cluster=cluster2, budget=1_000_000, view=None)
    with pytest.raises(ValueError, match=r"trial 'shapes': its data does not fit its model: data\(0\) = "
                                         r"inputs \(16, 8\)"):
        select([Trial(mlp, features, 1, name="ok"),
                Trial(lambda: nn.Sequential(nn.Linear(5, 4)), features, 1, name="shapes")],
               cluster=cluster2, budget=BUDGET, view=None)
    with pytest.raises(ValueError, match="on CPU engines the per-engine budget"):
        select([Trial(mlp, features, 1, name="a")], cluster=cluster2, view=None)
    with pytest.raises(ValueError, match="names must be unique; a repeat"):
        select([Trial(mlp, features, 1, name="a")] * 2, cluster=cluster2, budget=BUDGET, view=None)
    with pytest.raises(ValueError, match="scheduler='sjf' is not one of lrtf, fifo, random"):
        select([Trial(mlp, features, 1, name="a")], cluster=cluster2, budget=BUDGET, scheduler="sjf",
               view=None)
    with pytest.raises(TypeError, match="write it as an nn.Sequential"):
        select([Trial(lambda: nn.Linear(8, 4), features, 1, name="plain")], cluster=cluster2,
               budget=BUDGET, view=None)


def test_grid_names_and_records_each_combination() -> None:
    trials = grid(lambda d, lr: Trial(gpt(d, 2), tokens, 2, lr=lr), d=[32, 64], lr=[1e-3, 3e-3])
    assert [t.name for t in trials] == ["d=32 lr=0.001", "d=32 lr=0.003", "d=64 lr=0.001", "d=64 lr=0.003"]
    assert trials[3].config == {"d": 64, "lr": 0.003} and trials[3].lr == 0.003


class _Candidate:
    def __init__(self, index: int, remaining: float, step: float = 1.0):
        self.index, self.remaining, self.step = index, remaining, step

    def remaining_seconds(self) -> float:
        return self.remaining

    def step_seconds(self) -> float:
        return self.step


def test_policies_pick_as_their_names_say() -> None:
    candidates = [_Candidate(0, 1.0), _Candidate(1, 5.0), _Candidate(2, 3.0), _Candidate(3, 5.0)]
    assert pick("lrtf", candidates, random.Random(0)).index == 1  # longest; the earlier of a tie
    assert pick("fifo", candidates, random.Random(0)).index == 0
    drawn = {pick("random", candidates, random.Random(seed)).index for seed in range(40)}
    assert drawn == {0, 1, 2, 3}
    assert pick("random", candidates, random.Random(7)) is pick("random", candidates, random.Random(7))
    # LRTF keeps the engine's last trial unless another has more than one of its steps more to go
    assert pick("lrtf", candidates, random.Random(0), stay=_Candidate(2, 3.0, step=2.0)).index == 2
    assert pick("lrtf", candidates, random.Random(0), stay=_Candidate(2, 3.0, step=1.5)).index == 1


def test_a_dead_engines_trial_resumes_elsewhere_from_its_last_step(tmp_path) -> None:
    """The engine running the spilled trial's last task of step 2 (shard 0's backward, after shards
    3..1 already stored their step-3 weights) is killed: the step is replayed on the other engine from the
    store's step-2 slot, and every trial still equals training it alone."""
    import os
    import signal
    import time

    from colab_par import Cluster

    calls = str(tmp_path / "data-calls")

    def dies_in_step_2(step: int):
        if step == 2:
            with open(calls, "ab", buffering=0) as log:  # one task of a trial at a time: no concurrent writers
                log.write(b"x")
                if log.tell() == 3:  # shard 0's forward, shard 3's loss, then shard 0's backward
                    os.kill(os.getpid(), signal.SIGKILL)
        return tokens(step)

    cluster = Cluster(n=2, backend="gloo", timeout=60.0, dashboard=False).start()
    try:
        started = time.monotonic()
        spilled = Trial(gpt(64, 4), dies_in_step_2, 4, name="gpt big", lr=3e-3, seed=1)
        trials = [spilled, Trial(mlp, features, 6, name="mlp"), Trial(gpt(32, 2), tokens, 4, name="small")]
        result = select(trials, cluster=cluster, budget=BUDGET, view=None)
        assert time.monotonic() - started < 30
        assert len(result.lost_engines) == 1
        assert result["gpt big"].restarts == 1 and result["gpt big"].shards == 4
        assert_equals_alone(result, [Trial(gpt(64, 4), tokens, 4, name="gpt big", lr=3e-3, seed=1),
                                     *trials[1:]])
        survivor = 1 - result.lost_engines[0]
        last_spans = [span for span in result.timeline if span.start > max(
            s.end for s in result.timeline if s.engine == result.lost_engines[0])]
        assert last_spans and all(span.engine == survivor for span in last_spans)
    finally:
        cluster.stop()


def test_successive_halving_keeps_the_trials_a_solo_run_ranks_best(cluster2) -> None:
    """Rungs at steps 1 and 2 keep the better half each time, by the mean loss since the previous
    rung; which trials those are is worked out here from solo runs, and every loss is a solo one."""
    trials = [Trial(gpt(d, n), tokens, 4, name=f"d{d} lr{lr:g}", lr=lr, seed=1)
              for d, n in ((32, 2), (64, 4)) for lr in (1e-3, 3e-2)]
    assert plan_shards(trials[-1], BUDGET).spilled
    result = select(trials, cluster=cluster2, budget=BUDGET, halving=Halving(first=1), view=None)
    alone = {trial.name: train_alone(trial) for trial in trials}
    lived = halving_lifetimes(alone, first=1, steps=4)
    assert sorted(lived.values()) == [1, 1, 2, 4]
    for trial in trials:
        got = result[trial.name]
        assert got.status == ("done" if lived[trial.name] == 4 else "pruned"), (trial.name, got.status)
        assert got.losses == pytest.approx(alone[trial.name][:lived[trial.name]], rel=RELATIVE)
        assert max(s.step for s in result.timeline if s.trial == trial.name) == lived[trial.name] - 1
    assert result.leaderboard()[0].name == max(lived, key=lived.get)
    with pytest.raises(ValueError, match="first rung, step 4, is not before"):
        select(trials, cluster=cluster2, budget=BUDGET, halving=Halving(first=4), view=None)
