"""Tensor parallel inside the experts: every tp rank holds a slice of every expert's weights and
runs every token routed to its experts through that slice; the partial outputs are summed.

What transformers' ``moe_tp_experts`` style means (its ``packed_colwise`` / ``rowwise`` entries on
the packed expert weights), done by the experts step so that ep and tp split the same tensors once:
- a weight is split along the dim the family's ``base_model_tp_plan`` names: ``colwise`` /
  ``packed_colwise`` the output features (dim 1 of an (expert, out, in) weight), ``rowwise`` the
  input features (dim 2). The kit's GPT stores (expert, in, out): w1/w3 split their out features
  (dim 2), w2 its in features (dim 1). Each SwiGLU expert then computes an exact partial sum.
- ``packed_colwise`` weights hold gate|up side by side. They are STORED as a plain contiguous split
  (rank r holds rows [r·2I/tp, (r+1)·2I/tp): checkpoints, FSDP and full state dicts see ordinary
  shards); forward regroups them with one all-to-all so rank r computes the r-th piece of the
  gate and of the up projection (`collectives.regroup_blocks`).
- Tokens: the experts' input is whole on every tp rank (tp ranks share their data); its gradient,
  and that of the routing weights that mix the partial outputs, is summed over tp in backward; the
  mixed output is summed over tp in forward (`TensorSplit.inputs` / `.output`). The router and the
  balance loss stay outside: each tp rank computes them whole, like a norm's.
With ep the weights are one DTensor over the (ep, tp) mesh, sharded by expert and inside.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.parallel.collectives import regroup_blocks, sum_grad_over, sum_replicas
from colab_par.parallel.hf_experts import plan_entry

__all__ = ["WeightSplit", "TensorSplit", "GPT_EXPERT_SPLITS", "hf_expert_splits"]


@dataclass(frozen=True)
class WeightSplit:
    """How tp splits one packed expert weight: along `dim`, made of `blocks` equal blocks side by
    side (gate|up: 2) of which every rank computes its piece of each."""

    dim: int
    blocks: int = 1


GPT_EXPERT_SPLITS = {"w1": WeightSplit(2), "w3": WeightSplit(2), "w2": WeightSplit(1)}
"""The kit's `models.moe.Experts`: (expert, in, out) weights of a SwiGLU."""

# transformers' tp styles on an (expert, out, in) weight, as a split.
_HF_WEIGHT_STYLES = {"colwise": WeightSplit(1), "packed_colwise": WeightSplit(1, 2), "rowwise": WeightSplit(2)}


def hf_expert_splits(model: nn.Module, module_name: str, weight_names: list[str]) -> dict[str, WeightSplit]:
    """The splits of one Hugging Face experts module's packed weights, from the family's own
    ``base_model_tp_plan``; refuses a family whose plan does not split all of them."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    family = type(model).__name__
    if plan_entry(plan, module_name) != "moe_tp_experts":
        raise ValueError(f"{family}'s experts ({module_name}) have no 'moe_tp_experts' entry in its "
                         "tensor-parallel plan (config.base_model_tp_plan), so tp cannot split them; "
                         "split its experts with ep instead (e.g. 'dp2 ep2') or use tp=1")
    splits = {}
    for name in weight_names:
        style = plan_entry(plan, f"{module_name}.{name}")
        if style not in _HF_WEIGHT_STYLES:
            raise ValueError(f"{family}'s expert weight {module_name}.{name} has tp style {style!r}, not one "
                             f"of {', '.join(_HF_WEIGHT_STYLES)}; split its experts with ep or use tp=1")
        splits[name] = _HF_WEIGHT_STYLES[style]
    return splits


class TensorSplit:
    """One experts module split over the tp ranks of `group`: the forward's entry and exit and its
    weights' local pieces."""

    def __init__(self, group: dist.ProcessGroup, splits: dict[str, WeightSplit]):
        self.group, self.splits, self.size = group, splits, dist.get_world_size(group)

    def check(self, module: nn.Module, owner: str) -> None:
        """Refuse a split tp does not divide evenly (the pieces of gate and up must line up)."""
        for name, split in self.splits.items():
            size = getattr(module, name).shape[split.dim]
            if size % (split.blocks * self.size):
                raise ValueError(f"{owner}.{name} has {size // split.blocks} features per block along dim "
                                 f"{split.dim}, which tp={self.size} does not divide; choose a tp that "
                                 "divides the experts' hidden size")

    def inputs(self, tensor: torch.Tensor) -> torch.Tensor:
        """Identity forward; backward sums the partial gradients of the tp ranks."""
        return sum_grad_over(tensor, self.group)

    def output(self, partial: torch.Tensor) -> torch.Tensor:
        """The tp ranks' partial outputs summed; backward passes the gradient through (every tp
        rank computes the same loss from the sum, so its gradient is already whole)."""
        return sum_replicas(partial, self.group)

    def local(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `weight` as the experts compute with it (packed blocks regrouped)."""
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        split = self.splits.get(name)
        if split is None or split.blocks == 1:
            return local
        return regroup_blocks(local, self.group, split.blocks, split.dim)

