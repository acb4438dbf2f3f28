"""ZeRO stage 1 under memory tiers: which data-parallel rank keeps (and tiers) the optimizer state
of each parameter, and how the parameters it updated reach the other ranks.

Under zero1 every rank holds the full parameters and, after DDP's all-reduce, the full averaged
gradients; the AdamW state (moments, and a float32 master where the parameters are not float32)
of a parameter lives on its owner only, so each rank's chunks, tiers and disk files hold about
1/dp of it. After the owners updated their parameters, each broadcasts them to the group in
flat buckets of at most `bucket_bytes` (one transient bucket, not a second copy of the model).

The partition is over whole parameters, largest first onto the rank with the fewest bytes so far
(ties: the lower rank), as torch's ZeroRedundancyOptimizer partitions: every rank computes the
same one from the parameters' order and sizes, with no communication.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from colab_par.memory_tiers.chunks import local

__all__ = ["owners_by_bytes", "Ownership"]


def owners_by_bytes(sizes: Sequence[int], ranks: int) -> list[int]:
    """The owning rank of each item of `sizes` (bytes): largest first onto the least-loaded rank."""
    loads = [0] * ranks
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


class Ownership:
    """This rank's share of `params` (in optimizer order) over the data-parallel `group`, and the
    broadcast that gives every rank the parameters their owners updated (`share`)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int):
        self.group = group
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        sizes = [local(p).numel() * local(p).element_size() for p in params]
        owners = owners_by_bytes(sizes, self.ranks)
        idle = sorted(set(range(self.ranks)) - set(owners))
        if idle:
            raise ValueError(f"zero1 with memory tiers gives each of the {self.ranks} data-parallel ranks whole "
                             f"parameters to update, and this model has only {len(params)} trainable "
                             f"parameter(s), so rank(s) {idle} would own none: use fewer dp ranks, zero2/zero3, "
                             "or drop the tiers tokens")
        self.owned = {id(p) for p, owner in zip(params, owners) if owner == self.rank}
        self.bytes = [sum(size for size, owner in zip(sizes, owners) if owner == rank) for rank in range(self.ranks)]
        self._buckets = _buckets(params, owners, sizes, self.ranks, bucket_bytes)

    def owns(self, param: nn.Parameter) -> bool:
        return id(param) in self.owned

    @torch.no_grad()
    def share(self) -> None:
        """Each owner's parameters to every rank of the group, bucket by bucket (same order on all)."""
        if self.ranks == 1:
            return
        for owner, bucket in self._buckets:
            pieces = [local(p) for p in bucket]
            if owner == self.rank:
                flat = torch.cat([piece.reshape(-1) for piece in pieces])
            else:
                flat = torch.empty(sum(piece.numel() for piece in pieces), dtype=pieces[0].dtype,
                                   device=pieces[0].device)
            dist.broadcast(flat, group=self.group, group_src=owner)
            if owner != self.rank:
                for piece, values in zip(pieces, flat.split([piece.numel() for piece in pieces])):
                    piece.copy_(values.view_as(piece))


def _buckets(params: list[nn.Parameter], owners: list[int], sizes: list[int], ranks: int,
             bucket_bytes: int) -> list[tuple[int, list[nn.Parameter]]]:
    """(owner, parameters of one dtype and device) runs of at most `bucket_bytes` (a larger
    parameter alone), owner by owner in parameter order."""
    out: list[tuple[int, list[nn.Parameter]]] = []
    for owner in range(ranks):
        filling: dict[tuple, tuple[list[nn.Parameter], int]] = {}  # (dtype, device) -> (bucket, bytes)
        for p, size, of in zip(params, sizes, owners):
            if of != owner:
                continue
            key = (local(p).dtype, local(p).device)
            bucket, held = filling.get(key, (None, 0))
            if bucket is None or held + size > bucket_bytes:
                bucket, held = [], 0
                out.append((owner, bucket))
            bucket.append(p)
            filling[key] = (bucket, held + size)
    return out
