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

from colab_par.compat import flatten_mesh, forget_dtensor_plans, unflatten_mesh
from colab_par.layout import Layout, tensor_grid

__all__ = ["MESH_DIMS", "GRID_DIMS", "build_mesh", "build_grid_mesh", "build_expert_mesh",
           "broadcast_from_rank0",
           "default_device"]

MESH_DIMS = ("pp", "dp", "cp", "tp")
# The tp dim of a multi-dimensional tensor-parallel layout, arranged as its grid (outermost first).
GRID_DIMS = {"2d": ("row", "col"), "2.5d": ("depth", "row", "col"), "3d": ("x", "y", "z")}


def default_device() -> torch.device:
    """This rank's GPU (the cluster bound it) when its world runs on nccl, else the CPU: a gloo world
    computes on the CPU also on a GPU host (`colab_par.cluster.backend`). Outside a world: the current GPU
    if there is one."""
    world_on_gpus = "nccl" in dist.get_backend() if dist.is_initialized() else torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if world_on_gpus else torch.device("cpu")


# Meshes built in the current world, by (device type, shape). Every DeviceMesh opens a process
# group per dim (a gloo group is three threads and its sockets) that lives as long as the world,
# so a session that parallelizes again and again reuses them instead of growing without bound.
_MESHES: dict[tuple[str, tuple[int, ...]], tuple[DeviceMesh, DeviceMesh]] = {}
_GRIDS: dict[tuple, DeviceMesh] = {}
_MESHES_WORLD: list[object] = [None]  # the default group they were built in


def build_mesh(layout: Layout, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """A (pp, dp, cp, tp) mesh over the whole world, and its flattened 1-D "dp_cp" gradient mesh
    (kept by the caller: torch deprecates slicing flattened dims back out of the root mesh).
    Built once per shape in a world (see `_MESHES`); a re-initialised world builds anew."""
    if _MESHES_WORLD[0] is not dist.group.WORLD:
        _MESHES.clear()
        _GRIDS.clear()
        forget_dtensor_plans()  # cached plans would hand new DTensors the old world's meshes
        _MESHES_WORLD[0] = dist.group.WORLD
    shape = tuple(getattr(layout, name) for name in MESH_DIMS)
    key = (device.type, shape)
    if key not in _MESHES:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
        _MESHES[key] = (mesh, flatten_mesh(mesh["dp", "cp"], "dp_cp"))
    return _MESHES[key]


def build_grid_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The tp ranks of `build_mesh` as the layout's tensor grid: a mesh of the `GRID_DIMS` of its
    tp_mode, sliced from the same root (so FSDP over dp composes with it), built once per world."""
    grid = tensor_grid(layout.tp, layout.tp_mode, layout.tp_depth)
    if grid is None:
        raise ValueError(f"layout {layout} has no tensor grid (tp_mode='1d')")
    q, depth = grid
    names = GRID_DIMS[layout.tp_mode]
    sizes = (depth, q, q) if layout.tp_mode == "2.5d" else (q,) * len(names)
    mesh, _ = build_mesh(layout, device)
    key = (device.type, tuple(getattr(layout, name) for name in MESH_DIMS), layout.tp_mode, depth)
    if key not in _GRIDS:
        _GRIDS[key] = unflatten_mesh(mesh, "tp", sizes, names)[names]
    return _GRIDS[key]


def build_expert_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The dp ranks of `build_mesh` as an ("edp", "ep") mesh: neighbouring dp ranks form an ep group
    (they split the experts); ranks at the same place of different ep groups ("edp") hold the same
    experts. Sliced from the same root, so FSDP over edp composes with experts sharded over ep."""
    mesh, _ = build_mesh(layout, device)
    key = (device.type, tuple(getattr(layout, name) for name in MESH_DIMS), "ep", layout.ep)
    if key not in _GRIDS:
        _GRIDS[key] = unflatten_mesh(mesh, "dp", (layout.dp // layout.ep, layout.ep), ("edp", "ep"))
    return _GRIDS[key]


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Copy global rank 0's parameters and buffers to every rank (ranks need not share a seed).

    One tensor at a time in its own dtype: the extra memory is one tensor's worth on no rank.
    """
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.numel():
            dist.broadcast(tensor.data, src=0)
