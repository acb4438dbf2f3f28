"""The live dashboard: silent until metrics arrive, one display handle updated in place with cheap
SVG frames while training (at most twice a second, within its CPU share) and the full matplotlib
picture at the end, complete curves despite missed publishes, a text line per step in a terminal,
and a real training run on two engines drawn through ipyparallel's datapub."""
from __future__ import annotations

import base64
import io
import os
import re
import time

import numpy as np
import pytest
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from picture import (SVG, assert_shows_data, assert_svg_shows_data, blank_frame, empty_plots,
                     svg_empty_plots)

from colab_par.views.dashboard import PANELS, LiveDashboard, progress_line
from colab_par.views.svg_plot import MAX_POINTS
from colab_par.training.telemetry import CHUNK, METRICS_KEY, ROWS_KEY, Publisher, metrics_data

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The requirement: while training a new frame at least every 2 s, within 1 % of the machine's CPU.
MAX_FRAME_INTERVAL_S = 2.0
MAX_CPU_SHARE = 0.01


def row(step: int, rank: int, **extra) -> dict:
    return {"step": step, "rank": rank, "loss": 4.0 - 0.1 * step, "step_time": 0.5, "lr": 1e-3,
            "grad_norm": 1.0 / step, "tokens_per_s": 100.0 + step, "mfu": 0.02, "mem_params": 2 ** 20,
            "mem_grads": 2 ** 20, "mem_optimizer": 2 ** 21, "mem_activations": 2 ** 22,
            "mem_total": 2 ** 22, "time_forward_backward": 0.4, "time_optimizer": 0.1, **extra}


def published(rank: int, steps, *, run: int = 1, total: int = 10) -> dict:
    """An engine's data dict as the client sees it (all rows so far fit in the first chunk)."""
    return {"other": 1, METRICS_KEY: {"rank": rank, "run": run, "total_steps": total},
            f"{ROWS_KEY}0": [row(s, rank) for s in steps]}


def display_ids(outputs) -> list[str]:
    return [(o["transient"] or {}).get("display_id") for o in outputs]


