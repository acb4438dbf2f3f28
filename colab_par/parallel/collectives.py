"""Collectives with the backward their forward implies, for layers that move activations by hand.

Each forward collective is paired with its adjoint: an all-gather's gradient is a reduce-scatter
(every rank used every piece, so the pieces' gradients are summed where they live), a
reduce-scatter's is an all-gather, an all-reduce's is an all-reduce. `gather_replicas` is the one
exception: its callers compute the same loss from the same gathered tensor on every rank, so each
rank's gradient of its piece is already whole and is just sliced out.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["Split", "SumGradOverGroup", "all_gather", "reduce_scatter", "gather", "scatter_sum",
           "gather_replicas", "all_reduce_sum"]

Split = tuple[dist.ProcessGroup, int]  # a group and the tensor dim its ranks' pieces lie along


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """The group's pieces concatenated along `dim`, in group-rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()  # a strided view would leak its layout downstream


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """The sum over the group, of which this rank keeps its piece along `dim`."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def gather_all(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """All-gather along each split in turn (innermost split first)."""
    for group, dim in splits:
        tensor = all_gather(tensor, group, dim)
    return tensor


def reduce_scatter_all(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """The adjoint of `gather_all`: reduce-scatter along each split, in reverse order."""
    for group, dim in reversed(splits):
        tensor = reduce_scatter(tensor, group, dim)
    return tensor


class _Adjoint(torch.autograd.Function):
    """`forward(tensor, splits)` forward and `backward(grad, splits)` backward: a collective and
    its adjoint."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: tuple[Split, ...], forward: Any,
                backward: Any) -> torch.Tensor:
        ctx.splits, ctx.adjoint = splits, backward
        return forward(tensor, splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.adjoint(grad, ctx.splits), None, None, None


def _own_piece(grad: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    for group, dim in reversed(splits):
        grad = grad.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)]
    return grad.contiguous()


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (each rank saw part of the data)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()  # autograd may still read the incoming buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """All-gather along `splits`; backward reduce-scatters (sums the pieces' gradients)."""
    return _Adjoint.apply(tensor, tuple(splits), gather_all, reduce_scatter_all) if splits else tensor


def scatter_sum(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """Reduce-scatter along `splits`; backward all-gathers."""
    return _Adjoint.apply(tensor, tuple(splits), reduce_scatter_all, gather_all) if splits else tensor


def gather_replicas(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """All-gather along `splits` for a computation every rank then repeats identically (a loss);
    backward keeps this rank's piece of the gradient."""
    return _Adjoint.apply(tensor, tuple(splits), gather_all, _own_piece) if splits else tensor


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over `group`, differentiable (backward sums the gradients too)."""
    return _AllReduceSum.apply(tensor, group)
