"""Activation checkpointing per block (trade recomputation for activation memory).

"full" recomputes each whole block in backward; "selective" keeps the matmul and attention outputs
(the expensive ops) and recomputes only the cheap elementwise ones (norms, SwiGLU, RoPE), following
torch's selective-checkpoint policies. Applied before FSDP so each wrapped block is one FSDP unit.

The recompute must redo the forward exactly. So the RNG state is saved before each block and
replayed in its recompute (dropout draws the forward's masks again; the stream is the one
`rng.py` seeds), and a block that takes a KV cache gets none while it trains: it would append this
forward's keys a second time in the recompute (the cause of selective checkpointing's "aten.slice
encountered during backward but not found in storage"), as transformers' own checkpointing drops it.
"""
from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from colab_par.compat import checkpoint_wrapper, sdpa_aten_ops
from colab_par.parallel.blocks import Block, replace_block

__all__ = ["apply_activation_checkpointing"]

_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              *sdpa_aten_ops()}
# The names blocks give the KV cache they write to (transformers' `GradientCheckpointingLayer`'s, the kit's GPT's).
_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the expensive ops' outputs autograd records. Not those a custom autograd Function runs
    inside its forward (grad mode off there): the Function saves what its backward needs itself,
    and caching its inner matmuls would keep, e.g., every s x s block of ring attention's scores
    of every layer until backward (more than no recompute at all); such a Function runs again."""
    if op in _SAVED_OPS and torch.is_grad_enabled():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _takes_cache(block: nn.Module) -> bool:
    """Whether `block`'s forward accepts a KV cache (by what it is: its signature, not its class)."""
    return any(name in inspect.signature(block.forward).parameters for name in (*_CACHE_KEYWORDS, "use_cache"))


def _drop_cache(block: nn.Module) -> Callable:
    """A forward pre-hook for `block`'s wrapper: a training call runs without the KV cache, whether
    the model passes it by keyword (Llama) or by position (GPT-2)."""
    signature = inspect.signature(block.forward)

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        bound = signature.bind_partial(*args, **kwargs)
        named = [bound.arguments, *(value for key, value in bound.arguments.items()
                                    if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD)]
        for arguments in named:
            for key in _CACHE_KEYWORDS:
                if arguments.get(key) is not None:
                    arguments[key] = None
            if arguments.get("use_cache"):
                arguments["use_cache"] = False
        return bound.args, bound.kwargs

    return hook


def apply_activation_checkpointing(module: nn.Module, mode: str, blocks: list[Block]) -> nn.Module:
    """Wrap each of `module`'s `blocks` (see `blocks.py`) in place; mode is "none", "selective" or
    "full"."""
    if mode == "none":
        return module
    if mode not in ("selective", "full"):
        raise ValueError(f"checkpointing={mode!r} is unknown; choose 'none', 'selective' or 'full'")
    options: dict[str, Any] = {"preserve_rng_state": True}
    if mode == "selective":
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _save_expensive_ops)
    for container, key, block in blocks:
        wrapped = checkpoint_wrapper(block, **options)
        if _takes_cache(block):
            wrapped.register_forward_pre_hook(_drop_cache(block), with_kwargs=True)
        replace_block(container, key, wrapped)
    return module
