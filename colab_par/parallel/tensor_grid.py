"""Multi-dimensional tensor parallelism (Colossal-AI's 2D, 2.5D and 3D) for the kit's GPT.

The tp ranks form a grid (`mesh.GRID_DIMS`). Unlike 1D (Megatron), the activations are
partitioned too: each rank holds a batch piece × a hidden piece of every activation.
- **2D** (Optimus, q×q, dims row/col): activations split by batch over rows and by hidden over
  columns; a weight [out, in] split by in over rows and by out over columns. A linear gathers its
  input along the row (the whole hidden) and its weight along the column (the whole in dim), and
  multiplies: the output is split like its input. These all-gathers move what SUMMA's q broadcasts
  move; their adjoints in backward are reduce-scatters.
- **2.5D** (Tesseract, q×q×d): 2D in each of d depth layers, the batch split over the depths too;
  weights are replicated over depth and their gradients summed over it.
- **3D** (Bian et al., q×q×q, dims x/y/z): two activation layouts alternate. Layout A (between
  blocks) splits batch over x·y and hidden over z; layout B (inside attention / FFN) splits batch
  over x·z and heads / FFN columns over y. A linear gathers its input's batch over one side and its
  weight over x, multiplies, and reduce-scatters the partial sums over the third side: q/k/v, gate
  and up map A -> B, the output projections B -> A. Layout A's hidden piece on z is the chunks
  x·q + z of q² (each of the q x-ranks stores one), so that weights are DTensors with plain Shard
  placements.
Every parameter is a DTensor on the grid mesh with exactly the placements its pieces have, so
checkpoints (DCP) relayout to and from 1d and the optimizer and clipping see ordinary DTensors; the
layers themselves run on the local pieces with the collectives of `collectives.py`. A linear keeps
only its local input and weight pieces for backward and gathers them again there (as SUMMA does),
so activation memory stays partitioned. Norm statistics are summed over the hidden split; the
head's logits are gathered whole (like the 1d plan) so any loss function scores them unchanged.
A vocabulary the grid side does not divide is split unevenly, as DTensor shards it; the embedding
table and the logits are gathered from those pieces (`collectives.py` pads and trims them).
A layer peft wrapped is placed through its base layer, whose weight piece gets LoRA's update
added (`adapters/grid.py`). For generation, attention takes its batch rows of per-row rotary
tables and of the KV cache, so each rank caches the keys and values of its rows and heads.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from colab_par.layout import Layout
from colab_par.parallel.collectives import (Split, all_reduce_sum, gather, gather_all, gather_replicas,
                                            piece_sizes, reduce_scatter_all, sum_grad_over)

__all__ = ["apply_tensor_grid", "Grid", "GridPlan", "WeightSpec", "grid_plan", "grid_linear_names"]

Along = tuple[tuple[str, int], ...]  # (grid dim, tensor dim) pairs, innermost split first


@dataclass(frozen=True)
class WeightSpec:
    shards: dict[str, int]  # grid dim -> the weight dim it splits (a dim not named: replicated)
    gathers: Along  # gathered before use
    grad_sums: tuple[str, ...] = ()  # replicated dims whose ranks saw different tokens


@dataclass(frozen=True)
class LinearSpec:
    weight: WeightSpec
    x_gathers: Along  # the input's pieces gathered before the product
    y_scatters: Along = ()  # partial sums reduce-scattered after it


@dataclass(frozen=True)
class GridPlan:
    """Where every piece of the GPT lives on one grid mode."""
    dims: tuple[str, ...]
    into_block: LinearSpec  # q/k/v, gate, up, the head: layout A -> B
    out_of_block: LinearSpec  # attention and FFN output projections: B -> A
    embedding: WeightSpec
    norm: WeightSpec
    norm_dim: str  # the grid dim splitting layout A's hidden
    batch_dims: tuple[str, ...]  # the dims splitting layout A's batch, outermost first
    attention_batch_dims: tuple[str, ...]  # the dims splitting layout B's batch (attention's), outermost first
    logits_gathers: Along  # layout B logits -> whole


def grid_plan(mode: str) -> GridPlan:
    """The placements of `tensor_grid.py`'s docstring, written out per mode."""
    if mode == "3d":
        into = LinearSpec(WeightSpec({"x": 1, "y": 0, "z": 1}, (("x", 1),)), (("y", 0),), (("z", 0),))
        out = LinearSpec(WeightSpec({"x": 0, "y": 1, "z": 0}, (("x", 0),)), (("z", 0),), (("y", 0),))
        return GridPlan(("x", "y", "z"), into, out,
                        embedding=WeightSpec({"x": 1, "y": 0, "z": 1}, (("x", 1), ("y", 0))),
                        norm=WeightSpec({"x": 0, "z": 0}, (("x", 0),), ("y",)), norm_dim="z",
                        batch_dims=("x", "y"), attention_batch_dims=("x", "z"),
                        logits_gathers=(("y", -1), ("z", 0), ("x", 0)))
    depth: tuple[str, ...] = ("depth",) if mode == "2.5d" else ()
    linear = LinearSpec(WeightSpec({"row": 1, "col": 0}, (("row", 1),), depth), (("col", -1),))
    return GridPlan((*depth, "row", "col"), linear, linear,
                    embedding=WeightSpec({"row": 0, "col": 1}, (("row", 0),), depth),
                    norm=WeightSpec({"col": 0}, (), ("row", *depth)), norm_dim="col",
                    batch_dims=(*depth, "row"), attention_batch_dims=(*depth, "row"),
                    logits_gathers=(("col", -1), ("row", 0), *((d, 0) for d in depth)))


