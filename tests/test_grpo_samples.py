"""The table of what a GRPO policy wrote: which rows of a rollout it shows (each shown prompt's
best and worst completion, decoded as the rewards saw them), and that it reaches the three places
a user looks: the live dashboard's frame (HTML), its text mode, and TensorBoard's text tab."""
from __future__ import annotations

import io
import math

import pytest
import torch

from colab_par.training.grpo.samples import rollout_samples
from colab_par.views.dashboard import LiveDashboard
from colab_par.views.rows import METRICS_KEY, ROWS_KEY, SAMPLES_COLUMN

EOS, PAD = 2, 0


def rollout():
    prompt_ids = torch.tensor([[PAD, 5, 6]] * 3 + [[7, 8, 9]] * 3)
    prompt_mask = prompt_ids != PAD
    completion_ids = torch.tensor([[10, EOS, PAD], [11, 12, EOS], [13, 14, 15],
                                   [16, EOS, PAD], [17, EOS, PAD], [18, 19, EOS]])
    return prompt_ids, prompt_mask, completion_ids


def test_each_prompt_shows_its_best_and_worst_completion_as_the_rewards_saw_them():
    rewards = torch.tensor([0.5, 2.0, -1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    samples = rollout_samples(*rollout(), rewards, group_size=3, eos=[EOS],
                              decode=lambda ids: "-".join(map(str, ids)))
    assert samples == [
        {"prompt": "5-6", "completion": "11-12-2", "reward": 2.0},   # best of group 0 (end token kept)
        {"prompt": "5-6", "completion": "13-14-15", "reward": -1.0},  # worst (cut off: no end)
        {"prompt": "7-8-9", "completion": "16-2", "reward": 1.0}]    # all equal: one row


def test_unscored_rows_and_no_decoder():
    rewards = torch.tensor([math.nan, math.nan, math.nan, math.nan, 3.0, math.nan], dtype=torch.float64)
    samples = rollout_samples(*rollout(), rewards, group_size=3, eos=[EOS], decode=None, prompts=5)
    assert samples == [{"prompt": "[5, 6]", "completion": "[10, 2]", "reward": None},
                       {"prompt": "[7, 8, 9]", "completion": "[17, 2]", "reward": 3.0}]


def published(steps):
    rows = [{"step": step, "rank": 0, "loss": 1.0 / step, "reward": float(step),
             SAMPLES_COLUMN: [{"prompt": "2+2=", "completion": f"<{step}>", "reward": float(step)}]}
            for step in steps]
    return [{METRICS_KEY: {"rank": 0, "run": 1, "total_steps": 3}, f"{ROWS_KEY}0": rows}]


def test_the_dashboard_shows_the_newest_samples_under_its_frame():
    board = LiveDashboard(mode="display")
    shown = []
    board._show = shown.append
    board.update(published([1, 2]))
    html = shown[-1]["text/html"]
    assert "completions at step 2" in html and "&lt;2&gt;" in html and "&lt;1&gt;" not in html
    board.finish(published([1, 2, 3]))
    assert "&lt;3&gt;" in shown[-1]["text/html"] and "image/png" in shown[-1]


def test_text_mode_prints_each_new_table_once():
    out = io.StringIO()
    board = LiveDashboard(mode="text", stream=out)
    board.update(published([1]))
    board.update(published([1]))
    board.update(published([1, 2]))
    text = out.getvalue()
    assert text.count("completions at step 1") == 1 and text.count("completions at step 2") == 1
    assert "'2+2=' -> '<2>'" in text


def test_tensorboard_gets_the_table_in_its_text_tab(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from colab_par.training.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)
    logger.begin(0)
    logger.log({"step": 1, "reward": 0.5,
                SAMPLES_COLUMN: [{"prompt": "a|b", "completion": "c", "reward": 0.5}]}, 0)
    logger.flush()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    [event] = events.Tensors(f"train/{SAMPLES_COLUMN}/text_summary")  # add_text's tag
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 1 and "| a\\|b | c | 0.5 |" in text
    assert [e.value for e in events.Scalars("train/reward")] == [0.5]


def test_the_final_picture_draws_the_reward_curve():
    """The PNG picture's reward plot (after the Trainer's six and any others) shows its curve."""
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread
    from picture import INSET, MIN_LINE_PIXELS, TOLERANCE

    board = LiveDashboard(mode="text", stream=io.StringIO())
    board.update(published([1, 2, 3]))
    [panel] = [panel for panel in board.panels() if panel.title == "reward by step"]
    image = imread(io.BytesIO(board.png()), format="png")[..., :3]
    left, top, right, bottom = panel.box
    area = image[top + INSET:bottom - INSET, left + INSET:right - INSET]
    drawn = sum(int((np.abs(area - np.array(to_rgb(colour))) < TOLERANCE).all(axis=-1).sum())
                for colour in panel.colours)
    assert drawn >= MIN_LINE_PIXELS, drawn
