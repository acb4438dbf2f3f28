"""What a logged step adds to its row with telemetry on: throughput, model FLOPs and MFU, the
pipeline bubble, and memory (model state, gradients, activations, the device's own counters).
The Trainer owns the loop; this owns the measuring, so neither grows the other's job."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch.distributed as dist

from colab_par.parallel.activations import ActivationMeter
from colab_par.training import telemetry as telem

__all__ = ["StepMeasures", "telemetry_flops_per_token"]


def telemetry_flops_per_token(pm: Any, seq_len: int) -> float:
    """Model FLOPs per trained token of the whole (unsplit) model."""
    model = pm.model_parts[0]
    model = getattr(model, "module", model)  # DDP keeps the model under .module
    num_params = sum(p.numel() for part in pm.model_parts for p in part.parameters())
    return telem.model_flops_per_token(model, num_params, seq_len)


class StepMeasures:
    """Measures of one model's logged steps: `activations` wraps the first micro-step's forward,
    `count_flops` counts FLOPs once where no formula applies, `add_to` fills the row (of `pm`, which a relayout may have replaced)."""

    def __init__(self, pm: Any, seq_len: int | None, grad_accum: int, enabled: bool) -> None:
        self.grad_accum = grad_accum
        self.flops_per_token = telemetry_flops_per_token(pm, seq_len) if enabled and seq_len else 0.0
        self.measured_flops: float | None = None  # per rank and step, counted where no formula applies
        self.peak = telem.device_peak_flops(pm.device, pm.layout.precision) if enabled else 0.0
        self.activations = ActivationMeter()

    @contextlib.contextmanager
    def count_flops(self) -> Iterator[None]:
        """Count this rank's FLOPs of one micro-step once (torch's FlopCounterMode), for models
        with no FLOP formula; the count includes recomputation, so MFU is then hardware FLOPs."""
        if self.flops_per_token or self.measured_flops is not None:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield
        self.measured_flops = float(counter.get_total_flops()) * self.grad_accum

    def add_to(self, row: dict, pm: Any, grads: int, bubbles: list[float | None], samples: int, tokens: int) -> None:
        started = time.perf_counter()
        world = dist.get_world_size() if dist.is_initialized() else 1
        row["samples_per_s"] = samples / row["step_time"]
        if tokens:
            row["tokens_per_s"] = tokens / row["step_time"]
        if self.flops_per_token:
            row["flops_per_s"] = self.flops_per_token * tokens / world / row["step_time"]
        else:
            row["flops_per_s"] = (self.measured_flops or 0.0) / row["step_time"]
        row["mfu"] = row["flops_per_s"] / self.peak if self.peak else None
        row["bubble"] = sum(bubbles) / len(bubbles) if None not in bubbles else None
        row.update(telem.memory_sample(pm, self.activations.bytes, grads))
        row["time_telemetry"] = time.perf_counter() - started