def live_svg(output: dict) -> str | None:
    """The SVG of a live frame (inside its HTML), None for the final PNG picture."""
    match = re.search(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", output["data"]["text/html"])
    return base64.b64decode(match.group(1)).decode() if match else None


def test_silent_until_metrics_then_one_handle_updated_in_place(captured):
    dash = LiveDashboard(mode="display", max_fps=1e9, max_duty=1e9)
    dash.update([None, {"unrelated": 3}])
    dash.finish([None, {"unrelated": 3}])
    assert captured == [] and dash.handle is None
    for last in (2, 4, 6):
        dash.update([published(0, range(1, last + 1)), published(1, range(1, last + 1))])
    dash.finish([published(0, range(1, 8)), published(1, range(1, 8))])
    ids = display_ids(captured)
    assert len(captured) == 4 and len(set(ids)) == 1 and ids[0]
    assert [o["update"] for o in captured] == [False, True, True, True]
    assert dash.frames == 3
    for output, last in zip(captured, (2, 4, 6)):  # live frames: SVG, no picture drawn
        assert set(output["data"]) == {"text/plain", "text/html"}
        assert output["data"]["text/plain"].startswith(f"step {last}/10 · ")
        assert_svg_shows_data(live_svg(output))
    final = captured[-1]["data"]
    assert final["image/png"].startswith(PNG_MAGIC) and live_svg(captured[-1]) is None
    assert final["text/plain"].startswith("step 7/10 · loss 3.3000")
    assert "data:image/png;base64," in final["text/html"]
    assert_shows_data(final["image/png"])


def test_picture_check_fails_on_frames_without_data():
    """The negative controls of every picture test: no rows at all, and rows in a shape the
    dashboard does not read (what `colab-par demo` once sent), draw only empty plots, in the PNG
    picture and in the SVG frame alike."""
    assert len(empty_plots(blank_frame())) == len(PANELS)
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    dash.update([{METRICS_KEY: {"rank": 0, "total_steps": 7, "rows": [row(s, 0) for s in range(1, 8)]}}])
    assert len(empty_plots(dash.png())) == len(PANELS)
    assert len(svg_empty_plots(dash.svg())) == len(PANELS)


def test_rows_sent_as_metrics_data_are_drawn():
    """`metrics_data` is the one format: a whole history packed by it (more than one chunk) is
    drawn in full, in the live frame and in the final picture."""
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    dash.update([metrics_data({"rank": r, "total_steps": 100}, [row(s, r) for s in range(1, 101)])
                 for r in (0, 1)])
    assert dash.series("loss")[0] == list(range(1, 101)) and sorted(dash.latest()) == [0, 1]
    assert_shows_data(dash.png())
    assert_svg_shows_data(dash.svg())


def test_long_runs_keep_spikes_within_the_point_budget():
    """A 20,000-step curve is thinned to MAX_POINTS points per line by keeping each bucket's lowest
    and highest value: a one-step loss spike still reaches the top of the plot."""
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    rows = [row(s, 0, loss=1.0 + (9.0 if s == 12_345 else 0.0)) for s in range(1, 20_001)]
    dash.update([metrics_data({"rank": 0, "total_steps": 20_000}, rows)])
    from xml.etree import ElementTree as ET

    plot = ET.fromstring(dash.svg()).findall(f"{SVG}g[@class='plot']")[0]
    (line,) = plot.iter(f"{SVG}polyline")
    points = np.array([[float(v) for v in p.split(",")] for p in line.get("points").split()])
    frame = next(r for r in plot.iter(f"{SVG}rect"))  # the plot area's frame
    assert len(points) <= MAX_POINTS
    assert points[:, 1].min() <= float(frame.get("y")) + 1, "the spike was dropped"


def test_redraws_at_most_twice_a_second(captured):
    dash = LiveDashboard(mode="display", max_fps=2.0, max_duty=1e9)
    start = time.monotonic()
    for step in range(1, 40):
        dash.update([published(0, range(1, step + 1))])
        time.sleep(0.03)
    elapsed = time.monotonic() - start
    assert 2 <= dash.frames <= 1 + elapsed * 2


def test_no_new_rows_no_new_frame(captured):
    dash = LiveDashboard(mode="display", max_fps=1e9, max_duty=1e9)
    for _ in range(5):
        dash.update([published(0, range(1, 4))])
    assert dash.frames == 1 and len(captured) == 1


def test_drawing_keeps_to_its_share_of_the_cpu(captured):
    """Each frame's CPU cost sets the pace: the next frame waits until that cost fits `max_duty`
    of the machine's cores, so drawing never takes more than that from the engines."""
    duty = 0.001
    dash = LiveDashboard(mode="display", max_fps=1e9, max_duty=duty)
    dash.update([published(0, range(1, 2))])
    first_at, first_cost = dash._last_frame, dash._frame_cost
    deadline = time.monotonic() + 30.0
    step = 1
    while dash.frames < 2 and time.monotonic() < deadline:
        step += 1
        dash.update([published(0, range(1, step + 1))])
        time.sleep(0.01)
    assert first_cost > 0 and dash.frames == 2
    budget = duty * (os.cpu_count() or 1)  # CPU seconds per wall second
    assert dash._last_frame - first_at >= first_cost / budget


def test_a_live_frame_costs_far_less_than_its_share(captured):
    """Two frames a second within 1 % of a 2-core machine's CPU leave 10 ms of CPU per frame. A
    frame (a new row merged, the SVG, the HTML, the display message) measured 1.4 ms for 2 ranks x
    1,000 steps and 2.0 ms for 2 x 50,000 on the 2-core VM (benchmarks/dashboard.py). The bound is
    on this thread's CPU time, which other processes' load does not inflate."""
    allowed = MAX_CPU_SHARE * 2 / 2.0  # CPU seconds per frame: 2 frames/s on 2 cores
    for steps in (1_000, 20_000):
        rows = [[row(s, r) for s in range(1, steps + 7)] for r in (0, 1)]
        dash = LiveDashboard(mode="display", max_fps=1e9, max_duty=1e9)
        costs = []
        for last in range(steps, steps + 6):
            before = dash.cpu_seconds
            dash.update([metrics_data({"rank": r, "run": 1, "total_steps": 2 * steps}, rows[r][:last])
                         for r in (0, 1)])
            costs.append(dash.cpu_seconds - before)
        median = sorted(costs[1:])[2]  # the first update merges the whole history
        assert dash.frames == 6 and median < allowed, f"{steps} steps: {1e3 * median:.1f} ms CPU a frame"


def test_progress_line_names_grad_norm_and_lr():
    line = progress_line({0: row(4, 0)}, total_steps=10)
    assert "lr 1.00e-03" in line and "grad norm 0.25" in line


def test_client_holds_every_row_despite_missed_publishes():
    """Real Publisher messages, merged into one dict as ipyparallel's datapub does, read by a
    client that polls only now and then."""
    messages: list[dict] = []
    publisher = Publisher({"rank": 0, "run": 1, "total_steps": 150}, min_interval=0.0,
                          local_sink=lambda per_rank: messages.append(per_rank[0]))
    data: dict = {}
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    rows = []
    for step in range(1, 151):
        rows.append(row(step, 0))
        publisher.publish(rows)
        data.update(messages[-1])
        if step % 37 == 0:
            dash.update([dict(data)])
    dash.finish([data])
    assert dash.series("loss")[0] == list(range(1, 151))
    chunks = [[key for key in m if key.startswith(ROWS_KEY)] for m in messages]
    assert max(len(keys) for keys in chunks) <= 2, "a publish re-sends at most the chunks that grew"
    assert max(len(m[k]) for m, keys in zip(messages, chunks) for k in keys) <= CHUNK


def test_a_new_run_resets_the_curves():
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    dash.update([published(0, range(1, 7))])
    assert dash.series("loss")[0] == [1, 2, 3, 4, 5, 6]
    dash.update([published(0, [1], run=2)])  # a new fit in the same cell starts a fresh run
    assert dash.series("loss")[0] == [1]


def test_text_mode_prints_one_line_per_log_step():
    stream = io.StringIO()
    dash = LiveDashboard(mode="text", stream=stream)
    dash.update([published(0, [1, 2]), published(1, [1, 2])])
    dash.update([published(0, [1, 2, 3]), published(1, [1, 2, 3])])
    dash.finish([published(0, [1, 2, 3, 4]), published(1, [1, 2, 3, 4])])
    lines = stream.getvalue().splitlines()
    assert [line.split(" · ")[0] for line in lines] == ["step 1/10", "step 2/10", "step 3/10", "step 4/10"]
    assert "mem 4.0 MiB/rank" in lines[0]


def test_progress_line_eta():
    line = progress_line({0: row(4, 0)}, total_steps=10)
    assert line.endswith("ETA 0:00:03")  # 6 steps left at 0.5 s each
    assert "ETA" not in progress_line({0: row(10, 0)}, total_steps=10)
    assert progress_line({}, 10) == "waiting for the first step"


def test_a_compiling_step_says_how_long_and_its_compile_is_left_out_of_the_eta():
    line = progress_line({0: row(1, 0, step_time=20.5, compile_s=20.0)}, total_steps=10)
    assert "compiled in 20.0 s" in line and line.endswith("ETA 0:00:04")  # 9 steps at 0.5 s
    assert "compiled" not in progress_line({0: row(2, 0)}, total_steps=10)


def test_asynchronous_saves_get_their_plot_and_the_line_says_a_write_is_in_flight():
    saves = {2: dict(ckpt_pause_s=0.004, ckpt_writing=True), 3: dict(ckpt_writing=True), 4: dict(ckpt_pause_s=0.006)}
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    dash.update([{METRICS_KEY: {"rank": 0, "run": 1, "total_steps": 10}, f"{ROWS_KEY}0": [row(1, 0)]}])
    assert all("checkpoint" not in plot.title for plot in dash.plots())  # no save yet: no plot
    dash.update([{METRICS_KEY: {"rank": 0, "run": 1, "total_steps": 10},
                  f"{ROWS_KEY}0": [row(s, 0, **saves.get(s, {})) for s in range(1, 6)]}])
    plot = next(plot for plot in dash.plots() if plot.title.startswith("checkpoint pause"))
    pause, step_time = plot.lines
    assert list(pause.x) == [2, 4] and list(pause.y) == pytest.approx([4.0, 6.0])  # ms
    assert list(step_time.x) == [1, 2, 3, 4, 5]
    assert dash.panels()[-1].title == plot.title  # the PNG picture draws it too
    assert "checkpoint writing in the background" in progress_line({0: row(3, 0, **saves[3])}, 10)
    assert "the step paused 4 ms" in progress_line({0: row(2, 0, **saves[2])}, 10)
    assert "checkpoint" not in progress_line({0: row(5, 0)}, 10)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="choose 'auto'"):
        LiveDashboard(mode="html")


