"""``parallelize(model, layout)``: one call that spreads a model over the ranks of a Layout.

Runs on every engine (torch.distributed already initialised). The order is the one torchtitan uses,
and each step is a file of its own: mesh -> pipeline split -> experts (expert parallel, and the
experts' tensor split) -> tensor (+ sequence) parallel -> context parallel -> activation
checkpointing -> per-block compile -> FSDP / ZeRO / DDP -> pipeline schedule (for pipeline
parallel every step after the split is applied to each local stage module) -> optimizer -> memory tiers (`tiering.py`: with a budget or
pinned tiers the optimizer becomes a chunked `TieredAdamW` over the local tensors).
The returned `ParallelModel` (`model.py`) trains on the GLOBAL batch: it takes this rank's data- and
context-parallel slice itself, so a training loop is the same for every layout.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from colab_par.layout import Layout
from colab_par.memory_tiers.measure import resident_bytes
from colab_par.models.hf import is_hf_model
from colab_par.parallel.adapters import (Adapters, adapt_to_grid, adapter_tp_plan, attach_adapters, base_layer_of,
                                        wraps_output_layer)
from colab_par.data.batch import default_loss, slice_batch
from colab_par.parallel.blocks import find_blocks
from colab_par.parallel.checkpointing import apply_activation_checkpointing
from colab_par.parallel.compile import apply_compile, check_compiler, fused_optimizer_fn
from colab_par.parallel.context import apply_context_parallel
from colab_par.parallel.data_parallel import (GradientAverager, apply_ddp, apply_fsdp, build_optimizer,
                                              needs_gradient_averager)
from colab_par.parallel.experts import apply_expert_parallel
from colab_par.parallel.memory import memory_report
from colab_par.parallel.init_record import InitRecord, record_build, record_reset
from colab_par.parallel.materialize import WeightSource, broadcast_rng_state, is_meta_model, materialize
from colab_par.parallel.mesh import broadcast_from_rank0, build_grid_mesh, build_mesh, default_device
from colab_par.parallel.pipeline import PipelineRunner, split_model
from colab_par.parallel.tensor_grid import apply_tensor_grid
from colab_par.parallel.tensor_parallel import apply_tensor_parallel, tp_plan_for
from colab_par.parallel.tiering import apply_memory_tiers, cast_working_parameters
from colab_par.parallel.model import ParallelModel, _default_loss

__all__ = ["parallelize", "ParallelModel", "WeightSource", "memory_report"]

def parallelize(model: nn.Module | Callable[[], nn.Module], layout: Layout | str, *,
                optimizer_fn: Callable | None = None, loss_fn: Callable | None = None,
                blocks: Sequence[type | str] | None = None, tp_plan: dict[str, Any] | None = None,
                split_points: Sequence[str] | None = None, example_batch: Any = None,
                kernels: str = "auto", weights: WeightSource | None = None) -> ParallelModel:
    """Spread `model` (any nn.Module) over this world as `layout` says; see the module docstring.

    `model` may be built on the meta device, or be a zero-argument factory (run on meta here):
    then every step below is applied on meta and each rank allocates only its own shards, filled
    with exactly the weights a one-process CPU build with rank 0's seed would have
    (`init_record.py`), or read from `weights` (e.g. Hugging Face safetensors) block by block.

    `loss_fn`: `(logits, targets)` for token batches, `(outputs, batch)` for any other batch.
    `blocks`: the block classes (or names) FSDP shards and checkpointing wraps one by one, instead
    of the repeated blocks found automatically (`blocks.py`).
    `tp_plan` (module pattern -> DTensor ParallelStyle or Hugging Face style string) replaces the
    model's own tensor-parallel plan.
    Pipeline parallel cuts the kit's GPT and Hugging Face decoders by their layers; any other model
    is traced by torch's `pipeline()` on `example_batch` (a global batch like the training ones)
    and cut before the modules named in `split_points`, or between blocks balanced by parameters.
    `kernels` ("auto": on CUDA, "triton", "torch") puts the kit's Triton RMSNorm, SwiGLU and RoPE
    into Hugging Face decoders, and, where the whole vocabulary is on the rank (no tensor
    parallel), scores them with the fused linear cross-entropy so logits are never built."""
    layout = Layout.parse(layout)
    if kernels not in ("torch", "triton", "auto"):
        raise ValueError(f"kernels={kernels!r}; choose 'auto' (Triton on CUDA), 'triton' or 'torch'")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run parallelize on the engines of a "
                           "colab_par.Cluster (e.g. inside a %%colossal cell)")
    baseline = resident_bytes(default_device())  # before the model: outside a memory-tiers budget
    factory = model if not isinstance(model, nn.Module) else None
    built_on_meta = factory is None and is_meta_model(model)
    layout.validate(dist.get_world_size(), getattr(model, "config", None))  # before building anything
    model, record = _shard_first_model(model, layout, weights, example_batch)
    model, adapters, weights = attach_adapters(model, record, weights, layout, tp_plan=tp_plan,
                                               built_on_meta=built_on_meta)
    config = getattr(model, "config", None)
    layout.validate(dist.get_world_size(), config)
    hf = is_hf_model(model)
    takes_positions = "positions" in inspect.signature(model.forward).parameters
    block_types, block_names = _blocks_of(model, blocks)
    device = default_device()
    _refuse_what_the_model_lacks(model, layout, hf or takes_positions, bool(block_types), device)
    _refuse_kernels_it_lacks(model, kernels)
    optimizer_fn = optimizer_fn or (lambda params: torch.optim.AdamW(params, lr=1e-3))

    fused_loss = (_apply_hf_kernels(model, kernels, layout, device,
                                    fuse=loss_fn is None and not wraps_output_layer(model)) if hf else False)
    token_loss = loss_fn or getattr(model, "loss_fn", None) or _default_loss
    batch_loss = loss_fn or default_loss(model)
    if record is None:
        model.to(device)
        broadcast_from_rank0(model)
    mesh, dp_cp_mesh = build_mesh(layout, device)
    fill = (lambda part: None) if record is None else functools.partial(
        materialize, record=record, device=device, weights=weights)

    parts, names = [model], _state_names(model) if layout.pp > 1 else {}
    if layout.pp > 1:
        example = None if example_batch is None else _first_microbatch(example_batch, layout, mesh)
        parts = split_model(model, layout, mesh["pp"].get_local_rank(), split_points=split_points,
                            block_types=block_types, example_batch=example)
    data_group = dp_cp_mesh.get_group() if layout.dp * layout.cp > 1 else None
    experts = apply_expert_parallel(parts, layout, device, data_group)  # before TP and FSDP / DDP
    parts = [_parallelize_part(part, layout, mesh, dp_cp_mesh, device, hf, tp_plan,
                               _part_blocks(part, block_types, block_names), fill, adapters) for part in parts]

    optimizer, averager = _optimizer_and_averager(parts, optimizer_fn, layout, mesh, dp_cp_mesh, device,
                                                  baseline, experts)
    runner = None
    if layout.pp > 1:
        runner = PipelineRunner(parts, layout, mesh["pp"].get_group(), token_loss, device,
                                batch_loss_fn=batch_loss, stage_losses=experts.stages)
    rebuild = _rebuilder(model)
    if adapters is not None and rebuild is not None:
        rebuild = adapters.factory(rebuild)
    pm = ParallelModel(parts, layout, mesh, optimizer, (token_loss, batch_loss), device, hf, averager, runner,
                         optimizer_fn=optimizer_fn, model_factory=factory or rebuild,
                         takes_positions=takes_positions,
                         options=dict(loss_fn=loss_fn, blocks=blocks, tp_plan=tp_plan,
                                      split_points=split_points, example_batch=example_batch,
                                      kernels=kernels))
    pm._whole_model_names, pm._fused_loss, pm.adapters = names, fused_loss, adapters
    pm.balance_loss = experts.balance
    return pm


def _blocks_of(model: nn.Module, blocks: Sequence[type | str] | None) -> tuple[tuple[type, ...], frozenset[str]]:
    """The classes of the model's repeated blocks (given, or found: `blocks.py`) and their names."""
    model_blocks = find_blocks(model, blocks)
    block_types = tuple(dict.fromkeys(type(block) for _, _, block in model_blocks))
    block_names = frozenset(name for name, module in model.named_modules()
                            if any(module is block for _, _, block in model_blocks))
    return block_types, block_names


