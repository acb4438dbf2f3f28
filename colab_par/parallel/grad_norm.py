"""The total gradient norm over every shard (dp/tp/pp), a kind of sharding at a time, counting the
gradients memory tiers hold (on disk) from sums of squares read a chunk at a time, never all at
once, so that clipping keeps a rank under its memory budget.

Each kind (device mesh and placements; plain tensors are one kind) sums its local squares in
float64; that sum becomes the one element of a stand-in DTensor sharded over the same mesh
dimensions (any sharding, FSDP's strided one included; partial gradients are reduced first),
whose norm DTensor reduces over exactly the dimensions the kind is sharded on and not over those
it is replicated on: one collective per kind on every rank, whichever of its gradients a
rank's tiers happen to hold.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["total_gradient_norm"]


def total_gradient_norm(grads: list[tuple[nn.Parameter, "torch.Tensor | None"]], held: Mapping[int, float],
                        device: torch.device, pp_group: Any = None) -> float:
    """The 2-norm of all gradients. `grads`: (parameter, its gradient, or None where `held` has
    the sum of squares of this rank's piece of it); `pp_group`: where pipeline stages add theirs."""
    kinds: dict[Any, torch.Tensor] = {}
    for param, grad in grads:
        source = param if grad is None else grad
        key = (source.device_mesh, source.placements) if isinstance(source, DTensor) else None
        if grad is None:
            squares = torch.tensor(held[id(param)], dtype=torch.float64, device=device)
        else:
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p
                                                            for p in grad.placements])
                key = (grad.device_mesh, grad.placements)
            piece = grad.to_local() if isinstance(grad, DTensor) else grad
            squares = torch.linalg.vector_norm(piece).double() ** 2  # in the gradient's own dtype
        kinds[key] = kinds[key] + squares if key in kinds else squares
    total = torch.zeros((), dtype=torch.float64, device=device)
    for key, squares in kinds.items():
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
    return total.sqrt().item()
