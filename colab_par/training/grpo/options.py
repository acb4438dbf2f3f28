"""The GRPO objective's settings as one frozen value, checked when built so that a wrong option
fails in the notebook before any engine generates a token. Names and defaults follow TRL's
`GRPOConfig` (`loss_type`, `epsilon`/`epsilon_high`, `beta`, `mask_truncated_completions`,
`max_completion_length`, `scale_rewards`) so a TRL user can carry a configuration over."""
from __future__ import annotations

import math
from dataclasses import dataclass

from colab_par.training.grpo.advantages import SCALE_REWARDS

__all__ = ["GrpoLossOptions", "LOSS_TYPES"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass(frozen=True)
class GrpoLossOptions:
    """How per-token losses become one number (`loss_type`, see `objective.grpo_loss`), how far
    the importance ratio may move before its gradient is cut (`epsilon_low` below 1,
    `epsilon_high` above; `epsilon_high=None` takes `epsilon_low`, as TRL's `epsilon_high`), the
    weight `beta` of the KL term to the reference policy (0: no reference needed), whether
    completions cut off without an end-of-sequence token leave the loss (`mask_truncated`), and
    the generation budget `max_completion_length` that `dr_grpo` divides by (`GRPO` fills it
    in from its own; `grpo_loss` called alone needs it given), and how advantages divide rewards
    (`scale_rewards`: by their group's std, the batch's, or "none"; `advantages.group_advantages`).

    `loss_type` defaults to TRL's default, "dapo"."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    mask_truncated: bool = False
    max_completion_length: int | None = None
    scale_rewards: str = "group"

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {', '.join(LOSS_TYPES)} "
                             "(e.g. loss_type='dapo', TRL's default)")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon_low)
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if not _finite_number(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a finite number > 0 (e.g. 0.2; DAPO uses "
                                 "epsilon_high=0.28)")
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low={self.epsilon_low!r} must be < 1: the ratio's lower bound "
                             "1 - epsilon_low has to stay positive (e.g. 0.2)")
        if not _finite_number(self.beta) or self.beta < 0:
            raise ValueError(f"beta={self.beta!r} must be a finite number >= 0 (e.g. 0.04; 0 needs no "
                             "reference policy)")
        if not isinstance(self.mask_truncated, bool):
            raise TypeError(f"mask_truncated={self.mask_truncated!r} must be True or False")
        length = self.max_completion_length
        if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
            raise ValueError(f"max_completion_length={length!r} must be a whole number >= 1, e.g. 256")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
