"""Plots as SVG text: the live dashboard's frames, which the notebook frontend draws.

Why not matplotlib while training: an Agg picture costs the notebook 0.1-0.2 CPU-seconds and the
notebook shares its cores with the engines it watches. An SVG frame is a few kilobytes of text
built in about a millisecond, and every frontend (JupyterLab, VS Code, Colab) renders SVG and HTML
display data. This module knows nothing about training: it draws `Plot` values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Sequence

import numpy as np

__all__ = ["Line", "Stack", "Plot", "svg_grid", "heat_colour", "HEAT_COLOURS", "MAX_POINTS"]

MAX_POINTS = 400  # per line: two per pixel column of a plot; longer runs keep min and max
RIGHT_DASH = ' stroke-dasharray="5 3"'  # a right-axis curve may lie on a left one (MFU on tokens/s)
TITLE_PX, BOTTOM_PX, LEFT_PX, RIGHT_PX, GAP_PX = 20, 18, 46, 10, 8  # a plot's margins in its cell
# a heat map's ramp, low to high: viridis at six even stops, interpolated linearly in RGB (the PNG
# picture builds its matplotlib colormap from the same stops, so both draw a count the same colour)
HEAT_COLOURS = ("#440154", "#414487", "#2a788e", "#22a884", "#7ad151", "#fde725")
MIN_CELL_TEXT_PX = (22, 11)  # a heat-map cell this wide and tall also shows its value as text


@dataclass(frozen=True)
class Line:
    """One curve, y over x; `right` puts it on a second y axis whose tick labels take its colour."""

    label: str
    colour: str
    x: Sequence[float]
    y: Sequence[float]
    right: bool = False


@dataclass(frozen=True)
class Stack:
    """One part of stacked bars: its height in each category (earlier parts sit lower)."""

    label: str
    colour: str
    heights: Sequence[float]


@dataclass(frozen=True)
class Plot:
    """Lines over a shared x axis, or (`bars`) stacked bars over `categories` with a note above
    each bar and (`limit`, a height) a dashed line across them named `limit_label`, or (`heat`,
    rows of values) a heat map with `row_labels` down and `categories` across. `span` is how many
    grid columns the plot takes."""

    title: str
    bars: bool = False
    lines: tuple[Line, ...] = ()
    categories: tuple[str, ...] = ()
    stacks: tuple[Stack, ...] = ()
    notes: tuple[str, ...] = ()
    limit: float | None = None
    limit_label: str = ""
    heat: tuple[tuple[float, ...], ...] = ()
    row_labels: tuple[str, ...] = ()
    span: int = 1


def svg_grid(plots: Sequence[Plot], *, columns: int, width: int, height: int) -> str:
    """`plots` row by row in a grid of `columns` (a plot takes `span` of them; one that does not
    fit the rest of a row starts the next), as one standalone SVG document."""
    places = grid_places(plots, columns)
    rows = max((row for row, _ in places), default=0) + 1
    cell_w, cell_h = width / columns, height / rows
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="9">',
             f'<rect width="{width}" height="{height}" fill="white"/>']
    for plot, (row, column) in zip(plots, places):
        left, top = column * cell_w, row * cell_h
        right_axis = any(line.right for line in plot.lines)
        box = (left + LEFT_PX, top + TITLE_PX,
               left + plot.span * cell_w - (LEFT_PX if right_axis else RIGHT_PX) - GAP_PX,
               top + cell_h - BOTTOM_PX)
        kind = ' data-kind="heat"' if plot.heat else ""
        parts.append(f'<g class="plot" data-title="{escape(plot.title)}"{kind}>')
        parts.append(f'<text x="{(box[0] + box[2]) / 2:.0f}" y="{top + 14:.0f}" font-size="11" '
                     f'text-anchor="middle">{escape(plot.title)}</text>')
        parts.extend(_heat(plot, box) if plot.heat else _bars(plot, box) if plot.bars else _lines(plot, box))
        parts.append(f'<rect x="{box[0]:.0f}" y="{box[1]:.0f}" width="{box[2] - box[0]:.0f}" '
                     f'height="{box[3] - box[1]:.0f}" fill="none" stroke="#555"/></g>')
    parts.append("</svg>")
    return "".join(parts)


def grid_places(plots: Sequence[Plot], columns: int) -> list[tuple[int, int]]:
    """(row, column) of each plot's first grid cell: the SVG frames and the PNG picture agree."""
    places, row, column = [], 0, 0
    for plot in plots:
        span = min(plot.span, columns)
        if column + span > columns:
            row, column = row + 1, 0
        places.append((row, column))
        column += span
    return places


