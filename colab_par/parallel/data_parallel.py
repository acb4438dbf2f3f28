"""Data parallel and ZeRO: the mapping from ``Layout.zero`` to what PyTorch already provides.

zero=0 -> DDP; zero=1 -> DDP + ``ZeroRedundancyOptimizer`` (optimizer state sharded);
zero=2 -> ``fully_shard(reshard_after_forward=False)`` (gradients + optimizer state sharded, the
gathered parameters kept from forward to backward); zero=3 -> ``fully_shard()`` (parameters
sharded too). ``offload`` adds ``CPUOffloadPolicy``; bf16 adds ``MixedPrecisionPolicy`` with fp32
master weights and fp32 gradient reduction. Context-parallel ranks see different tokens of the same
sequences, so gradients are averaged over the flattened dp·cp group, not over dp alone.

DDP cannot wrap DTensor (tensor-parallel) parameters nor a pipeline stage driven by a schedule, so
for zero=0 with tp/pp the gradients are averaged by `GradientAverager` (an all-reduce per bucket).
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from colab_par.layout import Layout
from colab_par.parallel.blocks import Block

__all__ = ["apply_fsdp", "apply_ddp", "GradientAverager", "GRADIENT_BUCKET_BYTES", "gradient_buckets",
           "build_optimizer", "needs_gradient_averager", "fsdp_options"]

GRADIENT_BUCKET_BYTES = 25 * 2 ** 20  # DDP's bucket cap: what `GradientAverager` copies at once


def fsdp_options(layout: Layout, device_type: str) -> dict:
    """fully_shard's settings for a layout on a mesh of `device_type` (all but the mesh):
    resharding, precision, offload. Offloaded shards are pinned only on a CUDA mesh: pinning asks
    the CUDA driver, which would open a context on every GPU-equipped rank of a gloo world."""
    mixed = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
             if layout.precision == "bf16" else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if layout.offload else OffloadPolicy()
    return dict(reshard_after_forward=layout.zero == 3, mp_policy=mixed, offload_policy=offload)


def apply_fsdp(module: nn.Module, layout: Layout, dp_mesh: DeviceMesh, blocks: list[Block]) -> nn.Module:
    """fully_shard each of `blocks` (see `blocks.py`), then the root (whatever is left: embeddings,
    norms, heads; the whole model when it has no repeated blocks)."""
    options = dict(mesh=dp_mesh, **fsdp_options(layout, dp_mesh.device_type))
    for _, _, block in blocks:
        fully_shard(block, **options)
    fully_shard(module, **options)
    return module


def apply_ddp(module: nn.Module, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=group)


def needs_gradient_averager(module: nn.Module, layout: Layout) -> bool:
    has_dtensor = any(isinstance(p, DTensor) for p in module.parameters())
    return layout.zero == 0 and layout.dp * layout.cp > 1 and (has_dtensor or layout.pp > 1)


class GradientAverager:
    """Average the local gradients of `params` over `group`, a bucket of them at a time.

    Used only where DDP cannot wrap the module (DTensor parameters, pipeline stages): every rank of
    the group holds the same shard layout, so the local pieces line up element by element. The sum
    is divided by `divisor` (default: the group's size; experts under ep divide by dp), and `then`
    (another averager, of other parameters over another group) runs after it. Consecutive gradients
    share one flat all-reduce up to `GRADIENT_BUCKET_BYTES` (`gradient_buckets`), a larger one is
    reduced in place: one flat copy of them all would hold every gradient twice at the step's end.
    """

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, *,
                 divisor: int | None = None, then: "GradientAverager | None" = None):
        self.params, self.group = [p for p in params if p.requires_grad], group
        self.size = divisor or dist.get_world_size(group)
        self.then = then

    @torch.no_grad()
    def __call__(self) -> None:
        if self.then is not None:
            self.then()
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        for bucket in gradient_buckets([grad.numel() * grad.element_size() for grad in grads]):
            self._average([grads[i] for i in bucket])

    def _average(self, grads: list[torch.Tensor]) -> None:
        if len(grads) == 1 and grads[0].is_contiguous():
            dist.all_reduce(grads[0], group=self.group)
            grads[0].div_(self.size)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def gradient_buckets(sizes: Sequence[int], cap: int = GRADIENT_BUCKET_BYTES) -> list[range]:
    """Runs of consecutive indices of `sizes` (bytes) whose sum stays within `cap`; a size over
    `cap` is a run of its own. Shared with the planner's collective estimate."""
    buckets, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > cap:
            buckets.append(range(start, index))
            start, total = index, 0
        total += size
    return buckets + ([range(start, len(sizes))] if sizes else [])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def build_optimizer(params: list[nn.Parameter], optimizer_fn: Callable, layout: Layout,
                    dp_group: dist.ProcessGroup) -> torch.optim.Optimizer:
    """`optimizer_fn(params)`; for zero=1 the same class and settings inside ZeroRedundancyOptimizer.
    With nothing to train (a model of frozen adapters, for evaluation) its one group is empty."""
    optimizer = optimizer_fn(params or [{"params": []}])
    if layout.zero != 1 or not params:
        return optimizer
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=dp_group,
                                   **settings)
