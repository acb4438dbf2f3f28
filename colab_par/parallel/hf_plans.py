"""Tensor-parallel plans the kit writes for Hugging Face families that ship none (BERT, GPT-2), and
the styles they need that torch lacks (transformers' Conv1D, GPT-2's fused q|k|v).

Both are Megatron plans: the projections into attention and the feed-forward are split by output
columns, the projections out of them by input rows (one all-reduce each in forward); the
vocabulary is split in the word embeddings and in the head tied to them, whose logits are
gathered. Position embeddings and norms stay whole.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from colab_par.layout import PACKED_ATTENTION
from colab_par.parallel.collectives import regroup_blocks, sum_grad_over, sum_replicas

__all__ = ["KIT_PLANS", "base_prefix", "bert_tp_plan", "gpt2_tp_plan", "Conv1DColwise", "Conv1DRowwise",
           "DivideAttribute"]


def base_prefix(model: nn.Module) -> str:
    """The prefix of the base model's modules ("bert.", "transformer.") or "" for a base model."""
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def bert_tp_plan(model: nn.Module) -> dict[str, Any]:
    """BERT encoders (a masked LM, a classifier, the bare encoder). Self-attention views its
    projections as ``(..., -1, head_size)``, so every rank simply sees its own heads."""
    base = base_prefix(model)
    layer = f"{base}encoder.layer.*"
    plan: dict[str, Any] = {
        f"{base}embeddings.word_embeddings": "embedding_rowwise",
        f"{layer}.attention.self.query": "colwise", f"{layer}.attention.self.key": "colwise",
        f"{layer}.attention.self.value": "colwise", f"{layer}.attention.output.dense": "rowwise",
        f"{layer}.intermediate.dense": "colwise", f"{layer}.output.dense": "rowwise"}
    if isinstance(dict(model.named_modules()).get("cls.predictions.decoder"), nn.Linear):
        plan["cls.predictions.decoder"] = "colwise_gather_output"
    return plan


def gpt2_tp_plan(model: nn.Module) -> dict[str, Any]:
    """GPT-2 (its LM head model or the bare model). Its layers are transformers' Conv1D (weights
    stored (in, out)), and attention projects q, k and v in one fused layer whose output it splits
    by ``split_size``: that layer is split so each rank computes its own heads' q, k and v, and the
    attention's ``split_size`` becomes the local width."""
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) has no tensor-parallel "
                         "plan; use tp=1, or pass parallelize(..., tp_plan=...)")
    base = base_prefix(model)
    layer = f"{base}h.*"
    plan: dict[str, Any] = {
        f"{base}wte": "embedding_rowwise",
        f"{layer}.attn": DivideAttribute("split_size"),
        f"{layer}.attn.c_attn": Conv1DColwise(parts=PACKED_ATTENTION["gpt2"]), f"{layer}.attn.c_proj": Conv1DRowwise(),
        f"{layer}.mlp.c_fc": Conv1DColwise(), f"{layer}.mlp.c_proj": Conv1DRowwise()}
    if isinstance(dict(model.named_modules()).get("lm_head"), nn.Linear):
        plan["lm_head"] = "colwise_gather_output"  # tied to wte, split the same way
    return plan


KIT_PLANS: dict[str, Callable[[nn.Module], dict[str, Any]]] = {"bert": bert_tp_plan, "gpt2": gpt2_tp_plan}
"""The kit's plans by ``config.model_type``, for families whose transformers models ship none."""


# ---- styles -----------------------------------------------------------------------------------------
class _Conv1DStyle(ParallelStyle):
    """transformers' Conv1D, ``y = x @ W + b`` with W stored (in, out), split over the tp ranks; it
    runs on the local pieces of its parameters (gradients reach the DTensor shards through
    ``to_local``)."""

    placements: dict[str, Placement]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if weight is None or weight.dim() != 2 or bias is None or tuple(bias.shape) != weight.shape[1:]:
            raise ValueError(f"{type(self).__name__} splits transformers' Conv1D (weight (in, out), bias "
                             f"(out)), not {type(module).__name__}; use 'colwise'/'rowwise' for nn.Linear")
        for name, placement in self.placements.items():
            param = getattr(module, name)
            sharded = distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        group = device_mesh.get_group()
        module.forward = lambda x: self._forward(module, group, x)
        return module


class Conv1DColwise(_Conv1DStyle):
    """Split by output columns: every rank computes its columns from the whole input (whose
    gradient is summed over the ranks) and keeps them. `parts` > 1: the output is `parts` equal
    blocks side by side (GPT-2's q|k|v). The parameters are still stored as one plain column split
    (checkpoints and FSDP see ordinary shards); forward regroups them with one all-to-all so rank r
    computes the r-th piece of every block: its own heads' q, k and v."""

    def __init__(self, parts: int = 1):
        super().__init__()
        self.parts = parts
        self.placements = {"weight": Shard(1), "bias": Shard(0)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        width = getattr(module, "weight").shape[-1]
        if width % (self.parts * device_mesh.size()):
            raise ValueError(f"Conv1DColwise(parts={self.parts}) splits each of {self.parts} blocks of "
                             f"{width // self.parts} columns over tp={device_mesh.size()}, which does not "
                             "divide them; choose a tp that divides the heads")
        return super()._apply(module, device_mesh)

    def _forward(self, module: nn.Module, group: Any, x: torch.Tensor) -> torch.Tensor:
        x = sum_grad_over(x, group)
        weight, bias = module.weight.to_local(), module.bias.to_local()
        if self.parts > 1:
            weight, bias = regroup_blocks(weight, group, self.parts, 1), regroup_blocks(bias, group, self.parts, 0)
        return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)


class Conv1DRowwise(_Conv1DStyle):
    """Split by input rows: every rank multiplies its piece of the input (a column-split layer's
    output) by its rows; the partial products are summed over the ranks and the whole bias added."""

    def __init__(self) -> None:
        super().__init__()
        self.placements = {"weight": Shard(0), "bias": Replicate()}

    def _forward(self, module: nn.Module, group: Any, x: torch.Tensor) -> torch.Tensor:
        partial = x.reshape(-1, x.shape[-1]) @ module.weight.to_local()
        return (sum_replicas(partial, group) + module.bias.to_local()).view(*x.shape[:-1], -1)


class DivideAttribute(ParallelStyle):
    """A module attribute counting the features of a column-split layer's output (GPT-2
    attention's ``split_size``), divided by tp so the module splits the local output."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        value = getattr(module, self.name)
        if value % device_mesh.size():
            raise ValueError(f"{type(module).__name__}.{self.name}={value} does not split over "
                             f"tp={device_mesh.size()}; choose a tp that divides the heads")
        setattr(module, self.name, value // device_mesh.size())
        return module
