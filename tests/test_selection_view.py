"""The sweep view: each trial drawn in its own colour where its data is (its loss curve, the lanes
of the engines it ran on and no others), a frame without data failing that same check, one display
handle redrawn at most `max_fps` times a second and kept at the end, and the leaderboard as text."""
from __future__ import annotations

import io
import itertools
import time

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from colab_par.selection.results import Span, SweepResult, TrialResult
from colab_par.selection.view import TRIAL_COLOURS, SelectionView, leaderboard_text, trial_colour

TOLERANCE = 0.08  # per RGB channel, as tests/picture.py: the data's core pixels, not its edges
INSET = 3  # pixels kept clear of spines, ticks and lane edges
MIN_PIXELS = 40  # a curve over a few steps, or one bar, covers far more than this


def sweep(*, with_data: bool = True) -> SweepResult:
    """Three trials on two engines, listed in an order that is not the leaderboard's: "narrow" runs
    on engine 0 only, "diverged" on engine 1 only (and fails), "wide" is sharded over both."""
    steps = 8
    trials = [TrialResult("narrow", {"lr": 1e-3}, steps, status="done", engines={0}),
              TrialResult("diverged", {"lr": 1.0}, steps, status="failed", engines={1},
                          error="FloatingPointError: loss is nan at step 4\nTraceback (most recent"),
              TrialResult("wide", {"lr": 1e-2}, steps, status="done", engines={0, 1}, shards=2)]
    if not with_data:
        for trial in trials:
            trial.status, trial.error, trial.engines = "waiting", None, set()
        return SweepResult(trials, [], 0.0, "fifo", {}, 2 ** 30)
    trials[0].losses = [2.0 - 0.05 * i for i in range(steps)]
    trials[1].losses = [2.5, 3.0, 4.5, 7.0]
    trials[2].losses = [3.0 - 0.25 * i for i in range(steps)]
    timeline = []
    for i in range(steps):
        kind = "init" if i == 0 else "forward_backward"
        timeline.append(Span(0, "narrow", i, 0, kind, 0.25 * i, 0.25 * i + 0.2))
        timeline += [Span(e, "wide", i, e, kind, 2.0 + 0.25 * i, 2.0 + 0.25 * i + 0.2) for e in (0, 1)]
    timeline += [Span(1, "diverged", i, 0, "init" if i == 0 else "forward_backward", 0.4 * i,
                      0.4 * i + 0.3) for i in range(4)]
    return SweepResult(trials, timeline, 4.0, "fifo", {0: 2 ** 20, 1: 2 ** 21}, 2 ** 30)


def colour_pixels(png: bytes, view: SelectionView, result: SweepResult) -> dict[tuple, int]:
    """Pixels of each trial's colour in the loss and timeline panels, and in each engine's lane of
    the timeline: keys (panel title, trial index) and ("lane", engine, trial index)."""
    image = imread(io.BytesIO(png), format="png")[..., :3]
    panels = {panel.title: panel for panel in view.panels(result)}
    assert image.shape[1] > panels["timeline"].box[2], "no view frame"

    def count(box: tuple[int, int, int, int], colour: str) -> int:
        left, top, right, bottom = box
        area = image[top + INSET:bottom - INSET, left + INSET:right - INSET]
        return int((np.abs(area - np.array(to_rgb(colour))) < TOLERANCE).all(axis=-1).sum())

    counts = {}
    for index in range(len(result.trials)):
        for title in ("loss per trial", "timeline"):
            assert trial_colour(index) in panels[title].colours
            counts[title, index] = count(panels[title].box, trial_colour(index))
        left, _, right, _ = panels["timeline"].box
        for engine in (0, 1):
            top, bottom = view.row_band(engine)
            counts["lane", engine, index] = count((left, top, right, bottom), trial_colour(index))
    return counts


def test_each_trial_is_drawn_in_its_colour_where_it_ran():
    view = SelectionView(mode="text")
    blank = sweep(with_data=False)
    assert max(colour_pixels(view.png(blank), view, blank).values()) < MIN_PIXELS, \
        "the picture check passes a frame without data"
    result = sweep()
    counts = colour_pixels(view.png(result), view, result)
    lanes = [view.row_band(0), view.row_band(1)]
    assert lanes[0][1] <= lanes[1][0] and lanes[0][1] - lanes[0][0] > 4 * INSET  # 0 on top
    for index, trial in enumerate(result.trials):
        assert counts["loss per trial", index] >= MIN_PIXELS, (trial.name, counts)
        assert counts["timeline", index] >= MIN_PIXELS, (trial.name, counts)
        for engine in (0, 1):  # placement, not just presence: nothing in a lane it never ran in
            ran = counts["lane", engine, index]
            assert ran >= MIN_PIXELS if engine in trial.engines else ran == 0, (trial.name, engine,
                                                                                counts)


