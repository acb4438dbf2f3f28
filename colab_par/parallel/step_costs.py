"""What one training step costs a rank, measured: the parameters it holds, the activations it keeps
for backward and the bytes of the collectives it issues. The cost models (`tensor_costs.py`, the
planner) are checked against these numbers (tests, `benchmarks/tensor_modes.py`)."""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from colab_par.parallel.collective_bytes import CollectiveBytes
from colab_par.parallel.activations import ActivationMeter

__all__ = ["measure_step_costs"]

Batch = tuple[torch.Tensor, torch.Tensor]


def measure_step_costs(pm: Any, warm: Batch, counted: Batch) -> dict[str, int]:
    """Train on `warm` (optimizer state, caches), then count one step on `counted`; the kept
    activations are those of a forward and loss on `warm` (parameters aside, each storage once).
    Returns "params" (elements held), "activations" and "comm" (bytes)."""
    pm.train_step(*warm)
    with CollectiveBytes() as collectives:
        pm.train_step(*counted)
    params = list(pm.model.parameters())
    meter = ActivationMeter(exclude=params)
    tokens, targets = warm
    positions = torch.arange(tokens.shape[1])  # as the kit passes them (SP shards the sequence)
    with meter.measure():
        pm.model.loss_fn(pm.model(tokens, positions), targets)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return {"params": held, "activations": meter.bytes, "comm": collectives.bytes}
