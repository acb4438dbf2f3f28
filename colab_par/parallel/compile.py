"""Per-block ``torch.compile``, placed as torchtitan places it: after activation checkpointing
(so the compiled code holds the checkpoint and recomputes compiled too), before FSDP.

Each block's ``forward`` is compiled in place rather than the block wrapped, so parameter names,
state dicts and checkpoints stay those of the eager model, and the hooks that FSDP (applied next,
to the same module) puts on the block run outside the compiled code. Blocks of one class share
one code object, so dynamo compiles a model once per input shape (parameters are graph inputs,
not guarded constants) and reuses that code in every later cell; tensor-parallel blocks compile
their DTensor arithmetic. Numerics stay those of eager up to inductor's reordering of float sums.

Choosing `compile` also chooses torch's fused optimizer kernel where the user's optimizer has one
and left the implementation open (`fused_optimizer_fn`): on CPU the per-parameter loop of AdamW
costs as much as everything compiling saves inside the blocks. And a block that hits dynamo's
recompile limit stops with an error instead of running eager from then on (`_guarded_call`).
The CPU vector width is pinned first (`compat.pin_inductor_vector_width`), so code compiled under
one ATEN_CPU_CAPABILITY is never served under another.
"""
from __future__ import annotations

import functools
import inspect
import os
import shutil
import types
from typing import Any, Callable

import torch
from colab_par.compat import (failing_at_recompile_limit, fused_optimizer_devices, pin_inductor_vector_width,
                              recompile_limit, recompile_limit_error, tree_map)
from colab_par.parallel.blocks import Block

__all__ = ["apply_compile", "check_compiler", "fused_optimizer_fn"]


def apply_compile(blocks: list[Block], enabled: bool) -> list[Block]:
    """Compile the module at each block's place (the checkpoint wrapper where activation
    checkpointing wrapped the block); returns the blocks as FSDP should now shard them."""
    if not enabled:
        return blocks
    pin_inductor_vector_width()
    compiled: list[Block] = []
    for container, key, _ in blocks:
        outer = container.get_submodule(key)
        outer.forward = _guarded_call(torch.compile(outer.forward))
        compiled.append((container, key, outer))
    return compiled


def fused_optimizer_fn(optimizer_fn: Callable, enabled: bool) -> Callable:
    """`optimizer_fn`, whose optimizer runs torch's fused kernel when `enabled` (the layout compiles).

    Only a torch.optim class that has one (Adam, AdamW, SGD, Adagrad), built with neither `fused`
    nor `foreach` given, not differentiable, and its parameters on devices the fused kernels
    support: the same update, one kernel per kind of parameter (plain tensors, DTensors of one
    mesh) instead of a handful of ops per parameter. An optimizer the user configured explicitly,
    or any other, is returned as built."""
    if not enabled:
        return optimizer_fn

    @functools.wraps(optimizer_fn)
    def build(params: Any) -> torch.optim.Optimizer:
        return _fused_twin(optimizer_fn(params))
    return build


def _fused_twin(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` rebuilt (before any step) with ``fused=True`` where that changes only its speed.

    Its state dicts say ``fused: None`` as the user's own optimizer would, and loading one keeps
    the fused kernel, so checkpoints move freely between compiled and eager layouts."""
    kind, defaults = type(optimizer), optimizer.defaults
    accepted = inspect.signature(kind.__init__).parameters
    params = [p for group in optimizer.param_groups for p in group["params"]]
    devices = fused_optimizer_devices()
    if (not kind.__module__.startswith("torch.optim.")
            or "fused" not in accepted
            or defaults.get("fused") is not None or defaults.get("foreach") is not None
            or defaults.get("differentiable") or _has_stepped(optimizer) or not params
            or any(p.device.type not in devices or not p.is_floating_point() for p in params)):
        return optimizer
    settings = {key: value for key, value in defaults.items() if key in accepted}
    twin = kind([{**group, "fused": True} for group in optimizer.param_groups], **{**settings, "fused": True})
    twin.register_state_dict_post_hook(_as_configured)
    twin.register_load_state_dict_post_hook(_keep_fused)
    if len(_by_kind(params)) > 1:
        twin.step = types.MethodType(_step_each_kind_apart, twin)
    return twin


def _by_kind(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` split into what one fused call can take together: plain tensors, and the DTensors
    of each mesh; in their order."""
    kinds: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        kinds.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return list(kinds.values())


def _step_each_kind_apart(optimizer: torch.optim.Optimizer, closure: Callable | None = None) -> Any:
    """The optimizer's own step (its hooks included) over its groups split by kind of parameter,
    each part one fused call. The groups are put back after it, so state dicts, schedulers and
    the user see their own; only hooks running inside the step see the split."""
    whole = optimizer.param_groups
    optimizer.param_groups = [{**group, "params": part} for group in whole for part in _by_kind(group["params"])]
    try:
        return type(optimizer).step(optimizer, closure)
    finally:
        optimizer.param_groups = whole


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` holds the state of a step (Adagrad creates step-0 state on construction)."""
    return any(float(state.get("step", 0)) > 0 for state in optimizer.state.values())


def _as_configured(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    for group in state["param_groups"]:
        group["fused"] = None
    return state


def _keep_fused(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None


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


def _guarded_call(compiled: Callable) -> Callable:
    """`compiled` called with its inputs' pending collectives finished first.

    Tensor parallel's output styles hand the next module a tensor whose all-reduce is still in
    flight (an `AsyncCollectiveTensor`, see `torch.distributed.tensor.parallel`); compiled code
    given one returns a plain gradient where DTensor's redistribute needs a DTensor in backward.
    A non-view op on it waits and gives a plain tensor, with its autograd history.

    Dynamo compiles a code object for at most `torch._dynamo.config.recompile_limit` input shapes
    (or guard failures) and then silently runs new ones eager; here that limit is an error that
    says why, since the user asked for compiled steps."""
    def settle(value: Any) -> Any:
        return value.clone() if hasattr(value, "trigger_wait") else value

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(settle, (args, kwargs))
        try:
            with failing_at_recompile_limit():
                return compiled(*args, **kwargs)
        except recompile_limit_error() as error:
            limit = recompile_limit()
            raise RuntimeError(
                f"compile: a block was compiled for {limit} different input shapes or guards "
                f"(torch._dynamo.config.recompile_limit = {limit}) and would run eager from now on; "
                "feed batches of fixed shapes (pad or bucket the sequence length), raise "
                "torch._dynamo.config.recompile_limit, or drop 'compile' from the layout") from error
    return call
