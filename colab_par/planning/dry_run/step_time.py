"""A step time from the trace: the traced FLOPs and collective bytes through the planner's own
device model (`planning.time_estimate`, `planning.devices`), to set beside the planner's time.

The planner derives its FLOPs and bytes from formulas; here they are what the rank's step did
(`DryRunReport.flops`, `DryRunReport.collectives`), and the same device figures turn them into
seconds: the FLOPs at the rate a micro-batch reaches on the device, the pipeline bubble on top,
each collective's ring traffic over the link its group spans, one latency per hop, and the
optimizer's read and write of the model state. Nothing is taken as hidden behind compute: this is
the step with every collective exposed, an upper bound on the planner's overlapped time.
"""
from __future__ import annotations

from colab_par.layout import Layout
from colab_par.planning.devices import DeviceSpec, get_device
from colab_par.planning.dry_run.report import DryRunReport
from colab_par.planning.time_estimate import pipeline_bubble, spans_nodes

__all__ = ["traced_step_seconds", "group_span"]


def group_span(layout: Layout, dim: str) -> tuple[int, int]:
    """(stride, size) in global ranks of the process group of mesh dimension `dim` (mesh order
    pp, dp, cp, tp; ep groups are neighbouring dp ranks, "edp" those holding the same experts;
    the grid dimensions of tp_mode 2d/2.5d/3d lie within the tp ranks)."""
    t, c, d, p = layout.tp, layout.cp, layout.dp, layout.pp
    spans = {"tp": (1, t), "cp": (t, c), "dp": (t * c, d), "dp_cp": (t, d * c), "pp": (t * c * d, p),
             "ep": (t * c, layout.ep), "edp": (t * c * layout.ep, d // layout.ep), "world": (1, t * c * d * p)}
    return spans.get(dim, (1, t))


def _ring_share(op: str, size: int) -> tuple[float, int]:
    """(share of the payload one rank moves, latency hops) of one call of `op` in a group of `size`."""
    if "send" in op or "recv" in op:
        return 1.0, 1
    if size == 1:
        return 0.0, 0
    if "all_reduce" in op or "allreduce" in op:
        return 2 * (size - 1) / size, 2 * (size - 1)
    return (size - 1) / size, size - 1


def traced_step_seconds(report: DryRunReport, device: "str | DeviceSpec", *, gpus_per_node: int = 8) -> float:
    """Seconds of `report`'s step on `device` (a catalogue name or DeviceSpec), all traffic exposed."""
    if report.flops <= 0:
        raise ValueError(f"the report of {report.layout!r} carries no traced FLOPs (flops={report.flops}); "
                         "trace it with this version's dry_run, which counts them")
    layout, dev = Layout.parse(report.layout), get_device(device)
    precision = layout.precision if layout.precision in dev.peak_flops else "fp32"  # a CPU has fp32 only, as the planner says
    micro_tokens = report.batch[0] // layout.dp // layout.microbatches * report.batch[1] // layout.cp
    rate = dev.peak_flops[precision] * dev.efficiency * micro_tokens / (micro_tokens + dev.half_tokens)
    compute = report.flops / rate
    bubble = pipeline_bubble(layout.pp, layout.microbatches, layout.pp_schedule, layout.virtual_stages)
    seconds = compute / (1 - bubble)
    for row in report.collectives:
        stride, size = group_span(layout, row.dim)
        share, hops = _ring_share(row.op, size)
        link = dev.inter_bandwidth if spans_nodes(stride, size, gpus_per_node) else dev.intra_bandwidth
        seconds += row.bytes * share / link + row.calls * hops * dev.latency
    state = report.peak.params + report.peak.grads + report.peak.optimizer
    return seconds + 2 * state / dev.hbm_bandwidth
