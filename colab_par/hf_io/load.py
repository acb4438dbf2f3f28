"""`from_pretrained`: a Hugging Face model directory straight into a `ParallelModel`.

The model is built on the meta device (shapes only), the directory is checked against it from the
safetensors headers, and `parallelize` then materialises each rank's shards and fills them from
the files block by block, so no rank ever holds the whole model. Every refusal (no config, a
missing shard, a tensor of the wrong shape, tensor parallel for an architecture without a plan)
comes before any weight is read.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from colab_par.hf_io.family_files import FamilyWeights
from colab_par.models.hf_weights import WeightsError
from colab_par.layout import Layout

__all__ = ["from_pretrained"]


def from_pretrained(path: str | os.PathLike, layout: Layout | str, *,
                    dtype: torch.dtype | str = torch.float32, attn_implementation: str | None = None,
                    tp_plan: dict[str, Any] | None = None, lora: Any = None,
                    adapter: str | os.PathLike | None = None, is_trainable: bool = False,
                    **options: Any) -> Any:
    """The causal LM in the local Hugging Face directory `path`, spread over the engines as `layout` says.

    Call on every engine (e.g. in a ``%%colossal`` cell). `dtype`: the parameters' dtype; float32 by
    default because the kit trains with float32 master weights (``precision="bf16"`` in the layout
    adds autocast), "auto" keeps the dtype the directory's config records. `attn_implementation`:
    as in transformers; None keeps transformers' default (sdpa where the architecture has it).
    `tp_plan` and `options` go to `parallelize` (optimizer_fn, loss_fn, blocks, kernels, ...).

    `lora`: a peft config (``peft.LoraConfig(...)``, or another tuner's) whose new adapters are added
    to the model, initialised exactly as ``get_peft_model`` initialises them in one process with the
    same seed; only they train. `adapter`: a PEFT adapter directory (what ``save_pretrained`` of a
    PEFT model or peft itself wrote) loaded onto the model instead, trainable if `is_trainable`
    (peft's argument), else frozen. Either is checked against the model before any weight is read.
    """
    layout = Layout.parse(layout)
    path = Path(path)
    if lora is not None and adapter is not None:
        raise ValueError("give lora= (new adapters) or adapter= (a saved adapter directory), not both")
    build = _model_builder(path, dtype, attn_implementation)
    with torch.device("meta"):
        shapes = build()
    if layout.tp > 1 and tp_plan is None:
        _require_tp_plan(shapes, layout)
    from colab_par.parallel import parallelize

    with FamilyWeights(path, shapes) as weights:
        _refuse_unread_experts(shapes, weights)
        unused = weights.check(_expected(shapes), optional=_optional(shapes))
        if unused:
            warnings.warn(f"{path} holds {len(unused)} tensor(s) {type(shapes).__name__} does not use "
                          f"(e.g. {unused[0]}); they are not loaded", stacklevel=2)
        if lora is not None or adapter is not None:
            from colab_par.parallel.adapters.files import peft_source

            build, weights = peft_source(build, weights, path, lora=lora, adapter=adapter, is_trainable=is_trainable)
        del shapes
        return parallelize(build, layout, weights=weights, tp_plan=tp_plan, **options)


def _model_builder(path: Path, dtype: torch.dtype | str,
                   attn_implementation: str | None) -> Callable[[], nn.Module]:
    """A zero-argument factory of the directory's model (random init, in `dtype`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise WeightsError(f"{path} has no config.json; give the local directory of a Hugging Face "
                           "model (config.json plus safetensors weights), e.g. one downloaded with "
                           "huggingface_hub.snapshot_download or written by save_pretrained")
    config = AutoConfig.from_pretrained(path)
    resolved = _resolved_dtype(dtype, config)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}

    def build() -> nn.Module:
        return AutoModelForCausalLM.from_config(config, dtype=resolved, **extra)

    return build


def _resolved_dtype(dtype: torch.dtype | str, config: Any) -> torch.dtype:
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: give a floating torch dtype (torch.float32, "
                         "torch.bfloat16) or 'auto' (the dtype recorded in config.json)")
    return dtype


def _require_tp_plan(model: nn.Module, layout: Layout) -> None:
    """Refuse tensor parallel for an architecture that ships no plan, before anything is read."""
    from colab_par.parallel.tensor_parallel import hf_tp_plan

    try:
        hf_tp_plan(model)
    except ValueError:
        model_type = getattr(model.config, "model_type", "?")
        raise ValueError(f"{type(model).__name__} (model_type {model_type!r}) has no tensor-parallel "
                         f"plan (its config.base_model_tp_plan is empty), so layout '{layout}' cannot "
                         "split it; load it without tensor parallel (e.g. 'dp2 zero3' or 'pp2'), or "
                         "pass from_pretrained(..., tp_plan={module pattern: style})") from None


def _refuse_unread_experts(model: nn.Module, weights: FamilyWeights) -> None:
    """Packed experts the files hold neither packed nor in a layout transformers' conversion mapping
    for this model describes (and the kit can slice) are refused before anything is read."""
    from colab_par.parallel.hf_experts import packed_expert_names

    missing = [name for name in packed_expert_names(model) if name not in weights]
    if missing:
        model_type = getattr(model.config, "model_type", "?")
        raise WeightsError(f"{weights.path} lacks the experts {missing[0]} of {type(model).__name__} "
                           f"(model_type {model_type!r}) packed, and transformers' conversion mapping for "
                           "this model names no per-expert layout the kit reads; build the model with "
                           "transformers' own from_pretrained and pass it to parallelize, or save it once "
                           "with colab_par.hf_io.save_pretrained")


def _expected(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every state-dict name (tied names included) -> (shape, dtype), from the meta model."""
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}


def _optional(model: nn.Module) -> set[str]:
    """Names the files may lack: second names of tied tensors (transformers writes a tied tensor
    once) and buffers (the model computes them; the recorded init fills them)."""
    seen: set[int] = set()
    optional = {name for name, _ in model.named_buffers()}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            optional.add(name)
        seen.add(id(tensor))
    return optional
