"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, fused forward and backward.

The forward keeps one float32 reciprocal RMS per row, so the backward needs no second reduction
over x^2; the weight gradient is summed per program in registers and the few partial rows are
added up by torch, which avoids atomics and keeps the result deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import as_rows, backend, count_launch, new_output, row_block, split_rows, tile_rows

__all__ = ["rms_norm", "rms_norm_reference"]

MAX_BLOCK = 8192


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Torch RMSNorm computed in (at least) float32 and stored in x's dtype: the CPU fallback."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, x_row_stride, y_row_stride, n_rows, n_cols, eps,
                             BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    if ONE_CHUNK:  # a tile of BLOCK_ROWS whole rows
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        # nested where: one comparison builds the 2-D mask (the 3.9 interpreter mis-types bool & bool)
        mask = tl.where(rows[:, None] < n_rows, cols[None, :], n_cols) < n_cols
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)
    else:  # one long row per program, walked block by block
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_row_stride
        y_row = y_ptr + row * y_row_stride
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
            squares += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
                              dy_row_stride, x_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program,
                              BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr):
    # dx = rstd * (w*dy - xhat * mean(w*dy*xhat)),  dw = sum_rows dy * xhat
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    partial_row = dw_partial_ptr + pid.to(tl.int64) * n_cols
    if ONE_CHUNK:  # tiles of BLOCK_ROWS whole rows; dw accumulates in registers
        first_row = pid.to(tl.int64) * rows_per_program
        row_end = tl.minimum(first_row + rows_per_program, n_rows)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, rows_per_program, BLOCK_ROWS):
            rows = first_row + i + tl.arange(0, BLOCK_ROWS)
            mask = tl.where(rows[:, None] < row_end, cols[None, :], n_cols) < n_cols
            rstd = tl.load(rstd_ptr + rows, mask=rows < row_end, other=0.0)[:, None]
            x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            xhat = x * rstd
            wdy = w[None, :] * dy
            c = tl.sum(xhat * wdy, axis=1)[:, None] / n_cols
            dx = (wdy - xhat * c) * rstd
            tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(partial_row + cols, dw, mask=cols < n_cols)
    else:
        for i in range(0, rows_per_program):
            row = (pid * rows_per_program + i).to(tl.int64)
            row_ok = row < n_rows
            col_limit = tl.where(row_ok, n_cols, 0)
            rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
            dot = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                row_mask = start + cols < col_limit
                x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * dy_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                dot += x * rstd * w * dy
            c = tl.sum(dot, axis=0) / n_cols
            for start in range(0, n_cols, BLOCK):
                row_mask = start + cols < col_limit
                x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * dy_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                xhat = x * rstd
                dx = (w * dy - xhat * c) * rstd
                tl.store(dx_ptr + row * dx_row_stride + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
                dw = tl.load(partial_row + start + cols, mask=row_mask, other=0.0)
                tl.store(partial_row + start + cols, dw + dy * xhat, mask=row_mask)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, path: str) -> torch.Tensor:
        rows = as_rows(x)
        n_rows, n_cols = rows.shape
        block, num_warps, one_chunk = row_block(n_cols, MAX_BLOCK)
        block_rows = tile_rows(n_rows, block) if one_chunk else 1
        y = new_output(rows.shape, x.dtype, x.device)
        rstd = new_output((n_rows,), torch.float32, x.device)
        count_launch("rms_norm_forward", path)
        _rms_norm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
            rows, weight, y, rstd, rows.stride(0), y.stride(0), n_rows, n_cols, eps, BLOCK_ROWS=block_rows,
            BLOCK=block, ONE_CHUNK=one_chunk, num_warps=num_warps)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.path, ctx.x_shape = path, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = rows.shape
        dy_rows = as_rows(dy)
        block, num_warps, one_chunk = row_block(n_cols, MAX_BLOCK)
        block_rows = tile_rows(n_rows, block) if one_chunk else 1
        programs, rows_per_program = split_rows(rows.device, n_rows, block_rows)
        dx = new_output(rows.shape, rows.dtype, rows.device)
        partial = (torch.empty if one_chunk else torch.zeros)((programs, n_cols), dtype=torch.float32,
                                                               device=rows.device)
        count_launch("rms_norm_backward", ctx.path)
        _rms_norm_backward_kernel[(programs,)](dy_rows, rows, weight, rstd, dx, partial, dy_rows.stride(0),
                                               rows.stride(0), dx.stride(0), n_rows, n_cols, rows_per_program,
                                               BLOCK_ROWS=block_rows, BLOCK=block, ONE_CHUNK=one_chunk,
                                               num_warps=num_warps)
        return dx.view(ctx.x_shape), partial.sum(0).to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape) with a per-feature ``weight``."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last dimension "
                         f"of x {tuple(x.shape)}; pass a 1-D weight of size {x.shape[-1]}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight on {weight.device}; move both to one device")
    path = backend(x)
    if path == "torch" or x.numel() == 0:
        count_launch("rms_norm_forward", "torch")
        return rms_norm_reference(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, eps, path)
