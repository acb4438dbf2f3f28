"""The shard map picture (matplotlib, Agg): rows = parameters (or blocks), columns = ranks.

Each cell draws the whole tensor as an outline (dim 0 down, the other dims across) and fills the
block the rank holds: dark where it holds a slice, light where it holds all of it; a block row
fills the share of the block's elements held. Below, the bytes each rank holds, stacked:
parameters, gradients, optimizer state.
"""
from __future__ import annotations

import io
import math
from typing import Any

__all__ = ["draw", "size_text", "SLICE", "WHOLE"]

SLICE, WHOLE, OUTLINE = "#2F6DB5", "#A9C1E0", "#8A8A8A"
_STATE_COLOURS = {"parameters": "#3B4B7A", "gradients": "#F28E2B", "optimizer state": "#59A14F"}
_ROW_IN, _COL_IN, _NAMES_IN, _BARS_IN = 0.3, 1.35, 2.6, 1.6
_BOX = 0.34  # of a cell's width: the tensor's outline; the rest holds the words


def draw(shard_map: Any, *, dpi: int = 100) -> bytes:
    """The PNG of `shard_map`."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    rows, ranks = shard_map.rows(), shard_map.ranks
    grid_in = _ROW_IN * len(rows)
    width, height = _NAMES_IN + _COL_IN * len(ranks) + 0.3, grid_in + _BARS_IN + 1.2
    figure = Figure(figsize=(width, height), dpi=dpi)
    left, right = _NAMES_IN / width, 1 - 0.3 / width
    grid = figure.add_axes((left, (_BARS_IN + 0.75) / height, right - left, grid_in / height))
    bars = figure.add_axes((left, 0.35 / height, right - left, (_BARS_IN - 0.3) / height))
    for y, row in enumerate(rows):
        for x, rank in enumerate(ranks):
            _cell(grid, Rectangle, row, rank, x, y)
    grid.set_xlim(0, len(ranks))
    grid.set_ylim(len(rows), 0)
    grid.set_xticks([x + 0.5 for x in range(len(ranks))], [f"rank {r}" for r in ranks], fontsize=8)
    grid.xaxis.tick_top()
    grid.set_yticks([y + 0.5 for y in range(len(rows))], [_label(row) for row in rows], fontsize=7)
    grid.tick_params(length=0)
    for spine in grid.spines.values():
        spine.set_visible(False)
    figure.suptitle(f"{shard_map.layout}: the slice of each {'block' if not rows[0].shape else 'parameter'} "
                    "each rank holds", fontsize=9, x=0.02, y=1 - 0.12 / height, ha="left", va="top")
    _bytes(bars, shard_map, ranks)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _label(row: Any) -> str:
    shape = "×".join(map(str, row.shape)) if row.shape else f"{row.numel:,} el."
    return f"{row.name}  {shape}"


def _cell(axes, rectangle, row: Any, rank: int, x: int, y: int) -> None:
    """The tensor's outline with the held block filled, and the block in words beside it."""
    pad = 0.12
    box_x, box_y, box_w, box_h = x + 0.04, y + pad, _BOX - 0.04, 1 - 2 * pad
    axes.add_patch(rectangle((box_x, box_y), box_w, box_h, fill=False, edgecolor=OUTLINE, linewidth=0.6))
    held = row.fraction(rank)
    if rank in row.held and row.held[rank] > 0:
        colour = WHOLE if held == 1.0 else SLICE
        (x0, x1), (y0, y1) = _extent(row, rank)
        axes.add_patch(rectangle((box_x + x0 * box_w, box_y + y0 * box_h), (x1 - x0) * box_w,
                                 (y1 - y0) * box_h, facecolor=colour, edgecolor="none"))
    axes.text(x + _BOX + 0.04, y + 0.5, row.cell(rank), fontsize=6.5, va="center", ha="left",
              color="#222222" if rank in row.held else "#999999")


def _extent(row: Any, rank: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """The held block as fractions of the outline: across (the dims after the first) and down
    (dim 0). A 1-d tensor is a bar across; a block row fills its share across."""
    if not row.shape or rank not in row.slices:
        return (0.0, row.fraction(rank)), (0.0, 1.0)
    spans = [(start / size, stop / size) if size else (0.0, 1.0)
             for (start, stop), size in zip(row.slices[rank], row.shape)]
    if len(spans) == 1:
        return spans[0], (0.0, 1.0)
    down, across = spans[0], spans[1:]
    if len(across) == 1:
        return across[0], down
    # several dims across: a contiguous run of the flattened dims when the later ones are whole
    whole_after = all(span == (0.0, 1.0) for span in across[1:])
    if whole_after:
        return across[0], down
    share = math.prod(b - a for a, b in across)
    return (0.0, share), down


def _bytes(axes, shard_map: Any, ranks: list[int]) -> None:
    states = shard_map.state_per_rank()
    bottom = [0.0] * len(ranks)
    for name, colour in _STATE_COLOURS.items():
        values = [states[r][name] for r in ranks]
        if not any(values):
            continue
        axes.bar([x + 0.5 for x in range(len(ranks))], values, width=0.55, bottom=bottom, color=colour,
                 label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        axes.text(x + 0.5, total, size_text(total), ha="center", va="bottom", fontsize=7)
    axes.set_xlim(0, len(ranks))
    axes.set_ylim(0, max(bottom) * 1.25 or 1.0)
    axes.set_xticks([x + 0.5 for x in range(len(ranks))], [f"rank {r}" for r in ranks], fontsize=8)
    axes.set_yticks([])
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    axes.set_ylabel("bytes held", fontsize=8)
    axes.legend(fontsize=7, frameon=False, loc="upper left", ncol=3, bbox_to_anchor=(0, 1.18))


def size_text(count: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"
