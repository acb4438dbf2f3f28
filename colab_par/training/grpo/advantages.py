"""Group-relative advantages: each completion's reward against the other completions of the same
prompt, as TRL's `GRPOTrainer` (`multi_objective_aggregation="sum_then_normalize"`, its default)
computes them, so that no value model is needed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["GroupAdvantages", "group_advantages", "nanstd", "SCALE_REWARDS", "STD_EPSILON"]

SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: advantages = (reward - group mean) / (std + 1e-4)


@dataclass(frozen=True)
class GroupAdvantages:
    """One advantage per completion, each group's reward spread (`group_std`, one per prompt), and
    `zero_std_fraction`: the share of groups whose rewards are all equal, whose completions all get
    advantage 0 and so teach nothing. When it nears 1 the task is too easy or too hard for the
    policy (the diagnostic TRL logs as `frac_reward_zero_std`)."""

    advantages: torch.Tensor
    group_std: torch.Tensor
    zero_std_fraction: float


def group_advantages(rewards: torch.Tensor | Sequence[float], group_size: int,
                     scale_rewards: str = "group") -> GroupAdvantages:
    """Advantages of `rewards` (num_prompts * group_size,), the completions of each prompt next to
    each other: reward minus its group's mean, divided by (std + 1e-4) where the std (Bessel's
    correction, as TRL's `nanstd`) is the group's (`scale_rewards="group"`, TRL's default), the
    whole batch's (`"batch"`), or not divided (`"none"`, Dr. GRPO). A NaN reward (a completion no
    reward function scored: `rewards.RewardScores.total`) is left out of means and stds and gets
    advantage 0, as in TRL.

    `zero_std_fraction` counts groups whatever `scale_rewards` is (TRL's `frac_reward_zero_std`
    under "batch" asks instead whether the whole batch's std is zero)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)} "
                         "(e.g. 'group', TRL's default)")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} must be a whole number >= 2: an advantage compares "
                         "a completion with the others of its prompt")
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.double()
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}: pass one reward per completion, "
                         f"num_prompts * group_size={group_size} of them")
    groups = rewards.view(-1, group_size)
    group_std = nanstd(groups, dim=1)
    centered = groups - torch.nanmean(groups, dim=1, keepdim=True)
    if scale_rewards == "group":
        centered = centered / (group_std[:, None] + STD_EPSILON)
    elif scale_rewards == "batch":
        centered = centered / (nanstd(rewards) + STD_EPSILON)
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    return GroupAdvantages(advantages=torch.nan_to_num(centered.reshape(-1), nan=0.0), group_std=group_std,
                           zero_std_fraction=zero_std.double().mean().item())


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (NaN with fewer than two values),
    as TRL's `nanstd`; over all values when `dim` is None."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    count = (~values.isnan()).sum(dim=dim)
    squares = torch.nansum((values - torch.nanmean(values, dim=dim, keepdim=True)) ** 2, dim=dim)
    return torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.nan).sqrt()