def _nice_ticks(low: float, high: float, count: int = 4) -> list[float]:
    """About `count` round tick values (steps of 1, 2, 2.5 or 5 times a power of ten) covering
    [low, high]; a degenerate range is widened around its value."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if high - low <= 1e-12 * max(abs(low), abs(high), 1e-300):
        spread = abs(low) * 0.1 or 1.0
        low, high = low - spread, high + spread
    raw = (high - low) / count
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(f * magnitude for f in (1, 2, 2.5, 5, 10) if f * magnitude >= raw * (1 - 1e-9))
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [float(f"{i * step:.12g}") for i in range(first, last + 1)]  # 0.30000000000000004 -> 0.3


def _tick_label(value: float) -> str:
    """Short tick text: 1.5k, 20M, 0.003, 2.5e-05."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


# ---- line plots ----------------------------------------------------------------------------------
def _lines(plot: Plot, box: tuple[float, float, float, float]) -> list[str]:
    left, top, right, bottom = box
    curves = [(line, *_finite(line.x, line.y)) for line in plot.lines]
    curves = [(line, x, y) for line, x, y in curves if len(x)]
    if not curves:
        return _waiting(box)
    x_low = min(float(x[0]) for _, x, _ in curves)
    x_high = max(float(x[-1]) for _, x, _ in curves)
    if x_high <= x_low:
        x_low, x_high = x_low - 0.5, x_high + 0.5
    parts = []
    for tick in _nice_ticks(x_low, x_high, 5):
        if x_low <= tick <= x_high:
            px = left + (tick - x_low) / (x_high - x_low) * (right - left)
            parts.append(f'<text x="{px:.1f}" y="{bottom + 12:.0f}" text-anchor="middle">'
                         f'{_tick_label(tick)}</text>')
    for side in (False, True):
        on_side = [(line, x, y) for line, x, y in curves if line.right == side]
        if not on_side:
            continue
        ticks = _nice_ticks(min(float(y.min()) for _, _, y in on_side),
                           max(float(y.max()) for _, _, y in on_side))
        y_low, y_high = ticks[0], ticks[-1]
        colour = on_side[0][0].colour if side else "black"
        for tick in ticks:
            py = bottom - (tick - y_low) / (y_high - y_low) * (bottom - top)
            if not side:
                parts.append(f'<line x1="{left:.0f}" x2="{right:.0f}" y1="{py:.1f}" y2="{py:.1f}" '
                             f'stroke="#e4e4e4"/>')
            anchor, tx = ("start", right + 4) if side else ("end", left - 4)
            parts.append(f'<text x="{tx:.0f}" y="{py + 3:.1f}" text-anchor="{anchor}" '
                         f'fill="{colour}">{_tick_label(tick)}</text>')
        for line, x, y in on_side:
            x, y = _thin(x, y)
            px = left + (x - x_low) / (x_high - x_low) * (right - left)
            py = bottom - (y - y_low) / (y_high - y_low) * (bottom - top)
            points = " ".join(map("%.1f,%.1f".__mod__, zip(px.tolist(), py.tolist())))
            parts.append(f'<polyline class="data" data-label="{escape(line.label)}" fill="none" '
                         f'stroke="{line.colour}" stroke-width="1.5"{RIGHT_DASH if side else ""} '
                         f'points="{points}"/>')
    return parts


