"""The GRPO loop under tensor, sequence and pipeline parallel and memory tiers (2 CPU engines, gloo)
against the one-process reference of `grpo_reference.py` (plain torch from the formulas, each row
unpadded).

1. Fixed prompts (of two lengths: left padding), completions, advantages and old log-probabilities
   far from the policy's: for grpo, bnpo, dr_grpo and dapo, the loss and every gradient of one
   optimizer step under tp2 and pp2 (1F1B, two microbatches: each scores its own rows and the
   runner's mean over them is the rank's loss), with full weights and with LoRA plus a KL term to
   the base (whose log-probabilities come from the pipeline's forward pass). One rank holds every
   row, so bnpo's per-rank token mean is the whole batch's. The other schedules (GPipe with four
   microbatches, interleaved and zero-bubble V on a four-layer GPT) and tp2 with sequence parallel
   (rows of 11 tokens lengthened to 12) with one loss type each.
2. The trainer-generator mismatch taken from the first training forward (no rollout log-probabilities
   of the policy's own): sampling log-probabilities the policy's moved by up to +-0.5 give the
   mismatch written here from the one-process policy, under pp2 (only the last stage scores) and dp2.
3. A whole GRPO step, sampling seeded, two iterations (the second off-policy), under pp2 and under
   memory tiers (optimizer state and gradients on disk, AdamW as the tiers step it): the same
   completions, loss and updated weights as the one-process step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from grpo_reference import (EPS_HIGH, EPS_LOW, LOSS_TYPES, assert_close_grads, engine_fixed_step,
                            engine_whole_step, fixed_batch, fixed_rollout, gpt, reference_grads,
                            reference_whole_step, row_logps)


def run_fixed(cluster, layout: str, loss_types: list[str], lora: bool, layers: int = 2) -> list:
    """Per loss type, (the row, every parameter's gradient): a pipeline's ranks each hold their
    stages' gradients, so theirs are joined; the rows must agree on every rank."""
    batch = fixed_batch(layers)
    model = gpt(lora, layers)
    state = (model.get_base_model() if lora else model).state_dict()
    results = cluster.run(engine_fixed_step, layout, state, fixed_rollout(batch), loss_types, lora, layers)
    joined = []
    for index, loss_type in enumerate(loss_types):
        rows = [result[index][0] for result in results]
        assert all(row == rows[0] for row in rows), loss_type
        grads = {}
        for result in results if "pp" in layout else results[:1]:
            grads.update(result[index][1])
        joined.append((rows[0], grads))
    return batch, joined


def assert_equals_one_process(batch: dict, loss_type: str, lora: bool, row: dict, grads: dict, layers: int = 2):
    expected_loss, expected_grads = reference_grads(batch, loss_type, lora, ranks=1, layers=layers)
    # the loss is a mean of per-token terms of the advantages' size (about 1) that largely cancel:
    # float32 rounds those terms (tp sums each logit's halves in another order), so the bound is
    # relative to them, not to their small mean (grpo's 0.016 here moved by 3e-8 under avx2)
    scale = max(abs(expected_loss), batch["advantages"].abs().mean().item())
    assert abs(row["loss"] - expected_loss) <= 1e-6 * scale, (loss_type, row["loss"], expected_loss)
    assert_close_grads(grads, expected_grads)
    assert row["clip_low"] > 0 and row["clip_high"] > 0
    assert ("kl" in row) == lora and (not lora or row["kl"] > 1e-3)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_fixed_rollout_loss_and_gradients_equal_one_process(cluster2, layout: str, lora: bool) -> None:
    batch = fixed_batch()
    ratios = torch.exp(torch.stack([row_logps(gpt(), p, c) for p, c in zip(batch["prompts"], batch["completions"])])
                       .detach() - batch["old"])
    assert (ratios < 1 - EPS_LOW).any() and (ratios > 1 + EPS_HIGH).any()  # both clips are exercised
    batch, results = run_fixed(cluster2, layout, LOSS_TYPES, lora)
    for loss_type, (row, grads) in zip(LOSS_TYPES, results):
        assert_equals_one_process(batch, loss_type, lora, row, grads)
        if lora:
            assert all("lora_" in name for name in grads)


@pytest.mark.parametrize("layout, loss_type, lora, layers", [
    ("pp2 gpipe mb4", "bnpo", False, 2),
    ("pp2 interleaved v2", "dapo", True, 4),
    ("pp2 zbv v2", "grpo", True, 4),
    ("tp2 sp", "bnpo", True, 2),
])
def test_every_schedule_and_sequence_parallel_equal_one_process(cluster2, layout: str, loss_type: str, lora: bool,
                                                                layers: int) -> None:
    batch, [(row, grads)] = run_fixed(cluster2, layout, [loss_type], lora, layers)
    if "sp" in layout:  # rows of 11 tokens: sequence parallel lengthens them to a multiple of tp
        assert max(map(len, batch["prompts"])) + batch["completions"].shape[1] == 11
    assert_equals_one_process(batch, loss_type, lora, row, grads, layers)


@pytest.mark.parametrize("layout, optimizer", [("pp2", "sgd"), ("dp2 zero3 optimizer@disk grads@disk", "adamw")])
def test_a_whole_sampled_step_equals_one_process(cluster2, layout: str, optimizer: str) -> None:
    results = cluster2.run(engine_whole_step, layout, gpt().state_dict(), optimizer)
    expected = reference_whole_step(optimizer)
    assert torch.equal(results[0]["completions"], results[1]["completions"])
    assert torch.equal(results[0]["completions"], expected["completions"])
    row = results[0]["row"]
    assert row == results[1]["row"] | {"rank": 0, "rollout_s": row["rollout_s"], "train_s": row["train_s"],
                                    "samples": row["samples"]}  # the table: rank 0's rows only
    assert row["reward"] == pytest.approx(expected["rewards"].mean().item(), abs=1e-12)
    assert row["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    for name, value in expected["state"].items():
        assert torch.allclose(results[0]["state"][name], value, rtol=1e-6, atol=1e-7), name
    moved = max((results[0]["state"][n] - v).abs().max().item() for n, v in gpt().state_dict().items())
    assert moved > 1e-3  # the step changed the weights, so equal weights mean equal gradients


@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_the_mismatch_is_measured_from_the_first_training_forward(cluster2, layout: str) -> None:
    from colab_par.training.grpo import completion_mask
    from colab_par.training.grpo.mismatch import logp_mismatch
    from grpo_reference import EOS

    batch = fixed_batch()
    rollout = dataclasses.replace(fixed_rollout(batch), old_logps=None, sampling_logps=batch["old"])
    results = cluster2.run(engine_fixed_step, layout, gpt().state_dict(), rollout, ["dapo"], False)
    with torch.no_grad():
        policy = torch.stack([row_logps(gpt(), p, c) for p, c in zip(batch["prompts"], batch["completions"])])
    expected = logp_mismatch(policy, batch["old"], completion_mask(batch["completions"], EOS)).row()
    assert expected["mismatch/logp_difference_mean"] > 0.1  # far from zero: a row without it fails
    for per_rank in results:
        row, _ = per_rank[0]
        assert {key: row[key] for key in expected} == pytest.approx(expected, rel=1e-5)
