"""What a sweep's tasks cost: the work a model dispatches, counted, and an engine's speeds, measured.

A task's time is not its matmul FLOPs alone. Small models spend most of it dispatching ATen ops
(microseconds each, with autograd's bookkeeping on top), element-wise ops are bound by memory, and
`foreach=False` optimizers pay per parameter tensor. So the meta probe counts, per unit, the ops a
forward dispatches and the bytes they write (`OpCounter`, beside torch's FLOP counter), and each
engine measures the matching rates once when it joins a sweep (`measure_speeds`): matmul FLOP/s,
copy bytes/s, ops/s with and without autograd, and optimizer tensor steps/s for each optimizer
the sweep uses. `predict.py` combines the two.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from colab_par import compat
from colab_par.compat import tree_leaves
from colab_par.selection.store import SpillStore
from colab_par.selection.trial import Trial, make_optimizer

__all__ = ["OpCounter", "measure_speeds", "optimizer_key"]


class OpCounter(compat.torch_dispatch_mode()):
    """Counts the ATen ops dispatched under it and the bytes their outputs write (a view writes
    none; an in-place op writes its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.written = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if not any(r.alias_info is not None and not r.alias_info.is_write for r in compat.op_schema(func).returns):
            self.written += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                                if isinstance(t, torch.Tensor))
        return out


def optimizer_key(trial: Trial) -> str:
    """The speeds entry that holds the rate of `trial`'s optimizer (one per optimizer setting)."""
    return f"optimizer_tensors_per_s {trial.optimizer} {sorted(trial.optimizer_kwargs.items())}"


def measure_speeds(device: torch.device, trials: list[Trial], repeats: int = 5) -> dict[str, float]:
    """This engine's rates (best of `repeats` tries each): `flops_per_s` (a 256² matmul),
    `copy_bytes_per_s` (a 4 MiB copy), `init_params_per_s` (normal draws), `store_tensors_per_s`
    (spill store writes and reads of small tensors), `ops_per_s` (ops of a chain of small element-wise ops run
    forward and backward, backward's ops counted), `nograd_ops_per_s` (the chain without autograd)
    and, per optimizer setting in `trials`, its tensor steps per second (`optimizer_key`)."""
    a = torch.randn(256, 256, device=device)
    source, target = torch.randn(1 << 20, device=device), torch.empty(1 << 20, device=device)
    speeds = {"flops_per_s": 2 * 256 ** 3 / _best_seconds(lambda: a @ a, device, repeats),
              "copy_bytes_per_s": source.numel() * source.element_size()
              / _best_seconds(lambda: target.copy_(source), device, repeats)}
    draw = torch.empty(1 << 20, device=device)
    speeds["init_params_per_s"] = draw.numel() / _best_seconds(draw.normal_, device, repeats)
    speeds["store_tensors_per_s"] = _store_rate(repeats)
    for grad in (True, False):
        chain, ops = _op_chain(device, grad)
        speeds["ops_per_s" if grad else "nograd_ops_per_s"] = ops / _best_seconds(chain, device, repeats)
    for trial in {optimizer_key(trial): trial for trial in trials}.values():
        step, tensors = _optimizer_step(trial, device)
        speeds[optimizer_key(trial)] = tensors / _best_seconds(step, device, repeats)
    return speeds


def _best_seconds(work: Callable[[], Any], device: torch.device, repeats: int) -> float:
    work()  # warm up (allocations, lazy state)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def _op_chain(device: torch.device, grad: bool, length: int = 100) -> tuple[Callable[[], None], int]:
    """A chain of `length` small element-wise ops (and its backward when `grad`), and how many
    ATen ops one run of it dispatches."""
    x = torch.randn(16, device=device, requires_grad=grad)

    def chain() -> None:
        y = x
        for i in range(length):
            y = torch.tanh(y) if i % 2 else y * 1.001
        if grad:
            y.sum().backward()

    counter = OpCounter()
    with counter:
        chain()
    return chain, counter.ops


def _optimizer_step(trial: Trial, device: torch.device, tensors: int = 32) -> tuple[Callable[[], None], int]:
    """One step of the trial's optimizer over `tensors` small parameters that have gradients."""
    params = [nn.Parameter(torch.randn(16, device=device)) for _ in range(tensors)]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = make_optimizer(trial, params)
    return optimizer.step, tensors


def _store_rate(repeats: int, tensors: int = 32) -> float:
    """Small tensors written to and read back from a spill store per second (file and mapping
    work per tensor; the bytes are counted at the copy rate)."""
    store, small = SpillStore.create(), torch.zeros(16)
    try:
        def put_and_get() -> None:
            for i in range(tensors):
                store.put(0, f"t{i}", small)
                store.get(0, f"t{i}", (16,)).clone()
        return 2 * tensors / _best_seconds(put_and_get, torch.device("cpu"), repeats)
    finally:
        store.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
