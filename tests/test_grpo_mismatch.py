"""The trainer–generator mismatch measures (`training/grpo/mismatch.py`) against their definitions
written out token by token in float64 Python (TRL's sampling_logp_difference mean / max and
importance_sampling_ratio mean / min / max over the unmasked tokens)."""
from __future__ import annotations

import math

import pytest
import torch

from colab_par.training.grpo.mismatch import logp_mismatch


def written_out(train: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    deltas = [t - s for t, s, keep in zip(train.flatten().tolist(), sampling.flatten().tolist(),
                                          mask.flatten().tolist()) if keep]
    ratios = [math.exp(d) for d in deltas]
    return {"mismatch/logp_difference_mean": sum(abs(d) for d in deltas) / len(deltas),
            "mismatch/logp_difference_max": max(abs(d) for d in deltas),
            "mismatch/importance_ratio_mean": sum(ratios) / len(ratios),
            "mismatch/importance_ratio_min": min(ratios), "mismatch/importance_ratio_max": max(ratios)}


def test_measures_follow_their_definitions_in_float64() -> None:
    generator = torch.Generator().manual_seed(0)
    sampling = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 5
    train = sampling + torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.3
    mask = torch.rand(4, 6, generator=generator) < 0.7
    mask[1] = False  # a row with no counted token
    train[~mask] += 50.0  # masked tokens, if counted, would dominate every measure
    measured = logp_mismatch(train, sampling, mask)
    expected = written_out(train, sampling, mask)
    assert int(measured.tokens) == int(mask.sum())
    assert measured.logp_difference_mean.dtype == torch.float64
    for name, value in measured.row().items():
        assert math.isclose(value, expected[name], rel_tol=1e-12), (name, value, expected[name])


def test_agreeing_log_probabilities_measure_zero_and_an_empty_mask_is_neutral() -> None:
    logps = -torch.rand(3, 5, dtype=torch.float64)
    agreed = logp_mismatch(logps, logps.clone(), torch.ones(3, 5)).row()
    assert agreed["mismatch/logp_difference_max"] == 0 and agreed["mismatch/importance_ratio_mean"] == 1
    empty = logp_mismatch(logps, logps + 1, torch.zeros(3, 5, dtype=torch.bool))
    assert int(empty.tokens) == 0 and empty.row()["mismatch/logp_difference_mean"] == 0
    assert empty.row()["mismatch/importance_ratio_min"] == empty.row()["mismatch/importance_ratio_max"] == 1


def test_rows_of_another_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="one shape"):
        logp_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_microbatches_combine_into_the_whole_batch_measures():
    from colab_par.training.grpo.mismatch import combined

    generator = torch.Generator().manual_seed(3)
    train = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    sampling = train + 0.3 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=generator) > 0.3
    parts = [logp_mismatch(train[rows], sampling[rows], mask[rows]) for rows in (slice(0, 2), slice(2, 6))]
    assert combined(parts).row() == pytest.approx(logp_mismatch(train, sampling, mask).row(), rel=1e-12)
    assert combined([]) is None
