"""The planner and picker for models the kit did not write: sized from parameters plus a measured
probe, offering only layouts `parallelize` accepts for the model."""
from __future__ import annotations

import math

import pytest
from any_models import build, make_batches

from colab_par import LayoutPicker
from colab_par.layout import Layout, LayoutError, valid_layouts
from colab_par.planning.module_spec import ModuleSpec
from colab_par.planning.planner import estimate


def _spec(kind: str, **options) -> ModuleSpec:
    return ModuleSpec.probe(build(kind, 0), make_batches(kind, 1, batch=8)[0], **options)


def test_probe_counts_parameters_units_and_flops_of_a_cnn() -> None:
    spec = _spec("cnn")
    model = build("cnn", 0)
    assert spec.n_params == sum(p.numel() for p in model.parameters())
    assert spec.n_blocks == 3 and spec.unit_params == 4 * 4 * 9 + 4  # the largest conv
    # forward 2·MACs; backward 2·MACs for weight and for input gradients, except the first conv's input
    macs = 64 * (1 * 4 * 9 + 4 * 4 * 9 + 4 * 4 * 9) + 256 * 5
    assert spec.flops_per_sample == 2 * (3 * macs - 64 * 1 * 4 * 9)
    assert spec.activation_bytes > 0 and not spec.tensor_parallel


def test_a_model_without_blocks_is_gathered_whole_under_zero3() -> None:
    """With no repeated block FSDP's only unit is the model: zero3 gathers all of it at once."""
    mlp, cnn = _spec("mlp"), _spec("cnn")
    options = dict(device="cpu", global_batch=8, seq_len=0)
    zero2 = estimate(mlp, "dp2 zero2", **options).memory.params
    assert estimate(mlp, "dp2 zero3", **options).memory.params == pytest.approx(
        zero2 / 2 + mlp.n_params * 4)  # sharded at rest, plus the whole model gathered
    assert estimate(cnn, "dp2 zero3", **options).memory.params == pytest.approx(
        estimate(cnn, "dp2 zero2", **options).memory.params / 2 + 2 * cnn.unit_params * 4)


def test_picker_offers_only_what_the_model_supports() -> None:
    model, batch = build("mlp", 0), make_batches("mlp", 1, batch=8)[0]
    picker = LayoutPicker(2, model=model, example_batch=batch, device="cpu", global_batch=8)
    assert picker.controls["tp"].options == (1,) and picker.controls["cp"].options == (1,)
    assert picker.controls["pp"].options == (1,)  # no blocks to cut between
    assert picker.controls["checkpointing"].options == ("none",)
    assert "samples/s" in repr(picker) and "NoBlocksMLP" in repr(picker)
    picker.controls["zero"].value = 3
    assert str(picker.layout) == "dp2 zero3"


def test_rules_refuse_tensor_parallel_without_a_plan_and_accept_it_with_one() -> None:
    with pytest.raises(LayoutError, match="no tensor-parallel plan.*tp_plan="):
        estimate(_spec("mlp"), "tp2", device="cpu", global_batch=8, seq_len=0)
    with_plan = _spec("mlp", tp_plan={"inp": "colwise", "out": "rowwise"})
    assert estimate(with_plan, "tp2", device="cpu", global_batch=8, seq_len=0).fits


STEPS = 10


def _trains(layouts: list[str]) -> dict[str, list[float]]:
    """Engine side: each layout parallelizes the CNN and takes STEPS steps over the same two
    batches in turn (their labels follow from the images: learnable); every step's loss."""
    import torch

    from colab_par import parallelize

    batches = make_batches("cnn", 2, batch=8)
    losses = {}
    for layout in layouts:
        pm = parallelize(build("cnn", 0), layout, example_batch=batches[0],
                         optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-2))
        losses[layout] = [pm.train_step(batches[step % 2]) for step in range(STEPS)]
    return losses


def test_every_plan_the_picker_offers_trains(cluster2) -> None:
    """Every listed plan runs and learns: finite losses, the same on both ranks, and the last pass
    over the two batches at most 80 % of the first (one process falls to 58 % on this data)."""
    model, batch = build("cnn", 0), make_batches("cnn", 1, batch=8)[0]
    picker = LayoutPicker(2, model=model, example_batch=batch, device="cpu", global_batch=8, top=None)
    layouts = [str(p.layout) for p in picker.plans]
    assert any("pp2" in l for l in layouts) and any("zero3" in l for l in layouts)
    first, second = cluster2.run(_trains, layouts)
    assert first == second, "ranks disagree on the losses"
    for layout, losses in first.items():
        assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), (layout, losses)
        assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), (layout, losses)


def test_a_traced_model_with_tied_parameters_is_never_offered_zbv() -> None:
    """ZB-V puts a traced model's first and last stages on one rank, where a tie becomes two tensors
    under one name that checkpoints cannot save: the rule refuses it, so neither the picker nor
    plan() offers it, while an untied model keeps it."""
    assert _spec("bert").tied_params and not _spec("mlp").tied_params
    tied = {"n_blocks": 4, "generic_model": 1, "tied_params": 1}
    with pytest.raises(LayoutError, match="first and last pipeline stages on one rank.*'interleaved'"):
        Layout.parse("pp2 zbv v2").validate(2, tied)
    assert Layout.parse("pp2 interleaved v2").validate(2, tied)
    schedules = {layout.pp_schedule for layout in valid_layouts(2, tied) if layout.pp > 1}
    assert "zbv" not in schedules and "interleaved" in schedules
    assert "zbv" in {layout.pp_schedule for layout in valid_layouts(2, {**tied, "tied_params": 0})}
