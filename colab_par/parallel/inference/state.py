"""Forward-only work on a ParallelModel that leaves its training state as it was (what evaluation
and generation share).

Inside `training_state_kept(pm)`: no autograd graph, every module in eval mode (no dropout), and
the RNG streams of training forked (whatever draws inside comes back untouched). On the way out
every module's own train/eval flag is restored and FSDP modules are resharded: a forward without
backward leaves the root's (and, under zero 2, every block's) parameters gathered, which the
next training forward would otherwise find gathered (and memory would hold them).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

__all__ = ["training_state_kept", "bare_module"]


@contextlib.contextmanager
def training_state_kept(pm: Any) -> Iterator[None]:
    parts: list[nn.Module] = pm.model_parts
    modes = [(module, module.training) for part in parts for module in part.modules()]
    devices = [pm.device] if pm.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            for part in parts:
                part.eval()
            yield
        finally:
            for module, training in modes:
                module.training = training
            for part in parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()


def bare_module(part: nn.Module) -> nn.Module:
    """The module to call for forward-only work: DDP's wrapped module (DDP's forward would sync
    buffers and prepare a backward that never comes); anything else as it is (FSDP's forward
    gathers the parameters every rank must take part in)."""
    return part.module if isinstance(part, DistributedDataParallel) else part
