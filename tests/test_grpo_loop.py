"""The GRPO loop on real engines (2 CPU engines, gloo) against one process written here in plain
torch from the formulas: each row's log-probabilities from its own unpadded forward (no padding
mask, no cache), the clipped surrogate and each loss type's aggregation token by token, the k3 KL
to peft's own `disable_adapter()` base, advantages from group means and stds, and the rollouts'
per-row seeded sampling (row r's generator seeded (seed * 1_000_003 + r) mod 2**64, float32 logits
/ temperature, softmax, one multinomial draw per row per step).

1. Fixed prompts (of two lengths: left padding), completions, advantages and old log-probabilities
   far from the policy's (so ratios clip on both sides): the loss and every gradient of one
   optimizer step under dp2 and dp2 zero3, for grpo, bnpo (each rank's own token mean, as TRL's
   bnpo per process), dr_grpo and dapo; and each of them with LoRA and a KL term under dp2 zero3.
2. A whole step, sampling seeded, two iterations (the second off-policy): the same completions,
   rewards, loss and updated weights as the one-process step, under dp2 with full weights and
   under dp2 zero3 with LoRA and a KL term to the base.
"""
from __future__ import annotations

import pytest
import torch
from grpo_reference import (EPS_HIGH, EPS_LOW, LOSS_TYPES, assert_close_grads, engine_fixed_step,
                            engine_whole_step, fixed_batch, fixed_rollout, gpt, reference_grads,
                            reference_whole_step, row_logps)


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3"])
def test_fixed_rollout_loss_and_gradients_equal_one_process(cluster2, layout: str) -> None:
    batch = fixed_batch()
    ratios = torch.exp(torch.stack([row_logps(gpt(), p, c) for p, c in zip(batch["prompts"], batch["completions"])])
                       .detach() - batch["old"])
    assert (ratios < 1 - EPS_LOW).any() and (ratios > 1 + EPS_HIGH).any()  # both clips are exercised
    results = cluster2.run(engine_fixed_step, layout, gpt().state_dict(), fixed_rollout(batch), LOSS_TYPES, False)
    for loss_type, (row, grads) in zip(LOSS_TYPES, results[0]):
        expected_loss, expected_grads = reference_grads(batch, loss_type, lora=False)
        assert abs(row["loss"] - expected_loss) <= 1e-6 * abs(expected_loss), loss_type
        assert_close_grads(grads, expected_grads)
        assert row["clip_low"] > 0 and row["clip_high"] > 0 and "kl" not in row
    assert results[1][0][0]["loss"] == results[0][0][0]["loss"]


def test_fixed_rollout_with_lora_and_kl_to_the_base_equals_one_process(cluster2) -> None:
    batch = fixed_batch()
    state = gpt(lora=True).get_base_model().state_dict()
    results = cluster2.run(engine_fixed_step, "dp2 zero3", state, fixed_rollout(batch), LOSS_TYPES, True)
    for loss_type, (row, grads) in zip(LOSS_TYPES, results[0]):
        expected_loss, expected_grads = reference_grads(batch, loss_type, lora=True)
        assert abs(row["loss"] - expected_loss) <= 1e-6 * abs(expected_loss), loss_type
        assert set(grads) == set(expected_grads) and all("lora_" in name for name in grads)
        assert_close_grads(grads, expected_grads)
        assert row["kl"] > 1e-3


def test_a_whole_sampled_step_under_dp2_equals_one_process(cluster2) -> None:
    results = cluster2.run(engine_whole_step, "dp2", gpt().state_dict())
    expected = reference_whole_step()
    assert torch.equal(results[0]["completions"], results[1]["completions"])
    assert torch.equal(results[0]["completions"], expected["completions"])
    row = results[0]["row"]
    assert row["zero_std_fraction"] == (expected["rewards"].std(1) == 0).double().mean().item()
    assert row["reward"] == pytest.approx(expected["rewards"].mean().item(), abs=1e-12)
    assert row["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert row["rollout_s"] > 0 and row["train_s"] > 0
    for name, value in expected["state"].items():
        assert torch.allclose(results[0]["state"][name], value, rtol=1e-6, atol=1e-7), name
    moved = max((results[0]["state"][n] - v).abs().max().item() for n, v in gpt().state_dict().items())
    assert moved > 1e-3  # the step changed the weights, so equal weights mean equal gradients


def test_a_whole_sampled_step_under_dp2_zero3_with_lora_equals_one_process(cluster2) -> None:
    """Sampling from the adapted policy, the KL term to the base with the adapters off, two
    optimizer steps on the adapters only: the same completions, loss and adapter weights."""
    results = cluster2.run(engine_whole_step, "dp2 zero3", gpt(lora=True).get_base_model().state_dict(), "sgd", True)
    expected = reference_whole_step(lora=True)
    assert torch.equal(results[0]["completions"], results[1]["completions"])
    assert torch.equal(results[0]["completions"], expected["completions"])
    row = results[0]["row"]
    assert row["loss"] == pytest.approx(expected["loss"], rel=1e-6) and row["kl"] > 0
    adapters = {name.removeprefix("base_model.model."): value for name, value in expected["state"].items()
                if "lora_" in name}
    got = {name.removeprefix("base_model.model."): value for name, value in results[0]["state"].items()
           if "lora_" in name}
    assert got.keys() == adapters.keys() and adapters
    for name, value in adapters.items():
        assert torch.allclose(got[name], value, rtol=1e-6, atol=1e-7), name
    start = {name.removeprefix("base_model.model."): value for name, value in gpt(True).state_dict().items()}
    assert max((got[name] - start[name]).abs().max().item() for name in adapters) > 1e-3  # the step moved them
