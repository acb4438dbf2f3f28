"""A pipeline step of many microbatches from two short traces of the same layout.

A planner's pick for a large cluster may run 256 or 512 microbatches a step; tracing each one
costs minutes per rank role on a CPU. Once its warm-up is over a schedule repeats one
microbatch's work: each more microbatch issues the same sends, per-layer collectives and FLOPs,
and leaves the same bytes behind until the step ends (a stage-boundary activation's worth of
temporaries, its loss). So the step is
traced at `k` and `2k` microbatches of the same size (k at least the warm-up, `shortest_k`), and
every count, byte and FLOP (collectives, memory per kind at each phase's peak, the
operators' FLOPs) is carried along the line through the two to the layout's count: exactly, or
refused where the line does not land on whole calls and bytes.
"""
from __future__ import annotations

import dataclasses

from colab_par.layout import Layout
from colab_par.planning.dry_run.report import CollectiveCount, DryRunReport, MemoryKinds

__all__ = ["shortest_k", "short_layouts", "scaled_report"]


def shortest_k(layout: Layout) -> int:
    """The fewest microbatches from which `layout`'s step repeats one microbatch's work on every
    rank. One stage a rank (1F1B, GPipe): pp + 1, as rank 0 holds pp microbatches in 1F1B's steady
    state and its peak repeats from the next on (at k = pp it falls at the step's end instead: a
    4-stage 1F1B's rank 0 traced 16 % over its 16-microbatch step). Several stages a rank
    (interleaved, zbv): 2 x pp x virtual stages, a warm-up of up to that many forwards."""
    if layout.virtual_stages == 1:
        return layout.pp + 1
    return 2 * layout.pp * layout.virtual_stages


def short_layouts(layout: Layout, batch: tuple[int, int], k: int) -> list[tuple[Layout, tuple[int, int]]]:
    """The two traced variants of `layout` at global `batch`: `k` and `2k` microbatches of the
    layout's own microbatch size. Raises ValueError for a layout without a pipeline or with too
    few microbatches for the shortcut to save anything."""
    if layout.pp == 1:
        raise ValueError(f"microbatches={k}: {layout} has no pipeline, so no microbatches to scale; "
                         "leave microbatches=None")
    per_rank = batch[0] // layout.dp
    if per_rank % layout.microbatches:
        raise ValueError(f"batch {batch[0]} does not split into {layout.dp} x {layout.microbatches} microbatches")
    warm_up = shortest_k(layout)
    if not warm_up <= k < 2 * k < layout.microbatches:
        raise ValueError(f"microbatches={k}: the layout runs {layout.microbatches} a step and its warm-up "
                         f"{warm_up}; give k >= {warm_up} with 2k < {layout.microbatches}, or None to trace every one")
    size = per_rank // layout.microbatches
    return [(dataclasses.replace(layout, microbatches=m), (layout.dp * m * size, batch[1])) for m in (k, 2 * k)]


def _along(short: float, long: float, k: int, target: int) -> float:
    """The value at `target` microbatches on the line through (k, short) and (2k, long)."""
    return short + (long - short) * (target - k) / k


def _whole(short: int, long: int, k: int, target: int, what: str) -> int:
    numerator = short * k + (long - short) * (target - k)
    if numerator % k:
        raise ValueError(f"{what}: {short} at {k} microbatches and {long} at {2 * k} do not grow by a whole "
                         f"amount per microbatch; trace every microbatch (microbatches=None)")
    return numerator // k


def scaled_report(short: DryRunReport, long: DryRunReport, layout: Layout, batch: tuple[int, int]) -> DryRunReport:
    """`layout`'s step at global `batch` from traces at k (`short`) and 2k (`long`) microbatches."""
    k, target = Layout.parse(short.layout).microbatches, layout.microbatches
    if Layout.parse(long.layout).microbatches != 2 * k:
        raise ValueError(f"the traces run {k} and {Layout.parse(long.layout).microbatches} microbatches; "
                         f"scaling needs k and 2k")

    def memory(before: MemoryKinds, after: MemoryKinds, what: str) -> MemoryKinds:
        return MemoryKinds(**{kind: _whole(getattr(before, kind), getattr(after, kind), k, target, f"{what} {kind}")
                              for kind in MemoryKinds.__dataclass_fields__})

    shorter = {(row.dim, row.op): row for row in short.collectives}
    longer = {(row.dim, row.op): row for row in long.collectives}
    collectives = []
    for dim, op in dict.fromkeys([*longer, *shorter]):
        before, after = (rows.get((dim, op), CollectiveCount(dim, op, 0, 0)) for rows in (shorter, longer))
        collectives.append(CollectiveCount(dim, op, _whole(before.calls, after.calls, k, target, f"{dim} {op} calls"),
                                           _whole(before.bytes, after.bytes, k, target, f"{dim} {op} bytes")))
    return dataclasses.replace(
        long, layout=str(layout), batch=tuple(batch), collectives=tuple(collectives),
        phases={phase: memory(short.phases[phase], kinds, phase) for phase, kinds in long.phases.items()},
        peak=memory(short.peak, long.peak, "peak"), host=memory(short.host, long.host, "host"),
        flops=_along(short.flops, long.flops, k, target), seconds=short.seconds + long.seconds, scaled_from=(k, 2 * k))