def test_an_empty_sweep_draws_empty_panels():
    """Nothing run yet (and no trials at all) still draws, and its data pixels are ~0: the
    counter above is not satisfied by axes, ticks or the leaderboard's colour markers."""
    view = SelectionView(mode="text")
    for result in (sweep(with_data=False), SweepResult([], [], 0.0, "fifo", {}, 0)):
        png = view.png(result)
        assert png.startswith(b"\x89PNG")
        counts = colour_pixels(png, view, result)
        assert sum(counts.values()) <= 2, counts


def test_trial_colours_are_told_apart():
    """No two trial colours (nor a lighter init bar and a trial colour) fall within the tolerance."""
    rgb = [np.array(to_rgb(c)) for c in TRIAL_COLOURS]
    lighter = [0.5 + 0.5 * c for c in rgb]
    for a, b in itertools.combinations(rgb, 2):
        assert (np.abs(a - b) >= TOLERANCE).any()
    for a, b in itertools.product(rgb, lighter):
        assert (np.abs(a - b) >= TOLERANCE).any()
    assert trial_colour(0) == trial_colour(len(TRIAL_COLOURS)) == "tab:blue"


def test_leaderboard_text_orders_by_final_loss_and_shows_errors():
    lines = leaderboard_text(sweep()).splitlines()
    header, rows = lines[0], lines[1:]
    assert header.split() == ["#", "trial", "status", "final", "best", "steps", "engines", "shards",
                              "error"]
    assert [row.split()[:3] for row in rows] == [["1", "wide", "done"], ["2", "narrow", "done"],
                                                 ["-", "diverged", "failed"]]
    assert rows[0].split()[3:8] == ["1.2500", "1.2500", "8/8", "0,1", "2"]
    assert rows[2].split()[3:8] == ["7.0000", "2.5000", "4/8", "1", "1"]
    assert rows[2].endswith("FloatingPointError: loss is nan at step 4")  # first line only
    for column in ("status", "final", "engines"):  # aligned: every cell starts under its header
        starts = {row.index(row.split()[header.split().index(column)], header.index(column))
                  for row in rows}
        assert starts == {header.index(column)}
    assert "error" not in leaderboard_text(sweep(with_data=False)).splitlines()[0]


def test_text_mode_prints_status_changes_and_the_final_leaderboard():
    stream = io.StringIO()
    view = SelectionView(mode="text", stream=stream)
    view.update(sweep(with_data=False))
    view.update(sweep(with_data=False))  # nothing changed: no line
    view.update(sweep())
    view.finish(sweep())
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("3 trials: 3 waiting")
    assert lines[1].startswith("3 trials: 2 done, 1 failed · best wide 1.2500")
    assert lines[2] == lines[1] and lines[3:] == leaderboard_text(sweep()).splitlines()
    assert view.frames == 0 and view.handle is None


def test_one_handle_redrawn_at_most_max_fps_and_kept_at_the_end(captured):
    view = SelectionView(mode="png", max_fps=4.0, max_duty=1e9)
    view.update(sweep(with_data=False))
    view.update(sweep())  # within 1/max_fps of the first: not drawn
    assert view.frames == 1 and len(captured) == 1
    time.sleep(1 / 4.0 + 0.05)
    view.update(sweep())
    assert view.frames == 2
    view.finish(sweep())  # always drawn, however soon
    assert view.frames == 3 and len(captured) == 3
    ids = [(o["transient"] or {}).get("display_id") for o in captured]
    assert len(set(ids)) == 1 and ids[0] and [o["update"] for o in captured] == [False, True, True]
    final = captured[-1]["data"]
    assert final["text/plain"].endswith(leaderboard_text(sweep()))
    assert "data:image/png;base64," in final["text/html"]
    counts = colour_pixels(final["image/png"], view, sweep())
    assert min(counts["timeline", i] for i in range(3)) >= MIN_PIXELS


def test_duty_cap_spaces_frames_by_their_cpu_cost(captured):
    """With a tiny CPU share, the first frame's cost keeps every later update from drawing."""
    view = SelectionView(mode="png", max_fps=1e9, max_duty=1e-9)
    for _ in range(3):
        view.update(sweep())
    assert view.frames == 1 and view._render_cost > 0


def test_rejects_unknown_modes():
    with pytest.raises(ValueError, match="mode"):
        SelectionView(mode="html")
    assert SelectionView(mode="display").mode == SelectionView(mode="png").mode == "display"
