"""Linear head + cross-entropy without ever holding the full (tokens x vocab) logits.

Tokens are processed in chunks sized so that one chunk's logits take about as much memory as the
hidden states: each chunk's logits are computed, turned into their gradient in place by the
cross-entropy kernel, and immediately contracted into grad_hidden and grad_weight. The forward
therefore already holds both gradients; the backward only scales them by the incoming gradient.
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


class _FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                path: str) -> torch.Tensor:
        rows, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()
        n_rows, vocab_size = rows.shape[0], weight.shape[0]
        n_valid = count_valid_targets(target, vocab_size, ignore_index)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        write_grad = want_hidden or want_weight
        grad_hidden = new_output(rows.shape, rows.dtype, rows.device) if want_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if want_weight else None
        losses = new_output((n_rows,), torch.promote_types(rows.dtype, torch.float32), rows.device)
        step = chunk_rows(n_rows, vocab_size, rows.shape[1])
        for start in range(0, n_rows, step):
            chunk = rows[start:start + step]
            logits = chunk @ weight.t()
            losses[start:start + step] = loss_rows_and_grad_(logits, target[start:start + step], ignore_index, 0.0,
                                                             1.0 / max(n_valid, 1), write_grad, path)
            if want_hidden:
                torch.matmul(logits, weight, out=grad_hidden[start:start + step])
            if want_weight:
                grad_weight += (logits.t() @ chunk).to(accumulate)
        ctx.grads, ctx.hidden_shape = (grad_hidden, grad_weight), hidden.shape
        return losses.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy: backward ran twice; the gradients are computed in the "
                               "forward and handed out once (no retain_graph reuse)")
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        scale = None if bool(grad_output == 1) else grad_output
        if grad_hidden is not None:
            grad_hidden = (grad_hidden if scale is None else grad_hidden * scale).view(ctx.hidden_shape)
        if grad_weight is not None:
            grad_weight = grad_weight if scale is None else grad_weight * scale
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
