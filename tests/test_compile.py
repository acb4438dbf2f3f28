"""Compiled layouts (per-block torch.compile, inductor: C++ on this CPU) train like eager
single-process training, on real gloo engines.

10 AdamW steps of the tiny GPT on learnable batches: losses and gradient norms within 1e-5
relative of the single-process eager reference (torch's per-parameter AdamW), every final
parameter within Adam's tolerance (`parity.assert_parity`). Every run starts from an empty dynamo
cache and must report compile seconds on every rank, and every optimizer step must have run
torch's fused kernel, so a layout whose blocks or optimizer silently ran eager fails.
Compiling costs seconds per layout on two cores (inductor's on-disk cache makes repeats cheap),
so the cross-section is small: plain DDP, FSDP (ZeRO-3) with recompute, Megatron tp (plain norms
beside DTensor projections: two fused optimizer calls) and tp+sp, Ulysses context parallel,
pipeline. In one process: the fused optimizer compile picks trains like the user's own (Adam,
AdamW, SGD, Adagrad), is not picked where the user or torch rules it out, and checkpoints as the
user's; a block past dynamo's recompile limit raises instead of running eager.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from parity import GPT_SIZES, SEED, assert_parity, build_model, engine_run, reference_run, training_batches
from colab_par.training.options import Logs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

STEPS = 10
LAYOUTS = ["dp2", "dp2 zero3 ac-selective", "tp2", "tp2 sp", "cp2 ulysses", "pp2"]


def _compiled_run(layout: str, kind: str = "gpt") -> dict:
    """Engine side: `engine_run` under `layout` + compile, from an empty dynamo cache."""
    import torch._dynamo
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from colab_par.compat import compile_seconds

    torch._dynamo.reset()
    before = compile_seconds()
    fused: list[bool] = []
    hook = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: fused.append(all(g["fused"] for g in optimizer.param_groups)))
    try:
        result = engine_run(f"{layout} compile", kind, steps=STEPS)
    finally:
        hook.remove()
    return {**result, "compile_s": compile_seconds() - before, "fused_steps": fused}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_layout_trains_like_eager_single_process(cluster2, layout: str) -> None:
    results = cluster2.run(_compiled_run, layout)
    assert all(r["compile_s"] > 0 for r in results), [r["compile_s"] for r in results]
    assert all(r["fused_steps"] == [True] * STEPS for r in results), [r["fused_steps"] for r in results]
    assert_parity(results, reference_run("gpt", STEPS))


@pytest.mark.parametrize("layout, kind", [("dp2 ep2", "gpt-moe-aux"), ("dp2 ep2", "qwen3-moe-aux"), ("tp2", "gpt-moe")])
def test_compiled_moe_trains_like_eager_single_process(cluster2, layout: str, kind: str) -> None:
    """The experts' blocks compile too: torch's grouped matmul traces in bf16 only, so float32
    experts take the loop under compile (a crash before, not a refusal), and the all-to-all breaks
    the graph around itself."""
    results = cluster2.run(_compiled_run, layout, kind)
    assert all(r["compile_s"] > 0 for r in results), [r["compile_s"] for r in results]
    assert_parity(results, reference_run(kind, STEPS))


def test_float32_experts_are_one_graph_break_whatever_the_routing() -> None:
    """The experts' loop of matmuls reads each expert's row count as a Python int: traced, that
    was a graph break per grouped matmul and per count (bincount, tolist) between small graphs of
    slices. It runs outside the graph as one call, so every break is that call and a step whose
    routing differs makes no new graph (dynamo's eager backend: the same graphs, no inductor)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_model("gpt-moe", SEED)
    for block in model.layers.values():
        block.compile(backend="eager")
    graphs, routings = [], []
    for tokens, targets in training_batches("gpt-moe", 4):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
        routings.append([block.feed_forward.last_counts.tolist() for block in model.layers.values()])
    assert len({str(r) for r in routings}) == len(routings), routings  # the routing moved every step
    assert graphs == [graphs[0]] * len(graphs), graphs
    assert counters["graph_break"] and all("compiler.disable" in reason for reason in counters["graph_break"]), \
        list(counters["graph_break"])


def _regression(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A two-layer net and a learnable target (a fixed random linear map of the inputs)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(64, 16, generator=gen)
    targets = inputs @ torch.randn(16, 4, generator=gen)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, inputs, targets


def _fit(optimizer_fn, steps: int = STEPS) -> tuple[list[float], list[torch.Tensor], torch.optim.Optimizer]:
    model, inputs, targets = _regression()
    optimizer = optimizer_fn(model.parameters())
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()], optimizer


OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-1),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_fused_optimizer_compile_picks_trains_like_the_one_the_user_built(name: str) -> None:
    """Same losses (1e-5 relative: the fused kernel only reorders float32 roundings, ~1e-7 a step)
    and parameters over 10 steps as torch's default implementation of the same optimizer."""
    from colab_par.parallel.compile import fused_optimizer_fn

    losses, params, plain = _fit(OPTIMIZERS[name])
    fused_losses, fused_params, fused = _fit(fused_optimizer_fn(OPTIMIZERS[name], True))
    assert not any(g["fused"] for g in plain.param_groups)
    assert type(fused) is type(plain) and all(g["fused"] for g in fused.param_groups)
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(losses), rtol=1e-5, atol=0.0)
    for got, want in zip(fused_params, params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _OwnAdamW(torch.optim.AdamW):
    """A user's optimizer class (outside torch.optim): its constructor may mean anything."""


@pytest.mark.parametrize("optimizer_fn", [
    lambda params: torch.optim.AdamW(params, fused=False),
    lambda params: torch.optim.AdamW(params, foreach=True),
    lambda params: torch.optim.AdamW(params, differentiable=True),
    lambda params: _OwnAdamW(params),
    lambda params: torch.optim.RMSprop(params),
], ids=["fused=False", "foreach=True", "differentiable", "own subclass", "no fused kernel"])
def test_an_optimizer_the_user_configured_or_torch_cannot_fuse_stays_as_built(optimizer_fn) -> None:
    from colab_par.parallel.compile import fused_optimizer_fn

    params = [torch.nn.Parameter(torch.zeros(3))]
    built = fused_optimizer_fn(optimizer_fn, True)(params)
    assert not any(g.get("fused") for g in built.param_groups)
    assert fused_optimizer_fn(optimizer_fn, False) is optimizer_fn


def test_fused_optimizer_checkpoints_read_as_the_users_and_loading_keeps_the_kernel() -> None:
    """A compiled layout's optimizer state loads into an eager one unchanged (fused: None) and back."""
    from colab_par.parallel.compile import fused_optimizer_fn

    make = OPTIMIZERS["AdamW"]
    *_, fused = _fit(fused_optimizer_fn(make, True), steps=2)
    *_, plain = _fit(make, steps=2)
    saved = fused.state_dict()
    assert [g["fused"] for g in saved["param_groups"]] == [None]
    plain.load_state_dict(saved)
    assert [g["fused"] for g in plain.param_groups] == [None]
    fused.load_state_dict(plain.state_dict())
    assert [g["fused"] for g in fused.param_groups] == [True]


def _fused_calls(layout: str) -> dict:
    """Engine side: compile's optimizer over `layout`'s parameters, two steps: the fused calls and
    per-parameter AdamW updates (lerp_, addcdiv_) each step dispatched (a DTensor's call counts
    once), and its groups as its state dict gives them."""
    from colab_par import parallelize
    from colab_par.compat import torch_dispatch_mode
    from colab_par.parallel.compile import fused_optimizer_fn

    class Updates(torch_dispatch_mode()):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    pm = parallelize(build_model("gpt", SEED), layout)
    params = [p for p in pm.model.parameters() if p.requires_grad]
    optimizer = fused_optimizer_fn(lambda params: torch.optim.AdamW(params, lr=1e-3), True)(params)
    steps = []
    for batch in training_batches("gpt", 2):
        pm.forward_backward(*batch)
        with Updates() as updates:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append([op for op in updates.seen if op.startswith("_fused") or op in ("lerp_", "addcdiv_")])
    groups = optimizer.state_dict()["param_groups"]
    return {"steps": steps, "groups": [(len(g["params"]), g["fused"]) for g in groups], "params": len(params)}


def test_parameters_of_mixed_kinds_step_one_fused_call_per_kind(cluster2) -> None:
    """tp without sp leaves the norms plain beside DTensor projections; one fused call cannot take
    both, so the optimizer makes one per kind (and no per-parameter update), while tp+sp's
    all-DTensor one makes one; either way its groups are the user's (one, all parameters)."""
    for layout, calls in (("tp2", 2), ("tp2 sp", 1)):
        for rank in cluster2.run(_fused_calls, layout):
            assert rank["steps"] == [["_fused_adamw_"] * calls] * 2, (layout, rank["steps"])
            assert rank["groups"] == [(rank["params"], None)], (layout, rank["groups"])


def test_a_block_past_the_recompile_limit_raises_instead_of_running_eager() -> None:
    """Dynamo's own behaviour is a log line and eager from then on; a compiled layout says so."""
    import torch._dynamo

    from colab_par.parallel.compile import apply_compile

    blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
    apply_compile([(blocks, str(i), block) for i, block in enumerate(blocks)], True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        for block in blocks:  # both blocks share the code compiled for this shape
            block(torch.randn(3, 8)).sum().backward()
        with pytest.raises(RuntimeError, match=r"recompile_limit = 1\) and would run eager"):
            blocks[0](torch.randn(5, 8))
    torch._dynamo.reset()


def test_code_compiled_for_one_cpu_vector_width_is_never_served_to_another(tmp_path, monkeypatch) -> None:
    """Inductor picks its CPU vector width from ATEN_CPU_CAPABILITY per compile, but keys its graph
    cache on its config: an avx512 entry was served under avx2 (wrong numbers; NaN losses in the
    parity tests) and under "default" failed to build. The kit pins the width into the config
    (`compat.pin_inductor_vector_width`), so each capability compiles its own code. Without the
    pin the avx2 result here is wrong (checked)."""
    import torch._dynamo
    from torch._inductor import config

    from colab_par.compat import pin_inductor_vector_width

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return (x.softmax(-1) * x).sum(-1) + x.mean()

    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # one cache for every capability
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    widths = {}
    for capability in (None, "avx2", "default"):
        if capability:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        torch._dynamo.reset()
        with config.patch({"cpp.simdlen": None}):
            widths[capability] = pin_inductor_vector_width()
            torch.testing.assert_close(torch.compile(reduce)(x), reduce(x))
    torch._dynamo.reset()
    assert widths["default"] == 0 and (not torch.cpu._is_avx2_supported() or widths["avx2"] == 256)


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
        cells.append(Trainer(pm, data, steps=2, logs=Logs(telemetry=True)).fit())
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
