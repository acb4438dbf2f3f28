"""Does a dashboard frame show data? Counts pixels of the data colours inside each plot area.

One helper for every test of a dashboard picture (unit frames, the live run, `colab-par demo`'s
PNG, the notebooks' final frames): a frame passes only when every one of its four plots shows
its lines or bars, so a blank frame with empty axes fails (checked on every call).
"""
from __future__ import annotations

import io

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from colab_par.dashboard import LiveDashboard

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
    """Every plot of `png` shows data, by the same check that finds all four plots of a blank
    frame empty (asserted here too, so no caller can pass with a check that sees data anywhere)."""
    assert len(empty_plots(blank_frame())) == 4, "the picture check passes a blank frame"
    empty = empty_plots(png)
    assert not empty, f"the dashboard frame shows no data in {empty}: {data_pixels(png)}"


def blank_frame() -> bytes:
    """A frame drawn before any row arrived: the negative control every picture test checks."""
    return LiveDashboard(mode="text").png()
