"""Hugging Face mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3,
GPT-OSS, ...) under the kit's expert parallel and balance-loss rules, found from the model itself.

- The experts: the config's own ``base_model_ep_plan`` names the experts modules (style
  ``ep_dispatch_experts``) and their packed expert-sharded parameters (``grouped_gemm``: leading
  dimension = expert). Shared experts are not in it and stay dense.
- Dispatch (ep > 1): each rank keeps its slice of every packed parameter (a DTensor sharded by
  expert, as `experts.py` does for the kit's GPT); the experts module's forward is wrapped so each
  (token, choice) pair travels by all-to-all to the rank holding its expert, runs there through the
  family's OWN experts forward on the local slice (local expert indices, weight 1), comes back and
  is weighted and summed over the top-k choices here. Dropless, like the kit's GPT.
- Tensor parallel (`expert_tensor.py`): the family's forward runs on this rank's slice of every
  expert (``_local_slice`` with the packed gate|up regrouped), its input and routing weights
  entering and its output leaving through the tp collectives.
- Counts: every wrapped experts module records how many (token, choice) pairs each expert got
  (`last_counts`), so the Trainer publishes ``expert_tokens.<layer>.<expert>`` rows for these
  models too.
- The auxiliary load-balancing loss (``output_router_logits`` with ``router_aux_loss_coef``):
  transformers computes it per forward from the local router logits, which under data parallel is
  a per-rank loss, not the one-process loss of the global batch. `GlobalBalanceLoss` records the
  routers' logits (the routers the model's own ``_can_record_outputs`` names), gathers them over
  the ranks sharing the global batch with autograd (`GatherRows`: backward sums the ranks'
  gradients), and calls the family's own ``load_balancing_loss_func`` on the global logits: every
  rank then holds the global loss, and its gradient, averaged over dp as all gradients are, is the
  one-process gradient.
"""
from __future__ import annotations

import contextlib
import inspect
import re
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.compat import hf_output_recorder, swapped_parameters
from colab_par.models.moe import expert_counts, in_autocast_dtype, inverse_permutation

__all__ = ["hf_expert_layers", "packed_expert_names", "HFExpertLayer", "GlobalBalanceLoss", "GatherRows", "balance_loss_for"]

DISPATCH_STYLE, EXPERT_WEIGHT_STYLE = "ep_dispatch_experts", "grouped_gemm"


def _pattern(plan_key: str) -> re.Pattern:
    return re.compile(re.escape(plan_key).replace(r"\*", r"[^.]+"))


def plan_entry(plan: dict[str, str], name: str) -> str | None:
    """The style a transformers plan (``layers.*.mlp.experts`` keys) gives the module or parameter
    `name` of the base model; None where no key names it."""
    return next((style for key, style in plan.items() if _pattern(key).fullmatch(name)), None)


def hf_expert_layers(model: nn.Module) -> list["HFExpertLayer"]:
    """The experts modules the model's ``base_model_ep_plan`` names, wrapped (once) for counting
    and dispatch, in model order; [] for a model without that plan."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    dispatch = [_pattern(key) for key, style in plan.items() if style == DISPATCH_STYLE]
    weights = [_pattern(key) for key, style in plan.items() if style == EXPERT_WEIGHT_STYLE]
    if not dispatch:
        return []
    base = getattr(model, "base_model", model)
    layers = []
    for name, module in base.named_modules():
        if not any(p.fullmatch(name) for p in dispatch):
            continue
        if not hasattr(module, "colab_par_experts"):
            names = [p for p, _ in module.named_parameters(recurse=False)
                     if any(w.fullmatch(f"{name}.{p}") for w in weights)]
            module.colab_par_experts = HFExpertLayer(module, names, name)
        layers.append(module.colab_par_experts)
    return layers


def packed_expert_names(model: nn.Module) -> list[str]:
    """State-dict names of the packed expert weights the ep plan names (leading dim = expert)."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    weights = [_pattern(key) for key, style in plan.items() if style == EXPERT_WEIGHT_STYLE]
    prefix = getattr(model, "base_model_prefix", "")
    return [name for name, _ in model.named_parameters()
            if any(w.fullmatch(name.removeprefix(f"{prefix}.")) for w in weights)]


