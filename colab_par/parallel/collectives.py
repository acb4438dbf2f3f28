"""Collectives with the backward their forward implies, for layers that move activations by hand.

Each forward collective is paired with its adjoint: an all-gather's gradient is a reduce-scatter
(every rank used every piece, so the pieces' gradients are summed where they live), a
reduce-scatter's is an all-gather, an all-reduce's is an all-reduce, an identity whose ranks saw
different data has a summing all-reduce (`sum_grad_over`). `gather_replicas` is the one
exception: its callers compute the same loss from the same gathered tensor on every rank, so each
rank's gradient of its piece is already whole and is just sliced out.

Pieces are DTensor's: a dim of size n split k ways gives ranks ceil(n/k) each until n runs out, so
a vocabulary k does not divide has uneven pieces. A split that may be uneven names the full size
(`Split`'s third element); its collectives pad every piece to ceil(n/k) and trim after, so even
splits move exactly what they did.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["Split", "piece_sizes", "all_gather", "reduce_scatter", "gather", "gather_replicas", "all_reduce_sum",
           "sum_grad_over", "sum_replicas", "regroup_blocks"]

# A group and the tensor dim its ranks' pieces lie along; a third element, the full size along that
# dim, marks a split whose pieces may be uneven.
Split = tuple[dist.ProcessGroup, int] | tuple[dist.ProcessGroup, int, int]


def piece_sizes(full: int, parts: int) -> list[int]:
    """The sizes of DTensor's `parts` pieces of a dim of size `full` (torch.chunk's, empty ones kept)."""
    step = -(-full // parts)
    return [max(0, min(step, full - i * step)) for i in range(parts)]


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int, full: int | None = None) -> torch.Tensor:
    """The group's pieces concatenated along `dim`, in group-rank order (`full`: their total size
    along `dim`, for pieces that may be uneven)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    sizes = piece_sizes(full, size) if full is not None else [tensor.shape[dim]] * size
    moved = _padded(tensor.movedim(dim, 0), max(sizes)).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    if len(set(sizes)) > 1:
        out = torch.cat([piece[:n] for piece, n in zip(out.chunk(size), sizes)])
    return out.movedim(0, dim).contiguous()  # a strided view would leak its layout downstream


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int, full: int | None = None) -> torch.Tensor:
    """The sum over the group, of which this rank keeps its piece along `dim` (`full`: the size
    along `dim`, for pieces that may be uneven)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    moved = tensor.movedim(dim, 0)
    sizes = piece_sizes(full, size) if full is not None else [moved.shape[0] // size] * size
    if len(set(sizes)) > 1:
        moved = torch.cat([_padded(piece, max(sizes)) for piece in moved.split(sizes)])
    moved = moved.contiguous()
    out = moved.new_empty((max(sizes), *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out[:sizes[dist.get_rank(group)]].movedim(0, dim).contiguous()


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended along dim 0 up to `rows`."""
    missing = rows - tensor.shape[0]
    return tensor if missing == 0 else torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])


