"""Parity proof: every layout trains like single-process training (fp32, gloo, real engines).

10 AdamW steps of the same tiny GPT on the same global batches: losses and gradient norms within
1e-5 relative of the single-process reference, every final parameter within the tolerance Adam's
arithmetic gives it (see `parity.assert_parity` and tests/test_parity_bound.py).
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from parity import SEED, assert_parity, build_model, engine_run, engine_run_moved, reference_run

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

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


# ---- a vocabulary tp does not divide (101 tokens, as GPT-2's 50,257): split unevenly --------------
def _vocabulary_pieces(layout: str) -> dict[str, tuple[int, ...]]:
    """Engine side: this rank's rows of the embedding and the head."""
    import torch.distributed as dist

    from colab_par import parallelize

    pm = parallelize(build_model("gpt-odd-vocab", SEED + dist.get_rank()), layout)
    return {name: tuple(pm.model.get_parameter(name).to_local().shape)
            for name in ("tok_embeddings.weight", "output.weight")}


def test_an_odd_vocabulary_is_split_unevenly(cluster2) -> None:
    assert [rank["tok_embeddings.weight"][0] for rank in cluster2.run(_vocabulary_pieces, "tp2")] == [51, 50]
    assert [rank["output.weight"][0] for rank in cluster2.run(_vocabulary_pieces, "tp2")] == [51, 50]


@pytest.mark.parametrize("layout", ["tp2", "tp2 sp"])
def test_odd_vocabulary_trains_like_single_process(cluster2, layout: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, "gpt-odd-vocab"), reference_run("gpt-odd-vocab"))


@pytest.mark.slow
@pytest.mark.parametrize("layout,source", [("dp2 tp2", "module"), ("tp2 pp2 mb2", "module"),
                                           ("dp2 tp2 zero3", "module"), ("dp2 tp2 zero3", "factory")])
def test_odd_vocabulary_on_four_engines_trains_like_single_process(cluster4, layout: str, source: str) -> None:
    """With FSDP over the uneven tensor-parallel pieces, built whole or shard-first."""
    assert_parity(cluster4.run(engine_run, layout, "gpt-odd-vocab", source=source), reference_run("gpt-odd-vocab"))


@pytest.mark.parametrize("kind,first,second", [("gpt-odd-vocab", "tp2", "dp2"), ("gpt-odd-vocab", "dp2", "tp2"),
                                               ("gpt2-lm", "tp2", "dp2 zero3")])
def test_odd_vocabulary_checkpoint_moves_between_tp_and_dp(cluster2, tmp_path, kind: str, first: str,
                                                           second: str) -> None:
    """Saved with the model's real shapes (101 rows, loadable whole by dp2) and back: five steps under
    one layout, five under the other, equal to ten steps in one process. GPT-2 (67 tokens, its
    fused q|k|v regrouped only in forward) moves from tp2 to ZeRO-3."""
    results = cluster2.run(engine_run_moved, first, second, str(tmp_path), kind)
    assert_parity(results, reference_run(kind))
