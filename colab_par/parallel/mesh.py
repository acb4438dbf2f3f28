"""The DeviceMesh for a Layout, and the broadcast that makes every rank start from rank 0's model.

All four dims ("pp", "dp", "cp", "tp", outermost first) are always present, size 1 included, so
callers can ask ``mesh["dp"]`` without caring which degrees are on; gradients of context-parallel
ranks are averaged together with data-parallel ones, so a flattened "dp_cp" mesh comes with it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from colab_par.compat import flatten_mesh
from colab_par.layout import Layout

__all__ = ["MESH_DIMS", "build_mesh", "broadcast_from_rank0", "default_device"]

MESH_DIMS = ("pp", "dp", "cp", "tp")


def default_device() -> torch.device:
    """This rank's accelerator if it has one (the cluster bound it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Meshes built in the current world, by (device type, shape). Every DeviceMesh opens a process
# group per dim (a gloo group is three threads and its sockets) that lives as long as the world,
# so a session that parallelizes again and again reuses them instead of growing without bound.
_MESHES: dict[tuple[str, tuple[int, ...]], tuple[DeviceMesh, DeviceMesh]] = {}
_MESHES_WORLD: list[object] = [None]  # the default group they were built in


def build_mesh(layout: Layout, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """A (pp, dp, cp, tp) mesh over the whole world, and its flattened 1-D "dp_cp" gradient mesh
    (kept by the caller: torch deprecates slicing flattened dims back out of the root mesh).
    Built once per shape in a world (see `_MESHES`); a re-initialised world builds anew."""
    if _MESHES_WORLD[0] is not dist.group.WORLD:
        _MESHES.clear()
        _MESHES_WORLD[0] = dist.group.WORLD
    shape = tuple(getattr(layout, name) for name in MESH_DIMS)
    key = (device.type, shape)
    if key not in _MESHES:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
        _MESHES[key] = (mesh, flatten_mesh(mesh["dp", "cp"], "dp_cp"))
    return _MESHES[key]


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Copy global rank 0's parameters and buffers to every rank (ranks need not share a seed).

    One tensor at a time in its own dtype: the extra memory is one tensor's worth on no rank.
    """
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.numel():
            dist.broadcast(tensor.data, src=0)
