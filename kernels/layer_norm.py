"""LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias, fused forward and backward.

The forward keeps a float32 mean and reciprocal std per row; the weight and bias gradients are
summed per program (in registers when a row fits one block) and the partial rows added by torch,
so no atomics are needed and results are deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import as_rows, backend, count_launch, new_output, row_block, split_rows

__all__ = ["layer_norm", "layer_norm_reference"]

MAX_BLOCK = 8192


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float = 1e-5) -> torch.Tensor:
    """Torch LayerNorm computed in (at least) float32 and stored in x's dtype: the CPU fallback."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).pow(2).mean(-1, keepdim=True)
    y = (xc - mean) * torch.rsqrt(var + eps) * weight.to(compute) + bias.to(compute)
    return y.to(x.dtype)


@triton.jit
def _layer_norm_forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, x_row_stride, y_row_stride,
                               n_cols, eps, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK)
    if ONE_CHUNK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        centred = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (centred * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
            total += x
        mean = tl.sum(total, axis=0) / n_cols
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            centred = tl.where(mask, x - mean, 0.0)
            squares += centred * centred
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, ((x - mean) * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr,
                                dy_row_stride, x_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program,
                                BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr):
    # dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)),  dw = sum dy*xhat,  db = sum dy
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    dw_row = dw_partial_ptr + pid.to(tl.int64) * n_cols
    db_row = db_partial_ptr + pid.to(tl.int64) * n_cols
    if ONE_CHUNK:
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, rows_per_program):
            row = (pid * rows_per_program + i).to(tl.int64)
            row_ok = row < n_rows
            row_mask = cols < tl.where(row_ok, n_cols, 0)  # (interpreter 3.9 mis-types bool & bool)
            mean = tl.load(mean_ptr + row, mask=row_ok, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=row_mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=row_mask, other=0.0).to(tl.float32)
            xhat = tl.where(row_mask, (x - mean) * rstd, 0.0)
            wdy = w * dy
            c_hat = tl.sum(xhat * wdy, axis=0) / n_cols
            c_mean = tl.sum(wdy, axis=0) / n_cols
            dx = (wdy - c_mean - xhat * c_hat) * rstd
            tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
            dw += dy * xhat
            db += dy
        tl.store(dw_row + cols, dw, mask=mask)
        tl.store(db_row + cols, db, mask=mask)
    else:
        for i in range(0, rows_per_program):
            row = (pid * rows_per_program + i).to(tl.int64)
            row_ok = row < n_rows
            col_limit = tl.where(row_ok, n_cols, 0)
            mean = tl.load(mean_ptr + row, mask=row_ok, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
            dot = tl.zeros([BLOCK], dtype=tl.float32)
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                row_mask = start + cols < col_limit
                x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * dy_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                xhat = tl.where(row_mask, (x - mean) * rstd, 0.0)
                dot += xhat * w * dy
                total += w * dy
            c_hat = tl.sum(dot, axis=0) / n_cols
            c_mean = tl.sum(total, axis=0) / n_cols
            for start in range(0, n_cols, BLOCK):
                row_mask = start + cols < col_limit
                x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * dy_row_stride + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + start + cols, mask=row_mask, other=0.0).to(tl.float32)
                xhat = tl.where(row_mask, (x - mean) * rstd, 0.0)
                dx = (w * dy - c_mean - xhat * c_hat) * rstd
                tl.store(dx_ptr + row * dx_row_stride + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
                dw = tl.load(dw_row + start + cols, mask=row_mask, other=0.0)
                tl.store(dw_row + start + cols, dw + dy * xhat, mask=row_mask)
                db = tl.load(db_row + start + cols, mask=row_mask, other=0.0)
                tl.store(db_row + start + cols, db + dy, mask=row_mask)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                path: str) -> torch.Tensor:
        rows = as_rows(x)
        n_rows, n_cols = rows.shape
        block, num_warps, one_chunk = row_block(n_cols, MAX_BLOCK)
        y = new_output(rows.shape, x.dtype, x.device)
        mean = new_output((n_rows,), torch.float32, x.device)
        rstd = new_output((n_rows,), torch.float32, x.device)
        count_launch("layer_norm_forward", path)
        _layer_norm_forward_kernel[(n_rows,)](rows, weight, bias, y, mean, rstd, rows.stride(0), y.stride(0),
                                              n_cols, eps, BLOCK=block, ONE_CHUNK=one_chunk, num_warps=num_warps)
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.path, ctx.x_shape, ctx.bias_dtype = path, x.shape, bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = rows.shape
        dy_rows = as_rows(dy)
        block, num_warps, one_chunk = row_block(n_cols, MAX_BLOCK)
        programs, rows_per_program = split_rows(rows.device, n_rows)
        dx = new_output(rows.shape, rows.dtype, rows.device)
        allocate = torch.empty if one_chunk else torch.zeros
        dw_partial = allocate((programs, n_cols), dtype=torch.float32, device=rows.device)
        db_partial = allocate((programs, n_cols), dtype=torch.float32, device=rows.device)
        count_launch("layer_norm_backward", ctx.path)
        _layer_norm_backward_kernel[(programs,)](dy_rows, rows, weight, mean, rstd, dx, dw_partial, db_partial,
                                                 dy_rows.stride(0), rows.stride(0), dx.stride(0), n_rows, n_cols,
                                                 rows_per_program, BLOCK=block, ONE_CHUNK=one_chunk,
                                                 num_warps=num_warps)
        return (dx.view(ctx.x_shape), dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(ctx.bias_dtype),
                None, None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` (any leading shape) with per-feature weight and bias."""
    for name, param in (("weight", weight), ("bias", bias)):
        if param.dim() != 1 or param.shape[0] != x.shape[-1]:
            raise ValueError(f"layer_norm: {name} of shape {tuple(param.shape)} does not match the last dimension "
                             f"of x {tuple(x.shape)}; pass a 1-D {name} of size {x.shape[-1]}")
        if param.device != x.device:
            raise ValueError(f"layer_norm: x is on {x.device} but {name} on {param.device}; move both to one device")
    path = backend(x)
    if path == "torch" or x.numel() == 0:
        return layer_norm_reference(x, weight, bias, eps)
    return _LayerNormFunction.apply(x, weight, bias, eps, path)
