"""`verify` (colab_par/planning/dry_run/verify.py): every rank role of a layout dry-run beside the
planner; the picker's Verify button and `plan(verify=k)` built on it.

The references are independent of verify: the whole model's parameters counted in this process
(a pipeline's stages hold them between them), a device's memory against the traced phase peak,
`dry_run` called directly for the rank verify picks, and `plan` without verify for the order.
Tiny GPTs; fake tensors except where a layout needs real ones. Each dry run is a spawned process
(~5-10 s here).
"""
from __future__ import annotations

import pytest

from colab_par.layout import Layout, LayoutError
from colab_par.models import GPT, GPTConfig
from colab_par.notebook.picker import LayoutPicker
from colab_par.planning.devices import get_device
from colab_par.planning.dry_run import dry_run
from colab_par.planning.dry_run.compare import compare
from colab_par.planning.dry_run.microbatch_scaling import scaled_report, short_layouts, shortest_k
from colab_par.planning.dry_run.report import CollectiveCount, DryRunReport, MemoryKinds
from colab_par.planning.dry_run.roles import rank_roles
from colab_par.planning.dry_run.verify import verify
from colab_par.planning.layout_estimate import Plan
from colab_par.planning.planner import VerifiedPlan, plan

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
BATCH = (4, 16)
FOUR_LAYERS = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32, kernels="torch")  # pp2 x v2
# activations of ~90 GiB per rank at a local batch of 128 x 4096 tokens: nothing of it exists (fake tensors)
WIDE = GPTConfig(vocab_size=64, seq_len=4096, n_layer=2, n_head=8, d_model=1024, kernels="torch")


def test_each_pipeline_rank_is_traced_as_its_own_role() -> None:
    checked = verify(CONFIG, "pp2", 2, device="H100", batch=BATCH, tensors="real")
    roles = rank_roles("pp2", 2)
    assert [(c.role, c.rank, c.report.rank) for c in checked.roles] == [(r, k, k) for r, k in roles.items()]
    # the two stages hold the model between them, each its own part (fp32: 4 bytes a parameter)
    whole = 4 * sum(p.numel() for p in GPT(CONFIG).parameters())
    stages = [c.report.peak.params for c in checked.roles]
    assert sum(stages) == whole and min(stages) > 0
    for check in checked.roles:
        assert check.comparison.rows == compare(check.report, CONFIG, device="H100").rows
        assert check.traced_seconds > 0 and check.report.peak.total > 0
    assert checked.fits and checked.overflow == "" and checked.peak == max(c.report.peak.total for c in checked.roles)
    text = str(checked)
    for row in ("forward", "backward", "optimizer", "step peak", "planner", "error", *roles):
        assert row in text
    assert "pp stage 1 of 2" in checked._repr_html_()


def test_a_layout_too_large_for_80_gb_names_the_phase_and_kind() -> None:
    """Fake tensors: the verdict comes before anything of the ~90 GiB exists."""
    device = get_device("H100-80GB")
    checked = verify(WIDE, "dp2 zero3", 2, device=device, batch=(256, 4096))
    (check,) = checked.roles
    assert check.report.tensors == "fake"
    forward = check.report.phases["forward"]
    assert forward.total > 0.9 * device.memory  # the planner's usable share of the device, without the baseline
    assert not checked.fits and checked.fits == compare(check.report, WIDE, device=device).fits
    assert checked.overflow.startswith("all ranks (rank 0): forward needs") and checked.overflow.endswith("activations")
    assert "does NOT fit" in str(checked) and "forward needs" in checked._repr_html_()


