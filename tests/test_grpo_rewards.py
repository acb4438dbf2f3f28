"""Rewards from plain Python functions and the group-relative advantages made from them, against
hand computations; every way a reward function can fail, by its message. One process, no cluster."""
from __future__ import annotations

import math
import statistics
import traceback

import pytest
import torch

from colab_par.training.grpo import RewardFunctionError, group_advantages, score_completions

GROUPS = [[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [1.0, math.nan, 3.0, 5.0]]  # mixed, all equal, one unscored


def _hand(scale: str) -> list[float]:
    """reward - group mean, over (std + 1e-4) of the group or of the batch (statistics.stdev: n - 1)."""
    scored = [r for group in GROUPS for r in group if not math.isnan(r)]
    advantages = []
    for group in GROUPS:
        present = [r for r in group if not math.isnan(r)]
        std = {"group": statistics.stdev(present), "batch": statistics.stdev(scored), "none": None}[scale]
        for reward in group:
            centered = 0.0 if math.isnan(reward) else reward - statistics.mean(present)
            advantages.append(centered if std is None else centered / (std + 1e-4))
    return advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_hand_computation_and_count_equal_groups(scale):
    rewards = torch.tensor([r for group in GROUPS for r in group], dtype=torch.float64)
    result = group_advantages(rewards, group_size=4, scale_rewards=scale)
    assert torch.allclose(result.advantages, torch.tensor(_hand(scale), dtype=torch.float64), rtol=0, atol=1e-12)
    assert result.advantages[4:8].tolist() == [0.0] * 4
    assert result.zero_std_fraction == 1 / 3
    assert result.group_std[1].item() == 0 and abs(result.group_std[2].item() - 2.0) < 1e-12


def test_advantages_refuse_what_cannot_be_grouped():
    with pytest.raises(ValueError, match="scale_rewards='std' is not one of group, batch, none"):
        group_advantages([1.0, 2.0], 2, scale_rewards="std")
    with pytest.raises(ValueError, match="group_size=1 must be a whole number >= 2"):
        group_advantages([1.0, 2.0], 1)
    with pytest.raises(ValueError, match=r"rewards has shape \(5,\).*group_size=2"):
        group_advantages([1.0] * 5, 2)


def correct(prompts, completions, answer, **_):
    return [1.0 if completion.strip() == expected else 0.0 for completion, expected in zip(completions, answer)]


def short(completions, **_):
    return [None if completion.startswith("?") else -0.1 * len(completion) for completion in completions]


def test_rewards_are_weighted_sums_with_none_left_out():
    prompts = ["1+1=", "1+1=", "2+2=", "2+2="]
    completions = ["2", "?3", "?5", "4 "]
    scores = score_completions([correct, short], prompts, completions, {"answer": ["2", "2", "4", "4"]},
                               weights=[1.0, 0.5])
    assert scores.names == ("correct", "short")
    assert scores.per_function[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert scores.per_function[:, 1].isnan().tolist() == [False, True, True, False]
    assert scores.total.tolist() == [1.0 - 0.05, 0.0, 0.0, 1.0 - 0.1]
    assert scores.means == {"correct": 0.5, "short": pytest.approx(-0.15, abs=1e-15)}
    assert scores.stds["correct"] == pytest.approx(statistics.stdev([1.0, 0.0, 0.0, 1.0]), abs=1e-15)
    assert scores.stds["short"] == pytest.approx(statistics.stdev([-0.1, -0.2]), abs=1e-15)


def test_a_completion_no_function_scores_has_no_total_and_no_advantage():
    scores = score_completions(short, ["p"] * 4, ["ab", "?", "abcd", "a"])
    assert math.isnan(scores.total[1].item())
    advantages = group_advantages(scores.total, group_size=4).advantages
    assert advantages[1].item() == 0.0
    assert abs(advantages[[0, 2, 3]].sum().item()) < 1e-12


def test_bools_and_tensors_are_rewards_and_same_names_are_numbered():
    scores = score_completions([lambda completions, **_: [c == "a" for c in completions],
                                lambda completions, **_: torch.ones(len(completions))], ["p", "p"], ["a", "b"])
    assert scores.names == ("<lambda>", "<lambda>_2")
    assert scores.total.tolist() == [2.0, 1.0]


def _failure(function, completions=("a", "b", "c", "d"), **columns) -> RewardFunctionError:
    with pytest.raises(RewardFunctionError) as caught:
        score_completions([correct, function], ["p"] * len(completions), list(completions),
                          {"answer": ["a"] * len(completions), **columns})
    return caught.value


def test_a_function_that_raises_is_named_with_the_row_and_its_own_traceback():
    def parse_number(completions, **_):
        return [float(int(c, 16)) for c in completions]

    error = _failure(parse_number, completions=("a", "b", "zz", "d"))
    assert str(error).startswith("reward function 'parse_number' raised ValueError: invalid literal")
    assert "on row 2 (prompt 'p', completion 'zz')" in str(error)
    assert (error.function, error.row) == ("parse_number", 2)
    assert isinstance(error.__cause__, ValueError)
    frames = [frame.name for frame in traceback.extract_tb(error.__cause__.__traceback__)]
    assert "parse_number" in frames


def test_a_function_that_raises_only_on_the_whole_batch_says_so():
    def needs_one(completions, **_):
        if len(completions) > 1:
            raise RuntimeError("one at a time")
        return [0.0]

    error = _failure(needs_one)
    assert "'needs_one' raised RuntimeError: one at a time on the batch of 4 completions" in str(error)
    assert error.row is None and isinstance(error.__cause__, RuntimeError)


@pytest.mark.parametrize("returned, message, row", [
    ([1.0, 2.0], r"'bad' returned 2 rewards for 4 completions: return one per completion \(None where", None),
    (0.5, r"'bad' returned 0.5 \(float\), not a list of 4 rewards", None),
    ([1.0, "high", 0.0, 0.0], r"'bad' returned 'high' \(str\) at row 1: a reward is a number, or None", 1),
    ([1.0, 0.0, 0.0, math.nan], r"'bad' returned nan at row 3: a reward must be finite; return None", 3),
    ([math.inf, 0.0, 0.0, 0.0], r"'bad' returned inf at row 0", 0),
])
def test_a_function_returning_something_else_is_named_with_the_row_and_value(returned, message, row):
    def bad(completions, **_):
        return returned

    error = _failure(bad)
    assert error.function == "bad" and error.row == row
    with pytest.raises(RewardFunctionError, match=message):
        raise error


def test_the_batch_itself_is_checked_before_any_function_runs():
    calls = []

    def counted(completions, **_):
        calls.append(1)
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        score_completions(counted, ["p", "p"], ["a", "b"], {"answer": ["a"]})
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        score_completions(counted, ["p", "p"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="1 weights for 2 reward functions"):
        score_completions([counted, counted], ["p"], ["a"], weights=[1.0])
    with pytest.raises(TypeError, match="reward function 3 is not callable"):
        score_completions([counted, 3], ["p"], ["a"])
    assert not calls
