"""What one rank holds of each parameter, read from the real tensors (runs on the engines).

A DTensor parameter (tensor parallel, FSDP2's dim-0 shards over dp, the tensor grid's 2–3 mesh
dims) holds the block its placements give this rank's mesh coordinates; a plain parameter is held
whole; a parameter of another pipeline stage is not held at all. Names are the model's own: the
wrappers DDP and activation checkpointing put around modules are taken out.
"""
from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from colab_par import compat
from colab_par.parallel.memory import memory_report
from colab_par.parallel.pipeline import stage_ids

__all__ = ["describe_rank"]


def describe_rank(pm: Any) -> dict[str, Any]:
    """This rank's part of the shard map: per parameter its global shape, the block this rank
    holds (offsets, sizes), its placements and stage; and this rank's optimizer-state and gradient
    bytes (`memory_report`)."""
    stages = stage_ids(pm.layout, pm.pp_rank) if pm.layout.pp > 1 else [None]
    params, storages = [], {}
    seen: set[int] = set()
    for stage, part in zip(stages, pm.model_parts):
        module = part.module if isinstance(part, DistributedDataParallel) else part
        for name, param in _named_parameters(module):
            if id(param) in seen:
                continue
            seen.add(id(param))
            local = param.to_local() if isinstance(param, DTensor) else param.detach()
            storages[compat.storage_key(local)] = local.untyped_storage().nbytes()
            params.append({"name": name, "shape": list(param.shape), "dtype": str(param.dtype).removeprefix("torch."),
                           "itemsize": param.element_size(), "offsets": list(_offsets(param)),
                           "sizes": list(local.shape), "placement": _placement(param), "stage": stage,
                           "trainable": param.requires_grad, "device": local.device.type})
    memory = memory_report(pm)
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "host": socket.gethostname(),
            "layout": str(pm.layout), "coords": {"pp": pm.pp_rank, "dp": pm.dp_rank, "cp": pm.cp_rank,
                                                 "tp": pm.tp_rank},
            "params": params, "storage_bytes": sum(storages.values()),
            "grad_bytes": memory["grads"] + memory["host_grads"],
            "optimizer_bytes": memory["optimizer"] + memory["host_optimizer"],
            "tied": {name: names for name, names in pm.tied_names.items() if len(names) > 1}}


def _named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(compat.unwrapped_name(name), param) for name, param in module.named_parameters()]


def _offsets(param: torch.Tensor) -> tuple[int, ...]:
    if isinstance(param, DTensor):
        return compat.local_shard_offsets(param.shape, param.device_mesh, param.placements)
    return (0,) * param.dim()


def _placement(param: torch.Tensor) -> str:
    """"dp:S(0)" style, one entry per mesh dim; "whole" for a plain tensor."""
    if not isinstance(param, DTensor):
        return "whole"
    names = param.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(param.device_mesh.ndim))
    return " ".join(f"{name}:{_short(p)}" for name, p in zip(names, param.placements))


def _short(placement: Any) -> str:
    if isinstance(placement, Shard):  # _StridedShard too: its pieces are still dim `dim` blocks
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    return str(placement)
