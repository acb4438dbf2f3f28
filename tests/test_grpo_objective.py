"""The GRPO objective against an independent implementation written here from TRL's formulas:
per token and per sequence with Python floats, and with the gradient derived by hand rather than
by autograd. One process, float64, no cluster."""
from __future__ import annotations

import math

import pytest
import torch

from colab_par.training.grpo import GrpoLossOptions, LOSS_TYPES, completion_mask, grpo_loss, token_entropy

EPS_LOW, EPS_HIGH = 0.1, 0.3  # different, so a swapped or shared epsilon changes the numbers
LENGTHS = [6, 4, 1, 0, 5, 6, 3, 2]  # one empty completion: TRL's clamp(min=1) cases
MAX_COMPLETION_LENGTH = 10
EXTRA_GLOBAL_TOKENS = 7  # other micro-batches' and ranks' tokens in dapo's denominator
RATIOS = [0.55, 0.8, 0.95, 1.05, 1.2, 1.45]  # below 1-eps_high, between the lower bounds, inside, ...


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Ratios in every band the two epsilons make (each row a rotation of RATIOS, jittered),
    advantages of both signs and one zero."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(LENGTHS), max(LENGTHS)
    logps = -2 * torch.rand(rows, width, generator=generator, dtype=torch.float64) - 0.05
    ratios = torch.tensor([RATIOS[(i + t) % width] for i in range(rows) for t in range(width)],
                          dtype=torch.float64).view(rows, width)
    jitter = 0.04 * torch.rand(rows, width, generator=generator, dtype=torch.float64) - 0.02
    signs = torch.tensor([1, -1, 1, -1, -1, 0, 1, -1], dtype=torch.float64)
    advantages = signs * (0.2 + torch.rand(rows, generator=generator, dtype=torch.float64))
    mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return {"logps": logps, "old_logps": logps - ratios.log() - jitter, "advantages": advantages, "mask": mask,
            "ref_logps": logps + 0.3 * torch.randn(rows, width, generator=generator, dtype=torch.float64)}


def _reference(batch: dict[str, torch.Tensor], loss_type: str, beta: float) -> tuple[float, list[list[float]]]:
    """The loss and its gradient w.r.t. logps, token by token: a token's weight in the loss is
    what its aggregation divides by; the surrogate's derivative is -ratio*A where min() takes the
    unclipped term and 0 where it takes the clipped one; the k3 term's is 1 - exp(ref - logp)."""
    logps, old, ref = batch["logps"].tolist(), batch["old_logps"].tolist(), batch["ref_logps"].tolist()
    advantages, mask = batch["advantages"].tolist(), batch["mask"].tolist()
    rows = len(logps)
    all_tokens = sum(sum(row) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in logps]
    for i in range(rows):
        length = sum(mask[i])
        weight = {"grpo": 1 / (rows * max(length, 1)), "bnpo": 1 / max(all_tokens, 1),
                  "dr_grpo": 1 / (rows * MAX_COMPLETION_LENGTH),
                  "dapo": 1 / (all_tokens + EXTRA_GLOBAL_TOKENS)}[loss_type]
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            ratio, advantage = math.exp(logps[i][t] - old[i][t]), advantages[i]
            bounded = min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
            if ratio * advantage <= bounded * advantage:
                value, slope = -ratio * advantage, -ratio * advantage
            else:
                value, slope = -bounded * advantage, 0.0
            gap = ref[i][t] - logps[i][t]
            value += beta * (math.exp(gap) - gap - 1)
            slope += beta * (1 - math.exp(gap))
            loss += weight * value
            grad[i][t] = weight * slope
    return loss, grad


def _options(loss_type: str, beta: float = 0.0, **more) -> GrpoLossOptions:
    return GrpoLossOptions(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=beta,
                           max_completion_length=MAX_COMPLETION_LENGTH, **more)


