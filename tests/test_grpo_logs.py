"""A GRPO loop's rows reach the Trainer's sinks, and a checkpointed loop resumes exactly.

1. One process: `LiveRows` passes each logged row to the loggers (TensorBoard's tags included) and
   to the local dashboard; `Logs` options GRPO cannot honour are refused; the loop state a
   checkpoint keeps (step, seed) is restored, and a resume with another prompts_per_step refused.
2. Two engines (dp2, gloo), Adam: 4 steps uninterrupted against 2 steps, a checkpoint, a fresh loop
   (other weights, other seed) resumed from it, 2 more steps: the same rows and the same weights;
   the uninterrupted run's rows also went to its logger on rank 0.
"""
from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import cloudpickle
import pytest
import torch

from colab_par.layout import Layout
from colab_par.models import GPT, GPTConfig
from colab_par.training.grpo import GRPO, Completions
from colab_par.training.live_rows import LiveRows
from colab_par.training.loggers import scalar_tags
from colab_par.training.options import Logs
from colab_par.views import dashboard

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = dict(vocab_size=16, seq_len=16, n_layer=1, n_head=2, d_model=16, kernels="torch")
PROMPTS = [[3, 4, 5], [7, 8], [9, 10, 11, 12], [13, 14]]
EOS, PAD, GROUP, LENGTH = 2, 0, 4, 5
TIMINGS = ("rollout_s", "train_s")
NOT_NUMBERS = ("samples",)  # rank 0's table of completions, compared as it is


class Collected:
    """A logger that keeps what it was given."""

    def __init__(self):
        self.rows: list[tuple[dict, int]] = []

    def log(self, row: dict, rank: int) -> None:
        self.rows.append((dict(row), rank))


def count_fives(prompts, completions, **_):
    return [float(sum(token in (5, 6, 7) for token in completion)) for completion in completions]


# ---- one process ------------------------------------------------------------------------------------------
def grpo_row(step: int) -> dict:
    return {"step": step, "rank": 0, "loss": 0.5 / step, "grad_norm": 1.0, "reward": float(step),
            "reward/count_fives": float(step), "zero_std_fraction": 0.25, "rollout_s": 0.1, "train_s": 0.2}


def test_logged_rows_go_to_the_loggers_and_the_local_dashboard(monkeypatch):
    shown = []

    class Kept(dashboard.LiveDashboard):
        def __init__(self):
            super().__init__(mode="text", stream=io.StringIO())
            shown.append(self)

    monkeypatch.setattr(dashboard, "LiveDashboard", Kept)
    collected = Collected()
    live = LiveRows(Logs(every=2, loggers=[collected]), rank=0)
    history: list[dict] = []
    with live.fit(history, 0, {"total_steps": 3, "layout": "dp1"}, torch.device("cpu")) as sinks:
        for step in (1, 2, 3):
            row = grpo_row(step) if live.logged(step, 3) else None
            history.extend([row] if row else [])
            sinks.after_step(row, step == 3)
    assert [row["step"] for row, _ in collected.rows] == [2, 3]
    assert shown[0].series("reward/count_fives") == ([2, 3], [2.0, 3.0])
    assert [panel.title for panel in shown[0].panels()][-1] == "reward by step"  # after the Trainer's
    assert list(shown[0].plots()[-1].lines[0].y) == [2.0, 3.0]
    tags = scalar_tags(collected.rows[0][0])
    assert tags["train/reward/count_fives"] == 2.0 and tags["train/zero_std_fraction"] == 0.25


def test_logs_it_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="profile_steps=3: the step profiler does not mark a GRPO step"):
        stand_in_loop(logs=Logs(profile_steps=3))
    with pytest.raises(TypeError, match="logs=5 must be a Logs"):
        stand_in_loop(logs=5)


def stand_in_loop(**changes) -> GRPO:
    layout = Layout.parse("dp2")
    pm = SimpleNamespace(layout=layout, model=GPT(GPTConfig(**CONFIG)), adapters=None, dp_size=2)
    options = dict(group_size=2, max_completion_length=4, steps=4, completions=Completions(eos_token_id=EOS),
                   logs=Logs(telemetry=False))
    return GRPO(pm, PROMPTS, count_fives, **{**options, **changes})


def test_the_loop_state_restores_step_and_seed_and_names_the_draw():
    saved = stand_in_loop(seed=7, prompts_per_step=2)
    saved.step = 3
    resumed = stand_in_loop(prompts_per_step=2)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.step, resumed.seed, resumed.data.describe()) == (3, 7, saved.state_dict()["data"])
    assert stand_in_loop().data.describe() != saved.data.describe()  # checkpoint.load refuses it


# ---- two engines ------------------------------------------------------------------------------------------
def engine_resumed_equals_uninterrupted(folder: str) -> dict:
    from colab_par import parallelize

    from colab_par.training.checkpoint import CheckpointError

    def loop(seed: int, steps: int, logs: Logs = Logs(), per_step: int = 1) -> GRPO:
        torch.manual_seed(seed)
        pm = parallelize(GPT(GPTConfig(**CONFIG)), "dp2", optimizer_fn=lambda p: torch.optim.Adam(p, lr=0.05))
        return GRPO(pm, PROMPTS, count_fives, group_size=GROUP, max_completion_length=LENGTH, steps=steps, seed=seed,
                    prompts_per_step=per_step, completions=Completions(eos_token_id=EOS, pad_token_id=PAD), logs=logs)

    collected = Collected()
    whole = loop(0, 4, Logs(every=1, telemetry=True, loggers=[collected]))
    whole.fit()
    first = loop(0, 2)
    first.fit()
    first.save_checkpoint(folder)
    resumed = loop(1, 4)  # other weights and seed: the checkpoint's must win
    resumed.resume(folder)
    resumed.fit()
    with pytest.raises(CheckpointError, match="prompts_per_step': 1.*prompts_per_step': 2"):
        loop(0, 4, per_step=2).resume(folder)
    return {"whole": whole.history, "resumed": resumed.history, "logged": collected.rows,
            "weights": (whole.pm.full_state_dict(), resumed.pm.full_state_dict())}


def without_timings(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if key not in TIMINGS + NOT_NUMBERS} for row in rows]


def test_a_resumed_run_gives_the_rows_and_weights_of_an_uninterrupted_one(cluster2, tmp_path) -> None:
    results = cluster2.run(engine_resumed_equals_uninterrupted, str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        whole, resumed = result["whole"], result["resumed"]
        assert [(row["step"], row["rank"]) for row in whole] == [(step, rank) for step in (1, 2, 3, 4)]
        assert len(resumed) == len(whole)
        assert [row.get("samples") for row in resumed] == [row.get("samples") for row in whole]
        assert all(bool(row.get("samples")) == (rank == 0) for row in whole)
        for got, expected in zip(without_timings(resumed), without_timings(whole)):
            assert got == pytest.approx(expected, rel=1e-6, abs=1e-6, nan_ok=True)
        weights, resumed_weights = result["weights"]
        for name, value in weights.items():
            assert torch.allclose(resumed_weights[name], value, rtol=1e-6, atol=1e-6), name
    whole = results[0]["whole"]
    assert len({row["reward"] for row in whole}) > 1 and all(row["loss"] == row["loss"] for row in whole)
    logged = [row for row, _ in results[0]["logged"]]
    assert [row["step"] for row in logged] == [1, 2, 3, 4] and logged[-1].keys() == whole[-1].keys()
    assert results[1]["logged"] == []  # rank 0 writes