def _optimizer_and_averager(parts: list[nn.Module], optimizer_fn: Callable, layout: Layout, mesh: Any,
                            dp_cp_mesh: Any, device: torch.device, baseline: int, experts: Any) -> tuple[Any, Any]:
    """The optimizer over the trainable parameters (ZeRO-1 sharded, memory-tiered as the layout
    says) and the gradient averager the layout's data parallelism needs beyond FSDP/DDP."""
    params = [p for part in parts for p in part.parameters() if p.requires_grad]  # frozen ones get no state
    optimizer = build_optimizer(params, fused_optimizer_fn(optimizer_fn, layout.compile), layout,
                                mesh["dp"].get_group())
    optimizer = apply_memory_tiers(parts, optimizer, layout, device, baseline=baseline)
    expert_params = set(map(id, experts.averager.params)) if experts.averager else set()
    averager = (GradientAverager([p for p in params if id(p) not in expert_params], dp_cp_mesh.get_group(),
                                 then=experts.averager)
                if needs_gradient_averager(parts[0], layout) else experts.averager)
    return optimizer, averager


def _shard_first_model(model: nn.Module | Callable[[], nn.Module], layout: Layout,
                       weights: WeightSource | None, example_batch: Any) -> tuple[nn.Module, InitRecord | None]:
    """The model to parallelize and, when it is (or will be built) on meta, its recorded init."""
    if isinstance(model, nn.Module) and not is_meta_model(model):
        if weights is not None:
            raise ValueError("weights= fills a model built on the meta device; pass a zero-argument "
                             "factory (e.g. lambda: MyModel(config)) or a meta model, not a built one")
        return model, None
    if not isinstance(model, nn.Module) and not callable(model):
        raise TypeError(f"parallelize takes an nn.Module or a zero-argument factory building one, "
                        f"not {type(model).__name__}")
    broadcast_rng_state(default_device())
    if isinstance(model, nn.Module):
        record = record_reset(model)
    else:
        model, record = record_build(model, draw=weights is None)  # a checkpoint replaces random values
    _refuse_rank_dependent_init(record)
    return model, record


