"""The GRPO loop on real engines (2 CPU engines, gloo) against one process written here in plain
torch from the formulas: each row's log-probabilities from its own unpadded forward (no padding
mask, no cache), the clipped surrogate and each loss type's aggregation token by token, the k3 KL
to peft's own `disable_adapter()` base, advantages from group means and stds, and the sampling
procedure of `generate` (float32 logits / temperature, softmax, one multinomial draw per step).

1. Fixed prompts (of two lengths: left padding), completions, advantages and old log-probabilities
   far from the policy's (so ratios clip on both sides): the loss and every gradient of one
   optimizer step under dp2 and dp2 zero3, for grpo, bnpo (each rank's own token mean, as TRL's
   bnpo per process), dr_grpo and dapo; and LoRA with a KL term under dp2 zero3.
2. A whole step, sampling seeded, two iterations (the second off-policy): the same completions,
   rewards, loss and updated weights as the one-process step.
"""
from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = dict(vocab_size=32, seq_len=24, n_layer=2, n_head=4, d_model=32, kernels="torch")
EOS, PAD, GROUP, LENGTH = 2, 0, 4, 6
EPS_LOW, EPS_HIGH, BETA, LR = 0.1, 0.3, 0.2, 0.5
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
LORA = dict(r=4, lora_alpha=8, target_modules=["wq", "wv"], init_lora_weights=False)


def gpt(lora: bool = False) -> torch.nn.Module:
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


def count_fives(prompts, completions, **_):
    return [float(sum(token in (5, 6, 7) for token in completion)) for completion in completions]


class GradRecorder(torch.optim.SGD):
    """SGD that keeps each parameter's whole gradient (gathered from its shards) before stepping."""

    def __init__(self, params):
        super().__init__(params, lr=LR)
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        self.grads = {id(p): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for group in self.param_groups for p in group["params"] if p.grad is not None}
        return super().step(closure)


# ---- the one-process reference ------------------------------------------------------------------------
def row_logps(model, prompt: list[int], completion: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    tokens = torch.cat([torch.tensor(prompt), completion])[None]
    logits = model(tokens)[0, len(prompt) - 1:len(prompt) - 1 + len(completion)].float() / temperature
    return logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]


def kept(completion: torch.Tensor) -> int:
    """Tokens up to and including the first EOS."""
    ends = (completion == EOS).nonzero()
    return int(ends[0]) + 1 if len(ends) else len(completion)


def reference_loss(logps, old, ref, advantages, lengths, loss_type: str, beta: float = 0.0) -> torch.Tensor:
    """The objective token by token (logps: a list of per-row tensors with gradient)."""
    rows, total = len(logps), sum(lengths)
    terms = []
    for i in range(rows):
        row = []
        for t in range(lengths[i]):
            ratio = torch.exp(logps[i][t] - old[i][t])
            a = advantages[i]
            term = -torch.minimum(ratio * a, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
            if beta:
                gap = ref[i][t] - logps[i][t]
                term = term + beta * (torch.exp(gap) - gap - 1)
            row.append(term)
        terms.append(torch.stack(row).sum() if row else torch.zeros(()))
    if loss_type == "grpo":
        return sum(terms[i] / max(lengths[i], 1) for i in range(rows)) / rows
    if loss_type == "dr_grpo":
        return sum(terms) / (rows * LENGTH)
    if loss_type == "dapo":
        return sum(terms) / total
    halves = [range(0, rows // 2), range(rows // 2, rows)]  # bnpo: each dp rank's own token mean
    return sum(sum(terms[i] for i in half) / max(sum(lengths[i] for i in half), 1) for half in halves) / 2


def fixed_batch() -> dict:
    """Prompts of two lengths, completions with end tokens at several places (and none), advantages
    from fixed rewards, old log-probabilities the policy's moved by up to +-0.5."""
    generator = torch.Generator().manual_seed(1)
    prompts = [PROMPTS[0]] * GROUP + [PROMPTS[1]] * GROUP
    completions = torch.randint(3, CONFIG["vocab_size"], (len(prompts), LENGTH), generator=generator)
    for row, end in enumerate([2, None, 0, 5, 3, None, 1, 4]):
        if end is not None:
            completions[row, end], completions[row, end + 1:] = EOS, PAD
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 0.0, 3.0, 1.0], dtype=torch.float64).view(-1, GROUP)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    noise = (torch.rand(completions.shape, generator=generator) - 0.5).float()
    with torch.no_grad():
        old = torch.stack([row_logps(gpt(), p, c) for p, c in zip(prompts, completions)]) + noise
    return {"prompts": prompts, "completions": completions, "advantages": advantages.float(), "old": old}


def fixed_rollout(batch: dict):
    from colab_par.training.grpo import Rollout, completion_mask
    from colab_par.training.grpo.prompts import left_padded

    ids, mask = left_padded(batch["prompts"], PAD)
    return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=batch["completions"],
                   mask=completion_mask(batch["completions"], EOS), advantages=batch["advantages"],
                   old_logps=batch["old"])


