"""2D, 2.5D and 3D tensor parallelism on real engines: training equals one-process training, the
weights and the activations are partitioned as the papers describe, and checkpoints move between
1d and every grid mode in both directions."""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from parity import (GPT_SIZES, SEED, assert_close_to_fp32, assert_parity, batches, build_model, engine_run,
                    reference_run)
from test_checkpoint import SAVE_AT, resume, train_and_save

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FOUR_ENGINES = ["tp4 2d", "tp4 2.5d", "tp4 2d ac-full"]
EIGHT_ENGINES = ["tp8 3d", "tp8 2.5d d2", "dp2 tp4 2d zero3", "dp2 tp4 2d", "pp2 tp4 2d"]


@pytest.mark.parametrize("layout", FOUR_ENGINES)
def test_grid_layout_trains_like_single_process(cluster4, layout: str) -> None:
    assert_parity(cluster4.run(engine_run, layout), reference_run("gpt"))


def test_grid_built_shard_first_trains_like_single_process(cluster4) -> None:
    assert_parity(cluster4.run(engine_run, "tp4 2d", source="factory"), reference_run("gpt"))


def test_grid_bf16_trains_close_to_fp32(cluster4) -> None:
    assert_close_to_fp32(cluster4.run(engine_run, "tp4 2d bf16"), reference_run("gpt"))


def pieces(layout: str) -> dict:
    """On an engine: local shapes of a block's output, a q projection's output, and the share of
    the parameters this rank holds."""
    import torch

    from colab_par import parallelize

    pm = parallelize(build_model("gpt", SEED), layout)
    shapes: dict[str, tuple] = {}

    def keep_shape(name: str):
        def hook(module, inputs, out) -> None:
            shapes.setdefault(name, tuple(out.shape))
        return hook

    block = pm.model.layers["0"]
    block.register_forward_hook(keep_shape("block"))
    block.attention.wq.register_forward_hook(keep_shape("wq"))
    x, y = batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=1)[0]
    pm.forward_backward(x, y)
    local = sum(p.to_local().numel() for p in pm.model.parameters())
    whole = sum(p.numel() for p in pm.model.parameters())
    grads_whole = all(torch.isfinite(p.grad.to_local()).all() for p in pm.model.parameters())
    return {**shapes, "share": local / whole, "grads": grads_whole}


@pytest.mark.parametrize("layout,block,wq", [
    # batch 4, seq 16, d_model 32: 2d keeps a batch half × a hidden half; q/k/v heads split by q
    ("tp4 2d", (2, 16, 16), (2, 16, 16)),
    ("tp4 2.5d", (2, 16, 16), (2, 16, 16)),
])
def test_grid_partitions_weights_and_activations(cluster4, layout: str, block: tuple, wq: tuple) -> None:
    for rank in cluster4.run(pieces, layout):
        assert rank["block"] == block and rank["wq"] == wq and rank["grads"]
        assert rank["share"] == pytest.approx(1 / 4, rel=0.02)  # norms: replicated over one side


@pytest.mark.parametrize("saved_as,loaded_as", [("dp2 tp2", "tp4 2d"), ("tp4 2d", "dp2 tp2"),
                                                ("tp4 2.5d", "dp4 zero3")])
def test_checkpoint_moves_between_1d_and_grid(cluster4, tmp_path, saved_as: str, loaded_as: str) -> None:
    uninterrupted = cluster4.run(train_and_save, saved_as, None)[0]
    cluster4.run(train_and_save, saved_as, str(tmp_path))
    result = cluster4.run(resume, loaded_as, str(tmp_path))[0]
    assert result["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5)


# ---- eight engines ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout", EIGHT_ENGINES)
def test_eight_engine_grid_layout_trains_like_single_process(cluster8, layout: str) -> None:
    assert_parity(cluster8.run(engine_run, layout), reference_run("gpt"))


@pytest.mark.slow
def test_3d_partitions_weights_and_activations(cluster8) -> None:
    # layout A (between blocks): batch over x·y (4 pieces), hidden over z; q/k/v: batch over x·z,
    # heads over y; every weight in q³ = 8 pieces
    for rank in cluster8.run(pieces, "tp8 3d"):
        assert rank["block"] == (1, 16, 16) and rank["wq"] == (1, 16, 16) and rank["grads"]
        assert rank["share"] == pytest.approx(1 / 8, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("saved_as,loaded_as", [("tp8 3d", "dp4 tp2"), ("dp2 tp4 2d zero3", "tp8 3d"),
                                                ("dp4 tp2", "tp8 2.5d d2")])
def test_checkpoint_moves_between_1d_and_3d_grids(cluster8, tmp_path, saved_as: str, loaded_as: str) -> None:
    uninterrupted = cluster8.run(train_and_save, saved_as, None)[0]
    cluster8.run(train_and_save, saved_as, str(tmp_path))
    result = cluster8.run(resume, loaded_as, str(tmp_path))[0]
    assert result["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5)