def _refuse_rank_dependent_init(record: InitRecord) -> None:
    """Every rank must record the same init, or the shards would not fit together."""
    mine = torch.tensor([record.fingerprint()], dtype=torch.int64, device=default_device())
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low.item() != high.item():
        raise ValueError("the model initialised differently on different ranks (does the factory call "
                         "torch.manual_seed with a rank-dependent seed?); seed once with the same value "
                         "on every rank, or not at all: the kit starts every rank from rank 0's generator")


def _rebuilder(model: nn.Module) -> Callable[[], nn.Module] | None:
    """`type(model)(model.config)` for models built from a config (GPT, Hugging Face), else None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    build = functools.partial(type(model), config)
    build.config = config  # type: ignore[attr-defined]
    return build


def _refuse_kernels_it_lacks(model: nn.Module, kernels: str) -> None:
    """An explicit `kernels` is honoured or refused: "triton" on a model the kit's kernels cannot
    reach is refused as apply_kernels refuses it (Hugging Face decoders are known by their
    config's model_type); the kit's GPT follows its own GPTConfig.kernels, so another mode named
    here is refused. "auto" uses the kernels where they apply."""
    if kernels == "auto":
        return
    from colab_par.models.gpt import GPTConfig
    from colab_par.models.hf_kernels import require_kernels

    config = getattr(model, "config", None)
    if isinstance(config, GPTConfig):
        if config.kernels != kernels:
            raise ValueError(f"kernels={kernels!r} but this GPT was built with GPTConfig(kernels="
                             f"{config.kernels!r}), which its modules follow; build it with GPTConfig("
                             f"kernels={kernels!r}), or leave parallelize's kernels out")
    elif kernels == "triton":
        require_kernels(model)


def _apply_hf_kernels(model: nn.Module, kernels: str, layout: Layout, device: torch.device, *,
                      fuse: bool) -> bool:
    """Patch a Hugging Face decoder's modules with the kit's kernels; True when its loss is then
    the fused linear cross-entropy (the default loss, the vocabulary whole on this rank, no
    pipeline stages, and a model whose own loss it is: `fused_loss_mismatch`)."""
    from colab_par.models.hf_kernels import apply_kernels, fuse_loss_into_forward, fused_loss_mismatch, supports_kernels

    on = kernels == "triton" or (kernels == "auto" and device.type == "cuda")
    if not on or not supports_kernels(model):
        return False
    apply_kernels(model, kernels)
    if not fuse or layout.tp > 1 or layout.pp > 1 or fused_loss_mismatch(model) is not None:
        return False
    fuse_loss_into_forward(model)
    return True


def _state_names(model: nn.Module) -> dict[str, list[str]]:
    """Each state-dict name of `model` -> all names of the same tensor (tied weights share one)."""
    state = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    return {name: aliases[id(tensor)] for name, tensor in state.items()}


def _first_microbatch(batch: Any, layout: Layout, mesh: Any) -> Any:
    """One microbatch of this rank's dp share: what a pipeline stage is traced on."""
    mine = slice_batch(batch, layout.dp, mesh["dp"].get_local_rank()) if layout.dp > 1 else batch
    return slice_batch(mine, layout.microbatches, 0)


def _part_blocks(part: nn.Module, block_types: tuple[type, ...], block_names: frozenset[str]) -> list:
    """The blocks inside one part: by class, or (stages traced by pipeline(), whose modules are
    torch's stand-ins) by the blocks' names in the whole model, which the stages keep."""
    found = find_blocks(part, block_types, strict=False)
    if found or not block_names:
        return found
    return [(part.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], module)
            for name, module in part.named_modules() if name in block_names]