def reference_grads(batch: dict, loss_type: str, lora: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model = gpt(lora)
    pairs = list(zip(batch["prompts"], batch["completions"]))
    ref = None
    if lora:
        with torch.no_grad(), model.disable_adapter():
            ref = [row_logps(model, p, c) for p, c in pairs]
    logps = [row_logps(model, p, c) for p, c in pairs]
    lengths = [kept(c) for c in batch["completions"]]
    loss = reference_loss(logps, batch["old"], ref, batch["advantages"], lengths, loss_type, BETA if lora else 0.0)
    loss.backward()
    prefix = "base_model.model." if lora else ""
    return loss.item(), {name.removeprefix(prefix): p.grad for name, p in model.named_parameters() if p.grad is not None}


# ---- engine side ------------------------------------------------------------------------------------
def engine_fixed_step(layout: str, state: dict, rollout, loss_types: list[str], lora: bool) -> list:
    from colab_par import parallelize
    from colab_par.parallel.inference.state import bare_module
    from colab_par.training.grpo import GRPO, Completions, GrpoLossOptions

    results = []
    for loss_type in loss_types:
        model = gpt(lora)
        (model.get_base_model() if lora else model).load_state_dict(state)
        pm = parallelize(model, layout, optimizer_fn=GradRecorder)
        options = GrpoLossOptions(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                  beta=BETA if lora else 0.0, max_completion_length=LENGTH)
        grpo = GRPO(pm, PROMPTS, count_fives, group_size=GROUP, max_completion_length=LENGTH, steps=1,
                    prompts_per_step=2, completions=Completions(eos_token_id=EOS, pad_token_id=PAD), loss=options)
        row = grpo.train_on(rollout)
        names = {id(p): name for name, p in bare_module(pm.model).named_parameters()}
        results.append((row, {names[key]: grad for key, grad in pm.optimizer.grads.items()}))
    return results


def assert_close_grads(got: dict, expected: dict) -> None:
    assert set(got) == set(expected) and expected
    for name, grad in expected.items():
        error = (got[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < 1e-5 or (got[name] - grad).abs().max() < 1e-9, f"{name}: relative error {error:.2e}"
    total = math.sqrt(sum((got[n] - g).norm() ** 2 for n, g in expected.items()))
    assert total / math.sqrt(sum(g.norm() ** 2 for g in expected.values())) < 1e-6


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


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
    results = cluster2.run(engine_fixed_step, "dp2 zero3", state, fixed_rollout(batch), ["dapo"], True)
    row, grads = results[0][0]
    expected_loss, expected_grads = reference_grads(batch, "dapo", lora=True)
    assert abs(row["loss"] - expected_loss) <= 1e-6 * abs(expected_loss)
    assert set(grads) == set(expected_grads) and all("lora_" in name for name in grads)
    assert_close_grads(grads, expected_grads)
    assert row["kl"] > 1e-3


# ---- a whole step ---------------------------------------------------------------------------------------
SEED, TEMPERATURE, ITERATIONS, PER_STEP = 5, 0.7, 2, 2


def engine_whole_step(layout: str, state: dict) -> dict:
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.training.grpo import GRPO, Completions, GrpoLossOptions

    torch.manual_seed(dist.get_rank())  # nothing may depend on a rank's own generator
    model = gpt()
    model.load_state_dict(state)
    pm = parallelize(model, layout, optimizer_fn=lambda params: torch.optim.SGD(params, lr=LR))
    grpo = GRPO(pm, PROMPTS, count_fives, group_size=GROUP, max_completion_length=LENGTH, steps=1,
                prompts_per_step=PER_STEP, iterations=ITERATIONS, seed=SEED,
                completions=Completions(temperature=TEMPERATURE, eos_token_id=EOS, pad_token_id=PAD),
                loss=GrpoLossOptions(loss_type="dapo", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH))
    row = grpo.fit()[0]
    return {"row": row, "completions": grpo.last_rollout.completion_ids, "state": pm.full_state_dict()}


def reference_whole_step() -> dict:
    """The step in one process: prompts by the documented shuffle, sampling, rewards, advantages,
    the sampling policy's log-probabilities, two SGD steps of the dapo loss."""
    model = gpt()
    order = torch.randperm(len(PROMPTS), generator=torch.Generator().manual_seed(SEED)).tolist()
    prompts = [PROMPTS[i] for i in order[:PER_STEP] for _ in range(GROUP)]
    generator = torch.Generator().manual_seed(SEED)
    rows, done = [torch.tensor(p) for p in prompts], [False] * len(prompts)
    with torch.no_grad():
        for _ in range(LENGTH):
            logits = torch.stack([model(row[None])[0, -1] for row in rows]).float() / TEMPERATURE
            chosen = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
            rows = [torch.cat([row, torch.tensor([PAD if done[i] else int(chosen[i])])]) for i, row in enumerate(rows)]
            done = [d or int(c) == EOS for d, c in zip(done, chosen)]
            if all(done):
                break
    completions = torch.stack([row[len(p):] for row, p in zip(rows, prompts)])
    lengths = [kept(c) for c in completions]
    rewards = torch.tensor(count_fives(prompts, [c[:n].tolist() for c, n in zip(completions, lengths)]),
                           dtype=torch.float64).view(-1, GROUP)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    pairs = list(zip(prompts, completions))
    with torch.no_grad():
        old = [row_logps(model, p, c, TEMPERATURE) for p, c in pairs]
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=LR), []
    for _ in range(ITERATIONS):
        logps = [row_logps(model, p, c, TEMPERATURE) for p, c in pairs]
        loss = reference_loss(logps, old, None, advantages.float(), lengths, "dapo")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"completions": completions, "rewards": rewards, "loss": sum(losses) / ITERATIONS,
            "state": model.state_dict()}


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
