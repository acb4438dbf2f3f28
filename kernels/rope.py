"""Rotary position embedding (rotate-half / Llama convention) on q and k in one launch.

Each program rotates every query and key head of a tile of tokens, so a cos/sin row is read once
and reused across heads. The backward is the transposed rotation, no tensors saved but cos/sin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import backend, count_launch, new_output, next_power_of_2

__all__ = ["apply_rope", "apply_rope_reference"]

TILE_ELEMENTS = 2048  # half-rows of q elements per program (x2 halves, plus k)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x * cos + rotate_half(x) * sin in (at least) float32, stored in x's dtype: the CPU fallback."""
    compute = torch.promote_types(q.dtype, torch.float32)
    cos, sin = cos.to(compute)[None, :, None, :], sin.to(compute)[None, :, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xc = x.to(compute)
        return (xc * cos + _rotate_half(xc) * sin).to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, tokens, n_tokens, n_heads, half, cos1, sin1, cos2, sin2, dcols,
                  BLOCK_HEADS: tl.constexpr, BACKWARD: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    offsets = (tokens[:, None, None] * n_heads + heads[None, :, None]) * 2 * half + dcols[None, None, :]
    # nested wheres build the 3-D mask with one comparison (the 3.9 interpreter mis-types bool & bool)
    dim_or_half = tl.where(heads[None, :, None] < n_heads, dcols[None, None, :], half)
    mask = tl.where(tokens[:, None, None] < n_tokens, dim_or_half, half) < half
    x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offsets + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the rotation: dx1 = dy1*cos1 + dy2*sin2, dx2 = dy2*cos2 - dy1*sin1
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    tl.store(out_ptr + offsets, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offsets + half, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, n_tokens, seq_len, n_q_heads, n_k_heads,
                 half, BLOCK_TOKENS: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    dcols = tl.arange(0, BLOCK_HALF)
    table_mask = tl.where(tokens[:, None] < n_tokens, dcols[None, :], half) < half
    table = (tokens % seq_len)[:, None] * 2 * half + dcols[None, :]
    cos1 = tl.load(cos_ptr + table, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    cos2 = tl.load(cos_ptr + table + half, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    sin1 = tl.load(sin_ptr + table, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    sin2 = tl.load(sin_ptr + table + half, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    _rotate_heads(q_ptr, q_out_ptr, tokens, n_tokens, n_q_heads, half, cos1, sin1, cos2, sin2, dcols,
                  BLOCK_Q_HEADS, BACKWARD)
    _rotate_heads(k_ptr, k_out_ptr, tokens, n_tokens, n_k_heads, half, cos1, sin1, cos2, sin2, dcols,
                  BLOCK_K_HEADS, BACKWARD)


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
            path: str) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len, n_q_heads, head_dim = q.shape
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = new_output(q.shape, q.dtype, q.device), new_output(k.shape, k.dtype, k.device)
    half, n_tokens = head_dim // 2, batch * seq_len
    block_heads, block_half = next_power_of_2(max(n_q_heads, k.shape[2])), next_power_of_2(half)
    # several tokens per program when heads x head_dim is small, so each program moves a few KB
    block_tokens = min(next_power_of_2(n_tokens), max(1, TILE_ELEMENTS // (block_heads * block_half)))
    count_launch("rope_backward" if backward else "rope_forward", path)
    _rope_kernel[(triton.cdiv(n_tokens, block_tokens),)](
        q, k, cos, sin, q_out, k_out, n_tokens, seq_len, n_q_heads, k.shape[2], half, BLOCK_TOKENS=block_tokens,
        BLOCK_Q_HEADS=next_power_of_2(n_q_heads), BLOCK_K_HEADS=next_power_of_2(k.shape[2]),
        BLOCK_HALF=block_half, BACKWARD=backward, num_warps=4)
    return q_out, k_out


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                path: str) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.path, ctx.q_meta, ctx.k_meta = path, (q.shape, q.dtype), (k.shape, k.dtype)
        return _launch(q, k, cos, sin, backward=False, path=path)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        # an output that did not reach the loss arrives as None
        dq = dq if dq is not None else torch.zeros(ctx.q_meta[0], dtype=ctx.q_meta[1], device=cos.device)
        dk = dk if dk is not None else torch.zeros(ctx.k_meta[0], dtype=ctx.k_meta[1], device=cos.device)
        dq_in, dk_in = _launch(dq, dk, cos, sin, backward=True, path=ctx.path)
        return dq_in, dk_in, None, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (batch, seq, heads, head_dim) and k (batch, seq, kv_heads, head_dim) by cos/sin (seq, head_dim).

    cos and sin are treated as constants (no gradient flows to them).
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must both be (batch, seq, heads, "
                         "head_dim) with the same batch, seq and head_dim (k may have fewer heads)")
    head_dim = q.shape[-1]
    if head_dim % 2:
        raise ValueError(f"apply_rope: head_dim={head_dim} is odd; rotate-half needs an even head_dim")
    expected = (q.shape[1], head_dim)
    if tuple(cos.shape) != expected or tuple(sin.shape) != expected:
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be (seq, head_dim) = "
                         f"{expected}; build them with colab_par.models.gpt.rope_cos_sin(positions, ...)")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError("apply_rope: q, k, cos and sin must be on one device")
    path = backend(q)
    if path == "torch" or q.numel() == 0:
        count_launch("rope_forward", "torch")
        return apply_rope_reference(q, k, cos, sin)
    return _RoPEFunction.apply(q, k, cos.contiguous(), sin.contiguous(), path)
