"""The dashboard's memory-tier plot: from the `mem_tier_*` columns of a real metrics stream (the
runtime's memory_report keys, as telemetry publishes them) each rank's bar stacks its working
memory and resident state per tier with the bytes moved per step above it, and a dashed line marks
the budget per rank, in the SVG frames and the PNG picture; a run without tiers keeps its frame
exactly."""
from __future__ import annotations

import io
import xml.etree.ElementTree as ET

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.image import imread
from picture import SVG
from test_dashboard import PNG_MAGIC, published, row

from colab_par.views.dashboard import PANELS, TIER_PANEL, LiveDashboard, progress_line
from colab_par.training.telemetry import metrics_data

MiB = 2 ** 20
# per rank: (working, device, host, disk, moved) MiB; rank 1 holds more on disk and moves more
TIERS = {0: (64, 256, 0, 128, 384), 1: (64, 192, 0, 512, 1536)}
BUDGET_MIB = 400


def tier_row(step: int, rank: int) -> dict:
    working, device, host, disk, moved = TIERS[rank]
    return row(step, rank, mem_tier_working=working * MiB, mem_tier_device=device * MiB,
               mem_tier_host=host * MiB, mem_tier_disk=disk * MiB, mem_tier_moved=moved * MiB,
               mem_tier_budget=BUDGET_MIB * MiB)


def tier_dashboard() -> LiveDashboard:
    dash = LiveDashboard(mode="text")
    dash.update([metrics_data({"rank": r, "run": 1, "total_steps": 3}, [tier_row(s, r) for s in (1, 2, 3)])
                 for r in TIERS])
    return dash


def test_tier_bars_carry_each_ranks_bytes_per_tier_and_moved() -> None:
    svg = ET.fromstring(tier_dashboard().svg())
    plot = next(p for p in svg.findall(f"{SVG}g[@class='plot']") if p.get("data-title") == TIER_PANEL.title)
    bars = [(r.get("data-label"), float(r.get("x")), float(r.get("height")))
            for r in plot.iter(f"{SVG}rect") if r.get("class") == "data"]
    per_rank: dict[float, dict[str, float]] = {}
    for label, x, height in bars:
        per_rank.setdefault(x, {})[label] = height
    assert len(per_rank) == 2
    pixels_per_mib = per_rank[min(per_rank)]["device"] / TIERS[0][1]
    for (_, heights), rank in zip(sorted(per_rank.items()), TIERS):
        working, device, host, disk, _ = TIERS[rank]
        expected = {"working": working, "device": device, "disk": disk}  # an empty host stack is not drawn
        assert set(heights) == set(expected)
        for label, mib in expected.items():  # the SVG writes heights to 0.1 px
            assert abs(heights[label] - mib * pixels_per_mib) <= 0.1, (rank, label, heights)
    notes = [t.text for t in plot.iter(f"{SVG}text") if t.text and t.text.startswith("moved")]
    assert notes == ["moved 384 MiB/step", "moved 1,536 MiB/step"]
    bottom = max(float(r.get("y")) + float(r.get("height")) for r in plot.iter(f"{SVG}rect")
                 if r.get("class") == "data")
    [limit] = [line for line in plot.iter(f"{SVG}line") if line.get("class") == "limit"]
    assert limit.get("data-label") == "budget per rank"
    assert abs(bottom - float(limit.get("y1")) - BUDGET_MIB * pixels_per_mib) <= 0.2


def test_tier_plot_in_the_png_picture() -> None:
    dash = tier_dashboard()
    png = dash.png()
    assert png.startswith(PNG_MAGIC)
    panels = dash.panels()
    assert [p.title for p in panels] == [*(p.title for p in LiveDashboard(mode="text").panels()), TIER_PANEL.title]
    tier = panels[-1]
    image = imread(io.BytesIO(png), format="png")[..., :3]
    left, top, right, bottom = tier.box
    area = image[top + 3:bottom - 3, left + 3:right - 3]
    area = area[-int(0.25 * area.shape[0]):]  # bars stand on the bottom edge
    for colour in ("#d62728", "#1f77b4", "#2ca02c"):  # working, device, disk
        assert (np.abs(area - np.array(to_rgb(colour))) < 0.08).all(axis=-1).sum() > 50, colour
    # the budget's dashed line: one pixel row across the plot dark grey in many places
    plot = image[top + 3:bottom - 3, left + 3:right - 3]
    dark = (np.abs(plot - np.array(to_rgb("#333333"))) < 0.12).all(axis=-1).sum(axis=1)
    assert dark.max() > 0.3 * plot.shape[1], "no budget line across the tier plot"


def test_progress_line_says_what_moved() -> None:
    dash = tier_dashboard()
    assert "tiers moved 1,536.0 MiB/step" in progress_line(dash.latest(), 3)


def test_a_run_without_tiers_keeps_its_frame() -> None:
    dense = LiveDashboard(mode="text")
    dense.update([published(0, range(1, 4)), published(1, range(1, 4))])
    svg = ET.fromstring(dense.svg())
    assert (svg.get("width"), svg.get("height")) == ("792", "396")
    titles = [p.get("data-title") for p in svg.findall(f"{SVG}g[@class='plot']")]
    assert len(titles) == len(PANELS) and TIER_PANEL.title not in titles
    assert "tiers" not in dense.progress()
    assert ET.fromstring(tier_dashboard().svg()).get("height") == "594"  # one row more for the tiers
