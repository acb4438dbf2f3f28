"""The timeline picture: a block of lanes per rank on one time axis (matplotlib, Agg).

Per rank: the Trainer's phases (thin), the host threads' time by category, one lane per
communication thread (gloo's workers, point-to-point transfers) and per CUDA stream, each
collective in its own colour, so what overlaps what is seen by looking down a rank's block.
"""
from __future__ import annotations

import io
from typing import Any

from colab_par.profiling.events import COLLECTIVES, MAIN_CATEGORIES

__all__ = ["draw", "COLOURS"]

COLOURS = {
    # the host lane
    "compute": "#4C72B0", "optimizer": "#8172B3", "data": "#17BECF", "communication": "#DD8452",
    "waiting": "#C44E52", "bubble": "#BDBDBD", "host": "#E4E4E4",
    # collectives
    "all_reduce": "#F28E2B", "reduce_scatter": "#59A14F", "all_gather": "#76B7B2", "broadcast": "#EDC948",
    "all_to_all": "#B07AA1", "send": "#FF9DA7", "recv": "#9C755F", "send_recv": "#E15759",
    "reduce": "#D4A6C8", "gather": "#86BCB6", "scatter": "#A0CBE8", "barrier": "#79706E", "other": "#BAB0AC",
}
_PHASE_COLOURS = {"data": "#D9CBB8", "forward_backward": "#C6D4E8", "clip": "#E8E0C6", "optimizer": "#D6CFE6"}
_LANE_IN = {"phase": 0.12, "main": 0.3, "comm": 0.22, "device": 0.22}
_HEADER_IN, _GAP_IN = 0.22, 0.16
_LEGEND = {"communication": "comm call", "waiting": "waiting on comm", "bubble": "pipeline bubble",
           "host": "host code"}
_SHORT = {"communication": "comm", "waiting": "wait", "optimizer": "optim"}


def draw(timeline: Any, *, width: float = 12.0, dpi: int = 100) -> bytes:
    """The PNG of `timeline` (a `timeline.Timeline`)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    blocks = [(rank, timeline.lanes(rank)) for rank in timeline.ranks]
    height_in = sum(_HEADER_IN + sum(_LANE_IN[lane["kind"]] for lane in lanes) + _GAP_IN
                    for _, lanes in blocks)
    figure = Figure(figsize=(width, height_in + 1.3), dpi=dpi)
    axes = figure.add_axes((0.11, 0.9 / (height_in + 1.3), 0.87, height_in / (height_in + 1.3)))
    y, ticks, labels, used = 0.0, [], [], set()
    summaries = {row["rank"]: row for row in timeline.summary()}
    for rank, lanes in blocks:
        top = y
        axes.text(0, y + _HEADER_IN * 0.55, _headline(rank, summaries[rank]), fontsize=8, va="center",
                  ha="left", fontweight="bold")
        y += _HEADER_IN
        for lane in lanes:
            height = _LANE_IN[lane["kind"]]
            _bars(axes, lane, y + 0.1 * height, 0.8 * height, used)
            ticks.append(y + height / 2)
            labels.append(f"r{rank} {lane['name']}")
            y += height
        for step, start, end in timeline.steps(rank):
            axes.vlines([start, end], top + _HEADER_IN, y, colors="#333333", linestyles="dashed", linewidth=0.6)
            axes.text(start, y, f" step {step}", fontsize=7, va="top", ha="left", color="#333333")
        y += _GAP_IN
    axes.set_ylim(y, 0)
    axes.set_xlim(0, timeline.span_us * 1.001 or 1.0)
    axes.set_yticks(ticks, labels, fontsize=7)
    axes.tick_params(axis="y", length=0)
    ticks_us = axes.get_xticks()
    axes.set_xticks(ticks_us, [f"{t / 1e3:g}" for t in ticks_us], fontsize=8)
    axes.set_xlim(0, timeline.span_us * 1.001 or 1.0)
    axes.set_xlabel("time (ms)", fontsize=8)
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    order = [c for c in MAIN_CATEGORIES if c in used] + [k for k in COLLECTIVES if k in used]
    handles = [Patch(facecolor=_colour(name), edgecolor="none",
                     hatch="///" if name == "bubble" else None, label=_LEGEND.get(name, name))
               for name in order]
    handles += [Patch(facecolor=_PHASE_COLOURS[p], edgecolor="none", label=f"phase: {p}")
                for p in _PHASE_COLOURS if f"phase:{p}" in used]
    figure.legend(handles=handles, loc="lower center", ncol=min(8, max(1, len(handles))), fontsize=7,
                  frameon=False)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _headline(rank: int, row: dict[str, Any]) -> str:
    shares = " · ".join(f"{_SHORT.get(c, c)} {row[c]:.0%}" for c in MAIN_CATEGORIES if row[c] >= 0.005)
    hidden = row["hidden_us"] / row["comm_us"] if row["comm_us"] else 0.0
    comm = f"  |  collectives {row['comm_us'] / 1e3:.2f} ms, {hidden:.0%} overlapped" if row["comm_us"] else ""
    return f"rank {rank}  {row['span_us'] / 1e3:.1f} ms:  {shares}{comm}"


def _colour(label: str) -> str:
    return COLOURS.get(label, COLOURS["other"])


def _bars(axes: Any, lane: dict[str, Any], y: float, height: float, used: set[str]) -> None:
    """One broken_barh per label of the lane (fast for thousands of segments)."""
    phase = lane["kind"] == "phase"
    by_label: dict[str, list[tuple[float, float]]] = {}
    for start, end, label in lane["segments"]:
        by_label.setdefault(label, []).append((start, end - start))
    for label, spans in by_label.items():
        colour = _PHASE_COLOURS.get(label, COLOURS["other"]) if phase else _colour(label)
        axes.broken_barh(spans, (y, height), facecolors=colour, edgecolor="none",
                         hatch="///" if label == "bubble" else None)
        used.add(f"phase:{label}" if phase else label)
