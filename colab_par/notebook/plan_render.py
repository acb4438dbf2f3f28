"""A plan as the LayoutPicker shows it: sizes, the memory bar, the table of top plans, the tiers line.

Kept apart from the picker's widget logic so that each reads on its own."""
from __future__ import annotations

import html

from colab_par.planning.planner import GiB, Plan

__all__ = ["size_text", "tier_text", "memory_bar_html", "plans_table_html"]

_PARTS = (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868"),
          ("activations", "#c44e52"), ("buffers", "#8172b3"))


def size_text(num_bytes: float) -> str:
    """MiB below a GiB, so the tiny models of a CPU tutorial do not all read 0.00 GiB."""
    if num_bytes < GiB:
        return f"{num_bytes / 2 ** 20:,.2f} MiB"
    return f"{num_bytes / GiB:,.2f} GiB"


def tier_text(option: Plan) -> str:
    """` · state per tier under a budget of 4.00 GiB: device 1.20 GiB, disk 3.10 GiB · 6.20 GiB moved
    per step (+2,310.0 ms)`."""
    tiers = option.tiers
    if tiers is None:
        return ""
    resident = tiers.resident()
    placed = ", ".join(f"{tier} {size_text(resident[tier])}" for tier in resident if resident[tier]) or "none"
    budget = f" under a budget of {size_text(tiers.budget)}" if tiers.budget is not None else ""
    return (f" · state per tier{budget}: {placed} · {size_text(tiers.moved)} moved per step "
            f"(+{tiers.seconds * 1e3:,.1f} ms)")


def memory_bar_html(estimate: "Plan | None", init: str) -> str:
    """The predicted memory by kind as a bar, with the building peak (solid) and the usable
    capacity (dashed) marked; "" without an estimate."""
    if estimate is None:
        return ""
    memory, capacity = estimate.memory, estimate.capacity
    scale = max(memory.total, memory.init, capacity)
    segments = "".join(
        f"<div title='{part}: {size_text(getattr(memory, part))}' style='width:"
        f"{100 * getattr(memory, part) / scale:.2f}%;background:{colour}'></div>"
        for part, colour in _PARTS)
    limit = (f"<div style='position:absolute;left:{100 * capacity / scale:.2f}%;top:0;bottom:0;"
             "border-left:2px dashed #000'></div>"
             f"<div style='position:absolute;left:{100 * memory.init / scale:.2f}%;top:0;bottom:0;"
             "border-left:2px solid #000'></div>")
    legend = " ".join(f"<span style='color:{colour}'>■</span> {part} "
                      f"{size_text(getattr(memory, part))}" for part, colour in _PARTS)
    return (f"<div style='position:relative;display:flex;height:18px;width:100%;"
            f"background:#eee'>{segments}{limit}</div><small>{legend} · solid line: building "
            f"the model (init='{init}') {size_text(memory.init)} · dashed line: usable "
            f"capacity {size_text(capacity)}</small>")


def plans_table_html(plans: list[Plan], none_fit: str) -> str:
    """The top plans that fit as a table; `none_fit` in bold where there are none."""
    if not plans:
        return f"<b>{html.escape(none_fit)}</b>"
    rows = "".join(
        f"<tr><td><code>{html.escape(str(p.layout))}</code></td><td>{size_text(p.memory.peak)}</td>"
        f"<td>{p.step_time * 1e3:,.1f}</td><td>{p.throughput}</td><td>{p.mfu:.1%}</td></tr>"
        for p in plans)
    return ("<table><tr><th>top plans that fit</th><th>peak/device</th><th>step ms</th>"
            f"<th>throughput</th><th>MFU</th></tr>{rows}</table>")
