"""Does a dashboard frame show data? Counts pixels of the data colours inside each plot area of
a PNG picture, and the drawn extent of the data elements of each plot of an SVG live frame.

One helper for every test of a dashboard picture (unit frames, the live run, `colab-par demo`'s
PNG, the notebooks' final frames): a frame passes only when every one of its plots shows its lines
or bars, so a blank frame with empty axes fails (checked on every call). The model-selection
view's frames get the same kind of check, per trial colour and engine lane.
"""
from __future__ import annotations

import io
import xml.etree.ElementTree as ET

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from colab_par.views.dashboard import PANELS, LiveDashboard
from colab_par.views.svg_plot import heat_colour

TOLERANCE = 0.08  # per RGB channel: the line's core pixels, not its anti-aliased edges
INSET = 3  # pixels kept clear of the axes' spines and ticks
MIN_LINE_PIXELS = 40  # a curve over a handful of steps crosses far more of the plot than this
BAR_BAND = 0.25  # bars stand on the bottom edge: look at the lowest quarter (legends sit on top)
MIN_BAR_PIXELS = 200


def data_pixels(png: bytes) -> dict[str, int]:
    """For each plot (by title): pixels in its data colours inside its plot area."""
    image = imread(io.BytesIO(png), format="png")[..., :3]
    panels = LiveDashboard(mode="text").panels()
    width = max(panel.box[2] for panel in panels)
    assert image.shape[1] > width, f"a {image.shape[1]} px wide image is no dashboard frame"
    counts = {}
    for panel in panels:
        left, top, right, bottom = panel.box
        area = image[top + INSET:bottom - INSET, left + INSET:right - INSET]
        if panel.bars:
            area = area[-int(BAR_BAND * area.shape[0]):]
        matches = np.zeros(area.shape[:2], dtype=bool)
        for colour in panel.colours:
            matches |= (np.abs(area - np.array(to_rgb(colour))) < TOLERANCE).all(axis=-1)
        counts[panel.title] = int(matches.sum())
    return counts


def empty_plots(png: bytes) -> list[str]:
    """Titles of the plots that show no data (an empty list: every plot has data)."""
    panels = {panel.title: panel for panel in LiveDashboard(mode="text").panels()}
    return [title for title, count in data_pixels(png).items()
            if count < (MIN_BAR_PIXELS if panels[title].bars else MIN_LINE_PIXELS)]


def assert_shows_data(png: bytes) -> None:
    """Every plot of `png` shows data, by the same check that finds every plot of a blank frame
    empty (asserted here too, so no caller can pass with a check that sees data anywhere)."""
    assert len(empty_plots(blank_frame())) == len(PANELS), "the picture check passes a blank frame"
    empty = empty_plots(png)
    assert not empty, f"the dashboard frame shows no data in {empty}: {data_pixels(png)}"


def blank_frame() -> bytes:
    """A frame drawn before any row arrived: the negative control every picture test checks."""
    return LiveDashboard(mode="text").png()


# ---- live SVG frames ----------------------------------------------------------------------------------
SVG = "{http://www.w3.org/2000/svg}"


def svg_extent(svg: str) -> dict[str, float]:
    """For each plot (by its place in the grid): pixels of data drawn in its data colours, the
    length of its polylines for line plots, the area of its bars for bar plots."""
    plots = [plot for plot in ET.fromstring(svg).findall(f"{SVG}g[@class='plot']")
             if plot.get("data-kind") != "heat"]  # a MoE run's heat maps: tests/test_expert_view.py
    assert len(plots) == len(PANELS), f"{len(plots)} plots in an SVG frame of {len(PANELS)}"
    extent = {}
    for spec, plot in zip(PANELS, plots):
        colours = {colour.lower() for colour in spec.colours}
        drawn = 0.0
        for line in plot.iter(f"{SVG}polyline"):
            if line.get("stroke", "").lower() in colours:
                points = np.array([[float(v) for v in p.split(",")] for p in line.get("points").split()])
                drawn += float(np.hypot(*np.diff(points, axis=0).T).sum()) if len(points) > 1 else 0.0
        for bar in plot.iter(f"{SVG}rect"):
            if bar.get("class") == "data" and bar.get("fill", "").lower() in colours:
                drawn += float(bar.get("width")) * float(bar.get("height"))
        extent[plot.get("data-title")] = drawn
    return extent


def svg_empty_plots(svg: str) -> list[str]:
    """Plots of an SVG frame that show no data (lines shorter than MIN_LINE_PIXELS, bars smaller
    than MIN_BAR_PIXELS)."""
    return [title for (title, drawn), spec in zip(svg_extent(svg).items(), PANELS)
            if drawn < (MIN_BAR_PIXELS if spec.parts else MIN_LINE_PIXELS)]


def assert_svg_shows_data(svg: str) -> None:
    """Every plot of a live SVG frame shows data; a frame drawn before any row arrived fails the
    same check (asserted here)."""
    assert len(svg_empty_plots(LiveDashboard(mode="text").svg())) == len(PANELS), \
        "the SVG check passes a blank frame"
    empty = svg_empty_plots(svg)
    assert not empty, f"the live frame shows no data in {empty}: {svg_extent(svg)}"


# ---- a MoE run's heat maps ------------------------------------------------------------------------
COLOUR_TOLERANCE = 0.03  # per RGB channel: matplotlib's colormap has 256 levels along the ramp


