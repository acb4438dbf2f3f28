"""The memory-tiers step of parallelize: after the data-parallel step and the optimizer build, the
optimizer becomes a `TieredAdamW` over this rank's local tensors as the layout left them (DDP
parameters, FSDP / tensor-parallel local shards, pipeline stage parameters), so tiers compose
with dp, zero1-3, tp and pp. zero1's ZeroRedundancyOptimizer is replaced: the tiered optimizer
partitions the state over the dp group itself (`memory_tiers/ownership.py`). Off
(`layout.tiers.enabled` false) nothing changes."""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from colab_par.layout import Layout
from colab_par.memory_tiers.optimizer import TieredAdamW
from colab_par.layout.tier_options import bf16_working_shards as working_shards_in_bf16

__all__ = ["apply_memory_tiers", "cast_working_parameters", "bf16_working_shards"]


def bf16_working_shards(layout: Layout) -> bool:
    """See `tier_options.bf16_working_shards` (the planner reads the same rule)."""
    return working_shards_in_bf16(layout.tiers, layout.precision, layout.zero)


def cast_working_parameters(part: nn.Module, layout: Layout) -> None:
    """Before fully_shard: the part's floating parameters in bf16 where `bf16_working_shards`
    (buffers such as rotary tables stay as they are; tied parameters stay tied)."""
    if not bf16_working_shards(layout):
        return
    cast: dict[int, nn.Parameter] = {}
    for name, param in list(part.named_parameters(remove_duplicate=False)):  # every name of a tied one
        if not param.is_floating_point():
            continue
        if id(param) not in cast:
            cast[id(param)] = nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=param.requires_grad)
        owner, _, leaf = name.rpartition(".")
        setattr(part.get_submodule(owner), leaf, cast[id(param)])


def apply_memory_tiers(parts: list[nn.Module], optimizer: torch.optim.Optimizer, layout: Layout,
                       device: torch.device, *, baseline: int) -> torch.optim.Optimizer:
    """`optimizer` itself without tiers, else a TieredAdamW of its class's settings.

    `baseline`: the process's resident bytes before the model was built, the fixed overhead the
    budget does not cover. Gradients may leave the fast tier only where the layout shards them
    (zero2/3, written out after each reduce-scatter); DDP keeps them in its own buckets."""
    if not layout.tiers.enabled:
        return optimizer
    zero1_group = optimizer.process_group if isinstance(optimizer, ZeroRedundancyOptimizer) else None
    # `compile` builds AdamW with fused=True wherever the user left the kernel open
    # (`compile.fused_optimizer_fn`): not a choice that keeps state off the device from the host step
    return TieredAdamW(_over_every_parameter(optimizer), layout.tiers, parts, device=device, rank=dist.get_rank(),
                       baseline=baseline, grads_movable=layout.zero >= 2, zero1_group=zero1_group,
                       fused_by_compile=layout.compile)


def _over_every_parameter(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """zero1's ZeroRedundancyOptimizer as the plain optimizer it wraps, over all its parameters
    (it holds no state before a step): the tiers keep their own partition of the state."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    kind = type(optimizer.optim)
    accepted = inspect.signature(kind.__init__).parameters
    settings = {key: value for key, value in optimizer.optim.defaults.items() if key in accepted}
    return kind([dict(group) for group in optimizer.param_groups], **settings)
