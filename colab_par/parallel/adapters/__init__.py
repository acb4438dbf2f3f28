"""The adapters step of `parallelize`: PEFT models (peft's LoRA and other tuners) under every layout.

A model from ``peft.get_peft_model`` is recognised by what it is (a ``PeftModel``). The step hands
the rest of `parallelize` its inner model, peft's tuner layers in place, so data parallel, ZeRO,
pipeline stages, recompute and bf16 treat it as any other model; only the parameters peft left
trainable get gradients and optimizer state. Tensor parallel splits each adapter with its base layer
(`tensor_split.py`), the 2d/2.5d/3d grids add LoRA to their weight pieces (`grid.py`); adapter
files go out and in in peft's format (`files.py`); what is kept for that and for rebuilding under
another layout is `Adapters` (`model.py`).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from colab_par.layout import Layout
from colab_par.models.hf import is_hf_model
from colab_par.parallel.adapters.files import PeftWeights
from colab_par.parallel.adapters.grid import adapt_to_grid, refuse_off_grid
from colab_par.parallel.adapters.model import (Adapters, base_layer_of, is_auxiliary_wrapper, is_peft_model,
                                               is_tuner_layer)
from colab_par.parallel.adapters.tensor_split import adapter_tp_plan, refuse_unsplittable
from colab_par.parallel.init_record import InitRecord
from colab_par.parallel.tensor_parallel import hf_tp_plan, tp_plan_for

__all__ = ["Adapters", "attach_adapters", "adapter_tp_plan", "adapt_to_grid", "base_layer_of", "is_peft_model",
           "wraps_output_layer"]


def attach_adapters(model: nn.Module, record: InitRecord | None, weights: Any, layout: Layout, *,
                    tp_plan: dict[str, Any] | None, built_on_meta: bool) -> tuple[nn.Module, Adapters | None, Any]:
    """(the model to parallelize, its adapters or None, the weight source by its names).

    For a PEFT model: its inner model, the init record and `weights` renamed to the inner model's
    names (peft's ``...q_proj.base_layer.weight`` is the base's ``...q_proj.weight``). Refused before
    any work: a PeftModel built on meta by the user (peft's adapter init is no ``reset_parameters``,
    so it cannot be replayed; a factory can), and adapters the tp plan (1d) or the tensor grid
    (2d/2.5d/3d, `grid.py`) would split without a rule for them."""
    if not is_peft_model(model):
        return model, None, weights
    if built_on_meta:
        raise ValueError("a PeftModel built on the meta device cannot be initialised as peft initialises "
                         "its adapters; pass a factory instead, e.g. parallelize(lambda: "
                         "get_peft_model(MyModel(config), lora_config), layout), or use "
                         "colab_par.from_pretrained(path, layout, lora=lora_config)")
    adapters = Adapters.of(model)
    inner = model.get_base_model()
    if layout.tp_mode != "1d":
        refuse_off_grid(inner, layout.tp_mode)
    elif layout.tp > 1:
        hf = is_hf_model(inner)
        raw = tp_plan if tp_plan is not None else hf_tp_plan(inner) if hf else {}
        refuse_unsplittable(inner, list(raw))  # with peft's layer named, before the plan's own checks
        adapter_tp_plan(inner, tp_plan_for(inner, tp_plan, hf=hf, sequence_parallel=layout.sequence_parallel))
    if record is not None:
        record.keep_under(adapters.prefix)
    if weights is not None and not isinstance(weights, PeftWeights):
        weights = PeftWeights(weights, adapters.base_names)
    return inner, adapters, weights


def wraps_output_layer(model: nn.Module) -> bool:
    """Whether peft wrapped the model's output head (a fused loss reading ``lm_head.weight`` directly
    would then skip the adapter, or the trained copy of ``modules_to_save``)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return head is not None and (is_tuner_layer(head) or is_auxiliary_wrapper(head))