def heat_cells(svg: str) -> dict[str, list[list[float]]]:
    """Each heat map of an SVG frame (by title), its cells' counts as a layer × expert matrix;
    every cell's colour is checked against its count on the way."""
    maps = {}
    for plot in ET.fromstring(svg).findall(f"{SVG}g[@class='plot']"):
        if plot.get("data-kind") != "heat":
            continue
        cells = {(int(c.get("data-row")), int(c.get("data-column"))): c
                 for c in plot.iter(f"{SVG}rect") if c.get("class") == "cell"}
        layers, experts = (1 + max(index[axis] for index in cells) for axis in (0, 1))
        matrix = [[float(cells[layer, expert].get("data-value")) for expert in range(experts)]
                  for layer in range(layers)]
        high = max(map(max, matrix))
        for (layer, expert), cell in cells.items():
            assert cell.get("fill") == heat_colour(matrix[layer][expert] / high), (layer, expert)
        maps[plot.get("data-title")] = matrix
    return maps


def assert_png_heat_map(dash: LiveDashboard, png: bytes, counts: list[list[float]]) -> None:
    """Each cell of the PNG picture's heat map has the ramp's colour for its count (sampled a
    quarter into the cell, clear of the count written at its centre)."""
    image = imread(io.BytesIO(png), format="png")[..., :3]
    heat = [panel for panel in dash.panels() if panel.heat]
    assert [panel.title for panel in heat] == ["tokens per expert"]
    left, top, right, bottom = heat[0].box
    width, height = (right - left) / len(counts[0]), (bottom - top) / len(counts)
    high = max(map(max, counts))
    for layer, per_expert in enumerate(counts):
        for expert, value in enumerate(per_expert):
            pixel = image[int(top + (layer + 0.25) * height), int(left + (expert + 0.25) * width)]
            expected = to_rgb(heat_colour(value / high))
            assert np.abs(pixel - expected).max() < COLOUR_TOLERANCE, (layer, expert, pixel, expected)


# ---- the model-selection view's frames (colab_par.selection.view) ----------------------------------

def selection_pixels(png: bytes, trials: int, engines: int) -> dict[tuple, int]:
    """Pixels of trial i's colour (i < `trials`) in a `SelectionView` frame of a sweep over
    `engines` engines: keys ("loss per trial", i) and ("timeline", i) for the plots, and
    ("lane", e, i) for engine e's lane of the timeline. The view's axes sit at fixed boxes (no
    layout engine), so a view drawn here locates them in a frame drawn in another process."""
    from colab_par.selection.view import SelectionView, trial_colour

    view = SelectionView(mode="text")
    view.png(_waiting_sweep(trials, engines))  # lanes 0..engines-1, as the sweep's frame has them
    panels = {panel.title: panel for panel in view.panels(_waiting_sweep(trials, engines))}
    image = imread(io.BytesIO(png), format="png")[..., :3]
    assert image.shape[1] > panels["timeline"].box[2], f"a {image.shape[1]} px wide image is no view frame"

    def count(box: tuple[int, int, int, int], colour: str) -> int:
        left, top, right, bottom = box
        area = image[top + INSET:bottom - INSET, left + INSET:right - INSET]
        return int((np.abs(area - np.array(to_rgb(colour))) < TOLERANCE).all(axis=-1).sum())

    counts = {}
    left, _, right, _ = panels["timeline"].box
    for index in range(trials):
        for title in ("loss per trial", "timeline"):
            counts[title, index] = count(panels[title].box, trial_colour(index))
        for engine in range(engines):
            top, bottom = view.row_band(engine)
            counts["lane", engine, index] = count((left, top, right, bottom), trial_colour(index))
    return counts


def selection_gaps(png: bytes, trials: int, engines: int) -> list[str]:
    """What a selection frame fails to show (an empty list: nothing): a trial without its loss
    curve or its timeline bars, an engine lane with fewer than two trials' bars in it."""
    counts = selection_pixels(png, trials, engines)
    gaps = [f"trial {index} in the {title} plot" for index in range(trials)
            for title in ("loss per trial", "timeline") if counts[title, index] < MIN_LINE_PIXELS]
    for engine in range(engines):
        drawn = [i for i in range(trials) if counts["lane", engine, i] >= MIN_LINE_PIXELS]
        if len(drawn) < 2:
            gaps.append(f"engine {engine}'s lane shows trials {drawn} only")
    return gaps


def assert_selection_shows_data(png: bytes, trials: int, engines: int) -> None:
    """Every trial's loss curve and timeline bars are in `png`, and each engine's lane holds bars of
    more than one trial; a frame drawn before the sweep ran fails that same check (asserted here)."""
    blank = selection_gaps(selection_blank_frame(trials, engines), trials, engines)
    assert len(blank) == 2 * trials + engines, f"the picture check passes a blank view frame: {blank}"
    gaps = selection_gaps(png, trials, engines)
    assert not gaps, f"the selection view's frame does not show {gaps}: {selection_pixels(png, trials, engines)}"


def selection_blank_frame(trials: int, engines: int) -> bytes:
    """A selection view frame drawn before any task ran: the negative control."""
    from colab_par.selection.view import SelectionView

    return SelectionView(mode="text").png(_waiting_sweep(trials, engines))


def _waiting_sweep(trials: int, engines: int):
    from colab_par.selection.results import SweepResult, TrialResult

    return SweepResult([TrialResult(f"trial {i}", {}, 1) for i in range(trials)], [], 0.0, "lrtf",
                       {engine: 0 for engine in range(engines)}, 0)
