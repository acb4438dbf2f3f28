"""The total gradient norm over every shard (dp/tp/pp), a kind of sharding at a time, counting the
gradients memory tiers hold (on disk) from sums of squares read a chunk at a time, never all at
once, so that clipping keeps a rank under its memory budget.

Each kind (device mesh and placements; plain tensors are one kind) sums its local squares in
float64; that sum becomes the one element of a stand-in DTensor sharded over the same mesh
dimensions (any sharding, FSDP's strided one included; partial gradients are reduced first),
whose norm DTensor reduces over exactly the dimensions the kind is sharded on and not over those
it is replicated on: one collective per kind on every rank, whichever of its gradients a
rank's tiers happen to hold. Plain gradients every rank of a group holds alike (DDP's) are
split over that group: each rank reads its share and one all-reduce adds them, so no replica
reads the whole model.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["total_gradient_norm"]


def total_gradient_norm(grads: list[tuple[nn.Parameter, "torch.Tensor | None"]], held: Mapping[int, float],
                        device: torch.device, pp_group: Any = None, replicas: Any = None) -> torch.Tensor:
    """The 2-norm of all gradients, a float64 scalar on `device` (not read: the caller reads it
    where it needs the value). `grads`: (parameter, its gradient, or None where `held` has
    the sum of squares of this rank's piece of it); `pp_group`: where pipeline stages add theirs;
    `replicas`: a group whose ranks all hold the same plain gradients."""
    pieces: dict[Any, list[torch.Tensor]] = {}  # each kind's local gradients
    held_squares: dict[Any, float] = {}  # each kind's sums of squares memory tiers counted
    order: dict[Any, None] = {}  # kinds in parameter order, the same on every rank: collectives match
    for param, grad in grads:
        if grad is None:
            key = _kind(param)
            held_squares[key] = held_squares.get(key, 0.0) + held[id(param)]
        else:
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p
                                                            for p in grad.placements])
            key = _kind(grad)
            pieces.setdefault(key, []).append(grad.to_local() if isinstance(grad, DTensor) else grad)
        order.setdefault(key)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for key in order:
        shared = key is None and replicas is not None and dist.get_world_size(replicas) > 1
        mine = _share(pieces.get(key, []), replicas) if shared else pieces.get(key, [])
        squares = torch.tensor(held_squares.get(key, 0.0), dtype=torch.float64, device=device)
        if shared:
            squares /= dist.get_world_size(replicas)  # every replica counted the same held squares
        if mine:  # torch's foreach norms, in the gradients' own dtype, squared in float64
            squares += torch.nn.utils.get_total_norm(mine).double() ** 2
        if shared:
            dist.all_reduce(squares, group=replicas)
        if key is None:
            total += squares
            continue
        mesh, placements = key
        stand_in = DTensor.from_local(squares.sqrt().reshape(1), mesh,
                                      [Replicate() if p.is_replicate() else Shard(0) for p in placements],
                                      run_check=False)
        total += torch.linalg.vector_norm(stand_in).full_tensor() ** 2
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def _kind(tensor: torch.Tensor) -> Any:
    """What decides how a tensor's local squares combine across ranks: its mesh and placements."""
    return (tensor.device_mesh, tensor.placements) if isinstance(tensor, DTensor) else None


def _share(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """This rank's contiguous run of `tensors`, the runs about equal in elements over `group`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    total = sum(t.numel() for t in tensors)
    start, mine = 0, []
    for tensor in tensors:
        if start * size // max(total, 1) == rank:  # the share the tensor's first element falls in
            mine.append(tensor)
        start += tensor.numel()
    return mine
