"""Compiled layouts (per-block torch.compile, inductor: C++ on this CPU) train like eager
single-process training, on real gloo engines.

10 AdamW steps of the tiny GPT on learnable batches: losses and gradient norms within 1e-5
relative of the single-process eager reference, every final parameter within Adam's tolerance
(`parity.assert_parity`). Every run starts from an empty dynamo cache and must report compile
seconds on every rank, so a layout whose blocks silently ran eager fails.
Compiling costs seconds per layout on two cores (inductor's on-disk cache makes repeats cheap),
so the cross-section is small: plain DDP, FSDP (ZeRO-3) with recompute, Megatron tp+sp, Ulysses
context parallel, pipeline.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from parity import GPT_SIZES, SEED, assert_parity, build_model, engine_run, reference_run

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

STEPS = 10
LAYOUTS = ["dp2", "dp2 zero3 ac-selective", "tp2 sp", "cp2 ulysses", "pp2"]


def _compiled_run(layout: str) -> dict:
    """Engine side: `engine_run` under `layout` + compile, from an empty dynamo cache."""
    import torch._dynamo

    from colab_par.compat import compile_seconds

    torch._dynamo.reset()
    before = compile_seconds()
    result = engine_run(f"{layout} compile", steps=STEPS)
    return {**result, "compile_s": compile_seconds() - before}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_layout_trains_like_eager_single_process(cluster2, layout: str) -> None:
    results = cluster2.run(_compiled_run, layout)
    assert all(r["compile_s"] > 0 for r in results), [r["compile_s"] for r in results]
    assert_parity(results, reference_run("gpt", STEPS))


def _trainer_rows(layout: str) -> list[list[dict]]:
    """Engine side: two cells, each parallelizing a new GPT and fitting a Trainer for 2 steps."""
    import torch._dynamo

    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset

    torch._dynamo.reset()
    cells = []
    for _ in range(2):
        pm = parallelize(build_model("gpt", SEED), layout)
        data = SyntheticDataset(GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"], batch_size=4)
        cells.append(Trainer(pm, data, steps=2, telemetry=True).fit())
    return cells


def test_the_first_step_says_how_long_it_compiled_and_later_cells_reuse_the_code(cluster2) -> None:
    for first, second in cluster2.run(_trainer_rows, "dp2 compile"):
        assert first[0]["compile_s"] > 0 and first[0]["step_time"] > first[0]["compile_s"]
        assert "compile_s" not in first[1], "the second step of the same shapes compiled again"
        assert all("compile_s" not in row for row in second), "a new cell compiled the same blocks again"
    for first, second in cluster2.run(_trainer_rows, "dp2"):
        assert all("compile_s" not in row for row in first + second)


def _parallelize_blockless() -> str:
    import torch

    from colab_par import parallelize

    try:
        parallelize(torch.nn.Linear(4, 4), "dp2 compile")
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_model_without_blocks_is_refused_before_work(cluster2) -> None:
    for message in cluster2.run(_parallelize_blockless):
        assert "compile compiles each repeated block" in message and "blocks=[...]" in message


def _parallelize_without_a_compiler() -> str:
    import os

    from colab_par import parallelize

    before = os.environ.get("CXX")
    os.environ["CXX"] = "no-such-c++-compiler"
    try:
        parallelize(build_model("gpt", SEED), "dp2 compile")
    except RuntimeError as error:
        return str(error)
    finally:
        if before is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = before
    return "accepted"


def test_compile_on_cpu_without_a_cpp_compiler_is_refused_before_work(cluster2) -> None:
    for message in cluster2.run(_parallelize_without_a_compiler):
        assert "needs a C++ compiler" in message and "'no-such-c++-compiler'" in message, message
