"""parallelize beyond plain parity: memory measured from the shards, gradient clipping across
shards, gradient accumulation and pre-sliced batches, bf16, and refusals before any work."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from colab_par import LayoutError, parallelize
from parity import (GPT_SIZES, LR, SEED, assert_close_to_fp32, assert_parity, batches, bf16_engine_run,
                    build_model, reference_run)

PARAMS = build_model("gpt", SEED).config.num_params()


def _memory_after_backward_and_step(layout: str) -> dict[str, dict[str, int]]:
    import torch.distributed as dist

    from colab_par import memory_report, parallelize

    pm = parallelize(build_model("gpt", SEED + dist.get_rank()), layout)
    (x, y), = batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=1)
    pm.forward_backward(x, y)
    after_backward = memory_report(pm)
    pm.optimizer_step()
    return {"backward": after_backward, "step": memory_report(pm)}


@pytest.mark.parametrize("layout, shards", [("dp2", (1, 1, 1)), ("dp2 zero2", (2, 2, 2)),
                                            ("dp2 zero3", (2, 2, 2))])
def test_memory_report_counts_the_local_shards(cluster2, layout: str, shards: tuple) -> None:
    """fp32 Adam: params 4Ψ, grads 4Ψ, optimizer 8Ψ bytes, each divided by its sharding degree."""
    param_div, grad_div, optim_div = shards
    for report in cluster2.run(_memory_after_backward_and_step, layout):
        assert report["backward"]["params"] == 4 * PARAMS // param_div
        assert report["backward"]["grads"] == 4 * PARAMS // grad_div
        assert report["step"]["optimizer"] == 8 * PARAMS // optim_div
        assert report["step"]["grads"] == 0  # zero_grad(set_to_none) freed them
        assert report["step"]["host_total"] == 0


def test_zero1_shards_only_the_optimizer_state(cluster2) -> None:
    reports = [r["step"] for r in cluster2.run(_memory_after_backward_and_step, "dp2 zero1")]
    assert all(r["params"] == 4 * PARAMS for r in reports)
    assert sum(r["optimizer"] for r in reports) == 8 * PARAMS  # each element's state on one rank
    assert all(0 < r["optimizer"] < 8 * PARAMS for r in reports)


def test_offload_reports_host_bytes(cluster2) -> None:
    for report in cluster2.run(_memory_after_backward_and_step, "dp2 zero3 offload"):
        step = report["step"]
        assert step["host_params"] == 4 * PARAMS // 2 and step["host_optimizer"] == 8 * PARAMS // 2
        assert report["backward"]["host_grads"] == 4 * PARAMS // 2


def _clipped_norms(layout: str, max_norm: float) -> tuple[float, float]:
    import torch.distributed as dist

    from colab_par import parallelize

    pm = parallelize(build_model("gpt", SEED + dist.get_rank()), layout)
    (x, y), = batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=1)
    pm.forward_backward(x, y)
    before = pm.clip_grad_norm_(max_norm)
    return before, pm.clip_grad_norm_(float("inf"))


def _reference_grad_norm() -> float:
    model = build_model("gpt", SEED)
    (x, y), = batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=1)
    model.loss_fn(model(x), y).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


@pytest.mark.parametrize("layout", ["dp2", "cp2", "dp2 zero3", "tp2", "tp2 sp", "pp2 mb2"])
def test_clip_grad_norm_sums_over_all_shards(cluster2, layout: str) -> None:
    expected = _reference_grad_norm()
    for before, after in cluster2.run(_clipped_norms, layout, expected / 2):
        assert before == pytest.approx(expected, rel=1e-5)
        assert after == pytest.approx(expected / 2, rel=1e-4)


def _accumulated_steps(layout: str, mode: str) -> dict:
    """Train with the batch cut in two (accumulation) or pre-sliced per dp rank (local=True)."""
    import torch.distributed as dist

    from colab_par import parallelize

    pm = parallelize(build_model("gpt", SEED + dist.get_rank()), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR))
    losses = []
    for x, y in batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=5):
        if mode == "accumulate":
            first = pm.forward_backward(x[:2], y[:2], loss_scale=0.5, sync_grads=False)
            second = pm.forward_backward(x[2:], y[2:], loss_scale=0.5)
            losses.append((first + second) / 2)
        else:
            local = slice(2 * pm.dp_rank, 2 * pm.dp_rank + 2)
            losses.append(pm.forward_backward(x[local], y[local], local=True))
        pm.optimizer_step()
    return {"losses": losses, "state": pm.full_state_dict()}


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero2", "dp2 zero3", "tp2"])
def test_gradient_accumulation_equals_one_big_batch(cluster2, layout: str) -> None:
    assert_parity(cluster2.run(_accumulated_steps, layout, "accumulate"), reference_run("gpt", 5))


def test_pre_sliced_local_batches_equal_the_global_batch(cluster2) -> None:
    assert_parity(cluster2.run(_accumulated_steps, "dp2 zero3", "local"), reference_run("gpt", 5))


@pytest.mark.parametrize("layout", ["dp2 zero3 bf16", "dp2 bf16"])
def test_bf16_trains_close_to_fp32(cluster2, layout: str) -> None:
    assert_close_to_fp32(cluster2.run(bf16_engine_run, layout), reference_run("gpt"))


def _refusal(layout: str, batch: int) -> str:
    import torch.distributed as dist

    from colab_par import parallelize

    try:
        pm = parallelize(build_model("gpt", SEED), layout)
        (x, y), = batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=1, batch=batch)
        pm.train_step(x, y)
    except (ValueError, RuntimeError) as exc:
        dist.barrier()  # every rank refused at the same point: nothing is left half-done
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


@pytest.mark.parametrize("layout, batch, message", [
    ("dp4", 4, "the world has 2 ranks; try dp=2"),
    ("tp2 cp1 pp1 dp1 zero1", 4, "zero=1"),
    ("dp2 sp", 4, "sequence_parallel"),
    ("dp2", 3, "multiple of 2"),
    ("pp2 mb2 bf16", 4, "bf16 inside pipeline stages"),
])
def test_bad_layout_or_batch_is_refused_on_every_rank(cluster2, layout, batch, message) -> None:
    for answer in cluster2.run(_refusal, layout, batch):
        assert message in answer


def test_parallelize_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match="not initialised"):
        parallelize(build_model("gpt", SEED), "dp1")


def test_layout_string_errors_before_anything_runs() -> None:
    with pytest.raises(LayoutError, match="unknown layout token"):
        parallelize(build_model("gpt", SEED), "dp2 zero9x")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2 tp2 zero3", "tp2 pp2 mb2"])
def test_clip_grad_norm_on_four_engines(cluster4, layout: str) -> None:
    expected = _reference_grad_norm()
    for before, after in cluster4.run(_clipped_norms, layout, expected / 2):
        assert before == pytest.approx(expected, rel=1e-5)
        assert after == pytest.approx(expected / 2, rel=1e-4)


def _threads_after_parallelizing(layouts: list[str]) -> int:
    import os
    import torch.distributed as dist

    from colab_par import parallelize

    for layout in layouts:
        pm = parallelize(build_model("gpt", SEED + dist.get_rank()), layout)
        (x, y), = batches(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], steps=1)
        pm.train_step(x, y)
    return len(os.listdir("/proc/self/task"))


def test_parallelizing_again_opens_no_new_process_groups(cluster2) -> None:
    """A notebook session switches layouts many times: every gloo group is three threads that live
    as long as the world, so the second round over the same layouts must not add any."""
    layouts = ["dp2", "dp2 zero3", "tp2", "pp2"]
    first = cluster2.run(_threads_after_parallelizing, layouts)
    again = cluster2.run(_threads_after_parallelizing, layouts)
    assert again == first, (first, again)


def test_a_model_not_of_transformers_never_imports_it() -> None:
    """Its default loss is decided without transformers (seconds of import on every engine)."""
    code = ("import sys, colab_par.parallel; from colab_par.models import GPT, GPTConfig; "
            "from colab_par.data.batch import default_loss; "
            "default_loss(GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8))); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft')))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "[]"