def gather_all(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """All-gather along each split in turn (innermost split first)."""
    for split in splits:
        tensor = all_gather(tensor, *split)
    return tensor


def reduce_scatter_all(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """The adjoint of `gather_all`: reduce-scatter along each split, in reverse order."""
    for split in reversed(splits):
        tensor = reduce_scatter(tensor, *split)
    return tensor


class _Adjoint(torch.autograd.Function):
    """`forward(tensor, over)` forward and `backward(grad, over)` backward: a collective and its
    adjoint, over splits or a group."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, over: Any, forward: Any, backward: Any) -> torch.Tensor:
        ctx.over, ctx.adjoint = over, backward
        return forward(tensor, over)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.adjoint(grad, ctx.over), None, None, None


def _own_piece(grad: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    for group, dim, *_ in reversed(splits):
        sizes = piece_sizes(grad.shape[dim], dist.get_world_size(group))
        rank = dist.get_rank(group)
        grad = grad.narrow(dim, sum(sizes[:rank]), sizes[rank])
    return grad.contiguous()


def _summed(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tensor = tensor.clone()  # autograd may still read the incoming buffer
    dist.all_reduce(tensor, group=group)
    return tensor


def _same(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return tensor.view_as(tensor)


def gather(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """All-gather along `splits`; backward reduce-scatters (sums the pieces' gradients)."""
    return _Adjoint.apply(tensor, tuple(splits), gather_all, reduce_scatter_all) if splits else tensor


def gather_replicas(tensor: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """All-gather along `splits` for a computation every rank then repeats identically (a loss);
    backward keeps this rank's piece of the gradient."""
    return _Adjoint.apply(tensor, tuple(splits), gather_all, _own_piece) if splits else tensor


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over `group`, differentiable (backward sums the gradients too)."""
    return _Adjoint.apply(tensor, group, _summed, _summed)


def sum_grad_over(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward; backward sums the gradient over `group` (each rank saw part of the data)."""
    return _Adjoint.apply(tensor, group, _same, _summed)


def sum_replicas(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over `group` for a computation every rank then repeats identically (a row-split layer's
    partial products): backward passes the gradient through, each rank's being already whole."""
    return _Adjoint.apply(tensor, group, _summed, _same)


def regroup_blocks(tensor: torch.Tensor, group: dist.ProcessGroup, parts: int, dim: int) -> torch.Tensor:
    """A dim made of `parts` equal blocks side by side (GPT-2's fused q|k|v columns), split in
    contiguous equal pieces over `group`: this rank's piece in, its piece of every block out, side
    by side (rank r gets the r-th piece of q, of k and of v). One all-to-all; backward, the inverse."""
    if dist.get_world_size(group) == 1:
        return tensor
    return _Adjoint.apply(tensor, (group, parts, dim), _regrouped, _ungrouped)


def _regroup_plan(size: int, group: dist.ProcessGroup, parts: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """For a local piece of `size` rows: the local rows to send (grouped by destination), how many
    go to each rank, and how many come from each rank."""
    rows, send, recv = _regroup_rows(size, dist.get_world_size(group), dist.get_rank(group), parts)
    return torch.tensor(rows, dtype=torch.long), list(send), list(recv)


@functools.lru_cache(maxsize=None)
def _regroup_rows(size: int, ranks: int, rank: int, parts: int) -> tuple[tuple[int, ...], ...]:
    block = size * ranks // parts
    piece = block // ranks
    wanted = [[part * block + dest * piece + i for part in range(parts) for i in range(piece)]
              for dest in range(ranks)]  # global rows of each rank's pieces, in order
    mine = range(rank * size, (rank + 1) * size)
    send = [[row - mine.start for row in rows if row in mine] for rows in wanted]
    recv = [sum(source * size <= row < (source + 1) * size for row in wanted[rank]) for source in range(ranks)]
    return tuple(row for rows in send for row in rows), tuple(map(len, send)), tuple(recv)


def _regrouped(tensor: torch.Tensor, over: tuple) -> torch.Tensor:
    group, parts, dim = over
    moved = tensor.movedim(dim, 0)
    rows, send, recv = _regroup_plan(moved.shape[0], group, parts)
    out = moved.new_empty((sum(recv), *moved.shape[1:]))
    dist.all_to_all_single(out, moved.index_select(0, rows.to(moved.device)).contiguous(), recv, send, group=group)
    return out.movedim(0, dim).contiguous()


def _ungrouped(grad: torch.Tensor, over: tuple) -> torch.Tensor:
    group, parts, dim = over
    moved = grad.movedim(dim, 0).contiguous()
    rows, send, recv = _regroup_plan(moved.shape[0], group, parts)  # a regrouped piece has the same size
    back = moved.new_empty((sum(send), *moved.shape[1:]))
    dist.all_to_all_single(back, moved, send, recv, group=group)
    return moved.new_zeros(moved.shape).index_copy_(0, rows.to(moved.device), back).movedim(0, dim).contiguous()
