"""2D, 2.5D and 3D tensor parallelism on real engines: training equals one-process training, the
weights and the activations are partitioned as the papers describe, and checkpoints move between
1d and every grid mode in both directions. On eight engines also LoRA and generation (their 2d
cases: tests/test_adapters.py, tests/test_generation.py)."""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from parity import (GPT_SIZES, SEED, assert_close_to_fp32, assert_parity, batches, bf16_engine_run,
                    build_model, engine_run, reference_run)
from colab_par.layout import Layout
from colab_par.models import GPTConfig
from colab_par.planning.planner import ModelSpec, estimate
from colab_par.planning.tensor_costs import grid_local_params, kept_activation_bytes, tensor_comm_bytes
from test_checkpoint import SAVE_AT, relayout_midway, resume, train_and_save
from test_generation import GPT_CALLS, check_gpt_generation, engine_generate
from trained_models import trained_state

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A grid step is dozens of small collectives over 4 or 8 processes sharing 2 cores: 10 steps (the
# learnable data lowers the loss by 0.25 in them) instead of the 1d layouts' 20.
GRID_STEPS = 10
FOUR_ENGINES = ["tp4 2d", "tp4 2.5d", "tp4 2d ac-full"]
EIGHT_ENGINES = ["tp8 3d", "tp8 2.5d d2", "dp2 tp4 2d zero3", "dp2 tp4 2d", "pp2 tp4 2d"]


@pytest.mark.parametrize("layout", FOUR_ENGINES)
def test_grid_layout_trains_like_single_process(cluster4, layout: str) -> None:
    assert_parity(cluster4.run(engine_run, layout, "gpt", GRID_STEPS), reference_run("gpt", GRID_STEPS))


@pytest.mark.parametrize("kind", ["gpt", "gpt-odd-vocab"])
def test_grid_built_shard_first_trains_like_single_process(cluster4, kind: str) -> None:
    """Also with a vocabulary the grid side does not divide (101 over q=2: uneven pieces)."""
    assert_parity(cluster4.run(engine_run, "tp4 2d", kind, GRID_STEPS, source="factory"),
                  reference_run(kind, GRID_STEPS))


def test_grid_bf16_trains_close_to_fp32(cluster4) -> None:
    assert_close_to_fp32(cluster4.run(bf16_engine_run, "tp4 2d bf16"), reference_run("gpt"))


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


def measured_costs(layout: str) -> dict:
    """On an engine: `measure_step_costs` of the parity GPT under `layout`."""
    from colab_par import parallelize
    from colab_par.parallel.step_costs import measure_step_costs

    pm = parallelize(build_model("gpt", SEED), layout)
    return measure_step_costs(pm, *batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=2))


def assert_costs_as_predicted(results: list[dict], text: str) -> None:
    """Communication exactly the formula (+ the loss's float64 all-reduce), the parameters exactly,
    the kept activations within 5 %."""
    spec, layout = ModelSpec.of(GPTConfig(**GPT_SIZES)), Layout.parse(text)
    batch, seq = 4, GPT_SIZES["seq_len"]
    per_layer, outside = kept_activation_bytes(spec, layout, batch, seq)
    for rank in results:
        assert rank["comm"] == tensor_comm_bytes(spec, layout, batch, seq) + 8
        assert rank["params"] == grid_local_params(spec, layout)[0]
        if layout.checkpointing == "none":
            assert rank["activations"] == pytest.approx(spec.n_layer * per_layer + outside, rel=0.05)


@pytest.mark.parametrize("layout", ["tp4 2d", "tp4 2.5d", "tp4 2d ac-full"])
def test_tensor_costs_are_what_the_planner_predicts(cluster4, layout: str) -> None:
    assert_costs_as_predicted(cluster4.run(measured_costs, layout), layout)


@pytest.mark.parametrize("saved_as,loaded_as", [("dp2 tp2", "tp4 2d"), ("tp4 2d", "dp2 tp2"),
                                                ("tp4 2.5d", "dp4 zero3")])
def test_checkpoint_moves_between_1d_and_grid(cluster4, tmp_path, saved_as: str, loaded_as: str) -> None:
    assert_checkpoint_moves(cluster4, str(tmp_path), saved_as, loaded_as)


