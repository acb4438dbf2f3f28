"""AdamW over one flat chunk where the chunk lives (host memory or a memory-mapped file).

Why: torch's default AdamW on the CPU walks parameter by parameter (or in foreach groups of small
tensors) and makes several passes over memory per tensor; a chunk is one contiguous float32 run,
so torch's fused kernel updates it in one pass, vectorized, with no copy to another device.
Gradients that are not float32 (bf16 training) are widened into a reusable scratch buffer first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

__all__ = ["AdamWHyper", "adamw_chunk_step", "host_adamw_step"]


@dataclass(frozen=True)
class AdamWHyper:
    """One parameter group's AdamW settings (torch's names and meanings)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2
    maximize: bool = False


def adamw_chunk_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     step: torch.Tensor, hyper: AdamWHyper, scratch: torch.Tensor | None = None) -> None:
    """One AdamW step of the flat float32 `param` in place (decoupled weight decay, bias correction
    from `step`, a float32 scalar tensor this call increments), exactly torch's AdamW update.

    `grad` may be any float dtype of the same length; `scratch` (float32, at least as long) is used
    to widen it without a fresh allocation per chunk."""
    if param.dtype != torch.float32 or param.dim() != 1:
        raise ValueError(f"a chunk is a flat float32 tensor, got {param.dtype} of shape {tuple(param.shape)}")
    if grad.dtype != torch.float32:
        wide = scratch[:grad.numel()] if scratch is not None else torch.empty_like(param)
        wide.copy_(grad)
        grad = wide
    host_adamw_step([param], [grad], [exp_avg], [exp_avg_sq], [step], hyper)


def host_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """AdamW on tensors of one dtype where they live (host memory, a memory-mapped chunk): torch's
    fused kernel, one vectorized pass per tensor; what the tiers step state off the device with."""
    adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, amsgrad=False, beta1=hyper.beta1,
          beta2=hyper.beta2, lr=hyper.lr, weight_decay=hyper.weight_decay, eps=hyper.eps,
          maximize=hyper.maximize)
