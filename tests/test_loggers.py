"""TensorBoard event files from the rows the dashboard draws: TensorBoard's own reader gives back
exactly `trainer.history` (rank 0's rows, every rank's memory), rows of any kind (evaluation) flow
through under their own tags, and a resumed run replaces the abandoned run's later points."""
from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from colab_par.training.loggers import TensorBoardLogger, scalar_tags  # noqa: E402
from test_data_sources import BATCH, GPT_SIZES, Windows  # noqa: E402
from colab_par.training.options import Evaluation, Logs

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def read_back(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in `log_dir` as TensorBoard reads it: tag -> [(step, value)]."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def as_stored(value: float) -> float:
    """TensorBoard keeps a scalar as a float32."""
    return float(np.float32(value))


def test_rows_of_any_kind_land_under_their_own_tags(tmp_path):
    rows = [{"step": 1, "rank": 0, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "step_time": 0.5,
             "time_data": 0.1, "mem_total": 4096.0, "tokens_per_s": 800.0, "note": "text"},
            {"step": 2, "rank": 0, "eval_loss": 2.25, "eval_perplexity": 9.5}]
    logger = TensorBoardLogger(tmp_path)
    logger.begin(0)
    for row in rows:
        logger.log(row, 0)
    logger.log({"step": 1, "mem_total": 8192.0, "loss": 7.0}, 1)  # another rank: its memory only
    logger.flush()
    assert read_back(tmp_path) == {
        "train/loss": [(1, 2.5)], "train/lr": [(1, as_stored(1e-3))], "time/step_time": [(1, 0.5)],
        "time/data": [(1, as_stored(0.1))], "memory/rank0/total": [(1, 4096.0)],
        "train/tokens_per_s": [(1, 800.0)], "eval/loss": [(2, 2.25)], "eval/perplexity": [(2, 9.5)],
        "memory/rank1/total": [(1, 8192.0)]}


def test_a_resumed_run_replaces_the_abandoned_points(tmp_path):
    first = TensorBoardLogger(tmp_path)
    first.begin(0)
    for step in range(1, 6):
        first.log({"step": step, "loss": 10.0 - step}, 0)
    first.close()
    resumed = TensorBoardLogger(tmp_path)  # a new process resuming from the checkpoint of step 3
    resumed.begin(3)
    for step in (4, 5):
        resumed.log({"step": step, "loss": 100.0 + step}, 0)
    resumed.flush()
    assert read_back(tmp_path)["train/loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0)]


def test_a_stand_in_that_opens_in_the_same_second_keeps_its_rows(tmp_path, monkeypatch):
    """A survivor standing in for a killed rank 0 opens its writer moments after rank 0 began, from a
    process whose pid sorts before rank 0's: its file must still be read after rank 0's, or rank 0's
    purge (its writer opened at step 1) drops the stand-in's rows."""
    first = TensorBoardLogger(tmp_path)
    first.begin(0)
    for step in range(1, 5):
        first.log({"step": step, "loss": 10.0 - step}, 0)
    monkeypatch.setattr("os.getpid", lambda: 1)  # an older process than this one
    stand_in = TensorBoardLogger(tmp_path)
    stand_in.begin(4)
    for step in (5, 6):
        stand_in.log({"step": step, "loss": 10.0 - step}, 0)
    stand_in.close()
    assert read_back(tmp_path)["train/loss"] == [(step, 10.0 - step) for step in range(1, 7)]


def test_scalar_tags_leave_out_what_is_not_a_number():
    assert scalar_tags({"step": 3, "rank": 1, "ok": True, "mfu": None, "layout": "dp2"}) == {}


STEPS = 4


def train_with_logs(log_dir: str) -> list[dict]:
    import torch

    from colab_par import Trainer, parallelize
    from colab_par.models.gpt import GPT, GPTConfig
    torch.manual_seed(5)
    pm = parallelize(GPT(GPTConfig(**GPT_SIZES)), "dp2 zero3")
    trainer = Trainer(pm, Windows(), batch_size=BATCH, steps=STEPS, logs=Logs(every=2, tensorboard=log_dir), evaluation=Evaluation(Windows(), every=2))
    trainer.fit()
    return trainer.history


TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "mfu": "train/mfu",
        "samples_per_s": "train/samples_per_s", "flops_per_s": "train/flops_per_s", "bubble": "train/bubble",
        "step_time": "time/step_time", "time_data": "time/data", "time_forward_backward": "time/forward_backward",
        "time_clip": "time/clip", "time_optimizer": "time/optimizer", "time_telemetry": "time/telemetry",
        "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity", "eval_time": "eval/time",
        "eval_batches": "eval/batches", "eval_tokens": "eval/tokens"}
"""Where each field of the Trainer's rows shows in TensorBoard (a new field needs its line here)."""


def test_tensorboard_reads_back_the_history_of_every_rank(cluster2, tmp_path):
    ranks = cluster2.run(train_with_logs, str(tmp_path))
    assert sorted(p.parent for p in tmp_path.rglob("events.out.tfevents.*")) == [tmp_path]  # rank 0 alone
    for history in ranks:
        assert [(row["step"], row.get("kind")) for row in history] == [(2, None), (2, "eval"), (4, None),
                                                                        (4, "eval")]
    # The tags written out by hand (not by the function under test): rank 0's numbers by kind,
    # every rank's memory under its own rank; the row fields that are not numbers stay out.
    expected: dict[str, list[tuple[int, float]]] = {}
    for rank, history in enumerate(ranks):
        for row in history:
            for key, value in row.items():
                if key in ("step", "rank", "kind") or value is None:  # bubble: None outside pipelines
                    continue
                if key.startswith("mem_"):
                    tag = f"memory/rank{rank}/{key[len('mem_'):]}"
                elif rank:
                    continue
                else:
                    tag = TAGS[key]
                expected.setdefault(tag, []).append((row["step"], as_stored(value)))
    got = read_back(tmp_path)
    assert got == expected
    evals = [row for row in ranks[0] if row.get("kind") == "eval"]  # the validation curve
    assert got["eval/loss"] == [(row["step"], as_stored(row["eval_loss"])) for row in evals]
    assert [step for step, _ in got["eval/perplexity"]] == [2, 4]
    # Each rank's memory tags hold its own figures (which differ: the process sizes do).
    last = [[row for row in history if row.get("kind") is None][-1] for history in ranks]
    memory = [key for key in last[0] if key.startswith("mem_")]
    assert any(last[0][key] != last[1][key] for key in memory)


def fit_into(log_dir: str) -> str:
    import torch

    from colab_par import Trainer, parallelize
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(5)
    trainer = Trainer(parallelize(GPT(GPTConfig(**GPT_SIZES)), "dp2"), Windows(), batch_size=BATCH, steps=2, logs=Logs(tensorboard=log_dir))
    try:
        trainer.fit()
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__} at step {trainer.step}"
    return "trained"


def test_logs_rank_0_cannot_open_fail_every_rank_before_any_step(cluster2, tmp_path):
    (tmp_path / "a-file").write_text("")
    assert cluster2.run(fit_into, str(tmp_path / "a-file" / "logs")) == [
        "NotADirectoryError at step 0", "RuntimeError at step 0"]


def test_a_logger_without_log_is_refused():
    from colab_par.training.loggers import RunLogs

    with pytest.raises(TypeError, match="str is not a logger: a logger has log"):
        RunLogs.build(None, ["runs/"], rank=0)