def _finite(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    return (x, y) if keep.all() else (x[keep], y[keep])


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """At most MAX_POINTS points: each of MAX_POINTS / 2 buckets keeps its lowest and highest
    value, so spikes survive (a plain stride would drop them)."""
    if len(x) <= MAX_POINTS:
        return x, y
    edges = np.linspace(0, len(x), MAX_POINTS // 2 + 1).astype(int)
    starts, ends = edges[:-1], edges[1:] - 1
    lows, highs = np.minimum.reduceat(y, starts), np.maximum.reduceat(y, starts)
    return np.column_stack([x[starts], x[ends]]).ravel(), np.column_stack([lows, highs]).ravel()


def _waiting(box: tuple[float, float, float, float]) -> list[str]:
    left, top, right, bottom = box
    return [f'<text x="{(left + right) / 2:.0f}" y="{(top + bottom) / 2:.0f}" text-anchor="middle" '
            f'fill="#888">no data yet</text>']


# ---- stacked bars --------------------------------------------------------------------------------
def _bars(plot: Plot, box: tuple[float, float, float, float]) -> list[str]:
    left, top, right, bottom = box
    count = len(plot.categories)
    stacks = [s for s in plot.stacks if any(h > 0 for h in s.heights)]
    if not count or not stacks:
        return _waiting(box)
    totals = [sum(s.heights[i] for s in stacks) for i in range(count)]
    ticks = _nice_ticks(0.0, 1.35 * max(totals + [plot.limit or 0.0]))  # headroom for the legend and notes
    scale = (bottom - top) / ticks[-1]
    slot = (right - left) / count
    parts = []
    for tick in ticks:
        py = bottom - tick * scale
        parts.append(f'<line x1="{left:.0f}" x2="{right:.0f}" y1="{py:.1f}" y2="{py:.1f}" '
                     f'stroke="#e4e4e4"/><text x="{left - 4:.0f}" y="{py + 3:.1f}" '
                     f'text-anchor="end">{_tick_label(tick)}</text>')
    for i, category in enumerate(plot.categories):
        x, base = left + (i + 0.2) * slot, bottom
        for stack in stacks:
            h = stack.heights[i] * scale
            if h > 0:
                parts.append(f'<rect class="data" data-label="{escape(stack.label)}" x="{x:.1f}" '
                             f'y="{base - h:.1f}" width="{0.6 * slot:.1f}" height="{h:.1f}" '
                             f'fill="{stack.colour}"/>')
                base -= h
        parts.append(f'<text x="{x + 0.3 * slot:.1f}" y="{bottom + 12:.0f}" text-anchor="middle">'
                     f'{escape(category)}</text>')
        if i < len(plot.notes) and plot.notes[i]:
            parts.append(f'<text x="{x + 0.3 * slot:.1f}" y="{base - 3:.1f}" text-anchor="middle" '
                         f'font-size="8">{escape(plot.notes[i])}</text>')
    if plot.limit:
        py = bottom - plot.limit * scale
        parts.append(f'<line class="limit" data-label="{escape(plot.limit_label)}" x1="{left:.0f}" '
                     f'x2="{right:.0f}" y1="{py:.1f}" y2="{py:.1f}" stroke="#333" stroke-dasharray="4 3"/>'
                     f'<text x="{right - 2:.0f}" y="{py - 3:.1f}" text-anchor="end" font-size="8">'
                     f'{escape(plot.limit_label)}</text>')
    x, y = left + 4, top + 4
    for stack in stacks:  # legend along the top, wrapped at the plot's right edge
        width = 14 + 5 * len(stack.label)  # 8-pixel text is about 5 pixels a character
        if x + width > right and x > left + 4:
            x, y = left + 4, y + 11
        parts.append(f'<rect x="{x:.0f}" y="{y:.0f}" width="8" height="8" fill="{stack.colour}"/>'
                     f'<text x="{x + 10:.0f}" y="{y + 7:.0f}" font-size="8">{escape(stack.label)}</text>')
        x += width + 2
    return parts


# ---- heat maps -----------------------------------------------------------------------------------
def heat_colour(fraction: float) -> str:
    """The ramp's colour at `fraction` of the way from low (0) to high (1), as #rrggbb."""
    position = min(max(fraction, 0.0), 1.0) * (len(HEAT_COLOURS) - 1)
    index = min(int(position), len(HEAT_COLOURS) - 2)
    low, high = (_rgb(HEAT_COLOURS[i]) for i in (index, index + 1))
    mix = position - index
    return "#" + "".join(f"{round(a + (b - a) * mix):02x}" for a, b in zip(low, high))


def _rgb(colour: str) -> tuple[int, ...]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def _heat(plot: Plot, box: tuple[float, float, float, float]) -> list[str]:
    """One rect per value (class "cell", its row, column and value as data attributes), coloured
    from zero (low end) to the largest value (high end); the value as text where the cell has room."""
    left, top, right, bottom = box
    rows, columns = len(plot.heat), max((len(r) for r in plot.heat), default=0)
    if not rows or not columns:
        return _waiting(box)
    high = max(max(r) for r in plot.heat) or 1.0
    width, height = (right - left) / columns, (bottom - top) / rows
    labelled = width >= MIN_CELL_TEXT_PX[0] and height >= MIN_CELL_TEXT_PX[1]
    parts = []
    for i, values in enumerate(plot.heat):
        y = top + i * height
        for j, value in enumerate(values):
            x = left + j * width
            parts.append(f'<rect class="cell" data-row="{i}" data-column="{j}" data-value="{value:g}" '
                         f'x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{height:.1f}" '
                         f'fill="{heat_colour(value / high)}"/>')
            if labelled:
                ink = "black" if value / high > 0.6 else "white"  # the ramp's top is light
                parts.append(f'<text x="{x + width / 2:.1f}" y="{y + height / 2 + 3:.1f}" '
                             f'text-anchor="middle" font-size="8" fill="{ink}">{_tick_label(value)}</text>')
    for i, label in enumerate(plot.row_labels):
        parts.append(f'<text x="{left - 4:.0f}" y="{top + (i + 0.5) * height + 3:.1f}" '
                     f'text-anchor="end">{escape(label)}</text>')
    every = max(1, math.ceil(12 * columns / (right - left)))  # column labels at least 12 px apart
    for j, label in enumerate(plot.categories):
        if j % every == 0:
            parts.append(f'<text x="{left + (j + 0.5) * width:.1f}" y="{bottom + 12:.0f}" '
                         f'text-anchor="middle">{escape(label)}</text>')
    return parts
