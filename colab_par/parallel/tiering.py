"""The memory-tiers step of parallelize: after the data-parallel step and the optimizer build, the
optimizer becomes a `TieredAdamW` over this rank's local tensors as the layout left them (DDP
parameters, FSDP / tensor-parallel local shards, pipeline stage parameters), so tiers compose
with dp, zero2/3, tp and pp. Off (`layout.tiers.enabled` false) nothing changes."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from colab_par.layout import Layout
from colab_par.memory_tiers.optimizer import TieredAdamW

__all__ = ["apply_memory_tiers"]


def apply_memory_tiers(parts: list[nn.Module], optimizer: torch.optim.Optimizer, layout: Layout,
                       device: torch.device, *, baseline: int) -> torch.optim.Optimizer:
    """`optimizer` itself without tiers, else a TieredAdamW of its class's settings.

    `baseline`: the process's resident bytes before the model was built, the fixed overhead the
    budget does not cover. Gradients may leave the fast tier only where the layout shards them
    (zero2/3, written out after each reduce-scatter); DDP keeps them in its own buckets."""
    if not layout.tiers.enabled:
        return optimizer
    return TieredAdamW(optimizer, layout.tiers, parts, device=device, rank=dist.get_rank(), baseline=baseline,
                       grads_movable=layout.zero >= 2)