def _refuse_what_the_model_lacks(model: nn.Module, layout: Layout, takes_positions: bool, has_blocks: bool,
                                 device: torch.device) -> None:
    """Before any work: what the layout needs of the model (and the machine) that it does not have."""
    name = type(model).__name__
    if layout.cp > 1 and not takes_positions:
        raise ValueError(f"context parallel gives each rank scattered sequence chunks, so {name}.forward must "
                         "accept `positions` (the tokens' global positions, for rotary/position embeddings); "
                         "add it or use cp=1")
    for wanted, what, way_out in ((layout.checkpointing != "none", "activation checkpointing wraps",
                                   "use checkpointing='none'"),
                                  (layout.compile, "compile compiles", "drop 'compile'")):
        if wanted and not has_blocks:
            raise ValueError(f"{what} each repeated block, and {name} has none (no ModuleList/Sequential of "
                             f"one class); name them with blocks=[...] or {way_out}")
    if layout.compile:
        check_compiler(device)


def _parallelize_part(part: nn.Module, layout: Layout, mesh: Any, dp_cp_mesh: Any, device: torch.device,
                      hf: bool, tp_plan: dict | None, blocks: list, fill: Callable[[nn.Module], None],
                      adapters: Adapters | None) -> nn.Module:
    """TP(+SP) -> CP -> AC -> compile -> FSDP/DDP on one module (the whole model or one pipeline stage).

    `fill` gives a meta part its local shards: after FSDP has sharded it, before DDP (which
    broadcasts real parameters). A PEFT model's adapters split with their base layers."""
    if layout.tp_mode != "1d":
        grid = apply_tensor_grid(part, layout, build_grid_mesh(layout, device), unwrap=base_layer_of)
        if adapters is not None:
            adapt_to_grid(part, grid)
    elif layout.tp > 1:
        plan = tp_plan_for(part, tp_plan, hf=hf, sequence_parallel=layout.sequence_parallel)
        apply_tensor_parallel(part, mesh["tp"], plan if adapters is None else adapter_tp_plan(part, plan))
    if layout.cp > 1:
        apply_context_parallel(part, mesh["cp"].get_group(), layout.cp_mode)
    apply_activation_checkpointing(part, layout.checkpointing, blocks)
    blocks = apply_compile(blocks, layout.compile)
    if layout.zero >= 2:
        cast_working_parameters(part, layout)
        part = apply_fsdp(part, layout, dp_cp_mesh, blocks)
        fill(part)
        return part
    fill(part)
    if layout.dp * layout.cp > 1 and not needs_gradient_averager(part, layout):
        return apply_ddp(part, dp_cp_mesh.get_group(), device)
    return part
