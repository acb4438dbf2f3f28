"""The reference GPT's mixture-of-experts feed-forward: a top-k router over SwiGLU experts.

- Routing: softmax over the experts in float32 (at least), the top k kept and (``norm_topk_prob``, as Mixtral
  and Qwen3-MoE do) renormalised to sum to one.
- Dropless dispatch: every routed token is computed, however uneven the load (no capacity factor,
  no dropped tokens), so the layer computes the same function on one rank or spread over many and
  parity with one-process training is exact; the price is uneven work per expert, which the
  per-expert counts (`last_counts`) let a user see.
- Experts' weights are stacked per layer, (experts, in, out), and run as one grouped matmul
  (`compat.grouped_mm`: torch's ``_grouped_mm`` where it takes the dtype, a loop of matmuls else).
- ``dispatch`` is a plain attribute holding how grouped tokens reach the experts and come back:
  here they are all local; expert parallel (`colab_par.parallel.experts`) swaps in an all-to-all.
  ``tensor_split`` (None here) is set by tensor parallel, whose ranks each hold a slice of every
  expert: the experts' input and routing weights enter through its ``inputs`` (gradients summed
  over tp) and the mixed partial outputs leave through its ``output`` (summed over tp); the router
  and the balance loss stay outside, computed whole on every rank.
- The auxiliary load-balancing loss (Switch Transformer's E·Σ f_e·P_e, per layer) counts the
  tokens of the whole global batch: with ``stats_group`` set, the per-expert counts are summed over
  that data-parallel group first, so the mean of the ranks' losses equals the one-process loss.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.compat import grouped_mm, grouped_mm_is_one_op

__all__ = ["MoE", "Experts", "local_dispatch", "expert_counts", "inverse_permutation", "in_autocast_dtype"]


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight expert parallel made a DTensor (sharded by expert)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def in_autocast_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in the dtype autocast computes matmuls in on its device (as it is where autocast
    is off): torch's grouped matmul is not on autocast's list, so under a bf16 layout the experts,
    most of a MoE's compute, would run in float32 while every linear runs in bf16."""
    device = tensor.device.type
    if not torch.is_autocast_enabled(device) or not tensor.is_floating_point():
        return tensor
    return tensor.to(torch.get_autocast_dtype(device))


class Experts(nn.Module):
    """`count` SwiGLU MLPs; forward takes tokens grouped by expert and each expert's row count."""

    def __init__(self, count: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(count, d_model, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(count, d_model, hidden))  # up
        self.w2 = nn.Parameter(torch.empty(count, hidden, d_model))  # down

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        tokens, w1, w3, w2 = (in_autocast_dtype(t) for t in (tokens, _local(self.w1), _local(self.w3), _local(self.w2)))
        if torch.compiler.is_compiling() and not grouped_mm_is_one_op(tokens, w1):
            return _swiglu_outside_graph(tokens, w1, w3, w2, ends)
        return _swiglu(tokens, w1, w3, w2, ends)


def _swiglu(tokens: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            ends: torch.Tensor) -> torch.Tensor:
    return grouped_mm(F.silu(grouped_mm(tokens, w1, ends)) * grouped_mm(tokens, w3, ends), w2, ends)


# Where torch.compile cannot trace the grouped matmul, its loop of matmuls reads each expert's row
# count as a Python int: traced, that is a graph break per grouped matmul, with small graphs of
# slices between them, each compiled on its own. Run eagerly, the experts cost one break and no
# compile (`benchmarks/compile.py --model moe`); their matmuls are GEMMs a compiled graph would call
# as they are.
_swiglu_outside_graph = torch.compiler.disable(
    _swiglu, reason="per-expert row counts are data: the loop of matmuls runs eagerly")


Dispatch = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]


def local_dispatch(tokens: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert on this rank: compute them in place."""
    return experts(tokens, counts)


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of the (token, choice) pairs went to each expert: `bincount` with a shape fixed by
    `n_experts` rather than by the data, so torch.compile traces it without a graph break."""
    flat = chosen.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class MoE(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.norm_topk_prob, self.aux_loss_coef = config.norm_topk_prob, config.aux_loss_coef
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = Experts(config.n_experts, config.d_model, config.ffn_hidden)
        self.dispatch: Dispatch = local_dispatch
        self.tensor_split: Any = None  # `parallel.expert_tensor.TensorSplit` under tensor parallel
        self.stats_group: dist.ProcessGroup | None = None  # the ranks that share the global batch
        self.last_counts: torch.Tensor | None = None  # tokens routed to each expert, last forward
        self.aux_loss: torch.Tensor | None = None  # this layer's balance loss, last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen = chosen.reshape(-1)  # (token, choice) pairs, token-major
        order = chosen.argsort(stable=True)  # grouped by expert, tokens in order within each
        counts = expert_counts(chosen, self.n_experts)
        self.last_counts = counts.detach()
        rows, mix = flat, weights
        if self.tensor_split is not None:
            rows, mix = self.tensor_split.inputs(flat), self.tensor_split.inputs(weights)
        out = self.dispatch(rows[order // self.top_k], counts, self.experts)[inverse_permutation(order)]
        mixed = (out.view(-1, self.top_k, out.shape[-1]) * mix.unsqueeze(-1).to(out.dtype)).sum(1)
        if self.tensor_split is not None:
            mixed = self.tensor_split.output(mixed)
        self.aux_loss = self._balance_loss(probs, counts) if self.aux_loss_coef else None
        return mixed.view(x.shape)

    def take_aux_loss(self) -> torch.Tensor | None:
        """The balance loss of the last forward, once (so no graph outlives the step)."""
        loss, self.aux_loss = self.aux_loss, None
        return loss

    def _balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """coef · E · Σ_e f_e · P_e over the global batch: f_e the share of routed (token, choice)
        pairs expert e got, P_e its mean router probability. Only the counts cross ranks: each rank
        contributes its own probabilities scaled so the ranks' mean loss is the global one."""
        totals = torch.cat([counts, counts.new_tensor([probs.shape[0]])])
        ranks = 1
        if self.stats_group is not None:
            dist.all_reduce(totals, group=self.stats_group)
            ranks = dist.get_world_size(self.stats_group)
        tokens = totals[-1].to(probs.dtype)
        share = totals[:-1].to(probs.dtype) / (tokens * self.top_k)
        return self.aux_loss_coef * self.n_experts * ranks * (share * probs.sum(0)).sum() / tokens
