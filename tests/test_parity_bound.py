"""The parity check itself: its tolerance must still reject real training errors.

A correct layout differs from single-process training only in float32 summation order. Each
variant below is a real mistake a layout could make; `assert_parity` must refuse every one while
accepting the reference itself.
"""
from __future__ import annotations

import pytest
import torch

from parity import LR, assert_parity, reference_run

WRONG = {
    "learning rate 1% high": dict(lr=LR * 1.01),
    "one norm weight never updated": dict(frozen="layers.1.ffn_norm.weight"),
    "one projection never updated": dict(frozen="layers.3.attention.wo.weight"),
    "gradients summed over 2 ranks instead of averaged": dict(grad_scale=2.0),
}


def test_reference_passes_its_own_check() -> None:
    reference = reference_run("gpt")
    assert_parity([reference, {**reference, "state": {}}], reference)


@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_real_training_error_is_rejected(mistake: str) -> None:
    wrong = reference_run("gpt", **WRONG[mistake])
    with pytest.raises(AssertionError):
        assert_parity([wrong, {**wrong, "state": {}}], reference_run("gpt"))


def test_tolerance_is_tight_where_gradients_are_real() -> None:
    """Almost every element's tolerance, over all the steps, is a small fraction of ONE learning-rate
    step: the bound opens up only where an element's gradient sat at the rounding-noise level."""
    every = torch.cat([t.flatten() for t in reference_run("gpt")["tolerance"].values()])
    assert (every < 0.1 * LR).double().mean() > 0.98
