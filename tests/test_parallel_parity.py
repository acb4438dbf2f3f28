"""Parity proof: every layout trains like single-process training (fp32, gloo, real engines).

20 AdamW steps of the same tiny GPT on the same global batches: losses and gradient norms within
1e-5 relative of the single-process reference, every final parameter within the tolerance Adam's
arithmetic gives it (see `parity.assert_parity` and tests/test_parity_bound.py).
"""
from __future__ import annotations

import pytest

from parity import assert_parity, engine_run, reference_run

TWO_ENGINES = [
    "dp2", "dp2 zero1", "dp2 zero2", "dp2 zero3", "dp2 zero3 offload",
    "tp2", "tp2 sp", "cp2", "cp2 ulysses",
    "dp2 ac-full", "dp2 zero3 ac-selective", "tp2 sp ac-full",
]
# Bare "pp2" / "dp2 pp2" (1F1B): the default microbatch count fills the pipeline.
PIPELINE_SCHEDULES = ["pp2", "pp2 gpipe mb2", "pp2 interleaved v2 mb2", "pp2 zbv v2 mb2"]
FOUR_ENGINES = [
    "dp2 tp2", "dp2 tp2 sp",  # Megatron DP x TP (zero0): tensor-parallel gradients averaged over dp
    "dp2 tp2 zero2", "dp2 tp2 zero3", "dp2 tp2 zero3 sp", "dp2 pp2", "tp2 pp2 mb2",
    "dp2 cp2", "tp2 cp2", "dp2 cp2 ulysses zero3",
]


@pytest.mark.parametrize("layout", TWO_ENGINES)
def test_two_engine_layout_trains_like_single_process(cluster2, layout: str) -> None:
    assert_parity(cluster2.run(engine_run, layout), reference_run("gpt"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", PIPELINE_SCHEDULES)
def test_pipeline_schedule_through_parallelize_trains_like_single_process(cluster2, layout: str) -> None:
    assert_parity(cluster2.run(engine_run, layout), reference_run("gpt"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", FOUR_ENGINES)
def test_four_engine_layout_trains_like_single_process(cluster4, layout: str) -> None:
    assert_parity(cluster4.run(engine_run, layout), reference_run("gpt"))
