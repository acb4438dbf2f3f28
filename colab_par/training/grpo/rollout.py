"""One rollout phase of GRPO on a ParallelModel, the same on every rank: each prompt repeated
`group_size` times, completions sampled with `pm.generate`'s decoding (`generate_rollout`: each row
drawn from its own generator seeded from the step's seed and the row, so the completions do not
depend on the layout; under pure data parallel each rank decodes only the rows it trains on and the
rows are gathered after, so every rank holds the whole batch; each token's sampling
log-probability is kept for the trainer–generator mismatch, `mismatch.py`), the completion mask,
rewards from the user's functions and group-relative advantages.

Every rank scores every completion itself rather than rank 0 scoring and broadcasting: the
rewards are then there without a collective, and a reward function that raises raises on every
rank at the same point, so no rank is left waiting in a broadcast for a rank that failed. One
small all-reduce then checks that the ranks' rewards agree (a reward function that draws random
numbers, or reads a rank's own state, would otherwise train each rank on other advantages).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from colab_par.parallel.inference.generation import generate_rollout
from colab_par.parallel.inference.sampling import Sampling
from colab_par.training.grpo.advantages import group_advantages
from colab_par.training.grpo.objective import completion_mask
from colab_par.training.grpo.prompts import left_padded
from colab_par.training.grpo.rewards import RewardScores, score_completions

__all__ = ["Completions", "Rollout", "RolloutPlan", "sample_rollout", "reward_functions"]


@dataclass(frozen=True)
class Completions:
    """How each rollout samples its completions and shows them to reward functions: the sampling
    `temperature` (the training log-probabilities divide the logits by it too, as TRL does),
    `top_k` / `top_p` cuts, the end-of-sequence id or ids (None: a Hugging Face model's own), the
    padding id (None: the model's own, else the first end id), and `decode` (a completion's or
    prompt's token ids -> what reward functions get, e.g. ``tokenizer.decode``; None: lists of ids)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    decode: Callable[[list[int]], Any] | None = None

    def __post_init__(self) -> None:
        self.sampling()  # refuses a bad temperature, top_k or top_p with generate's own messages
        if self.decode is not None and not callable(self.decode):
            raise TypeError(f"decode={self.decode!r} must be a function of a list of token ids (e.g. "
                            "tokenizer.decode), or None to give reward functions the ids")

    def sampling(self) -> Sampling:
        return Sampling(do_sample=True, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass(frozen=True)
class Rollout:
    """A batch of rows, each a prompt (left-padded, `prompt_mask` True on its tokens) and one
    completion (`completion_ids`, padded after its end), with the `mask` of completion tokens the
    loss counts and the row's `advantage`. `old_logps` (the sampling policy's per-token
    log-probabilities; None: the policy being trained, detached, as TRL with one iteration) and
    `ref_logps` (the reference policy's) are filled for this rank's rows before training;
    `scores` and `zero_std_fraction` describe the rewards of a sampled batch; `sampling_logps`
    are the log-probabilities generation drew each completion token with (None: not sampled
    here), what the training forward's are compared with (`mismatch.py`)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    scores: RewardScores | None = None
    group_std: torch.Tensor | None = None
    zero_std_fraction: float = 0.0
    sampling_logps: torch.Tensor | None = None

    def rows(self, parts: int, index: int) -> "Rollout":
        """Piece `index` of `parts` equal pieces (a data-parallel rank's rows), on the same device."""
        size = self.prompt_ids.shape[0]
        if size % parts:
            raise ValueError(f"a rollout of {size} rows does not split over {parts} data-parallel ranks")
        rows = slice(index * size // parts, (index + 1) * size // parts)
        tensors = {field.name: getattr(self, field.name)[rows] for field in dataclasses.fields(self)
                   if field.name not in ("scores", "group_std", "zero_std_fraction")
                   and getattr(self, field.name) is not None}
        return dataclasses.replace(self, **tensors)

    def to(self, device: torch.device) -> "Rollout":
        tensors = {field.name: getattr(self, field.name).to(device) for field in dataclasses.fields(self)
                   if isinstance(getattr(self, field.name), torch.Tensor)}
        return dataclasses.replace(self, **tensors)


@dataclass(frozen=True)
class RolloutPlan:
    """What `sample_rollout` needs besides the prompts: the loop's settings, resolved."""

    group_size: int
    max_completion_length: int
    completions: Completions
    eos: list[int]
    pad: int
    mask_truncated: bool
    scale_rewards: str
    functions: list[Callable]
    weights: list[float] | None


def sample_rollout(pm: Any, plan: RolloutPlan, prompts: list[list[int]], columns: dict[str, list[Any]],
                   seed: int) -> Rollout:
    """Completions of `prompts` (`group_size` each, next to each other), scored (module docstring)."""
    repeated = [row for row in prompts for _ in range(plan.group_size)]
    prompt_ids, prompt_mask = left_padded(repeated, plan.pad)
    generated = generate_rollout(pm, prompt_ids, plan.max_completion_length, plan.completions.sampling(),
                                 eos_token_id=plan.eos, pad_token_id=plan.pad,
                                 attention_mask=prompt_mask.long(), seed=seed)
    completion_ids = generated.tokens[:, prompt_ids.shape[1]:]
    ended = completion_mask(completion_ids, plan.eos)  # what a reward function reads: up to the end token
    decode = plan.completions.decode or (lambda ids: ids)
    texts = [decode([t for t, keep in zip(row, kept) if keep])
             for row, kept in zip(completion_ids.tolist(), ended.tolist())]
    shown_prompts = [decode(row) for row in repeated]
    scores = score_completions(plan.functions, shown_prompts, texts,
                               {key: [v for v in values for _ in range(plan.group_size)]
                                for key, values in columns.items()}, plan.weights)
    _check_ranks_agree(scores.total, pm.device)
    grouped = group_advantages(scores.total, plan.group_size, plan.scale_rewards)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   mask=completion_mask(completion_ids, plan.eos, mask_truncated=plan.mask_truncated),
                   advantages=grouped.advantages.float(), scores=scores, group_std=grouped.group_std,
                   zero_std_fraction=grouped.zero_std_fraction, sampling_logps=generated.logps)


def _check_ranks_agree(rewards: torch.Tensor, device: torch.device) -> None:
    """One all-reduce: the same rewards on every rank, or an error on every rank saying so."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = int.from_bytes(hashlib.sha256(rewards.double().numpy().tobytes()).digest()[:7], "big")
    agreed = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if int(agreed[0]) != -int(agreed[1]):
        raise ValueError("the ranks computed different rewards for the same completions: a reward function "
                         "draws random numbers or reads something that differs by rank; make it a function "
                         "of its arguments only")


def reward_functions(rewards: Any) -> tuple[list[Callable], list[float] | None]:
    """`rewards` as (functions, weights): one function, a list of them (weights 1), or a mapping
    function -> weight (TRL's `reward_weights`)."""
    if callable(rewards):
        return [rewards], None
    if isinstance(rewards, dict):
        for weight in rewards.values():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward weight {weight!r} must be a finite number, e.g. {{correct: 1.0}}")
        return list(rewards), [float(weight) for weight in rewards.values()]
    if isinstance(rewards, (list, tuple)) and rewards:
        return list(rewards), None
    raise TypeError(f"rewards={rewards!r}: give a reward function (prompts, completions, **columns) -> list, "
                    "a list of them, or a dict function -> weight")
