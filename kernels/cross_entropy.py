"""Cross-entropy over a large vocabulary with the gradient written in place of the logits.

One program per row makes an online log-sum-exp pass over vocabulary blocks (running max and
rescaled sum), then a second pass writes softmax - one_hot (label-smoothed if asked), already
scaled for the reduction, over the logits. The (tokens x vocab) softmax is never allocated: the
logits buffer becomes the gradient, which is why the logits must not be reused after the call.
The count of valid targets and the reduction's scale stay on the device (no host sync).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from colab_par import compat

from ._dispatch import as_rows, backend, count_launch, new_output, row_block

__all__ = ["cross_entropy", "cross_entropy_reference"]

MAX_BLOCK = 8192
_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                            reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """torch's cross-entropy computed in (at least) float32: the CPU fallback."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(compute), target.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)


@triton.jit
def _cross_entropy_kernel(logits_ptr, logits_row_stride, target_ptr, loss_ptr, n_cols, ignore_index,
                          label_smoothing, grad_scale_ptr, BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr,
                          SMOOTHING: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK)
    running_max = float("-inf")
    running_sum = 0.0
    logit_total = 0.0
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
        if SMOOTHING:
            logit_total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = running_max + tl.log(running_sum)
    target_logit = tl.load(row_ptr + tl.where(valid, target, 0)).to(tl.float32)
    loss = lse - target_logit
    if SMOOTHING:  # (1-e) * nll + e * mean over the vocabulary of -log p
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - logit_total / n_cols)
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0).to(loss_ptr.dtype.element_ty))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(grad_scale_ptr).to(tl.float32), 0.0)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(start + cols == target, 1.0 - label_smoothing, 0.0)
            if SMOOTHING:
                grad = grad - label_smoothing / n_cols
            tl.store(row_ptr + start + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)


def count_valid_targets(target: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """Number of non-ignored targets as a 0-d tensor on target's device, read by no host.

    A target outside [0, vocab) fails an assertion queued before any kernel: on CPU an error at once,
    on CUDA a device-side assertion (as torch's own cross-entropy kernels do), never a host sync.
    """
    valid = target != ignore_index
    in_range = ((target >= 0) & (target < vocab_size)) | ~valid
    compat.assert_async(in_range.all(), f"cross_entropy: a target lies outside [0, {vocab_size}); targets must "
                                        f"be class indices or ignore_index={ignore_index}")
    return valid.sum()


def loss_rows_and_grad_(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                        grad_scale: torch.Tensor, write_grad: bool, path: str) -> torch.Tensor:
    """Per-row losses of a (rows, vocab) block with unit column stride; if ``write_grad``, overwrite
    the block with grad_scale * d loss_row / d logits (zero on ignored rows). ``grad_scale`` is a
    0-d float32 tensor on the logits' device, so a scale computed there is never read by the host."""
    loss_dtype = torch.promote_types(logits.dtype, torch.float32)
    if path == "torch":
        logits32 = logits.to(loss_dtype)
        losses = F.cross_entropy(logits32, target, ignore_index=ignore_index, reduction="none",
                                 label_smoothing=label_smoothing)
        if write_grad:
            row_scale = torch.where((target != ignore_index).unsqueeze(1), grad_scale, 0.0)
            grad = torch.softmax(logits32, dim=1).sub_(label_smoothing / logits.shape[1])
            grad.scatter_add_(1, target.clamp(min=0).unsqueeze(1),
                              torch.full_like(grad[:, :1], label_smoothing - 1.0))
            logits.copy_(grad.mul_(row_scale))
        return losses
    n_rows, n_cols = logits.shape
    block, num_warps, _ = row_block(n_cols, MAX_BLOCK)
    losses = new_output((n_rows,), loss_dtype, logits.device)
    count_launch("cross_entropy", path)
    _cross_entropy_kernel[(n_rows,)](logits, logits.stride(0), target, losses, n_cols, ignore_index,
                                     label_smoothing, grad_scale, BLOCK=block, WRITE_GRAD=write_grad,
                                     SMOOTHING=label_smoothing > 0.0, num_warps=num_warps)
    return losses


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                label_smoothing: float, path: str) -> torch.Tensor:
        rows, target = as_rows(logits), target.reshape(-1).long()
        n_valid = count_valid_targets(target, rows.shape[1], ignore_index)
        write_grad = ctx.needs_input_grad[0]
        # a leaf's gradient must not alias its data, so only intermediates give up their buffer
        if write_grad and rows.data_ptr() == logits.data_ptr() and logits.is_leaf:
            rows = rows.clone()
        one = torch.ones((), dtype=torch.float32, device=rows.device)
        grad_scale = one / n_valid.clamp(min=1) if reduction == "mean" else one
        losses = loss_rows_and_grad_(rows, target, ignore_index, label_smoothing, grad_scale, write_grad, path)
        ctx.grad, ctx.reduction, ctx.logits_shape = (rows if write_grad else None), reduction, logits.shape
        if reduction == "none":
            return losses.view(logits.shape[:-1])
        total = losses.sum()
        return total / n_valid if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("cross_entropy: backward ran twice; the gradient lives in the logits buffer, so "
                               "the Triton cross_entropy supports a single backward (no retain_graph reuse)")
        ctx.grad = None
        if ctx.reduction == "none":
            grad.mul_(grad_output.reshape(-1, 1))
        elif not bool(grad_output == 1):
            grad.mul_(grad_output)
        return grad.view(ctx.logits_shape), None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of logits (..., vocab) against integer targets (...).

    On the Triton paths the logits buffer is overwritten with its gradient when it requires grad;
    do not read the logits after calling this. The loss is float32 (float64 for float64 logits).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r}; choose one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1)")
    if logits.shape[:-1] != target.shape or logits.dim() < 1:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} need shape (..., vocab) with target "
                         f"{tuple(target.shape)} matching the leading dimensions")
    if target.dtype not in (torch.int64, torch.int32) or target.device != logits.device:
        raise ValueError(f"cross_entropy: target must be an int64/int32 tensor on {logits.device}, got "
                         f"{target.dtype} on {target.device}")
    path = backend(logits)
    if path == "torch" or logits.numel() == 0:
        loss = cross_entropy_reference(logits, target, ignore_index, reduction, label_smoothing)
        return loss.view(logits.shape[:-1]) if reduction == "none" else loss
    return _CrossEntropyFunction.apply(logits, target, ignore_index, reduction, label_smoothing, path)
