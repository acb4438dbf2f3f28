"""LoRA under the 2d / 2.5d / 3d tensor grids (colab_par's GPT).

The grid runs every linear on local pieces of its input and weight (`tensor_grid.py`), in
activation layouts that differ by mode and, under 3d, by layer (q/k/v change the batch split).
Rather than one adapter rule per layout, LoRA is applied where every layout agrees, on the weight:
each rank adds ``s·B[o]·A[:, i]`` to its own piece ``W[o, i]`` of the base weight and the grid
linear runs as before, so ``y = x(W + s·BA)ᵀ = Wx + s·B(Ax)`` whatever the layout, with the base's
collectives only. ``A`` and ``B`` stay whole on every rank (replicated DTensors on the grid mesh,
so checkpoints move to and from 1d and dp layouts); their gradients, each rank's from its piece,
are summed over the grid dims that split the weight (ranks holding the same piece, 2.5d's depths,
already see that piece's whole gradient, as the base's own sum over depth comes first). The cost
is one rank-r product of the local piece's size per linear and step (r·out·in/q² multiply-adds,
small next to the tokens' own), and no activation memory beyond the base's.

Refused before any work (`refuse_off_grid`): other tuners, DoRA, LoRA's bias and dropout (its mask
is on the input, which no rank holds whole for a token), LoRA on a layer the grid does not run as a
linear (the embedding), peft's ``modules_to_save``; each error names tp_mode='1d' as the way out.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor

from colab_par.parallel.adapters.model import is_auxiliary_wrapper, is_tuner_layer
from colab_par.parallel.adapters.tensor_split import adapter_kind, is_plain_lora
from colab_par.parallel.collectives import sum_grad_over
from colab_par.parallel.tensor_grid import Grid, WeightSpec, grid_linear_names

__all__ = ["refuse_off_grid", "adapt_to_grid"]


def refuse_off_grid(model: nn.Module, tp_mode: str) -> None:
    """Refuse, naming the layer, any peft layer of `model` (a PEFT model's inner model) that the
    weight-side LoRA above cannot run under `tp_mode`'s grid."""
    linears = set(grid_linear_names(model))
    way_out = "or use tp_mode='1d' (Megatron tensor parallel), where every adapter type trains"
    for name, module in model.named_modules():
        if is_auxiliary_wrapper(module):
            raise ValueError(f"the {tp_mode} grid splits {name}, which peft trains whole (modules_to_save); "
                             f"leave it out of modules_to_save {way_out}")
        if not is_tuner_layer(module):
            continue
        if not is_plain_lora(module) or name not in linears:
            short = name.rpartition(".")[2]
            raise ValueError(f"the {tp_mode} grid adds LoRA to the weights of its linear layers "
                             f"({', '.join(sorted({n.rpartition('.')[2] for n in linears}))}); {name} is "
                             f"{adapter_kind(module)}: leave {short!r} out of target_modules {way_out}")
        for dropout in module.lora_dropout.values():
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                raise ValueError(f"{name} has lora_dropout={dropout.p}, which masks the layer's input, and the "
                                 f"{tp_mode} grid never holds a token's whole input; use lora_dropout=0.0 "
                                 f"{way_out}")
        if any(module.lora_bias.get(adapter) for adapter in module.lora_A):
            raise ValueError(f"{name} has a LoRA bias, which the {tp_mode} grid does not split; use "
                             f"lora_bias=False {way_out}")


def adapt_to_grid(model: nn.Module, grid: Grid) -> None:
    """Every LoRA layer of `model` (already checked by `refuse_off_grid`, its base placed by
    `apply_tensor_grid`): A and B replicated on the grid mesh, their update added to the base's
    piece, the layer's output the base's."""
    for layer in model.modules():
        if not is_tuner_layer(layer):
            continue
        base = layer.get_base_layer()
        spec = grid.placed[base]
        for factors in (layer.lora_A, layer.lora_B):
            for linear in factors.values():
                weight = linear.weight
                linear.weight = nn.Parameter(distribute_tensor(weight.data, grid.mesh, [Replicate()] * grid.mesh.ndim),
                                             requires_grad=weight.requires_grad)
        grid.updates[base] = functools.partial(_update, layer, grid, spec)
        layer.forward = functools.partial(_base_output, layer)


def _base_output(layer: nn.Module, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return layer.get_base_layer()(x, *args, **kwargs)


def _update(layer: nn.Module, grid: Grid, spec: WeightSpec) -> torch.Tensor | None:
    """This rank's piece of the active adapters' ``s·B·A`` (None while adapters are off or merged)."""
    if layer.disable_adapters or layer.merged:
        return None
    (out_start, out_size), (in_start, in_size) = grid.piece_bounds(spec, layer.get_base_layer().weight.shape)
    total = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a = _summed_over_pieces(layer.lora_A[adapter].weight.to_local(), grid, spec)
        b = _summed_over_pieces(layer.lora_B[adapter].weight.to_local(), grid, spec)
        piece = b.narrow(0, out_start, out_size) @ a.narrow(1, in_start, in_size) * layer.scaling[adapter]
        total = piece if total is None else total + piece
    return total


def _summed_over_pieces(factor: torch.Tensor, grid: Grid, spec: WeightSpec) -> torch.Tensor:
    """`factor` as used for this rank's piece; backward sums its gradient over the ranks holding
    the other pieces."""
    for name in spec.shards:
        if grid.sizes[name] > 1:
            factor = sum_grad_over(factor, grid.groups[name])
    return factor
