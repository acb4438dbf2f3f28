"""Activation checkpointing per block (trade recomputation for activation memory).

"full" recomputes each whole block in backward; "selective" keeps the matmul and attention outputs
(the expensive ops) and recomputes only the cheap elementwise ones (norms, SwiGLU, RoPE), following
torch's selective-checkpoint policies. Applied before FSDP so each wrapped block is one FSDP unit.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from colab_par.compat import checkpoint_wrapper, sdpa_aten_ops
from colab_par.parallel.blocks import Block, replace_block

__all__ = ["apply_activation_checkpointing"]

_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              *sdpa_aten_ops()}


def _save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(module: nn.Module, mode: str, blocks: list[Block]) -> nn.Module:
    """Wrap each of `module`'s `blocks` (see `blocks.py`) in place; mode is "none", "selective" or
    "full"."""
    if mode == "none":
        return module
    if mode not in ("selective", "full"):
        raise ValueError(f"checkpointing={mode!r} is unknown; choose 'none', 'selective' or 'full'")
    options = {"preserve_rng_state": False}
    if mode == "selective":
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _save_expensive_ops)
    for container, key, block in blocks:
        replace_block(container, key, checkpoint_wrapper(block, **options))
    return module
