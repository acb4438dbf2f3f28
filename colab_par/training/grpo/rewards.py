"""Rewards from plain Python functions written in a notebook cell, called as TRL calls them:
``function(prompts=[...], completions=[...], **columns) -> list`` with one reward per completion
(the dataset's other columns, e.g. the expected answer, repeated once per completion). Several
functions are summed with weights. A reward of None means "does not apply to this completion",
as in TRL: it is NaN here, left out of the weighted sum (a NaN-ignoring sum over functions) and of
each function's mean and std; a completion no function scored gets a NaN total, which
`advantages.group_advantages` leaves out of its group's statistics and gives advantage 0.

A function that fails fails the cell with its name, the row it failed on and its own traceback."""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from colab_par.training.grpo.advantages import nanstd

__all__ = ["RewardFunction", "RewardFunctionError", "RewardScores", "score_completions", "function_names"]

RewardFunction = Callable[..., Sequence[Any]]


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than one number (or None) per
    completion. `function` is its name and `row` the completion it failed on (None when the
    failure belongs to no single row); the function's own exception, if any, is the cause."""

    def __init__(self, message: str, function: str, row: int | None):
        super().__init__(message)
        self.function, self.row = function, row


@dataclass(frozen=True)
class RewardScores:
    """Each function's rewards (`per_function`: completions x functions, float64, NaN where it
    returned None), their weighted sum per completion (`total`, NaN where every function returned
    None), and each function's mean and std over the completions it scored (by name, in
    `names`' order; the std with Bessel's correction, as TRL logs `rewards/<name>/std`)."""

    names: tuple[str, ...]
    per_function: torch.Tensor
    total: torch.Tensor
    means: dict[str, float]
    stds: dict[str, float]


def score_completions(functions: RewardFunction | Sequence[RewardFunction], prompts: Sequence[Any],
                      completions: Sequence[Any], columns: Mapping[str, Sequence[Any]] | None = None,
                      weights: Sequence[float] | None = None) -> RewardScores:
    """Calls every reward function once on the whole batch and sums their rewards with `weights`
    (default 1 each), as TRL's `reward_weights`. A function that raises is called again one
    completion at a time to name the first row that makes it raise (so keep reward functions
    free of side effects)."""
    functions = [functions] if callable(functions) else list(functions)
    columns = dict(columns or {})
    _check_batch(functions, prompts, completions, columns, weights)
    names = function_names(functions)
    rewards = [_rewards(function, name, prompts, completions, columns) for function, name in zip(functions, names)]
    per_function = torch.tensor(rewards, dtype=torch.float64).T
    weight = torch.tensor([1.0] * len(functions) if weights is None else list(weights), dtype=torch.float64)
    total = (per_function * weight).nansum(dim=1)
    total[per_function.isnan().all(dim=1)] = math.nan
    return RewardScores(names=tuple(names), per_function=per_function, total=total,
                        means={name: torch.nanmean(per_function[:, k]).item() for k, name in enumerate(names)},
                        stds={name: nanstd(per_function[:, k]).item() for k, name in enumerate(names)})


def _check_batch(functions: list, prompts: Sequence[Any], completions: Sequence[Any],
                 columns: dict[str, Sequence[Any]], weights: Sequence[float] | None) -> None:
    if not functions:
        raise ValueError("no reward functions: pass at least one (prompts, completions, **columns) -> list")
    for function in functions:
        if not callable(function):
            raise TypeError(f"reward function {function!r} is not callable: pass a function "
                            "(prompts, completions, **columns) -> list of rewards")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions: repeat each prompt "
                         "once per completion")
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"column {key!r} would replace the {key} argument: rename it")
        if isinstance(values, (str, bytes)) or len(values) != len(completions):
            raise ValueError(f"column {key!r} has {len(values)} values for {len(completions)} completions: "
                             "repeat each prompt's columns once per completion")
    if weights is not None:
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} weights for {len(functions)} reward functions: one weight each")
        for weight in weights:
            if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ValueError(f"reward weight {weight!r} must be a finite number, e.g. 1.0")


def _rewards(function: RewardFunction, name: str, prompts: Sequence[Any], completions: Sequence[Any],
             columns: dict[str, Sequence[Any]]) -> list[float]:
    """The function's rewards as floats (NaN for None), or an error naming it and the row."""
    try:
        values = function(prompts=list(prompts), completions=list(completions), **columns)
    except Exception as error:
        row, row_error = _first_failing_row(function, prompts, completions, columns)
        if row is None:
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(error).__name__}: {error} on the batch of "
                f"{len(completions)} completions (no single completion makes it raise)", name, None) from error
        raise RewardFunctionError(
            f"reward function {name!r} raised {type(row_error).__name__}: {row_error} on row {row} "
            f"(prompt {_short(prompts[row])}, completion {_short(completions[row])})", name, row) from row_error
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(f"reward function {name!r} returned {_short(values)} "
                                  f"({type(values).__name__}), not a list of {len(completions)} rewards", name, None)
    if len(values) != len(completions):
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} rewards for "
                                  f"{len(completions)} completions: return one per completion (None where it "
                                  "does not apply)", name, None)
    return [_reward(value, name, row) for row, value in enumerate(values)]


def _reward(value: Any, name: str, row: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardFunctionError(f"reward function {name!r} returned {_short(value)} ({type(value).__name__}) "
                                  f"at row {row}: a reward is a number, or None where the function does not "
                                  "apply", name, row)
    if not math.isfinite(value):
        raise RewardFunctionError(f"reward function {name!r} returned {value!r} at row {row}: a reward must be "
                                  "finite; return None where the function does not apply", name, row)
    return float(value)


def _first_failing_row(function: RewardFunction, prompts: Sequence[Any], completions: Sequence[Any],
                       columns: dict[str, Sequence[Any]]) -> tuple[int | None, Exception | None]:
    for row in range(len(completions)):
        try:
            function(prompts=[prompts[row]], completions=[completions[row]],
                     **{key: [values[row]] for key, values in columns.items()})
        except Exception as error:
            return row, error
    return None, None


def function_names(functions: list[RewardFunction]) -> list[str]:
    """Each function's `__name__` (a partial's function's; else its class's), numbered when two
    share one (two lambdas)."""
    names: list[str] = []
    for function in functions:
        inner = function.func if isinstance(function, functools.partial) else function
        base = getattr(inner, "__name__", type(inner).__name__)
        name, copy = base, 1
        while name in names:
            copy += 1
            name = f"{base}_{copy}"
        names.append(name)
    return names


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."

