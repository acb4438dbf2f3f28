"""Tensor parallel (+ Megatron sequence parallel) through DTensor's ``parallelize_module``.

The reference GPT gets a Megatron plan: q/k/v and the SwiGLU gate/up projections are split by
output columns, the attention and FFN output projections by input rows, so each block needs one
all-reduce in forward (or, with sequence parallel, a reduce-scatter + all-gather pair that keeps
norms and residuals sharded along the sequence). The vocabulary is sharded in the embedding and the
output head, whose logits are gathered so any loss function works on them unchanged.
Hugging Face models bring their own plan (``_tp_plan``), translated here to DTensor styles.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from colab_par import compat

__all__ = ["apply_tensor_parallel", "gpt_tp_plan", "hf_tp_plan"]


def gpt_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for `colab_par.models.GPT` (or a pipeline stage of it: missing parts are skipped)."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(input_layouts=between_blocks, output_layouts=Replicate())
    for name in model.layers:
        prefix = f"layers.{name}"
        if sequence_parallel:
            plan[f"{prefix}.attention_norm"] = SequenceParallel()
            plan[f"{prefix}.ffn_norm"] = SequenceParallel()
        # One replicated DTensor input shared by q/k/v (and gate/up): their input gradients are
        # summed as partial DTensors first, so backward needs one all-reduce, not one per projection.
        plan[f"{prefix}.attention"] = PrepareModuleInput(
            input_layouts=(between_blocks, None, None), desired_input_layouts=(Replicate(), None, None))
        plan[f"{prefix}.feed_forward"] = PrepareModuleInput(
            input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),))
        for proj in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"{prefix}.{proj}"] = ColwiseParallel()
        for proj in ("attention.wo", "feed_forward.w2"):
            plan[f"{prefix}.{proj}"] = RowwiseParallel(output_layouts=between_blocks)
    return plan


# Hugging Face plan strings -> DTensor styles (only the ones a dense decoder uses).
_HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def hf_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Translate a transformers model's own ``_tp_plan`` (FQN pattern -> style name) to DTensor."""
    raw: dict[str, str] = compat.hf_tp_plan(model)
    if not raw:
        raw = {f"model.{k}": v for k, v in (getattr(model.config, "base_model_tp_plan", None) or {}).items()}
    if not raw:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (_tp_plan / "
                         "config.base_model_tp_plan); use a layout with tp=1")
    plan = {}
    for pattern, style in raw.items():
        if style not in _HF_STYLES:
            raise ValueError(f"tensor-parallel style {style!r} for {pattern!r} is not supported; "
                             f"supported: {', '.join(_HF_STYLES)}; use tp=1 for this model")
        plan[pattern] = _HF_STYLES[style]()
    return plan


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, Any]) -> nn.Module:
    """Shard `module` in place over `tp_mesh` (a no-op plan on a size-1 mesh is skipped)."""
    if tp_mesh.size() == 1:
        return module
    parallelize_module(module, tp_mesh, plan)
    for submodule in module.modules():
        if isinstance(submodule, nn.Embedding):
            _keep_gradient_sharded_like(submodule.weight)
    return module


def _keep_gradient_sharded_like(param: nn.Parameter) -> None:
    """DTensor's embedding backward returns a full-size (Replicate) gradient for a vocab-sharded
    weight; chunking it back to the weight's placement (no communication) keeps (t-1)/t of the
    embedding's gradient bytes off every tensor-parallel rank."""
    if isinstance(param, DTensor):
        param.register_hook(lambda grad: grad.redistribute(placements=param.placements)
                            if isinstance(grad, DTensor) and grad.placements != param.placements else grad)
