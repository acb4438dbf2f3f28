"""Which mesh dimension each collective of a step ran on, with its calls and payload bytes.

The payload rule is the kit's own (`CollectiveBytes`: an all-reduce's tensor, an all-gather's
output, a reduce-scatter's input); this adds the process group each op names, read from its
arguments (a ProcessGroup object for the in-place c10d ops, a group name for the functional ones
DTensor issues), and the mesh dimension that group belongs to.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from colab_par.parallel.collective_bytes import CollectiveBytes
from colab_par.parallel.mesh import MESH_DIMS
from colab_par.planning.dry_run.report import CollectiveCount

__all__ = ["CollectivesByDim", "mesh_group_names"]


def mesh_group_names(mesh: Any, flat_meshes: dict[str, Any]) -> dict[str, str]:
    """{process group name: mesh dimension}: each dimension of the (pp, dp, cp, tp) mesh, then
    flattened ones (e.g. "dp_cp") for groups no single dimension owns, then "world" for the
    whole world's group where no dimension spans it (a dimension that does shares its group)."""
    names: dict[str, str] = {}
    for dim in MESH_DIMS:
        names.setdefault(mesh[dim].get_group().group_name, dim)
    for dim, flat in flat_meshes.items():
        names.setdefault(flat.get_group().group_name, dim)
    names.setdefault(dist.group.WORLD.group_name, "world")
    return names


class CollectivesByDim(CollectiveBytes):
    """``with CollectivesByDim(group_dims) as seen: ...``; then ``seen.rows()``."""

    def __init__(self, group_dims: dict[str, str]) -> None:
        super().__init__()
        self.group_dims = group_dims
        self.calls: dict[tuple[str, str], list[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = self.bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.bytes != before:
            dim = self.group_dims.get(self._group_of(args), "other")
            row = self.calls.setdefault((dim, f"{func.namespace}.{func.__name__.split('.')[0]}"), [0, 0])
            row[0] += 1
            row[1] += self.bytes - before
        return out

    def _group_of(self, args: tuple) -> str:
        for arg in args:
            if isinstance(arg, torch.ScriptObject):
                return dist.ProcessGroup.unbox(arg).group_name
            if isinstance(arg, str) and arg in self.group_dims:
                return arg
        return "?"

    def rows(self) -> tuple[CollectiveCount, ...]:
        return tuple(CollectiveCount(dim, op, calls, size)
                     for (dim, op), (calls, size) in sorted(self.calls.items()))