class HFExpertLayer:
    """One experts module of a Hugging Face MoE family: its forward counts the routed pairs and,
    once `dispatch` is set (expert parallel), sends them to the ranks holding their experts."""

    def __init__(self, module: nn.Module, weight_names: list[str], name: str):
        self.module, self.weight_names, self.name = module, weight_names, name  # name: in the base model
        self.n_experts = int(getattr(module, weight_names[0]).shape[0])
        self.dispatch: Callable | None = None  # `experts.AllToAllDispatch` under ep
        self.tensor_split: Any = None  # `expert_tensor.TensorSplit` under tp
        self.stats_group: dist.ProcessGroup | None = None  # the ranks sharing the global batch
        self.last_counts: torch.Tensor | None = None
        self._family_forward = module.forward  # the family's own (bound before any wrapping)
        self._arguments = inspect.signature(self._family_forward)
        module.forward = self.forward

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, index, weights = self._arguments.bind(*args, **kwargs).arguments.values()
        self.last_counts = expert_counts(index, self.n_experts).detach()
        split = self.tensor_split
        if split is not None:
            hidden, weights = split.inputs(hidden), split.inputs(weights)
        if self.dispatch is None:  # every expert here (under tp a slice of each)
            with self._local_slice(None):
                out = self._family_forward(hidden, index, weights)
        else:
            out = self._dispatched(hidden, index, weights)
        return out if split is None else split.output(out)

    def _dispatched(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each (token, choice) pair to the rank holding its expert and back, mixed here."""
        tokens, k = index.shape
        order = index.reshape(-1).argsort(stable=True)  # pairs grouped by expert
        rows = self.dispatch(hidden[order // k], self.last_counts,
                             lambda arrived, counts: self._run_local(arrived, counts, weights.dtype))
        out = rows[inverse_permutation(order)].view(tokens, k, -1)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(1).to(hidden.dtype)

    def _run_local(self, rows: torch.Tensor, counts: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
        """The family's forward on rows grouped by this rank's experts, each with weight 1."""
        local = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
        ones = torch.ones(rows.shape[0], 1, dtype=weight_dtype, device=rows.device)
        with self._local_slice(counts.numel()) as weights:
            out = self._family_forward(rows, local.unsqueeze(1), ones)
            if rows.shape[0] == 0:  # no token came: the gradients must still exist (zeros)
                out = out + sum(w.sum() for w in weights) * 0
        return out

    @contextlib.contextmanager
    def _local_slice(self, count: int | None) -> Iterator[list[torch.Tensor]]:
        """The family's forward sees this rank's pieces of its experts as if they were all the
        experts (`count` of them; None: as many as there are, tp without ep)."""
        module = self.module
        local = {n: self._local_weight(n, getattr(module, n)) for n in self.weight_names}
        had_count = getattr(module, "num_experts", None)
        try:
            if had_count is not None and count is not None:
                module.num_experts = count
            with swapped_parameters(module, local):
                yield list(local.values())
        finally:
            if had_count is not None:
                module.num_experts = had_count

    def _local_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """This rank's piece, in autocast's dtype (transformers' grouped matmul computes in the
        weights' dtype, and autocast does not cast it)."""
        if self.tensor_split is not None:
            weight = self.tensor_split.local(name, weight)
        elif isinstance(weight, DTensor):
            weight = weight.to_local()
        return in_autocast_dtype(weight)


class GatherRows(torch.autograd.Function):
    """Concatenate every rank's equal-shaped rows (rank order); backward sums the gradients all
    ranks computed for them and hands each rank its own rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.count = group, dist.get_rank(group), rows.shape[0]
        pieces = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, rows.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.count:(ctx.rank + 1) * ctx.count], None


def balance_loss_for(model: nn.Module, group: dist.ProcessGroup | None) -> "GlobalBalanceLoss | None":
    """The global-batch balance loss of a Hugging Face MoE model whose config switches it on
    (``output_router_logits``); None otherwise. Refuses a model whose family has no loss function."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not hf_expert_layers(model):
        return None
    family = sys.modules[type(model).__module__]
    loss_fn = getattr(family, "load_balancing_loss_func", None)
    recorder = hf_output_recorder(model, "router_logits")
    if loss_fn is None or recorder is None:
        raise ValueError(f"output_router_logits=True but {type(model).__name__} has no load-balancing loss "
                         "the kit can make global (no load_balancing_loss_func / router recorder); "
                         "set config.output_router_logits=False")
    return GlobalBalanceLoss(model, recorder, loss_fn, group)


class GlobalBalanceLoss:
    """The family's own balance loss over the global batch; `take()` after each forward."""

    def __init__(self, model: nn.Module, recorder: Any, loss_fn: Callable, group: dist.ProcessGroup | None):
        config = model.config
        self.coef, self.top_k = float(config.router_aux_loss_coef), int(config.num_experts_per_tok)
        self.n_experts = hf_expert_layers(model)[0].n_experts
        self.loss_fn, self.group = loss_fn, group
        router_type = getattr(recorder, "target_class", recorder)
        self.index = getattr(recorder, "index", 0)
        self.logits: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        self.layers = 0  # routers on this model (part): the logits each forward records
        for module in model.modules():
            if isinstance(module, router_type):
                module.register_forward_hook(self._record)
                self.layers += 1

    def _start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.logits, self.mask = [], kwargs.get("attention_mask")

    def _record(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.logits.append(output[self.index] if isinstance(output, tuple) else output)

    def take(self) -> torch.Tensor | None:
        """coef × the family's loss on the global batch's router logits of the last forward, once."""
        logits, mask = self.gather()
        return self.loss(logits, mask) if logits else None

    def gather(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The last forward's router logits per layer and its attention mask (None without one),
        each the global batch's rows (gathered with autograd over the ranks sharing it), once."""
        logits, mask, self.logits, self.mask = self.logits, self.mask, [], None
        if logits and self.group is not None:
            logits = [GatherRows.apply(layer, self.group) for layer in logits]
            mask = None if mask is None else GatherRows.apply(mask, self.group)
        return logits, mask

    def loss(self, logits: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        """coef × the family's own balance loss of these per-layer router logits."""
        return self.coef * self.loss_fn(tuple(logits), self.n_experts, self.top_k, mask)
