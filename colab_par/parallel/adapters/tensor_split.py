"""How adapters split with their tensor-parallel base layer.

A tensor-parallel plan names base modules (``model.layers.*.self_attn.q_proj``); where peft has put
a tuner layer there, the base's style goes to its ``base_layer`` and LoRA's two factors get styles
derived from it, so ``y = W x + s·B(A x)`` splits the way ``W`` does:
- a column-split base (each rank its output features): ``lora_A`` whole, ``lora_B`` split by output,
  fed ``A x`` as the base is fed ``x``. When ``x`` is whole on every rank, DTensor sums the gradient
  of ``A x`` over the ranks on its way back, so ``A``'s gradient is whole; when ``x`` arrives split
  along the sequence (sequence parallel) each rank's ``A`` sees only its tokens and its gradient is
  summed over the group (`ReplicatedGradSum`);
- a row-split base (each rank its input features): ``lora_A`` split by input (its partial products
  summed into ``A x`` as the base's are), ``lora_B`` whole; when the output is left split (sequence
  parallel) or partial, ``B``'s gradient is summed over the group;
- transformers' Conv1D (GPT-2) the same way, the fused q|k|v output regrouped as the base's is.
Dropout before ``A`` on an input every rank holds whole draws one mask for the group (the replicas
of ``A`` must see the same data); on a split input each rank draws its own piece's mask.
Any other tuner, LoRA on embeddings and DoRA (whose norm couples the split rows) have no rule: a plan
that splits their base is refused, naming the adapter type and what works.
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel, parallelize_module)

from colab_par.parallel.adapters.model import is_auxiliary_wrapper, is_tuner_layer
from colab_par.parallel.collectives import regroup_blocks, sum_grad_over
from colab_par.parallel.hf_plans import Conv1DColwise, Conv1DRowwise
from colab_par.parallel.tensor_parallel import ReplicatedGradSum, is_whole, modules_matching

__all__ = ["adapter_tp_plan", "refuse_unsplittable", "is_plain_lora", "adapter_kind", "AdapterInput", "ColumnBlocks",
           "WHAT_SPLITS"]

WHAT_SPLITS = ("LoRA on linear layers (nn.Linear, transformers' Conv1D) splits with its base under tensor "
               "parallel; every adapter type trains under dp, zero1-3, offload and pp")


def adapter_tp_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` (pattern -> resolved style) with every pattern that reaches a peft layer replaced by
    one entry per module it matches: the base layer gets the style, the adapters theirs."""
    names = {id(module): name for name, module in model.named_modules()}
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        modules = modules_matching(model, pattern)
        if not any(is_tuner_layer(m) or is_auxiliary_wrapper(m) for m in modules):
            out[pattern] = style
            continue
        for module in modules:
            out.update(_following(names[id(module)], module, style))
    return out


def refuse_unsplittable(model: nn.Module, patterns: list[str]) -> None:
    """Before a plan's styles are even resolved: refuse a peft layer the plan would split that no
    rule splits (any tuner but plain LoRA on a linear layer)."""
    names = {id(module): name for name, module in model.named_modules()}
    for pattern in patterns:
        for module in modules_matching(model, pattern):
            if is_tuner_layer(module):
                _refuse_unless_plain_lora(names[id(module)], module)


def _refuse_unless_plain_lora(name: str, module: nn.Module) -> None:
    if not is_plain_lora(module):
        raise ValueError(f"tensor parallel splits {name} ({adapter_kind(module)}), and the kit has no rule to split "
                         f"that adapter with its base; leave {name.rpartition('.')[2]!r} out of the "
                         f"adapter's target_modules or use a layout without tp ({WHAT_SPLITS})")


def _following(name: str, module: nn.Module, style: ParallelStyle) -> dict[str, ParallelStyle]:
    if isinstance(style, (PrepareModuleInput, PrepareModuleOutput)) or not (
            is_tuner_layer(module) or is_auxiliary_wrapper(module)):
        return {name: style}  # module boundaries and unwrapped modules keep their style
    if is_auxiliary_wrapper(module):
        return _trained_copies(name, module, style)
    _refuse_unless_plain_lora(name, module)
    if not getattr(style, "use_local_output", True):
        raise ValueError(f"the tp style of {name} keeps its output a DTensor (use_local_output=False), and "
                         "LoRA adds its output to the base layer's as plain tensors; use local outputs")
    entries = _following(f"{name}.base_layer", module.base_layer, style)
    for adapter in module.lora_A:
        a_style, b_style, layout = _factor_styles(name, style, module, adapter)
        dropout = module.lora_dropout[adapter]
        shared = isinstance(layout, Replicate) and isinstance(dropout, nn.Dropout) and dropout.p > 0
        if layout is not None:
            entries[f"{name}.lora_dropout.{adapter}"] = AdapterInput(layout, f"{name}.{adapter}" if shared else None)
        if a_style is not None:
            entries[f"{name}.lora_A.{adapter}"] = a_style
        if b_style is not None:
            entries[f"{name}.lora_B.{adapter}"] = b_style
    return entries


