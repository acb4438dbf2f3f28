"""One rank's training step, traced: the child process of `dry_run` (and the measurement a real
world's ranks make for comparison, `traced_step`).

The child is rank `rank` of a `fake` world (compat.fake_world): collectives move nothing, so one
process runs the step any rank of any world size runs, with the kit's own `parallelize` and
`ParallelModel.train_step` halves (`forward_backward_tensor`, then `optimizer_step`). Torch's
`MemTracker` sorts every allocation by kind; the root modules' forward and backward peaks and the
optimizer step's own peak make the phases. With fake tensors (`FakeTensorMode`) nothing is stored,
and the same allocations are counted: a rank of an 8 B model takes well under 1 GiB here.
"""
from __future__ import annotations

import contextlib

import time
import traceback
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from colab_par.compat import fake_world
from colab_par.layout import Layout, grid_batch_chunks, tensor_grid
from colab_par.models import GPT, GPTConfig
from colab_par.parallel import parallelize
from colab_par.parallel.mesh import GRID_DIMS, build_expert_mesh, build_grid_mesh, build_mesh
from colab_par.planning.dry_run.collectives import CollectivesByDim, mesh_group_names
from colab_par.planning.dry_run.report import DryRunReport, MemoryKinds

__all__ = ["model_factory", "token_batch", "traced_step", "fake_rank_step", "child_main", "pipeline_stage_inputs",
           "off_device_kinds"]


def model_factory(model: Any) -> Callable[[], nn.Module]:
    """A zero-argument factory for `parallelize` (it runs it on meta): a GPTConfig builds the kit's
    GPT, a Hugging Face config its causal LM without weights, a callable is the factory itself."""
    if isinstance(model, GPTConfig):
        return lambda: GPT(model)
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):
        from transformers import AutoModelForCausalLM

        return lambda: AutoModelForCausalLM.from_config(model)
    if callable(model) and not isinstance(model, nn.Module):
        return model
    raise TypeError(f"dry_run takes a GPTConfig, a Hugging Face config or a picklable zero-argument "
                    f"factory, not {type(model).__name__}: a built module cannot cross to the child "
                    "process (pass the function that builds it)")


