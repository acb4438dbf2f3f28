"""What one trial of a model-selection sweep is, a grid of them, and the one-process reference.

A trial is everything that makes its training reproducible on any engine: a model factory (called
under the trial's seed), a data function `data(step) -> (inputs, targets)` that every engine can
call, the optimizer by name with its hyperparameters, the loss and the number of steps. Nothing in
it refers to an engine, so any of its shards may run anywhere.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Trial", "grid", "train_alone", "OPTIMIZERS", "make_optimizer", "cross_entropy"]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# per-parameter state tensors each optimizer keeps (for memory accounting), by its hyperparameters
_STATE_TENSORS = {"sgd": lambda kw: 1 if kw.get("momentum", 0) else 0, "adam": lambda kw: 2,
                  "adamw": lambda kw: 2}


def cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy of (…, classes) logits against (…) class ids."""
    return F.cross_entropy(output.flatten(0, -2), targets.flatten())


@dataclass
class Trial:
    """One model to train. `model` is a zero-argument factory; `data(step)` returns that step's
    (inputs, targets) and must give the same tensors on every engine."""

    model: Callable[[], nn.Module]
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    steps: int
    name: str = ""  # grid() names an unnamed trial after its combination
    optimizer: str = "adamw"
    lr: float = 1e-3
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)  # what the leaderboard shows

    def __post_init__(self) -> None:
        if not callable(self.model) or not callable(self.data):
            raise TypeError(f"trial {self.name!r}: model must be a zero-argument factory and data a "
                            "function step -> (inputs, targets)")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"trial {self.name!r}: steps={self.steps!r} must be a positive integer")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"trial {self.name!r}: optimizer={self.optimizer!r} is not one of "
                             f"{', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"trial {self.name!r}: lr={self.lr!r} must be positive, e.g. 1e-3")

    @property
    def state_tensors_per_param(self) -> int:
        return _STATE_TENSORS[self.optimizer](self.optimizer_kwargs)

    def build(self) -> nn.Module:
        """The model under the trial's seed, as a one-process run builds it."""
        torch.manual_seed(self.seed)
        return self.model()


def make_optimizer(trial: Trial, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False: one kernel per tensor, the same arithmetic whatever the shard grouping
    return OPTIMIZERS[trial.optimizer](params, lr=trial.lr, foreach=False, **trial.optimizer_kwargs)


def grid(make: Callable[..., Trial], **axes: list[Any]) -> list[Trial]:
    """One trial per combination of the axes' values: ``make(**combination)`` builds it.

    A trial made without a name is named after its combination (``"d_model=64 lr=0.003"``), and
    the combination is recorded as its config.
    """
    if not axes or any(len(values) == 0 for values in axes.values()):
        empty = [name for name, values in axes.items() if len(values) == 0]
        raise ValueError("the grid is empty: " + (f"axis {', '.join(empty)} has no values" if empty else
                         "give at least one axis, e.g. grid(make, lr=[1e-3, 3e-3])"))
    trials = []
    for values in itertools.product(*axes.values()):
        combination = dict(zip(axes, values))
        label = " ".join(f"{key}={value}" for key, value in combination.items())
        trial = make(**combination)
        if not isinstance(trial, Trial):
            raise TypeError(f"grid's make(**{combination}) returned {type(trial).__name__}, not a Trial")
        trial.config = {**combination, **trial.config}
        if not trial.name:
            trial.name = label
        trials.append(trial)
    return trials


def train_alone(trial: Trial) -> list[float]:
    """Per-step losses of the trial trained in this process, the plain way: the reference every
    placement, migration and spill must reproduce."""
    model = trial.build()
    optimizer = make_optimizer(trial, list(model.parameters()))
    losses = []
    for step in range(trial.steps):
        inputs, targets = trial.data(step)
        loss = trial.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
