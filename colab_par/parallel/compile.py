"""Per-block ``torch.compile``, placed as torchtitan places it: after activation checkpointing
(so the compiled code holds the checkpoint and recomputes compiled too), before FSDP.

Each block's ``forward`` is compiled in place rather than the block wrapped, so parameter names,
state dicts and checkpoints stay those of the eager model, and the hooks that FSDP (applied next,
to the same module) puts on the block run outside the compiled code. Blocks of one class share
one code object, so dynamo compiles a model once per input shape (parameters are graph inputs,
not guarded constants) and reuses that code in every later cell; tensor-parallel blocks compile
their DTensor arithmetic. Numerics stay those of eager up to inductor's reordering of float sums.
"""
from __future__ import annotations

import functools
import os
import shutil
from typing import Any, Callable

import torch

from colab_par.compat import tree_map
from colab_par.parallel.blocks import Block

__all__ = ["apply_compile", "check_compiler"]


def apply_compile(blocks: list[Block], enabled: bool) -> list[Block]:
    """Compile the module at each block's place (the checkpoint wrapper where activation
    checkpointing wrapped the block); returns the blocks as FSDP should now shard them."""
    if not enabled:
        return blocks
    compiled: list[Block] = []
    for container, key, _ in blocks:
        outer = container.get_submodule(key)
        outer.forward = _settling_inputs(torch.compile(outer.forward))
        compiled.append((container, key, outer))
    return compiled


def check_compiler(device: torch.device) -> None:
    """Inductor turns CPU graphs into C++ (the compiler in $CXX, else g++); without one the first
    step would fail deep inside compilation, so `parallelize` says it before any work."""
    if device.type != "cpu":
        return
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"compile on CPU needs a C++ compiler for inductor, and {compiler!r} is not "
                           "on PATH; install one (e.g. apt-get install g++, or set CXX), or drop "
                           "'compile' from the layout")


def _settling_inputs(compiled: Callable) -> Callable:
    """`compiled` called with its inputs' pending collectives finished first.

    Tensor parallel's output styles hand the next module a tensor whose all-reduce is still in
    flight (an `AsyncCollectiveTensor`, see `torch.distributed.tensor.parallel`); compiled code
    given one returns a plain gradient where DTensor's redistribute needs a DTensor in backward.
    A non-view op on it waits and gives a plain tensor, with its autograd history."""
    def settle(value: Any) -> Any:
        return value.clone() if hasattr(value, "trigger_wait") else value

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(settle, (args, kwargs))
        return compiled(*args, **kwargs)
    return call