def _computed(batch: dict[str, torch.Tensor], options: GrpoLossOptions, *, with_ref: bool, **more):
    logps = batch["logps"].clone().requires_grad_(True)
    old_logps = batch["old_logps"].clone().requires_grad_(True)
    result = grpo_loss(logps, old_logps, batch["advantages"], batch["mask"], options,
                       ref_logps=batch["ref_logps"] if with_ref else None,
                       num_items_in_batch=int(batch["mask"].sum()) + EXTRA_GLOBAL_TOKENS, **more)
    result.loss.backward()
    assert old_logps.grad is None, "the sampling policy's log-probabilities must be constants"
    return result, logps.grad


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_and_its_gradient_equal_the_token_loop(loss_type, beta):
    batch = _batch()
    result, grad = _computed(batch, _options(loss_type, beta), with_ref=beta > 0)
    expected_loss, expected_grad = _reference(batch, loss_type, beta)
    assert abs(result.loss.item() - expected_loss) < 1e-12
    assert torch.allclose(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=0, atol=1e-12)
    assert grad[batch["mask"] == 0].abs().max() == 0


def test_the_aggregations_differ_on_this_batch():
    """Guards the test above: on equal numbers, two aggregations swapped would give another loss."""
    batch = _batch()
    losses = [_reference(batch, loss_type, 0.0)[0] for loss_type in LOSS_TYPES]
    assert min(abs(a - b) for i, a in enumerate(losses) for b in losses[i + 1:]) > 1e-6


def test_the_batch_has_ratios_on_both_sides_and_in_the_bands_only_one_epsilon_clips():
    batch = _batch()
    ratio = torch.exp(batch["logps"] - batch["old_logps"])[batch["mask"] == 1]
    advantage = batch["advantages"][:, None].expand_as(batch["mask"])[batch["mask"] == 1]
    bands = {"below 1-eps_high": (ratio < 1 - EPS_HIGH) & (advantage < 0),
             "between 1-eps_high and 1-eps_low": (ratio > 1 - EPS_HIGH) & (ratio < 1 - EPS_LOW) & (advantage < 0),
             "between 1+eps_low and 1+eps_high": (ratio > 1 + EPS_LOW) & (ratio < 1 + EPS_HIGH) & (advantage > 0),
             "above 1+eps_high": (ratio > 1 + EPS_HIGH) & (advantage > 0),
             "above 1+eps_high, negative advantage (not clipped)": (ratio > 1 + EPS_HIGH) & (advantage < 0)}
    for band, tokens in bands.items():
        assert tokens.any(), f"no token {band}"
    swapped = GrpoLossOptions(loss_type="bnpo", epsilon_low=EPS_HIGH, epsilon_high=EPS_LOW)
    assert abs(_computed(batch, swapped, with_ref=False)[0].loss.item() - _reference(batch, "bnpo", 0.0)[0]) > 1e-3


def test_clip_and_kl_diagnostics_equal_counts_over_the_unmasked_tokens():
    batch = _batch()
    result, _ = _computed(batch, _options("dapo", 0.04), with_ref=True)
    low = high = tokens = 0
    kl = 0.0
    for i, length in enumerate(LENGTHS):
        advantage = batch["advantages"][i].item()
        for t in range(length):
            ratio = math.exp(batch["logps"][i, t].item() - batch["old_logps"][i, t].item())
            low += ratio < 1 - EPS_LOW and advantage < 0
            high += ratio > 1 + EPS_HIGH and advantage > 0
            gap = batch["ref_logps"][i, t].item() - batch["logps"][i, t].item()
            kl += math.exp(gap) - gap - 1
            tokens += 1
    assert result.tokens.item() == tokens == sum(LENGTHS)
    assert result.clip_low.item() == low / tokens and low > 0
    assert result.clip_high.item() == high / tokens and high > 0
    assert result.clip_region.item() == (low + high) / tokens
    assert abs(result.kl.item() - kl / tokens) < 1e-12
    assert result.entropy is None
    assert not result.kl.requires_grad


def test_a_reference_with_beta_zero_is_measured_but_not_in_the_loss():
    batch = _batch()
    measured, grad = _computed(batch, _options("grpo"), with_ref=True)
    plain, plain_grad = _computed(batch, _options("grpo"), with_ref=False)
    assert measured.loss.item() == plain.loss.item() and torch.equal(grad, plain_grad)
    assert measured.kl.item() > 0 and plain.kl is None


