"""The planner's per-rank memory beside a dry run's traced peak, kind by kind.

The planner (`layout_estimate.estimate`) predicts the fullest rank's training peak from formulas,
at the step's fullest instant (`memory_estimate.step_instants`); the dry run sees what that rank's
real step allocates; its bytes per collective (`collective_estimate.collective_bytes`) stand beside
the trace's, call for call. Where the report carries its traced FLOPs, the planner's step time stands
beside the trace's (`step_time.traced_step_seconds`). Kinds pair up as the planner names them;
its `buffers` (the step's communication and staging buffers) stand against the tracker's
temporaries, and the process baseline (what an engine holds before any model) is left out on both
sides: the tracker sees tensors only. Whether the traced step fits the device is judged the
planner's way (90 % of its memory, less the baseline), naming the phase and kind that overflow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colab_par.layout import Layout
from colab_par.planning.collective_estimate import collective_bytes
from colab_par.planning.devices import GiB, DeviceSpec
from colab_par.planning.dry_run.report import MiB, DryRunReport, MemoryKinds
from colab_par.planning.dry_run.step_time import traced_step_seconds
from colab_par.planning.layout_estimate import estimate

__all__ = ["ComponentError", "CollectiveMatch", "Comparison", "compare"]

_PAIRS = (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
          ("activations", "activations"), ("temporaries", "buffers"))


@dataclass(frozen=True)
class ComponentError:
    """One kind of memory: the planner's bytes, the trace's, and (planner - trace) / trace."""

    kind: str
    predicted: float
    traced: float

    @property
    def relative_error(self) -> float:
        if self.traced == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return (self.predicted - self.traced) / self.traced


@dataclass(frozen=True)
class CollectiveMatch:
    """One collective op on one mesh dimension: the planner's (calls, bytes) and the trace's
    ((0, 0) where one side has none)."""

    dim: str
    op: str
    planned: tuple[int, int]
    traced: tuple[int, int]

    @property
    def equal(self) -> bool:
        return self.planned == self.traced


@dataclass(frozen=True)
class Comparison:
    """The planner against one dry run, per kind and for the whole peak (`rows[-1]`, "total")."""

    layout: str
    world_size: int
    rows: tuple[ComponentError, ...]
    device: str = "cpu"
    capacity: float = 0.0
    baseline: float = 0.0
    overflow: str = ""
    phase: str = ""  # the planner's fullest instant (`memory_estimate.step_instants`)
    step_time: float = 0.0  # the planner's seconds per step
    traced_step_time: float = 0.0  # the traced FLOPs and bytes on the device (0: the report has no FLOPs)
    collectives: tuple[CollectiveMatch, ...] = ()  # the planner's bytes per collective beside the trace's
    collectives_unplanned: str = ""  # why they were not compared (a family the planner does not model)

    @property
    def total(self) -> ComponentError:
        return self.rows[-1]

    @property
    def collectives_equal(self) -> bool | None:
        """Whether the planner's calls and bytes equal the trace's on every (dim, op); None when
        not compared."""
        return all(match.equal for match in self.collectives) if self.collectives else None

    @property
    def fits(self) -> bool:
        """The traced peak, with the process baseline, within the planner's usable capacity of
        the device (90 % of its memory)."""
        return not self.overflow

    def __str__(self) -> str:
        lines = [f"planner against the dry run of {self.layout!r} at world {self.world_size}",
                 f"{'kind':<12}{'planner':>14}{'traced':>14}{'error':>9}"]
        lines += [f"{row.kind:<12}{row.predicted / MiB:10.3f} MiB{row.traced / MiB:10.3f} MiB"
                  f"{row.relative_error:>+9.1%}" for row in self.rows]
        if self.phase:
            lines.append(f"the planner's fullest instant: {self.phase}")
        if self.traced_step_time:
            lines.append(f"step time on {self.device}: planner {self.step_time * 1e3:.1f} ms, traced "
                         f"{self.traced_step_time * 1e3:.1f} ms (every collective exposed)")
        if self.collectives_equal:
            lines.append(f"collectives: the planner's calls and bytes equal the trace's on all {len(self.collectives)}")
        elif self.collectives:
            lines += [f"collective {m.dim} {m.op}: planner {m.planned[0]} calls {m.planned[1]} B, traced "
                      f"{m.traced[0]} calls {m.traced[1]} B" for m in self.collectives if not m.equal]
        elif self.collectives_unplanned:
            lines.append(f"collectives not compared: {self.collectives_unplanned}")
        verdict = "fits" if self.fits else f"does not fit: {self.overflow}"
        lines.append(f"on {self.device} ({self.capacity / GiB:.1f} GiB usable): the trace {verdict}")
        return "\n".join(lines)


def compare(report: DryRunReport, model: Any, *, device: "str | DeviceSpec" = "cpu",
            optimizer: str = "adam") -> Comparison:
    """The planner's prediction for `report`'s layout, world and batch on `device`, beside the
    trace's peak (`model` as `dry_run` took it: a GPTConfig or Hugging Face config)."""
    layout = Layout.parse(report.layout)
    plan = estimate(model, layout, device=device, global_batch=report.batch[0], seq_len=report.batch[1],
                    optimizer=optimizer)
    predicted = plan.memory
    rows = [ComponentError(kind, getattr(predicted, planned), getattr(report.peak, kind)) for kind, planned in _PAIRS]
    rows.append(ComponentError("total", predicted.total, report.peak.total))
    traced_seconds = traced_step_seconds(report, device) if getattr(report, "flops", 0) > 0 else 0.0
    matches, unplanned = _collectives(report, model)
    return Comparison(report.layout, report.world_size, tuple(rows), getattr(device, "name", device), plan.capacity,
                      predicted.baseline, _overflow(report, plan.capacity - predicted.baseline), predicted.phase,
                      plan.step_time, traced_seconds, matches, unplanned)


def _collectives(report: DryRunReport, model: Any) -> tuple[tuple[CollectiveMatch, ...], str]:
    """The planner's bytes per collective (modelled for global rank 0) beside the trace's."""
    if report.rank != 0:
        return (), f"the planner models rank 0's collectives, not rank {report.rank}'s"
    try:
        planned = collective_bytes(model, report.layout, global_batch=report.batch[0], seq_len=report.batch[1],
                                   steps=report.steps)
    except ValueError as error:  # a family the planner does not model yet: the trace alone
        return (), str(error)
    traced = {(row.dim, row.op): (row.calls, row.bytes) for row in report.collectives}
    return tuple(CollectiveMatch(dim, op, planned.get((dim, op), (0, 0)), traced.get((dim, op), (0, 0)))
                 for dim, op in sorted({*planned, *traced})), ""


def _overflow(report: DryRunReport, room: float) -> str:
    """"" when every phase's peak fits in `room` bytes of the device; else the first phase that does
    not, and its largest kind of memory. State offloaded to the host (`report.host`) is not the
    device's to hold."""
    host = report.host.total
    for phase, kinds in report.phases.items():
        if kinds.total - host > room:
            largest = max(MemoryKinds.__dataclass_fields__, key=lambda kind: getattr(kinds, kind))
            return (f"{phase} needs {(kinds.total - host) / GiB:.1f} GiB on the device, "
                    f"{getattr(kinds, largest) / GiB:.1f} GiB of it {largest}")
    return "" if report.device_peak <= room else f"the step's peak needs {report.device_peak / GiB:.1f} GiB"