def _factor_styles(name: str, style: ParallelStyle, module: nn.Module,
                   adapter: str) -> tuple[ParallelStyle | None, ParallelStyle | None, Placement | None]:
    """(A's style, B's style, how A's input lies over the ranks, None: untouched) for a base split
    by `style`."""
    if isinstance(style, ColwiseParallel):
        layout = style.input_layouts[0]
        return (None if isinstance(layout, Replicate) else ReplicatedGradSum(),
                ColwiseParallel(input_layouts=layout, output_layouts=style.output_layouts[0],
                                use_local_output=True), layout)
    if isinstance(style, RowwiseParallel):
        out = style.output_layouts[0]
        if isinstance(out, Partial) and module.lora_bias.get(adapter):
            raise ValueError(f"{name} leaves its output partial (summed later), and LoRA's bias would be added "
                             "on every rank; use lora_bias=False or a rowwise style with a reduced output")
        return (RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=out, use_local_output=True),
                None if isinstance(out, Replicate) else ReplicatedGradSum(), style.input_layouts[0])
    if isinstance(style, Conv1DColwise):
        return None, ColwiseParallel() if style.parts == 1 else ColumnBlocks(style.parts), Replicate()
    if isinstance(style, Conv1DRowwise):
        return RowwiseParallel(), None, Shard(-1)
    if is_whole(style):
        return None, None, None  # "replicate": the base stays whole, and so do its adapters
    raise ValueError(f"{name} is split by {type(style).__name__}, and the kit has no rule to split LoRA "
                     f"adapters with it ({WHAT_SPLITS}); leave {name.rpartition('.')[2]!r} out of "
                     "target_modules or out of the tp plan")


def _trained_copies(name: str, wrapper: nn.Module, style: ParallelStyle) -> dict[str, ParallelStyle]:
    """``modules_to_save``: the original and each trained copy are the same module, split alike."""
    copies = dict(wrapper.named_children()).get("modules_to_save")
    if copies is None:
        raise ValueError(f"tensor parallel splits {name} ({adapter_kind(wrapper)}), which trains single rows of a "
                         "split tensor; leave it out of the plan or use a layout without tp")
    return {f"{name}.original_module": style, **{f"{name}.modules_to_save.{adapter}": style for adapter in copies}}


def is_plain_lora(module: nn.Module) -> bool:
    """peft's LoRA on a linear layer with no variant (DoRA and the like change the arithmetic)."""
    from peft.tuners.lora import LoraLayer

    return (isinstance(module, LoraLayer) and not module.lora_variant and len(module.lora_A) > 0
            and not module.lora_embedding_A
            and all(isinstance(m, nn.Linear) for m in (*module.lora_A.values(), *module.lora_B.values())))


def adapter_kind(module: nn.Module) -> str:
    """The adapter type, as peft names it ("LoRA with DoRA", "IA3", ...)."""
    from peft.tuners.lora import LoraLayer

    if isinstance(module, LoraLayer):
        if module.lora_variant:
            return f"LoRA with {', '.join(sorted({type(v).__name__ for v in module.lora_variant.values()}))}"
        return "LoRA on an embedding" if module.lora_embedding_A else f"LoRA on {type(module.base_layer).__name__}"
    return f"{type(module).__module__.split('.')[2].upper()} {type(module).__name__}" if type(
        module).__module__.startswith("peft.tuners.") else type(module).__name__


# ---- styles ------------------------------------------------------------------------------------------
class ColumnBlocks(ParallelStyle):
    """An nn.Linear whose output is `parts` equal blocks side by side (the adapter of GPT-2's fused
    q|k|v), split so each rank computes its piece of every block, as `Conv1DColwise(parts)` splits
    the layer it adapts. Stored as a plain row split; forward regroups the rows with one all-to-all.
    The input is whole on every rank, so its gradient is summed over the group."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if module.out_features % (self.parts * device_mesh.size()):
            raise ValueError(f"ColumnBlocks(parts={self.parts}) splits {module.out_features} outputs over "
                             f"tp={device_mesh.size()}; choose a tp that divides the heads")
        for name in ("weight", "bias"):
            param = getattr(module, name, None)
            if param is not None:
                sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
                module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        group = device_mesh.get_group()

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = regroup_blocks(module.weight.to_local(), group, self.parts, 0)
            bias = None if module.bias is None else regroup_blocks(module.bias.to_local(), group, self.parts, 0)
            return F.linear(sum_grad_over(x, group), weight, bias)

        module.forward = forward
        return module


class AdapterInput(ParallelStyle):
    """The adapters' input (what their dropout module receives) as this rank's local tensor: an
    ancestor's plan may hand the layer a DTensor (its base's style takes either). Where every rank
    holds that input whole, `shared_mask` (a name) makes dropout draw one mask for the group, from a
    generator its ranks share (seeded from rank 0's seed and the name), so the replicated ``lora_A``
    after it gets the same gradient on every rank and stays equal; on a split input each rank draws
    its own piece's mask."""

    def __init__(self, layout: Placement, shared_mask: str | None):
        super().__init__()
        self.layout, self.shared_mask = layout, shared_mask

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local = PrepareModuleInput(input_layouts=(self.layout,), desired_input_layouts=(self.layout,),
                                   use_local_output=True)
        parallelize_module(module, device_mesh, local)
        if self.shared_mask is not None:
            module.forward = _shared_mask_dropout(module, device_mesh, self.shared_mask)
        return module


def _shared_mask_dropout(module: nn.Module, device_mesh: DeviceMesh, name: str) -> Callable:
    group = device_mesh.get_group()
    seed = torch.tensor([torch.initial_seed() ^ zlib.crc32(name.encode())], dtype=torch.int64,
                        device=device_mesh.device_type)
    dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    generator = torch.Generator(device=device_mesh.device_type)
    generator.manual_seed(int(seed.item()) & (2**63 - 1))

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not module.training or module.p == 0:
            return x
        keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - module.p, generator=generator)
        return x * keep / (1 - module.p)

    return forward
