"""GRPO with generator engines apart from the trainers (`Generators`), on real clusters: two gloo
trainer engines (dp2) and one generator engine (dp1) in worlds of their own, joined by the bridge.

1. max_offpolicy_steps=0, sampling seeded, two iterations: a 2-step run equals the colocated loop's
   run on the trainers alone (the same completions each step, rewards, losses, weights), though
   the generator builds its model from another seed (its weights come from the trainers).
2. max_offpolicy_steps=1, each side's GRPO an engine variable its cluster made (as notebook cells
   do): the rows say staleness 0 then 1, and the losses and weights equal one
   process (written here) that samples rollout 2 from the initial weights and takes the ratio
   against their log-probabilities; with fresh log-probabilities the loss would differ.
3. LoRA, the trainers under dp2 zero3: after the first (whole) version only the adapters travel:
   the bytes sent are theirs, and the generator's base is the trainers'.
4. A reward function raising on the generator at its second rollout (the first in flight) fails
   the controller's call within seconds with the function's name, and both clusters run the next
   call on the same engines.
"""
from __future__ import annotations

import functools
import json
import sys
import time

import cloudpickle
import pytest
import torch
from grpo_reference import (EOS, EPS_HIGH, EPS_LOW, GROUP, LENGTH, LR, PAD, PROMPTS, count_fives, gpt, kept,
                            reference_loss, reference_rollout, row_logps)

from colab_par import Cluster

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SEED, TEMPERATURE, PER_STEP, STEPS = 5, 0.7, 2, 2


@pytest.fixture(scope="module")
def generator_cluster():
    cluster = Cluster(n=1, backend="gloo", timeout=60.0, dashboard=False)
    cluster.start()
    yield cluster
    cluster.stop()


def recording(path: str):
    """count_fives that also writes each rollout's completions (rank 0) to `path`, one line a call."""
    def count_fives_recorded(prompts, completions, **columns):
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(path, "a") as file:
                file.write(json.dumps(completions) + "\n")
        return count_fives(prompts, completions, **columns)
    return count_fives_recorded


def build(role: str, rewards, iterations: int = 1, lora: bool = False, layout: str = "dp2"):
    """Both sides' GRPO: the trainers under `layout`, the generator dp1 from another seed (the
    bridge's first version must overwrite it)."""
    from colab_par import parallelize
    from colab_par.training.grpo import GRPO, Completions, GrpoLossOptions

    model = gpt(lora)
    if role == "generator":
        torch.manual_seed(123)
        for p in model.parameters():
            p.data.add_(torch.randn_like(p) * 0.1)
    pm = parallelize(model, layout if role == "trainer" else "dp1",
                     optimizer_fn=lambda params: torch.optim.SGD(params, lr=LR))
    return GRPO(pm, PROMPTS, rewards, group_size=GROUP, max_completion_length=LENGTH, steps=STEPS,
                prompts_per_step=PER_STEP, iterations=iterations, seed=SEED,
                completions=Completions(temperature=TEMPERATURE, eos_token_id=EOS, pad_token_id=PAD),
                loss=GrpoLossOptions(loss_type="dapo", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH))


def colocated(rewards, iterations: int) -> dict:
    grpo = build("trainer", rewards, iterations)
    return {"rows": grpo.fit(), "state": grpo.pm.full_state_dict()}


def trained_state() -> dict:
    from colab_par.training.grpo.generators import last_loop

    return last_loop().pm.full_state_dict()


