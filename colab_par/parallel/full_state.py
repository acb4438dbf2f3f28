"""The full state dict of a `ParallelModel` on global rank 0, gathered without holding more than one
whole tensor on any device (torch's full state dict gathers them all there first)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.parallel.mesh import default_device

__all__ = ["gather_full_state"]


def gather_full_state(parts: list[nn.Module], pp: int, first_of_stage: bool,
                      tied_names: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Unsharded parameters (original FQNs, on the CPU) on global rank 0; {} elsewhere. Each tensor
    goes to the CPU as soon as it is gathered. With pipeline stages, each stage's first rank
    (`first_of_stage`) sends its tensors to rank 0 one by one over the world's backend (pickled
    objects would travel as one device buffer per rank); `tied_names` is `ParallelModel.tied_names`."""
    keeps = dist.get_rank() == 0 if pp == 1 else first_of_stage
    mine: dict[str, torch.Tensor] = {}
    for part in parts:  # sharded: the names resolved, nothing gathered yet
        for name, value in get_model_state_dict(part, options=StateDictOptions()).items():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            if keeps:
                mine[name] = whole.detach().to("cpu", copy=True)
            del whole
    if pp == 1:
        return mine
    state = _to_rank0(mine if first_of_stage else {})
    if state is None:
        return {}
    if not tied_names:
        return state
    # Stages traced by pipeline() hold a tied tensor under one of its names and turn buffers
    # into their own: give back exactly the model's names, each tied name its tensor.
    return {name: next(state[alias] for alias in aliases if alias in state)
            for name, aliases in tied_names.items()}


def _to_rank0(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every rank's `tensors` (CPU) in global rank 0's CPU memory, None elsewhere: names, shapes and
    dtypes as small objects, then each tensor point to point through one device buffer at a time."""
    device = default_device()
    metadata = {name: (tensor.shape, tensor.dtype) for name, tensor in tensors.items()}
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(metadata, gathered, dst=0)
    if dist.get_rank() != 0:
        for tensor in tensors.values():  # in the order of the names just gathered
            dist.send(tensor.to(device).contiguous(), dst=0)
        return None
    state = dict(tensors)
    for sender, names in enumerate(gathered[1:], start=1):
        for name, (shape, dtype) in names.items():
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=sender)
            state[name] = buffer.cpu()
    return state