# ---- a real run on two engines -------------------------------------------------------------------
def train_for_dashboard(steps: int) -> float:
    import torch

    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32,
                                   kernels="torch")), "dp2 zero2")
    trainer = Trainer(pm, SyntheticDataset(64, 16, 4), steps=steps)
    start = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - start


class TimedCapture(CapturingDisplayPublisher):
    """Records display messages as the frontend would get them, each with when it was sent and
    the CPU time the sending thread (the notebook's main thread) had used by then."""

    def publish(self, *args, **kwargs) -> None:
        super().publish(*args, **kwargs)
        self.outputs[-1]["sent"] = (time.monotonic(), time.thread_time())


LIVE_RUN_STEPS = 300  # several seconds of training: at one frame per 2 s, several frames must come


@pytest.mark.slow
def test_live_run_on_two_engines_updates_one_display(cluster2):
    """A real run through datapub: live SVG frames in one display while training, a new one at
    least every 2 s, the notebook's main thread (polling and drawing) within 1 % of the machine's
    CPU (its own CPU time, which the engines' load does not inflate), the final PNG picture last."""
    shell = InteractiveShell.instance()
    previous, shell.display_pub = shell.display_pub, TimedCapture()
    cluster2.dashboard = True  # the fixture runs without it; the magics turn it on
    try:
        seconds = cluster2.run(train_for_dashboard, LIVE_RUN_STEPS)
    finally:
        cluster2.dashboard = False
        captured, shell.display_pub = shell.display_pub.outputs, previous
    ids = display_ids(captured)
    assert len(set(ids)) == 1 and ids[0] and all(o["update"] for o in captured[1:])
    live = [o for o in captured if live_svg(o) is not None]
    assert len(live) == len(captured) - 1 >= 3, f"{len(live)} live frames in {max(seconds):.1f} s"
    times, cpu = zip(*(o["sent"] for o in live))
    gaps = np.diff(times)
    assert gaps.max() <= MAX_FRAME_INTERVAL_S, f"live frames {np.round(gaps, 2)} s apart"
    share = (cpu[-1] - cpu[0]) / (times[-1] - times[0]) / (os.cpu_count() or 1)
    assert share <= MAX_CPU_SHARE, f"the notebook used {100 * share:.2f} % of the machine's CPU"
    assert_svg_shows_data(live_svg(live[-1]))
    final = captured[-1]["data"]
    assert final["image/png"].startswith(PNG_MAGIC)
    assert final["text/plain"].startswith(f"step {LIVE_RUN_STEPS}/{LIVE_RUN_STEPS} · loss ")
    assert_shows_data(final["image/png"])


NOTEBOOK_CELL = """
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
from colab_par import Trainer, parallelize
from colab_par.data import SyntheticDataset
from colab_par.models.gpt import GPT, GPTConfig
pm = parallelize(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16,
                               kernels="torch")), "dp1")
Trainer(pm, SyntheticDataset(64, 16, 4), steps=12).fit();
"""


@pytest.mark.slow
def test_executed_notebook_keeps_the_final_frame(tmp_path):
    """Trainer in a notebook's own kernel (no engines) under headless nbclient: one display output,
    updated in place, holding the last step's frame."""
    import nbclient
    import nbformat

    cell = nbformat.v4.new_code_cell(NOTEBOOK_CELL.format(store=tmp_path / "store"))
    notebook = nbformat.v4.new_notebook(cells=[cell])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    outputs = [o for o in cell.outputs if o.output_type != "stream"]
    assert len(outputs) == 1 and outputs[0].output_type == "display_data"
    data = outputs[0]["data"]
    assert data["text/plain"].startswith("step 12/12 · loss ")
    assert_shows_data(base64.b64decode(data["image/png"]))