def test_a_pipeline_scaled_from_two_short_traces_equals_every_microbatch_traced() -> None:
    """zbv (the planner's usual pick) under ZeRO-3 at 32 microbatches: traced in full, against
    traced at 8 and 16 and carried along the line. Everything a step leaves per microbatch
    (sends held until the step's last wait, each microbatch's loss) grows the peak too, so the
    memory is scaled as well: equal to the byte, as the collectives and FLOPs are."""
    layout, role = "dp2 pp2 zero3 zbv v2 mb32", ["pp rank 0 of 2 (stages 0, 3)"]
    full, = verify(FOUR_LAYERS, layout, 4, device="H100", batch=(64, 16), roles=role).roles
    scaled, = verify(FOUR_LAYERS, layout, 4, device="H100", batch=(64, 16), roles=role, microbatches=8).roles
    traced, carried = full.report, scaled.report
    assert carried.scaled_from == (8, 16) and traced.scaled_from is None and "scaled from 8 and 16" in str(carried)
    assert (carried.layout, carried.batch) == (traced.layout, traced.batch)
    assert carried.collectives == traced.collectives and carried.flops == traced.flops
    assert carried.peak == traced.peak and carried.phases == traced.phases and carried.host == traced.host
    assert scaled.comparison.rows == full.comparison.rows


def test_a_one_stage_a_rank_pipeline_scales_from_pp_plus_one_microbatches() -> None:
    """1F1B's rank 0 (the one whose peak is last to settle: at k = pp it falls at the step's end,
    14 % over the full step's here) traced at pp + 1 and twice that, against all 16 microbatches
    traced: equal to the byte."""
    layout = Layout.parse("dp2 pp4 zero3 1f1b mb16 bf16 ac-selective")
    assert shortest_k(layout) == 5 and shortest_k(Layout.parse("pp4 zbv v2 mb32")) == 16
    full = dry_run(FOUR_LAYERS, layout, 8, rank=0, batch=(64, 16), tensors="fake")
    short, long = (dry_run(FOUR_LAYERS, variant, 8, rank=0, batch=batch, tensors="fake")
                   for variant, batch in short_layouts(layout, (64, 16), 5))
    carried = scaled_report(short, long, layout, (64, 16))
    assert carried.scaled_from == (5, 10) and carried.collectives == full.collectives and carried.flops == full.flops
    assert carried.peak == full.peak and carried.phases == full.phases and carried.host == full.host


def test_microbatch_scaling_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(ValueError, match="no pipeline"):
        verify(CONFIG, "dp2", 2, device="H100", batch=BATCH, microbatches=4)
    with pytest.raises(ValueError, match="warm-up 8; give k >= 8 with 2k < 16"):
        verify(FOUR_LAYERS, "pp2 zbv v2 mb16", 2, device="H100", batch=(16, 16), microbatches=8)
    with pytest.raises(ValueError, match="warm-up 5; give k >= 5 with 2k < 16"):
        verify(FOUR_LAYERS, "pp4 1f1b mb16", 4, device="H100", batch=(16, 16), microbatches=4)
    short = DryRunReport("pp2 mb4", 2, 0, (4, 16), {}, MemoryKinds(), (CollectiveCount("pp", "send", 4, 40),))
    long = DryRunReport("pp2 mb8", 2, 0, (8, 16), {}, MemoryKinds(), (CollectiveCount("pp", "send", 6, 80),))
    with pytest.raises(ValueError, match="whole amount per microbatch"):  # 0.5 calls a microbatch
        scaled_report(short, long, Layout.parse("pp2 mb9"), (9, 16))
    assert scaled_report(short, long, Layout.parse("pp2 mb12"), (12, 16)).collectives == (
        CollectiveCount("pp", "send", 8, 120),)