def test_entropy_diagnostic_is_the_masked_mean_of_each_positions_entropy():
    batch = _batch()
    logits = torch.randn(*batch["mask"].shape, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result, _ = _computed(batch, _options("bnpo"), with_ref=False, logits=logits)
    total = 0.0
    for i, length in enumerate(LENGTHS):
        for t in range(length):
            exps = [math.exp(x) for x in logits[i, t].tolist()]
            probabilities = [e / sum(exps) for e in exps]
            total -= sum(p * math.log(p) for p in probabilities)
    assert abs(result.entropy.item() - total / sum(LENGTHS)) < 1e-12
    assert token_entropy(logits).shape == batch["mask"].shape


def test_dapo_over_micro_batches_sums_to_dapo_over_the_whole_batch():
    batch, options = _batch(), _options("dapo")
    everything = int(batch["mask"].sum())
    whole = grpo_loss(batch["logps"], batch["old_logps"], batch["advantages"], batch["mask"], options,
                      num_items_in_batch=everything).loss
    parts = sum(grpo_loss(batch["logps"][rows], batch["old_logps"][rows], batch["advantages"][rows],
                          batch["mask"][rows], options, num_items_in_batch=torch.tensor(everything)).loss
                for rows in (slice(0, 3), slice(3, None)))
    assert abs(whole.item() - parts.item()) < 1e-12


def test_completion_mask_ends_at_the_first_end_token_and_can_drop_truncated_completions():
    ids = torch.tensor([[5, 6, 2, 0, 0],
                        [2, 2, 2, 2, 2],
                        [5, 6, 7, 8, 9],
                        [5, 3, 0, 2, 0]])
    kept = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert completion_mask(ids, [2, 3]).tolist() == kept
    assert completion_mask(ids, [2, 3], mask_truncated=True).tolist() == kept[:2] + [[0] * 5] + kept[3:]
    assert completion_mask(ids, 2)[3].tolist() == [1, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="eos_token_id"):
        completion_mask(ids, [])


@pytest.mark.parametrize("options, message", [
    (dict(loss_type="ppo"), "loss_type='ppo' is not one of grpo, bnpo, dr_grpo, dapo.*loss_type='dapo'"),
    (dict(epsilon_low=1.5), r"epsilon_low=1.5 must be < 1.*e\.g\. 0\.2"),
    (dict(epsilon_high=-0.1), r"epsilon_high=-0.1 must be a finite number > 0 \(e\.g\. 0\.2"),
    (dict(beta=-1.0), r"beta=-1.0 must be a finite number >= 0 \(e\.g\. 0\.04"),
    (dict(beta=float("nan")), "beta=nan must be a finite number"),
    (dict(max_completion_length=0), "max_completion_length=0 must be a whole number >= 1, e.g. 256"),
])
def test_options_name_the_bad_option_and_a_valid_one(options, message):
    with pytest.raises(ValueError, match=message):
        GrpoLossOptions(**options)


def test_options_follow_trl_defaults():
    options = GrpoLossOptions(epsilon_low=0.15)
    assert (options.loss_type, options.epsilon_high, options.beta, options.mask_truncated) == ("dapo", 0.15, 0.0, False)
    with pytest.raises(TypeError, match="mask_truncated='yes' must be True or False"):
        GrpoLossOptions(mask_truncated="yes")


def test_the_loss_names_what_an_option_needs():
    batch = _batch()
    args = batch["logps"], batch["old_logps"], batch["advantages"], batch["mask"]
    with pytest.raises(ValueError, match="beta=0.04 weighs the KL.*pass ref_logps="):
        grpo_loss(*args, _options("grpo", 0.04))
    with pytest.raises(ValueError, match="loss_type='dapo'.*pass num_items_in_batch="):
        grpo_loss(*args, _options("dapo"))
    with pytest.raises(ValueError, match="dr_grpo.*pass GrpoLossOptions.max_completion_length=.*or use loss_type='dapo'"):
        grpo_loss(*args, GrpoLossOptions(loss_type="dr_grpo"))
    with pytest.raises(ValueError, match="longer than max_completion_length=4"):
        grpo_loss(*args, GrpoLossOptions(loss_type="dr_grpo", max_completion_length=4))
    with pytest.raises(ValueError, match=r"old_logps has shape \(8, 5\), logps \(8, 6\)"):
        grpo_loss(batch["logps"], batch["old_logps"][:, :5], *args[2:], _options("grpo"))
    with pytest.raises(ValueError, match=r"advantages has shape \(7,\)"):
        grpo_loss(*args[:2], batch["advantages"][:7], args[3], _options("grpo"))