def lines(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_synchronous_generators_equal_the_colocated_loop(cluster2, generator_cluster, tmp_path) -> None:
    from colab_par.cluster.generator_engines import Generators

    apart, together = tmp_path / "apart.jsonl", tmp_path / "together.jsonl"
    expected = cluster2.run(colocated, recording(str(together)), 2)[0]
    run = Generators(generator_cluster, max_offpolicy_steps=0).start(
        cluster2, functools.partial(build, rewards=recording(str(apart)), iterations=2))
    rows = run.wait()
    assert lines(apart) == lines(together) and len(lines(apart)) == STEPS  # the same completions each step
    assert [row["staleness"] for row in rows] == [0] * STEPS
    for got, want in zip(rows, expected["rows"]):
        for column in ("reward", "reward_std", "zero_std_fraction", "completion_length", "loss", "grad_norm"):
            assert got[column] == pytest.approx(want[column], rel=1e-6, abs=1e-9), column
        assert got["weights_sync_s"] >= 0 and got["trainer_wait_s"] > 0 and got["rollout_s"] > 0
    state = cluster2.run(trained_state)[0]
    for name, value in expected["state"].items():
        assert torch.allclose(state[name], value, rtol=1e-6, atol=1e-7), name
    generator_state = generator_cluster.run(trained_state)[0]  # version 1 (the last any rollout needs)
    assert any((generator_state[n] - v).abs().max() > 1e-4 for n, v in state.items())
    assert set(run.weights_bytes) == {0, 1}


def reference_stale_run(staleness: int) -> dict:
    """Two steps in one process, rollout k sampled by the weights after max(0, k - staleness)
    steps, the ratio taken against that sampler's log-probabilities."""
    model, sampler = gpt(), gpt()
    optimizer, losses, states = torch.optim.SGD(model.parameters(), lr=LR), [], []
    for step in range(STEPS):
        states.append({name: value.clone() for name, value in model.state_dict().items()})
        sampler.load_state_dict(states[max(0, step - staleness)])
        order = torch.randperm(len(PROMPTS), generator=torch.Generator().manual_seed(SEED)).tolist()
        prompts = [PROMPTS[i] for i in order[step * PER_STEP:(step + 1) * PER_STEP] for _ in range(GROUP)]
        completions = reference_rollout(sampler, prompts, SEED + step, TEMPERATURE)[0]
        lengths = [kept(c) for c in completions]
        rewards = torch.tensor(count_fives(prompts, [c[:n].tolist() for c, n in zip(completions, lengths)]),
                               dtype=torch.float64).view(-1, GROUP)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        with torch.no_grad():
            old = [row_logps(sampler, p, c, TEMPERATURE) for p, c in zip(prompts, completions)]
        logps = [row_logps(model, p, c, TEMPERATURE) for p, c in zip(prompts, completions)]
        loss = reference_loss(logps, old, None, advantages.float(), lengths, "dapo")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def made_in_a_cell(role: str) -> None:
    """What a notebook cell on the `role` side's cluster does: `grpo = GRPO(...)` there."""
    from IPython import get_ipython

    get_ipython().user_ns["grpo"] = build(role, count_fives)


def test_one_step_stale_rollouts_train_against_the_sampler(cluster2, generator_cluster) -> None:
    from colab_par.cluster.generator_engines import Generators

    cluster2.run(made_in_a_cell, "trainer")
    generator_cluster.run(made_in_a_cell, "generator")
    rows = Generators(generator_cluster, max_offpolicy_steps=1).fit(cluster2, "grpo")
    expected, fresh = reference_stale_run(1), reference_stale_run(0)
    assert [row["staleness"] for row in rows] == [0, 1]
    assert abs(fresh["losses"][1] - expected["losses"][1]) > 1e-3  # staleness changes what is trained
    for row, loss in zip(rows, expected["losses"]):
        assert row["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-7)
    state = cluster2.run(trained_state)[0]
    for name, value in expected["state"].items():
        assert torch.allclose(state[name], value, rtol=1e-6, atol=1e-7), name


def test_lora_sends_only_the_adapters_after_the_first_version(cluster2, generator_cluster) -> None:
    from colab_par.cluster.generator_engines import Generators

    run = Generators(generator_cluster).start(cluster2, functools.partial(build, rewards=count_fives, lora=True,
                                                                  layout="dp2 zero3"))
    run.wait()
    model = gpt(lora=True)
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert run.weights_bytes == {0: whole, 1: adapters} and adapters < whole / 10
    trainer, generator = cluster2.run(trained_state)[0], generator_cluster.run(trained_state)[0]
    assert set(trainer) == set(generator)
    for name, value in trainer.items():  # the generator holds version 1: the adapters after step 1
        assert torch.equal(generator[name], value) or "lora_" in name, name


def exploding_reward(prompts, completions, **_):
    """count_fives on its first call (rollout 1 is sent while rollout 2 samples), then a raise."""
    exploding_reward.calls = getattr(exploding_reward, "calls", 0) + 1
    if exploding_reward.calls > 1:
        raise ZeroDivisionError("the reward cell divides by zero")
    return count_fives(prompts, completions)


def test_a_failing_reward_function_fails_the_call_within_seconds(cluster2, generator_cluster) -> None:
    from colab_par.cluster.generator_engines import Generators

    pids = cluster2.pids | generator_cluster.pids
    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        Generators(generator_cluster, max_offpolicy_steps=1).fit(
            cluster2, functools.partial(build, rewards=exploding_reward))
    assert time.monotonic() - started < 20  # engines build their models in this time too
    assert "exploding_reward" in str(failure.value) and "RewardFunctionError" in str(failure.value)
    assert any("generator engines" in note for note in failure.value.__notes__)
    assert cluster2.run(sum, [1, 2]) == [3, 3] and generator_cluster.run(sum, [1, 2]) == [3]
    assert cluster2.pids | generator_cluster.pids == pids  # the same engines, nothing restarted


def other_steps(role: str):
    grpo = build(role, count_fives)
    if role == "generator":
        grpo.steps = 3
    return grpo


def test_bad_settings_are_refused_naming_them(cluster2, generator_cluster) -> None:
    from colab_par.cluster.generator_engines import Generators

    with pytest.raises(ValueError, match="max_offpolicy_steps=-1"):
        Generators(generator_cluster, max_offpolicy_steps=-1)
    with pytest.raises(ValueError, match="same Cluster"):
        Generators(cluster2).start(cluster2, "grpo")
    with pytest.raises(TypeError, match="name of the engine variable"):
        Generators(generator_cluster).start(cluster2, "not a name")
    with pytest.raises(Exception, match=r"steps 3 \(trainers: 2\)"):
        Generators(generator_cluster).fit(cluster2, other_steps)