def assert_checkpoint_moves(cluster, folder: str, saved_as: str, loaded_as: str) -> None:
    """A checkpoint saved midway under one layout resumes under another with the losses the first
    would have gone on with."""
    uninterrupted = cluster.run(train_and_save, saved_as, None)[0]
    cluster.run(train_and_save, saved_as, folder)
    result = cluster.run(resume, loaded_as, folder)[0]
    assert result["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5)


@pytest.mark.parametrize("first,second", [("tp4 2d", "dp2 tp2"), ("dp4 zero3", "tp4 2.5d")])
def test_live_relayout_between_1d_and_grid_continues_the_same_losses(cluster4, first: str, second: str) -> None:
    uninterrupted = cluster4.run(train_and_save, first, None)[0]
    result = cluster4.run(relayout_midway, first, second)[0]
    assert Layout.parse(result["layout"]) == Layout.parse(second) and result["repointed"]
    assert result["losses"] == pytest.approx(uninterrupted, rel=1e-5)


LARGE = ModelSpec.of(dict(n_layer=8, d_model=8192, n_head=64, ffn_hidden=28672, vocab_size=32000))


@pytest.mark.parametrize("p,modes", [(16, ["tp16 2d", "tp16 2.5d d4"]),
                                     (64, ["tp64 2d", "tp64 2.5d d4", "tp64 3d"])])
def test_grid_modes_partition_activations_over_all_p_ranks(p: int, modes: list[str]) -> None:
    """The papers' claim: 2D, 2.5D and 3D split every activation over all p ranks (per-layer
    activations × p the same for each), where 1d splits only the heads and FFN and sequence
    parallel leaves the projections' gathered inputs whole."""
    whole = kept_activation_bytes(LARGE, Layout(), 8, 4096)[0]  # fp32: in bf16 the GPT's norms keep an fp32 copy
    for mode in modes:
        assert kept_activation_bytes(LARGE, Layout.parse(mode), 8, 4096)[0] * p == \
            pytest.approx(whole, rel=2e-3)
    # what 1d keeps whole grows with p: 2.2x / 4.7x the partitioned total at p=16, 6.2x / 17x at 64
    assert kept_activation_bytes(LARGE, Layout.parse(f"tp{p} sp"), 8, 4096)[0] * p > 2 * whole
    assert kept_activation_bytes(LARGE, Layout.parse(f"tp{p}"), 8, 4096)[0] * p > 4 * whole


def test_the_planner_weighs_grid_modes() -> None:
    """The planner searches the grid modes and counts their activations as the kit keeps them."""
    plan = estimate(LARGE, "tp64 3d bf16", device="H100", global_batch=16, seq_len=4096)
    per_layer, outside = kept_activation_bytes(LARGE, plan.layout, 16, 4096, 2)
    assert plan.memory.activations == pytest.approx(8 * per_layer + outside)  # the loss's logits: buffers
    assert plan.times["tp"] > 0
    from colab_par.planning.planner import candidate_layouts
    modes = {layout.tp_mode for layout in candidate_layouts(LARGE, 64, global_batch=64, seq_len=4096,
                                                            bf16=True)}
    assert modes == {"1d", "2d", "2.5d", "3d"}


# ---- eight engines ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout,kind", [(layout, "gpt") for layout in EIGHT_ENGINES] + [("tp8 3d", "gpt-odd-vocab")])
def test_eight_engine_grid_layout_trains_like_single_process(cluster8, layout: str, kind: str) -> None:
    assert_parity(cluster8.run(engine_run, layout, kind, GRID_STEPS), reference_run(kind, GRID_STEPS))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp8 3d", "tp8 2.5d d2"])
def test_eight_engine_tensor_costs_are_what_the_planner_predicts(cluster8, layout: str) -> None:
    assert_costs_as_predicted(cluster8.run(measured_costs, layout), layout)


@pytest.mark.slow
def test_3d_partitions_weights_and_activations(cluster8) -> None:
    # layout A (between blocks): batch over x·y (4 pieces), hidden over z; q/k/v: batch over x·z,
    # heads over y; every weight in q³ = 8 pieces
    for rank in cluster8.run(pieces, "tp8 3d"):
        assert rank["block"] == (1, 16, 16) and rank["wq"] == (1, 16, 16) and rank["grads"]
        assert rank["share"] == pytest.approx(1 / 8, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("saved_as,loaded_as", [("tp8 3d", "dp4 tp2"), ("dp4 tp2", "tp8 3d"),
                                                ("dp4 tp2", "tp8 2.5d d2"), ("dp2 tp4 2d zero3", "tp8 3d")])
def test_checkpoint_moves_between_1d_and_3d_grids(cluster8, tmp_path, saved_as: str, loaded_as: str) -> None:
    assert_checkpoint_moves(cluster8, str(tmp_path), saved_as, loaded_as)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp8 3d", "tp8 2.5d d2"])
def test_eight_engine_grid_trains_lora_and_generates_like_single_process(cluster8, layout: str) -> None:
    """LoRA (peft on the GPT) trains like peft in one process, and greedy / seeded sampled generate
    (three prompts over a batch split four ways: one padded copy) equal the one-process loop; on
    3d the attention's batch rows (x·z) are not the blocks' (x·y)."""
    steps, lr = 8, 3e-3
    reference = reference_run("gpt+lora", steps, lr=lr)
    assert_parity(cluster8.run(engine_run, layout, "gpt+lora", steps, lr=lr), reference)
    calls = GPT_CALLS[:2]
    check_gpt_generation(cluster8.run(engine_generate, "gpt", layout, trained_state("gpt"), calls), calls)