def token_batch(vocab_size: int, batch: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A global (inputs, targets) batch of random tokens: memory and traffic do not depend on values."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch[0], batch[1] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _vocab_size(factory: Callable[[], nn.Module]) -> int:
    with torch.device("meta"):
        config = getattr(factory(), "config", None)
    if getattr(config, "vocab_size", None) is None:
        raise ValueError("the model has no config.vocab_size: dry_run trains on token batches of a "
                         "language model (the kit's GPT or a Hugging Face decoder)")
    return int(config.vocab_size)


def pipeline_stage_inputs(factory: Callable[[], nn.Module], layout: Layout,
                          inputs: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """{stage: the tensors it takes} for every pipeline stage past the first, on meta: one
    microbatch of a dp rank's share through the whole model's stages (`split_model` of each pp
    rank), in the dtype a stage boundary carries (bf16 where FSDP casts the parameters; float32
    under autocast, whose residual stream stays float32). What a fake world's shape inference
    answers in place of the neighbours it cannot hear (`fake_world.pipeline_metadata`). On a tensor
    grid each rank passes its piece (`_grid_piece`)."""
    from colab_par.parallel.pipeline import split_model, stage_ids, stage_owner

    with torch.device("meta"):
        model = factory()
    if layout.precision == "bf16" and layout.zero >= 2:
        model = model.to(torch.bfloat16)
    rows = inputs.shape[0] // (layout.dp * layout.microbatches)
    carried: tuple[torch.Tensor, ...] = (torch.empty((rows, inputs.shape[1] // layout.cp), dtype=inputs.dtype,
                                                     device="meta"),)
    taken = {}
    for stage in range(layout.pp * layout.virtual_stages - 1):
        owner = stage_owner(layout, stage)
        part = split_model(model, layout, owner)[stage_ids(layout, owner).index(stage)]
        out = part(*carried)
        carried = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        taken[stage + 1] = tuple(_grid_piece(layout, tensor) for tensor in carried)
    return taken


def _grid_piece(layout: Layout, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (rows, seq, hidden) stage boundary on a tensor grid: layout A's rows
    split over the grid's batch dims, its hidden over q (`tensor_grid.py`); whole without a grid."""
    grid = tensor_grid(layout.tp, layout.tp_mode, layout.tp_depth)
    if grid is None:
        return tensor
    rows, hidden = tensor.shape[0] // grid_batch_chunks(layout), tensor.shape[-1] // grid[0]
    piece = torch.empty((rows, *tensor.shape[1:-1], hidden), dtype=tensor.dtype, device="meta")
    return piece.requires_grad_(tensor.requires_grad)  # a stage sends back the gradient of what it took


def _answer_ddp_on_fake_world(pm: Any) -> None:
    """torch 2.13's fake group completes an all-reduce with no value, which DDP's reducer refuses;
    this hook issues the same in-place sum of the pre-divided bucket (DDP's default) and answers
    with the bucket itself. (Unannotated: DDP refuses annotations that are not its own classes.)"""
    def allreduce(group, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer().div_(group.size())
        dist.all_reduce(buffer, group=group)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    for part in pm.model_parts:
        if isinstance(part, DistributedDataParallel):
            part.register_comm_hook(part.process_group, allreduce)


def _train_step(pm: Any, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """`ParallelModel.train_step` without reading the loss (a fake tensor has no value to read)."""
    pm.forward_backward_tensor(inputs, targets)
    pm.optimizer_step()


def traced_step(pm: Any, inputs: torch.Tensor, targets: torch.Tensor, *, steps: int = 2,
                world: str = "fake") -> DryRunReport:
    """Run `steps` (>= 2) training steps of `pm` on the global batch and trace the last one: its
    memory per phase and its collectives per mesh dimension (this rank's view), and its FLOPs.
    Under recompute the FLOPs are counted in a step of their own before it (the same operators):
    torch's FLOP counter keeps what recompute rebuilds alive until it exits (29 MiB past the
    backward of a small GPT under full recompute), which the memory tracker would count as the
    step's; a pipeline's first step builds its stages (an `autograd.grad` the counter's hooks
    refuse), so there the counted step is a second one."""
    if steps < 2:
        raise ValueError(f"steps={steps}: the traced step needs one before it (optimizer state, FLOPs)")

    def split() -> Any:  # the trackers' module hooks under zbv's split backward
        return fake_world.following_split_backward() if pm.layout.pp_schedule == "zbv" else contextlib.nullcontext()

    flops = fake_world.local_flop_counter()
    recompute = pm.layout.checkpointing != "none"
    warm_ups = steps - 1 + (recompute and pm.layout.pp > 1)  # a pipeline's first step also builds its stages
    for index in range(warm_ups):  # optimizer state exists from the first step on
        with (flops if recompute and index == warm_ups - 1 else contextlib.nullcontext()), split():
            _train_step(pm, inputs, targets)
    seen = CollectivesByDim(mesh_group_names(pm.mesh, _named_meshes(pm.layout, pm.device)))
    tracker = fake_world.memory_tracker()
    inner = getattr(pm.optimizer, "optim", None)  # ZeroRedundancyOptimizer (zero1) keeps its state in it
    tracker.track_external(*pm.model_parts, pm.optimizer, *([inner] if inner is not None else []))
    with seen, (contextlib.nullcontext() if recompute else flops):
        with tracker, split():
            pm.forward_backward_tensor(inputs, targets)
        phases = {"forward": {}, "backward": {}}
        for part in pm.model_parts:  # a pipeline rank's stages: the larger peak of each phase
            for phase, kinds in fake_world.module_phase_peaks(tracker, part).items():
                if kinds.get("Total", 0) > phases[phase].get("Total", 0):
                    phases[phase] = kinds
        step_peak = fake_world.tracked_kinds(tracker.get_tracker_snapshot("peak"))
        with tracker:  # entering again restarts the peak: the optimizer step's own
            pm.optimizer_step()
        phases["optimizer"] = fake_world.tracked_kinds(tracker.get_tracker_snapshot("peak"))
    peak = MemoryKinds.of(max((step_peak, phases["optimizer"]), key=lambda kinds: kinds.get("Total", 0)))
    resting = MemoryKinds.of(phases["optimizer"])
    host = MemoryKinds(**{kind: min(getattr(peak, kind), getattr(resting, kind)) for kind in off_device_kinds(pm.layout)})
    return DryRunReport(str(pm.layout), dist.get_world_size(), dist.get_rank(), tuple(inputs.shape),
                        {phase: MemoryKinds.of(kinds) for phase, kinds in phases.items()},
                        peak, seen.rows(), world=world, steps=steps, flops=float(flops.get_total_flops()), host=host)


def off_device_kinds(layout: Layout) -> tuple[str, ...]:
    """The kinds of model state a GPU run of `layout` keeps on the host or disk (see
    `DryRunReport.host`): all three under `offload`, else those the tiers pin off the device."""
    if layout.offload:
        return ("params", "grads", "optimizer")
    return tuple(kind for kind in ("params", "grads", "optimizer") if getattr(layout.tiers, kind) in ("host", "disk"))


def _named_meshes(layout: Layout, device: torch.device) -> dict[str, Any]:
    """The meshes beyond (pp, dp, cp, tp) whose groups a step may use, by the name a collective's
    row takes: the flattened "dp_cp", the expert mesh's "ep" and "edp", a tensor grid's dims."""
    _, dp_cp = build_mesh(layout, device)
    named = {"dp_cp": dp_cp}
    if layout.ep > 1:
        experts = build_expert_mesh(layout, device)
        named.update(ep=experts["ep"], edp=experts["edp"])
    if layout.tp_mode != "1d":
        grid = build_grid_mesh(layout, device)
        named.update({dim: grid[dim] for dim in GRID_DIMS[layout.tp_mode]})
    return named


def fake_rank_step(request: dict[str, Any]) -> DryRunReport:
    """Rank `request["rank"]` of a fake world: build, parallelize and trace its step.

    tensors="real": the factory goes to `parallelize` (built on meta, each rank's shards
    allocated). tensors="fake": nothing is allocated; the model is built on meta outside the fake
    mode (`to_empty` cannot swap a fake parameter for its shard: the fake mode holds a weak
    reference to it), then `parallelize` and the step run under `FakeTensorMode`."""
    layout = Layout.parse(request["layout"])
    fake_world.init_fake_world(request["rank"], request["world_size"])
    factory = model_factory(request["model"])
    inputs, targets = token_batch(_vocab_size(factory), request["batch"], request["seed"])
    if layout.pp > 1:
        stage_inputs = pipeline_stage_inputs(factory, layout, inputs)
        with fake_world.pipeline_metadata(stage_inputs.__getitem__):
            return _fake_rank_build_and_step(request, layout, factory, inputs, targets)
    return _fake_rank_build_and_step(request, layout, factory, inputs, targets)


def _fake_rank_build_and_step(request: dict[str, Any], layout: Layout, factory: Callable[[], nn.Module],
                              inputs: torch.Tensor, targets: torch.Tensor) -> DryRunReport:
    """`fake_rank_step` past the world and the batch: build with real or fake tensors, trace."""
    if request["tensors"] == "real":
        pm = parallelize(factory, layout)
        _answer_ddp_on_fake_world(pm)
        return traced_step(pm, inputs, targets, steps=request["steps"])
    with torch.device("meta"):
        model = factory()
    with fake_world.fake_tensors():
        pm = parallelize(model, layout)
        _answer_ddp_on_fake_world(pm)
        return replace(traced_step(pm, inputs, targets, steps=request["steps"]), tensors="fake")


def child_main(request: dict[str, Any], answer: Any) -> None:
    """The spawned process (`fake_rank_step`); sends ("ok", DryRunReport) or ("error", traceback
    text) through the pipe end `answer`."""
    try:
        start = time.perf_counter()
        torch.manual_seed(request["seed"])
        report = fake_rank_step(request)
        answer.send(("ok", replace(report, seconds=time.perf_counter() - start)))
    except BaseException:  # the caller raises it with the child's traceback
        answer.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        answer.close()
