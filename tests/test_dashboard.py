"""The live dashboard: silent until metrics arrive, one display handle updated in place at most
twice a second, complete curves despite missed publishes, a text line per step in a terminal, and
a real training run on two engines drawn through ipyparallel's datapub."""
from __future__ import annotations

import base64
import io
import os
import time

import pytest
from picture import assert_shows_data, blank_frame, empty_plots

from colab_par.dashboard import LiveDashboard, progress_line
from colab_par.telemetry import CHUNK, METRICS_KEY, ROWS_KEY, Publisher, metrics_data

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(step: int, rank: int, **extra) -> dict:
    return {"step": step, "rank": rank, "loss": 4.0 - 0.1 * step, "step_time": 0.5,
            "tokens_per_s": 100.0, "mfu": 0.02, "mem_params": 2 ** 20, "mem_grads": 2 ** 20,
            "mem_optimizer": 2 ** 21, "mem_activations": 2 ** 22, "mem_total": 2 ** 22,
            "time_forward_backward": 0.4, "time_optimizer": 0.1, **extra}


def published(rank: int, steps, *, run: int = 1, total: int = 10) -> dict:
    """An engine's data dict as the client sees it (all rows so far fit in the first chunk)."""
    return {"other": 1, METRICS_KEY: {"rank": rank, "run": run, "total_steps": total},
            f"{ROWS_KEY}0": [row(s, rank) for s in steps]}


def display_ids(outputs) -> list[str]:
    return [(o["transient"] or {}).get("display_id") for o in outputs]


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
    final = captured[-1]["data"]
    assert final["image/png"].startswith(PNG_MAGIC)
    assert final["text/plain"].startswith("step 7/10 · loss 3.3000")
    assert "data:image/png;base64," in final["text/html"]
    assert_shows_data(final["image/png"])


def test_picture_check_fails_on_frames_without_data():
    """The negative controls of every picture test: no rows at all, and rows in a shape the
    dashboard does not read (what `colab-par demo` once sent), both draw four empty plots."""
    assert len(empty_plots(blank_frame())) == 4
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    dash.update([{METRICS_KEY: {"rank": 0, "total_steps": 7, "rows": [row(s, 0) for s in range(1, 8)]}}])
    assert len(empty_plots(dash.png())) == 4


def test_rows_sent_as_metrics_data_are_drawn():
    """`metrics_data` is the one format: a whole history packed by it (more than one chunk) is
    drawn in full."""
    dash = LiveDashboard(mode="text", stream=io.StringIO())
    dash.update([metrics_data({"rank": r, "total_steps": 100}, [row(s, r) for s in range(1, 101)])
                 for r in (0, 1)])
    assert dash.series("loss")[0] == list(range(1, 101)) and sorted(dash.latest()) == [0, 1]
    assert_shows_data(dash.png())


def test_redraws_at_most_twice_a_second(captured):
    dash = LiveDashboard(mode="display", max_fps=2.0, max_duty=1e9)
    start = time.monotonic()
    for step in range(1, 40):
        dash.update([published(0, range(1, step + 1))])
        time.sleep(0.03)
    elapsed = time.monotonic() - start
    assert 1 <= dash.frames <= 1 + elapsed * 2


def test_drawing_keeps_to_its_share_of_the_cpu(captured):
    """Even the first frame's CPU cost sets the pace: the second frame waits until that cost fits
    `max_duty` of the machine's cores, so drawing never takes more than that from the engines."""
    duty = 0.05
    dash = LiveDashboard(mode="display", max_fps=100.0, max_duty=duty)
    dash.update([published(0, range(1, 2))])
    first_at, first_cost = dash._last_render, dash._render_cost
    deadline = time.monotonic() + 30.0
    step = 1
    while dash.frames < 2 and time.monotonic() < deadline:
        step += 1
        dash.update([published(0, range(1, step + 1))])
        time.sleep(0.01)
    assert first_cost > 0 and dash.frames == 2
    budget = duty * (os.cpu_count() or 1)  # CPU seconds per wall second
    assert dash._last_render - first_at >= first_cost / budget


def test_progress_line_moves_while_no_picture_is_due(captured):
    """Between pictures the progress line still advances, under the same picture: nothing drawn."""
    dash = LiveDashboard(mode="display", max_fps=1e9, max_duty=1e-9, progress_interval=0.0)
    for last in (1, 2, 3):
        dash.update([published(0, range(1, last + 1))])
    assert dash.frames == 1 and len(captured) == 3
    assert [o["data"]["text/plain"].split(" · ")[0] for o in captured] == ["step 1/10", "step 2/10",
                                                                           "step 3/10"]
    assert len({o["data"]["image/png"] for o in captured}) == 1


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


@pytest.mark.slow
def test_live_run_on_two_engines_updates_one_display(cluster2, captured):
    cluster2.dashboard = True  # the fixture runs without it; the magics turn it on
    try:
        seconds = cluster2.run(train_for_dashboard, 60)
    finally:
        cluster2.dashboard = False
    ids = display_ids(captured)
    assert len(captured) >= 2, f"{len(captured)} frames in {max(seconds):.1f}s"
    assert len(set(ids)) == 1 and ids[0]
    assert sum(o["update"] for o in captured) >= 1
    final = captured[-1]["data"]
    assert final["image/png"].startswith(PNG_MAGIC)
    assert final["text/plain"].startswith("step 60/60 · loss ")
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
