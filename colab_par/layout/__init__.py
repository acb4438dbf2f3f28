"""The parallel layout: one small frozen value that names every parallelism degree and option.

Pure Python on purpose (no torch.distributed import): the widget, the planner and the magics
validate layouts in a notebook kernel that has no cluster. Every rule lives in this folder, so the
planner and the picker offer layouts without knowing any rule themselves:

- `terms`: the fields, their named values, `LayoutError`, sizes derived from fields alone;
- `model_facts`: the model sizes the rules read, from any spelling of a config;
- `rules`: every rule that needs the world size, the model, the batch or the device, in order;
- `value`: the `Layout` itself, its compact string form and each field's own domain;
- `choices`: `valid_layouts` / `field_options`, the layouts the rules accept;
- `tier_options` (memory tiers) and `device_catalogue` (devices the bf16 rule knows).
"""
from colab_par.layout.choices import Choices, field_options, valid_layouts
from colab_par.layout.model_facts import PACKED_ATTENTION, has_expert_plan, model_sizes
from colab_par.layout.terms import (CHECKPOINTING, CP_MODES, DEGREES, FIELDS, PP_SCHEDULES, PRECISIONS,
                                    TP_MODES, ZERO_LEVELS, LayoutError, default_microbatches,
                                    grid_batch_chunks, tensor_grid)
from colab_par.layout.rules import splits_backward
from colab_par.layout.value import Layout

__all__ = ["Layout", "LayoutError", "model_sizes", "valid_layouts", "field_options",
           "default_microbatches", "tensor_grid", "grid_batch_chunks", "DEGREES", "ZERO_LEVELS",
           "PACKED_ATTENTION", "CP_MODES", "TP_MODES", "PP_SCHEDULES", "PRECISIONS", "CHECKPOINTING", "FIELDS",
           "Choices", "has_expert_plan", "splits_backward"]
