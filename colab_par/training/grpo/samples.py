"""A few rows of a rollout as the dashboard's and TensorBoard's table of what the policy wrote
(`views.rows.SAMPLES_COLUMN`): for each of the first `prompts` prompts, its highest- and
lowest-reward completions (the pair whose difference the advantage rewards), decoded the way
the reward functions saw them."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from colab_par.training.grpo.objective import completion_mask

__all__ = ["rollout_samples"]


def rollout_samples(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                    rewards: torch.Tensor, group_size: int, eos: list[int],
                    decode: Callable[[list[int]], Any] | None, prompts: int = 2) -> list[dict]:
    """[{"prompt", "completion", "reward"}, ...]: best then worst completion of each of the first
    `prompts` groups (one row when the group's rewards are all equal); texts are `decode` of the
    ids (their list as text without `decode`), a reward that is NaN (no function scored the row)
    is None."""
    shown = decode or (lambda ids: ids)
    ended = completion_mask(completion_ids, eos).bool()

    def reward_of(row: int) -> float:  # max and min keep the first of equal rewards
        return float(rewards[row])

    samples = []
    for group in range(min(prompts, completion_ids.shape[0] // group_size)):
        rows = range(group * group_size, (group + 1) * group_size)
        scored = [row for row in rows if not math.isnan(float(rewards[row]))]
        picks = [max(scored, key=reward_of), min(scored, key=reward_of)] if scored else [rows[0]]
        for row in dict.fromkeys(picks):
            prompt = prompt_ids[row][prompt_mask[row].bool()].tolist()
            completion = completion_ids[row][ended[row]].tolist()
            reward = float(rewards[row])
            samples.append({"prompt": str(shown(prompt)), "completion": str(shown(completion)),
                            "reward": None if math.isnan(reward) else reward})
    return samples
