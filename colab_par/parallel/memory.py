"""Bytes of model state this rank really holds: counted from the local shards, not from formulas.

The planner predicts these numbers; this module measures them, so the two can be compared.
Tensors that CPU offload keeps in host memory are reported under ``host_*`` keys; whether FSDP
offloads is read from FSDP's own state (its `CPUOffloadPolicy`), not from the layout that asked. The ``tier_*``
keys are memory tiers' view: model state resident per tier now (on a CPU-only machine device and
host are one memory, counted as ``tier_device``), bytes moved between tiers in the last step and
the measured working memory (0 before the first step); a layout without tiers has none of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from colab_par.compat import fsdp_offload_policy
from colab_par.memory_tiers.optimizer import TieredAdamW

if TYPE_CHECKING:
    from colab_par.parallel import ParallelModel

__all__ = ["memory_report"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors: Iterable[torch.Tensor], offloaded: bool) -> tuple[int, int]:
    """(device bytes, host bytes); with offload every CPU tensor counts as host memory."""
    device = host = 0
    for tensor in tensors:
        local = _local(tensor)
        size = local.numel() * local.element_size()
        if offloaded and local.device.type == "cpu":
            host += size
        else:
            device += size
    return device, host


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    if isinstance(optimizer, TieredAdamW):  # its state is counted per tier
        return []
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return [value for state in inner.state.values() for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0]


def memory_report(pm: "ParallelModel") -> dict[str, int]:
    """This rank's params / grads / optimizer bytes (and host_* for offloaded state), plus totals."""
    params = [p for part in pm.model_parts for p in part.parameters()]
    offloaded = any(isinstance(fsdp_offload_policy(module), CPUOffloadPolicy)
                    for part in pm.model_parts for module in part.modules() if isinstance(module, FSDPModule))
    report: dict[str, int] = {}
    for name, tensors in (("params", params), ("grads", [p.grad for p in params if p.grad is not None]),
                          ("optimizer", _optimizer_tensors(pm.optimizer))):
        report[name], report[f"host_{name}"] = _bytes(tensors, offloaded)
    _add_tiers(report, pm.optimizer)
    report["total"] = report["params"] + report["grads"] + report["optimizer"]
    report["host_total"] = report["host_params"] + report["host_grads"] + report["host_optimizer"]
    return report


def _add_tiers(report: dict[str, int], optimizer: torch.optim.Optimizer) -> None:
    """The tier_* keys of a layout with memory tiers (none without: the dashboard draws tiers
    only for runs that have them); the chunks a TieredAdamW holds in memory count as optimizer /
    grads bytes."""
    if not isinstance(optimizer, TieredAdamW):
        return
    placed = optimizer.placed_bytes()
    if placed is not None:
        for kind in ("optimizer", "grads"):
            report[kind] += placed["device"][kind]
            report[f"host_{kind}"] += placed["host"][kind]
        report["params"] -= placed["disk"]["params"]  # counted from the shards above; they live in files
    report["tier_device"] = report["params"] + report["grads"] + report["optimizer"]
    report["tier_host"] = report["host_params"] + report["host_grads"] + report["host_optimizer"]
    report["tier_disk"] = sum(placed["disk"].values()) if placed else 0
    report["tier_moved"] = optimizer.last_moved if placed else 0
    report["tier_working"] = optimizer.working if placed else 0
    report["tier_budget"] = optimizer.tiers.budget or 0  # bytes per rank; 0: no budget
