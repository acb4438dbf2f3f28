"""SwiGLU: silu(gate) * up, fused forward and backward.

The backward recomputes sigmoid(gate) from the saved inputs instead of storing silu(gate) or
sigmoid(gate), so the only activations kept are the two inputs the matmuls produced anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import backend, count_launch, new_output

__all__ = ["swiglu", "swiglu_reference"]

BLOCK = 1024


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in (at least) float32, stored in gate's dtype: the CPU fallback."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(compute)
    return (g * torch.sigmoid(g) * up.to(compute)).to(gate.dtype)


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_elements, BLOCK: tl.constexpr):
    # d silu(g)/dg = s * (1 + g * (1 - s)) with s = sigmoid(g)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(dgate_ptr + offsets, (dy * u * s * (1.0 + g * (1.0 - s))).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, (dy * g * s).to(dup_ptr.dtype.element_ty), mask=mask)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, path: str) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = new_output(gate.shape, gate.dtype, gate.device)
        n = gate.numel()
        count_launch("swiglu_forward", path)
        _swiglu_forward_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gate, up)
        ctx.path = path
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dgate, dup = new_output(gate.shape, gate.dtype, gate.device), new_output(up.shape, up.dtype, up.device)
        n = gate.numel()
        count_launch("swiglu_backward", ctx.path)
        _swiglu_backward_kernel[(triton.cdiv(n, BLOCK),)](dy, gate, up, dgate, dup, n, BLOCK=BLOCK, num_warps=4)
        return dgate, dup, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; gate and up must have the same shape, dtype and device."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} {gate.device} and up {tuple(up.shape)} "
                         f"{up.dtype} {up.device} must match in shape, dtype and device")
    path = backend(gate)
    if path == "torch" or gate.numel() == 0:
        count_launch("swiglu_forward", "torch")
        return swiglu_reference(gate, up)
    return _SwiGLUFunction.apply(gate, up, path)
