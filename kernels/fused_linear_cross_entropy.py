"""Linear head + cross-entropy without ever holding the full (tokens x vocab) logits.

Tokens are processed in chunks sized so that one chunk's logits take about as much memory as the
hidden states: each chunk's logits are computed, turned into their gradient in place by the
cross-entropy kernel, and immediately contracted into grad_hidden and grad_weight. The forward
therefore already holds both gradients; the backward only scales them by the incoming gradient.

Memory beyond the inputs and the two gradients: one chunk of logits, plus the weight gradient's
accumulator when it must be wider than the weight (``accumulation_dtype``); each chunk's product
is added into it by the GEMM itself (beta = 1), so no (vocab x d) temporary exists per chunk. The
count of valid targets stays on the device and the incoming gradient is applied by a device
multiply: no host sync anywhere.
"""
from __future__ import annotations

import torch

from ._dispatch import backend, new_output
from .cross_entropy import count_valid_targets, cross_entropy_reference, loss_rows_and_grad_

__all__ = ["fused_linear_cross_entropy", "fused_linear_cross_entropy_reference"]


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T with the full logits materialised (tests only)."""
    return cross_entropy_reference(hidden @ weight.t(), target, ignore_index)


def chunk_rows(n_rows: int, vocab_size: int, hidden_size: int) -> int:
    """Rows per chunk so a chunk of logits is about the size of the whole hidden-state tensor."""
    chunks = -(-vocab_size // hidden_size)
    return max(1, -(-n_rows // chunks))


def accumulation_dtype(weight_dtype: torch.dtype, n_chunks: int) -> torch.dtype:
    """The dtype grad_weight is summed in over ``n_chunks`` chunk products.

    Each chunk's GEMM sums in fp32 internally but rounds the running total to the accumulator's
    dtype once per chunk: k chunks cost up to k roundings of 2^-p (p the accumulator's mantissa
    bits) against eager's single rounding of the finished gradient. In the weight's own dtype that
    is exact for one chunk and for 32-bit or wider weights (k * 2^-24 is far below the GEMM's own
    summation error); for bf16 / fp16 with k > 1 it is up to k * 2^-9 (6 % at vocab 128256, d 4096,
    k = 32), so those sum in fp32 (k * 2^-24) and round to the weight's dtype once at the end.
    """
    if n_chunks == 1 or torch.finfo(weight_dtype).bits >= 32:
        return weight_dtype
    return torch.float32


def add_product_(acc: torch.Tensor, grad_logits: torch.Tensor, chunk: torch.Tensor, first: bool) -> None:
    """acc (vocab, d) = [acc +] grad_logits.T @ chunk, written in place: no (vocab x d) temporary."""
    beta = 0 if first else 1  # beta 0 ignores acc's uninitialised contents
    if acc.dtype == grad_logits.dtype:
        torch.addmm(acc, grad_logits.t(), chunk, beta=beta, out=acc)
    elif acc.is_cuda:  # cuBLAS reads and writes the fp32 accumulator with bf16/fp16 operands
        torch.addmm(acc, grad_logits.t(), chunk, out_dtype=acc.dtype, beta=beta, out=acc)
    else:  # CPU has no mixed-dtype GEMM: widen this chunk's operands (chunk-sized, not vocab x d)
        torch.addmm(acc, grad_logits.t().to(acc.dtype), chunk.to(acc.dtype), beta=beta, out=acc)


class _FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                path: str) -> torch.Tensor:
        rows, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()
        n_rows, vocab_size = rows.shape[0], weight.shape[0]
        n_valid = count_valid_targets(target, vocab_size, ignore_index)
        grad_scale = torch.ones((), dtype=torch.float32, device=rows.device) / n_valid.clamp(min=1)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        write_grad = want_hidden or want_weight
        step = chunk_rows(n_rows, vocab_size, rows.shape[1])
        grad_hidden = new_output(rows.shape, rows.dtype, rows.device) if want_hidden else None
        accumulate = accumulation_dtype(weight.dtype, -(-n_rows // step))
        grad_weight = new_output(weight.shape, accumulate, weight.device) if want_weight else None
        losses = new_output((n_rows,), torch.promote_types(rows.dtype, torch.float32), rows.device)
        for start in range(0, n_rows, step):
            chunk = rows[start:start + step]
            logits = chunk @ weight.t()
            losses[start:start + step] = loss_rows_and_grad_(logits, target[start:start + step], ignore_index, 0.0,
                                                             grad_scale, write_grad, path)
            if want_hidden:
                torch.matmul(logits, weight, out=grad_hidden[start:start + step])
            if want_weight:
                add_product_(grad_weight, logits, chunk, first=start == 0)
        if want_weight and n_rows == 0:
            grad_weight.zero_()
        ctx.grads, ctx.hidden_shape, ctx.weight_dtype = (grad_hidden, grad_weight), hidden.shape, weight.dtype
        return losses.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy: backward ran twice; the gradients are computed in the "
                               "forward and handed out once (no retain_graph reuse)")
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        if grad_hidden is not None:  # a device multiply, exact for the usual grad_output of 1
            grad_hidden = grad_hidden.mul_(grad_output).view(ctx.hidden_shape)
        if grad_weight is not None:
            if grad_weight.dtype == ctx.weight_dtype:
                grad_weight.mul_(grad_output)
            else:  # one pass scales the fp32 sum and rounds it to the weight's dtype
                grad_weight = torch.mul(grad_weight, grad_output,
                                        out=torch.empty(grad_weight.shape, dtype=ctx.weight_dtype,
                                                        device=grad_weight.device))
        return grad_hidden, grad_weight, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` (hidden (..., d), weight (vocab, d), target (...)).

    The logits are built one chunk of tokens at a time; the gradients for hidden and weight are
    computed in the forward, so the backward runs once (no retain_graph reuse).
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: weight {tuple(weight.shape)} must be (vocab, d) with d = "
                         f"hidden's last dimension {hidden.shape[-1]}")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"fused_linear_cross_entropy: target {tuple(target.shape)} must match hidden's leading "
                         f"dimensions {tuple(hidden.shape[:-1])}")
    if hidden.dtype != weight.dtype or len({hidden.device, weight.device, target.device}) != 1:
        raise ValueError("fused_linear_cross_entropy: hidden and weight need one dtype, and all inputs one device; "
                         f"got {hidden.dtype}/{weight.dtype} on {hidden.device}/{weight.device}/{target.device}")
    return _FusedLinearCrossEntropyFunction.apply(hidden, weight, target, ignore_index, backend(hidden))
