"""AdamW whose step is one Triton launch over all parameters of a group (per dtype).

A "multi-tensor apply": the launch gets tables of raw pointers (param, grad, exp_avg, exp_avg_sq)
and a list of (tensor, offset) chunks, so hundreds of small parameters cost one launch instead of
several elementwise kernels each. Math follows torch.optim.AdamW (decoupled weight decay, bias
correction per parameter step); state tensors live in the parameter's dtype, arithmetic in float32.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import triton
import triton.language as tl

from ._dispatch import backend, count_launch, is_dtensor

__all__ = ["FusedAdamW", "adamw_reference_step"]

BLOCK = 1024
CHUNK = 64 * BLOCK  # elements per program: few programs for big tensors, one for small ones
_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def adamw_reference_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of a single tensor in float32, in place: the CPU fallback."""
    p, g = param.float(), grad.float()
    m = exp_avg.float().mul_(beta1).add_(g, alpha=1 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p.mul_(1 - lr * weight_decay)
    denom = v.sqrt().div_(math.sqrt(1 - beta2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
    param.copy_(p), exp_avg.copy_(m), exp_avg_sq.copy_(v)


@triton.jit
def _adamw_kernel(pointer_table, numel_table, chunk_table, step_size_table, bias2_sqrt_table, n_tensors, n_chunks,
                  lr, beta1, beta2, eps, weight_decay, DTYPE: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tensor = tl.load(chunk_table + pid)
    start = tl.load(chunk_table + n_chunks + pid)
    end = tl.minimum(start + CHUNK, tl.load(numel_table + tensor))
    param_ptr = tl.load(pointer_table + tensor).to(tl.pointer_type(DTYPE))
    grad_ptr = tl.load(pointer_table + n_tensors + tensor).to(tl.pointer_type(DTYPE))
    exp_avg_ptr = tl.load(pointer_table + 2 * n_tensors + tensor).to(tl.pointer_type(DTYPE))
    exp_avg_sq_ptr = tl.load(pointer_table + 3 * n_tensors + tensor).to(tl.pointer_type(DTYPE))
    step_size = tl.load(step_size_table + tensor)
    bias2_sqrt = tl.load(bias2_sqrt_table + tensor)
    lanes = tl.arange(0, BLOCK)
    for block_start in range(start, end, BLOCK):
        offsets = block_start + lanes
        mask = offsets < end
        p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p * (1.0 - lr * weight_decay) - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(param_ptr + offsets, p.to(DTYPE), mask=mask)
        tl.store(exp_avg_ptr + offsets, m.to(DTYPE), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v.to(DTYPE), mask=mask)


Update = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]  # param, grad, exp_avg, exp_avg_sq, step


def _launch_group(updates: list[Update], lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  path: str) -> None:
    """One kernel launch applying every update (all tensors on one device, one dtype)."""
    device, dtype = updates[0][0].device, updates[0][0].dtype
    pointers = [tensors[i].data_ptr() for i in range(4) for tensors in updates]
    numels = [u[0].numel() for u in updates]
    chunk_tensor = [i for i, n in enumerate(numels) for _ in range(0, n, CHUNK)]
    chunk_start = [start for n in numels for start in range(0, n, CHUNK)]
    steps = [u[4] for u in updates]
    factors = torch.tensor([lr / (1 - beta1 ** t) for t in steps] + [math.sqrt(1 - beta2 ** t) for t in steps],
                           dtype=torch.float32).to(device)
    tables = torch.tensor(pointers + numels + chunk_tensor + chunk_start, dtype=torch.int64).to(device)
    n, n_chunks = len(updates), len(chunk_tensor)
    pointer_table, numel_table, chunk_table = tables[:4 * n], tables[4 * n:5 * n], tables[5 * n:]
    count_launch("adamw", path)
    _adamw_kernel[(n_chunks,)](pointer_table, numel_table, chunk_table, factors[:n], factors[n:], n, n_chunks,
                               lr, beta1, beta2, eps, weight_decay, DTYPE=_TRITON_DTYPES[dtype], CHUNK=CHUNK,
                               BLOCK=BLOCK, num_warps=4)


def _update_tensors(param: torch.Tensor, state: dict) -> tuple[torch.Tensor, ...]:
    """The tensors the update runs on: for a DTensor whose gradient has the same placement (FSDP
    shards), the local shards, since AdamW is elementwise; any other DTensor stays whole (torch path)."""
    tensors = (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
    if is_dtensor(param) and is_dtensor(param.grad) and param.grad.placements == param.placements:
        return tuple(t.to_local() for t in tensors)
    return tensors


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW semantics with one Triton launch per (param group, device, dtype) and step.

    FSDP-style DTensor parameters are updated shard by shard (param and grad share a placement).
    Without a Triton path for the parameters' device (CPU without TRITON_INTERPRET=1 at import) the
    same update runs tensor by tensor in torch. State keys match torch.optim.AdamW.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if not lr >= 0.0:
            raise ValueError(f"FusedAdamW: lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"FusedAdamW: betas={betas} must each be in [0, 1), e.g. (0.9, 0.999)")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"FusedAdamW: eps={eps} and weight_decay={weight_decay} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in _TRITON_DTYPES:
                    raise ValueError(f"FusedAdamW: parameter of dtype {p.dtype} is not supported; use float32, "
                                     "bfloat16 or float16 parameters (or torch.optim.AdamW)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            buckets: dict[tuple[torch.device, torch.dtype, str], list[Update]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                param, grad, exp_avg, exp_avg_sq = _update_tensors(p, state)
                if grad.dtype != param.dtype or not (param.is_contiguous() and grad.is_contiguous()):
                    raise RuntimeError(f"FusedAdamW needs contiguous parameters and gradients of the parameter's "
                                       f"dtype; got param {param.dtype} grad {grad.dtype}")
                key = (param.device, param.dtype, backend(param))
                buckets.setdefault(key, []).append((param, grad, exp_avg, exp_avg_sq, int(state["step"])))
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            for (_, _, path), updates in buckets.items():
                if path == "torch":
                    for update in updates:
                        adamw_reference_step(*update, **hyper)
                else:
                    _launch_group(updates, path=path, **hyper)
        return loss