class Grid:
    """One rank's view of a tensor grid: its mesh, a process group per dim, its coordinates."""

    def __init__(self, mesh: DeviceMesh, plan: GridPlan):
        self.mesh, self.plan = mesh, plan
        self.groups = {name: mesh[name].get_group() for name in plan.dims}
        self.coords = {name: mesh[name].get_local_rank() for name in plan.dims}
        self.sizes = {name: mesh[name].size() for name in plan.dims}
        self.placed: dict[nn.Module, WeightSpec] = {}  # every module whose weight the grid placed
        # A module's weight update, added to its local piece before use (LoRA: `adapters/grid.py`).
        self.updates: dict[nn.Module, Callable[[], torch.Tensor | None]] = {}

    def splits(self, along: Along, full: dict[int, int] | None = None) -> tuple[Split, ...]:
        """The collectives' splits for `along`; `full` names the full size of dims whose pieces
        may be uneven (the vocabulary)."""
        full = full or {}
        return tuple((self.groups[name], dim, full[dim]) if dim in full else (self.groups[name], dim)
                     for name, dim in along)

    def placements(self, spec: WeightSpec) -> tuple[Placement, ...]:
        return tuple(Shard(spec.shards[name]) if name in spec.shards else Replicate()
                     for name in self.plan.dims)

    def piece_bounds(self, spec: WeightSpec, shape: torch.Size) -> list[tuple[int, int]]:
        """(start, size) of this rank's piece along every dim of a tensor of `shape` placed by
        `spec`: DTensor's, each grid dim (outermost first) splitting what the ones before left."""
        bounds = [(0, size) for size in shape]
        for name in self.plan.dims:
            if name in spec.shards:
                dim = spec.shards[name]
                start, size = bounds[dim]
                sizes, coord = piece_sizes(size, self.sizes[name]), self.coords[name]
                bounds[dim] = (start + sum(sizes[:coord]), sizes[coord])
        return bounds

    def local_weight(self, param: torch.Tensor, spec: WeightSpec, update: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's piece of `param` (plus `update`, a tensor of the piece's shape), its gradient
        summed over the dims that saw other tokens."""
        local = param.to_local() if isinstance(param, DTensor) else param
        if update is not None:
            local = local + update
        for name in spec.grad_sums:
            if self.sizes[name] > 1:
                local = sum_grad_over(local, self.groups[name])
        return local

    def module_weight(self, module: nn.Module, spec: WeightSpec) -> torch.Tensor:
        """`local_weight` of `module.weight` with the update registered for the module, if any."""
        update = self.updates.get(module)
        return self.local_weight(module.weight, spec, None if update is None else update())

    def batch_piece(self, batch: torch.Tensor, dims: tuple[str, ...] | None = None) -> torch.Tensor:
        """This rank's piece of a (micro)batch split over `dims` (default: layout A's batch dims)."""
        pieces, index = 1, 0
        for name in self.plan.batch_dims if dims is None else dims:
            pieces, index = pieces * self.sizes[name], index * self.sizes[name] + self.coords[name]
        if batch.shape[0] % pieces:
            raise ValueError(f"{'×'.join(self.plan.dims)} tensor parallel splits each batch into "
                             f"{pieces} pieces, and this one has {batch.shape[0]} sequences; use a "
                             f"per-rank batch that is a multiple of {pieces}")
        return batch.chunk(pieces, 0)[index]


class _GridLinear(torch.autograd.Function):
    """y = reduce_scatter(gather(x) @ gather(w)ᵀ), keeping only the local pieces of x and w for
    backward (gathered again there), in the autocast dtype when autocast is on (backward works in
    the gradient's dtype, which is that dtype then)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, x_splits: tuple[Split, ...],
                w_splits: tuple[Split, ...], y_splits: tuple[Split, ...]) -> torch.Tensor:
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.save_for_backward(x, weight)
        ctx.splits = (x_splits, w_splits, y_splits)
        with torch.autocast(device, enabled=False):
            xg, wg = gather_all(_to(x, cast), x_splits), gather_all(_to(weight, cast), w_splits)
            return reduce_scatter_all(xg @ wg.t(), y_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        x_splits, w_splits, y_splits = ctx.splits
        dtype = grad.dtype
        grad = gather_all(grad, y_splits)
        xg, wg = gather_all(x.to(dtype), x_splits), gather_all(weight.to(dtype), w_splits)
        dx = reduce_scatter_all(grad @ wg, x_splits).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = reduce_scatter_all(grad.flatten(0, -2).t() @ xg.flatten(0, -2), w_splits)
        return dx, dw.to(weight.dtype), None, None, None


def _to(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


# ---- the GPT's modules on the grid ------------------------------------------------------------------
def _linear_forward(module: nn.Linear, grid: Grid, x: torch.Tensor, *, spec: LinearSpec) -> torch.Tensor:
    weight = grid.module_weight(module, spec.weight)
    return _GridLinear.apply(x, weight, grid.splits(spec.x_gathers), grid.splits(spec.weight.gathers),
                             grid.splits(spec.y_scatters))


def _head_forward(module: nn.Linear, grid: Grid, x: torch.Tensor) -> torch.Tensor:
    logits = _linear_forward(module, grid, x, spec=grid.plan.into_block)
    return gather_replicas(logits, grid.splits(grid.plan.logits_gathers, {-1: module.weight.shape[0]}))


def _embedding_forward(module: nn.Embedding, grid: Grid, tokens: torch.Tensor) -> torch.Tensor:
    spec = grid.plan.embedding
    table = gather(grid.local_weight(module.weight, spec), grid.splits(spec.gathers, {0: module.weight.shape[0]}))
    return nn.functional.embedding(grid.batch_piece(tokens), table)


def _norm_forward(module: nn.Module, grid: Grid, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over a hidden split across `norm_dim`: the sum of squares is summed there."""
    spec = grid.plan.norm
    weight = gather(grid.local_weight(module.weight, spec), grid.splits(spec.gathers))
    wide = x.float()
    squares = all_reduce_sum(wide.pow(2).sum(-1, keepdim=True), grid.groups[grid.plan.norm_dim])
    scale = torch.rsqrt(squares / module.weight.shape[0] + module.eps)
    return (wide * scale).to(x.dtype) * weight


def _attention_forward(attend: Callable[..., torch.Tensor], grid: Grid, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, cache: Any = None) -> torch.Tensor:
    """Attention on its layout-B batch piece. Per-row rotary tables and a KV cache (generation)
    cover the whole batch, so this rank takes its rows of them; the cache then holds only its rows'
    keys and values, of its heads."""
    dims = grid.plan.attention_batch_dims
    if cos.dim() == 3:
        cos, sin = grid.batch_piece(cos, dims), grid.batch_piece(sin, dims)
    if cache is not None:
        cache = cache.rows(grid.batch_piece(cache.keep, dims))
    return attend(x, cos, sin, cache=cache)


_INTO_BLOCK = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
_OUT_OF_BLOCK = ("attention.wo", "feed_forward.w2")


def grid_linear_names(model: nn.Module) -> list[str]:
    """The names of the GPT's linear layers the grid runs as grid linears (the head included)."""
    blocks = [f"layers.{index}.{name}" for index in getattr(model, "layers", {})
              for name in _INTO_BLOCK + _OUT_OF_BLOCK]
    return blocks + (["output"] if getattr(model, "output", None) is not None else [])


def apply_tensor_grid(model: nn.Module, layout: Layout, mesh: DeviceMesh, *,
                      unwrap: Callable[[nn.Module], nn.Module] = lambda module: module) -> Grid:
    """Place the GPT's parameters on the grid `mesh` and run its layers on their pieces. `unwrap`
    gives the layer a module stands for (peft's tuner layer: its base layer, whose adapters
    `adapters/grid.py` adds), which is placed instead."""
    from colab_par.models.gpt import GPT

    if not isinstance(model, GPT):
        raise ValueError(f"{layout.tp_mode} tensor parallel partitions colab_par's GPT; "
                         f"{type(model).__name__} needs tp_mode='1d'")
    plan = grid_plan(layout.tp_mode)
    grid = Grid(mesh, plan)
    if model.tok_embeddings is not None:
        _place(model.tok_embeddings, grid, plan.embedding, _embedding_forward)
    for block in model.layers.values():
        for norm in (block.attention_norm, block.ffn_norm):
            _place(norm, grid, plan.norm, _norm_forward)
        for name in _INTO_BLOCK + _OUT_OF_BLOCK:
            spec = plan.into_block if name in _INTO_BLOCK else plan.out_of_block
            _place(unwrap(block.get_submodule(name)), grid, spec.weight,
                   functools.partial(_linear_forward, spec=spec))
        block.attention.forward = functools.partial(_attention_forward, block.attention.forward, grid)
    if model.norm is not None:
        _place(model.norm, grid, plan.norm, _norm_forward)
    if model.output is not None:
        _place(unwrap(model.output), grid, plan.into_block.weight, _head_forward)
    return grid


def _place(module: nn.Module, grid: Grid, spec: WeightSpec, forward: Any) -> None:
    """Make `module.weight` a DTensor with `spec`'s placements and `forward` the module's forward."""
    weight = module.weight
    module.weight = nn.Parameter(distribute_tensor(weight.data, grid.mesh, grid.placements(spec)),
                                 requires_grad=weight.requires_grad)
    module.forward = functools.partial(forward, module, grid)
    grid.placed[module] = spec
