"""Give a meta-device model real storage holding only this rank's shards, and fill them.

Runs after tensor parallel, pipeline splitting and FSDP were applied on the meta device, so
`to_empty` allocates exactly what this rank keeps. Each parameter or buffer is then filled one at a
time: from a checkpoint (`WeightSource`, e.g. Hugging Face safetensors, read block by block) where
it has the tensor, else from the recorded init (`init_record.py`), whose full tensor lives only
while its shard is copied out. No rank ever holds more than its shards plus one full tensor.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from colab_par.compat import local_shard_offsets, unwrapped_name
from colab_par.memory_tiers.host_heap import trim_host_heap
from colab_par.parallel.init_record import InitRecord, named_state, retie, tie_groups

__all__ = ["WeightSource", "materialize", "broadcast_rng_state", "is_meta_model"]


class WeightSource(Protocol):
    """Tensors by state-dict name, readable in blocks (one slice per dim)."""

    def __contains__(self, name: str) -> bool: ...

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor: ...


def is_meta_model(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def broadcast_rng_state(device: torch.device) -> None:
    """Every rank takes global rank 0's CPU generator state, so all record the same init (the
    one rank 0 would build alone)."""
    state = torch.get_rng_state().to(device)
    dist.broadcast(state, src=0)
    torch.set_rng_state(state.cpu())


@torch.no_grad()
def materialize(part: nn.Module, record: InitRecord, device: torch.device,
                weights: WeightSource | None = None) -> None:
    """Allocate `part`'s local shards on `device` and fill them (see the module docstring)."""
    ties = tie_groups(part)
    part.to_empty(device=device)
    retie(part, ties)  # to_empty gives each module its own new tensor, splitting tied weights
    filled: set[int] = set()
    for name, tensor in named_state(part):
        if id(tensor) in filled:
            continue  # a tied tensor under its second name
        filled.add(id(tensor))
        original = unwrapped_name(name)
        aliases = record.aliases(original)
        source = next((alias for alias in aliases if weights is not None and alias in weights), None)
        if source is not None:
            _fill(tensor, lambda index: weights.read(source, index))
        else:
            _fill(tensor, lambda index: _block(record.value(original), index))
        trim_host_heap()


def _block(full: torch.Tensor, index: tuple[slice, ...] | None) -> torch.Tensor:
    return full if index is None else full[index]


def _fill(tensor: torch.Tensor, read: Any) -> None:
    """Copy this rank's block of the named tensor into `tensor` (a DTensor shard or a whole one)."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(read(None).to(tensor.dtype))
        return
    local = tensor.to_local()
    if all(isinstance(p, (Shard, Replicate)) for p in tensor.placements):
        offsets = local_shard_offsets(tensor.shape, tensor.device_mesh, tensor.placements)
        index = tuple(slice(start, start + size) for start, size in zip(offsets, local.shape))
        local.copy_(read(index).to(local.dtype))
        return
    # Placements with no block form (FSDP's strided shard over a TP shard): slice the full tensor.
    full = read(None).to(device=local.device, dtype=local.dtype)
    local.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local())
