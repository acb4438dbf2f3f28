"""The dashboard's full picture: `Plot` values drawn by matplotlib (Agg) into a PNG.

The frame at the end of a cell (the saved notebook keeps it) and the picture `LiveDashboard.png`
writes to files; live frames while training are SVG text (svg_plot.py), a hundred times cheaper.
matplotlib is imported at the first picture, never with this module.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from colab_par.views.svg_plot import HEAT_COLOURS, Plot, grid_places

__all__ = ["PngPicture"]


class PngPicture:
    """One matplotlib figure for a grid of `columns` plots, built once per arrangement of plots (a
    MoE run's first counts add the heat maps) and then only given new data: re-creating axes and
    ticks costs several times more than drawing. Margins are fixed (layout engines cost a lot), set
    for a frame `dense_height` inches tall; the first `dense_plots` plots (the dense frame's) and
    every later plot of curves get small tick labels and few ticks; a heat map writes each count in its cell up to
    `max_labelled_cells` cells."""

    def __init__(self, *, columns: int, dpi: int, dense_height: float, dense_plots: int,
                 max_labelled_cells: int) -> None:
        self.columns, self.dpi, self.dense_height = columns, dpi, dense_height
        self.dense_plots, self.max_labelled_cells = dense_plots, max_labelled_cells
        self._figure: Any = None
        self._shape: tuple = ()  # the (heat map?, span) of each plot the figure was built for
        self._axes: list[Any] = []
        self._lines: list[list[Any]] = []  # each plot's line artists, in its lines' order
        self._drawn: list[Any] = []  # what the last picture added: bars, notes, cells, legends

    def png(self, plots: list[Plot], inches: tuple[float, float]) -> bytes:
        """`plots`, drawn now on a figure of `inches`, as PNG bytes."""
        self._ensure_figure(plots, inches)
        for artist in self._drawn:
            artist.remove()
        self._drawn = []
        for plot, ax, artists in zip(plots, self._axes, self._lines):
            ax.set_title(plot.title, fontsize=10)
            if plot.heat:
                self._draw_heat(ax, plot)
            if plot.bars:
                self._draw_stacked(ax, plot)
            for line, artist in zip(plot.lines, artists):
                artist.set_data(line.x, line.y)
                artist.axes.relim()
                artist.axes.autoscale_view()
        buffer = io.BytesIO()
        self._figure.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        return buffer.getvalue()

    def boxes(self, plots: list[Plot], inches: tuple[float, float]) -> list[tuple[int, int, int, int]]:
        """Where `png(plots, inches)` draws each plot: left, top, right, bottom in PNG pixels."""
        self._ensure_figure(plots, inches)
        height = int(round(self._figure.bbox.height))
        return [(int(round(ax.bbox.x0)), int(round(height - ax.bbox.y1)),
                 int(round(ax.bbox.x1)), int(round(height - ax.bbox.y0))) for ax in self._axes]

    def _ensure_figure(self, plots: list[Plot], inches: tuple[float, float]) -> None:
        shape = tuple((bool(plot.heat), plot.span) for plot in plots)
        if self._figure is not None and shape == self._shape:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._figure = Figure(figsize=inches, dpi=self.dpi)
        self._shape = shape
        FigureCanvasAgg(self._figure)
        places = grid_places(plots, self.columns)
        grid = self._figure.add_gridspec(places[-1][0] + 1, self.columns)
        self._axes = [self._figure.add_subplot(grid[row, column:column + plot.span])
                      for plot, (row, column) in zip(plots, places)]
        margin = self.dense_height / inches[1]  # the dense frame's margins, in inches
        self._figure.subplots_adjust(left=0.06, right=0.95, top=1 - 0.06 * margin,
                                     bottom=0.07 * margin, hspace=0.4, wspace=0.3)
        self._lines = []
        for index, (plot, ax) in enumerate(zip(plots, self._axes)):
            twin = ax.twinx() if any(line.right for line in plot.lines) else None
            self._lines.append([(twin if line.right else ax).plot(
                [], [], color=line.colour, linewidth=2, linestyle="--" if line.right else "-")[0]
                for line in plot.lines])  # every plot of curves (a GRPO run's reward plot comes last)
            if index >= self.dense_plots and not plot.lines:
                continue  # the tiers bars and heat maps keep their own ticks
            for axes in (ax, twin) if twin is not None else (ax,):
                axes.tick_params(labelsize=8)
                axes.locator_params(axis="y", nbins=4)  # every tick label is drawn text: keep few
            if plot.lines:
                ax.locator_params(axis="x", nbins=5)
        self._drawn = []

    def _draw_heat(self, ax: Any, plot: Plot) -> None:
        """The heat map as an image of its cells, coloured along the SVG frames' ramp from 0 to the
        largest count (no interpolation: one flat colour per cell)."""
        from matplotlib.colors import LinearSegmentedColormap

        values = np.asarray(plot.heat, dtype=float)
        high = float(values.max()) or 1.0
        ramp = LinearSegmentedColormap.from_list("expert_heat", HEAT_COLOURS)
        self._drawn.append(ax.imshow(values, cmap=ramp, vmin=0.0, vmax=high, aspect="auto",
                                     interpolation="nearest"))
        if values.size <= self.max_labelled_cells:
            for (layer, expert), value in np.ndenumerate(values):
                self._drawn.append(ax.text(expert, layer, f"{value:g}", ha="center", va="center",
                                           fontsize=7, color="black" if value / high > 0.6 else "white"))
        ax.set_yticks(range(len(plot.row_labels)), list(plot.row_labels))
        every = max(1, -(-len(plot.categories) // 32))  # at most 32 column labels
        ax.set_xticks(range(0, len(plot.categories), every), list(plot.categories[::every]))

    def _draw_stacked(self, ax: Any, plot: Plot) -> None:
        positions = list(range(len(plot.categories)))
        bottoms = [0.0] * len(positions)
        for stack in plot.stacks:
            if any(stack.heights):
                self._drawn.append(ax.bar(positions, stack.heights, bottom=bottoms, label=stack.label,
                                         color=stack.colour))
                bottoms = [b + h for b, h in zip(bottoms, stack.heights)]
        for i, note in enumerate(plot.notes):
            if note:
                self._drawn.append(ax.annotate(note, (i, bottoms[i]), ha="center", va="bottom",
                                              fontsize=7))
        if plot.limit:
            self._drawn.append(ax.axhline(plot.limit, color="#333333", linestyle="--", linewidth=1,
                                          label=plot.limit_label))
        ax.set_xticks(positions, list(plot.categories))
        ax.set_xlim(-0.6, len(positions) - 0.4)
        ax.set_ylim(0, 1.8 * max(bottoms + [plot.limit or 0.0]) or 1.0)  # headroom for legend and notes
        if positions and ax.get_legend_handles_labels()[0]:  # rows without these parts (GRPO's) draw none
            self._drawn.append(ax.legend(fontsize=7, loc="upper center", ncol=3))