def test_bad_requests_fail_before_any_process() -> None:
    """Each is the parent's own error (a child's failure would arrive as RuntimeError)."""
    with pytest.raises(ValueError, match="spans 2 ranks"):
        verify(CONFIG, "dp2", 4, device="H100", batch=BATCH)
    with pytest.raises(ValueError, match="not in the device catalogue"):
        verify(CONFIG, "dp2", 2, device="H900", batch=BATCH)
    with pytest.raises(TypeError, match="GPTConfig or a Hugging Face config"):
        verify({"n_layer": 2, "d_model": 32, "n_head": 2, "vocab_size": 64}, "dp2", 2, device="H100", batch=BATCH)
    with pytest.raises(ValueError, match="roles are 'pp stage 0 of 2', 'pp stage 1 of 2'"):
        verify(CONFIG, "pp2", 2, device="H100", batch=BATCH, roles=["stage 3"])
    with pytest.raises(ValueError, match="batch="):
        verify(CONFIG, "dp2", 2, device="H100", batch=(4,))
    with pytest.raises(ValueError, match="tensors="):
        verify(CONFIG, "dp2", 2, device="H100", batch=BATCH, tensors="meta")
    with pytest.raises(LayoutError):
        verify(CONFIG, "tp4", 4, device="H100", batch=BATCH)  # 2 heads do not split over 4 ranks
    with pytest.raises(TypeError, match="GPTConfig or a Hugging Face config"):
        plan({"n_layer": 2, "d_model": 32, "n_head": 2, "vocab_size": 64}, 2, device="H100",
             global_batch=4, seq_len=16, verify=1)
    with pytest.raises(ValueError, match="verify=-1"):
        plan(CONFIG, 2, device="H100", global_batch=4, seq_len=16, verify=-1)


def test_plan_verifies_its_best_candidate() -> None:
    plain = plan(CONFIG, 2, device="H100", global_batch=4, seq_len=16, top=None)
    verified = plan(CONFIG, 2, device="H100", global_batch=4, seq_len=16, top=None, verify=1)
    best = verified[0]
    assert isinstance(best, VerifiedPlan) and best.layout == plain[0].layout
    assert not any(isinstance(option, VerifiedPlan) for option in verified[1:])
    assert [o.layout for o in verified] == [o.layout for o in plain]  # it fits: nothing moves
    checked = best.verification
    assert checked.layout == str(best.layout) and checked.predicted_fits == plain[0].fits
    assert [c.role for c in checked.roles] == list(rank_roles(best.layout, 2))
    assert best.fits == (plain[0].fits and checked.fits) and "traced" in str(best)
    assert isinstance(best, Plan) and best.step_time == plain[0].step_time


def test_the_pickers_verify_button_shows_the_layouts_dry_run_without_blocking() -> None:
    picker = LayoutPicker(2, model=CONFIG, device="H100", global_batch=4, seq_len=16)
    picker.apply("dp2 zero3")
    picker.verify_button.click()
    thread = picker._verifying
    assert thread is not None and picker.verify_button.disabled  # the click returned while it runs
    thread.join(300)
    assert not thread.is_alive() and not picker.verify_button.disabled
    direct = dry_run(CONFIG, "dp2 zero3", 2, batch=(4, 16), tensors="fake")
    (check,) = picker.verification.roles
    assert check.report.peak == direct.peak and check.report.collectives == direct.collectives
    shown = picker._verify_html.value
    assert "dp2 zero3" in shown and "forward" in shown and "planner" in shown
    picker.controls["zero"].value = 2  # a new choice clears the result of the old
    assert picker._verify_html.value == ""


def test_the_picker_shows_a_failed_verify_and_cannot_verify_sizes_alone() -> None:
    picker = LayoutPicker(2, model=CONFIG, device="H100", global_batch=4, seq_len=16)
    picker.controls["dp"].value = 1  # dp1 spans one rank of the two
    picker.verify_in_background().join(60)
    assert "verify failed" in picker._verify_html.value and not picker.verify_button.disabled
    sizes = LayoutPicker(2, model={"n_layer": 2, "d_model": 32, "n_head": 2, "vocab_size": 64}, device="H100",
                         global_batch=4, seq_len=16)
    assert sizes.verify_button.disabled and "GPTConfig" in sizes.verify_button.tooltip
