"""Experiment logs where people look: TensorBoard event files, written from the very rows the
dashboard draws (`Trainer.history`); nothing is computed here.

Rank 0 writes. Its rows carry everything that is the same on every rank (loss, LR, grad norm) or
that it measures as well as any rank (throughput, MFU, step-time phases); only memory differs per
rank. So at each log step rank 0 gathers the other ranks' `mem_*` figures with ONE small
`dist.gather` of a float64 vector (a few dozen bytes per rank), and nothing else crosses the
network. (Per-rank event files would need no collective, but a folder every host shares and one
TensorBoard run per rank; the notebook dashboard already gets every rank's full rows through
datapub.)

Tags follow the row's keys, so rows of any kind flow through (evaluation rows included):
`eval_loss` -> `eval/loss`, `mem_total` of rank k -> `memory/rank{k}/total` (bytes), `step_time`
and `time_*` -> `time/...`, every other number -> `train/<key>`. `step` is the x-axis; `rank` and
values that are not numbers (None, text) are left out, but for a row's `samples` (what a GRPO
policy wrote), which go to the text tab as a table.
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from colab_par.views.rows import SAMPLES_COLUMN
from colab_par.views.samples_table import samples_markdown, valid_samples

__all__ = ["Logger", "TensorBoardLogger", "RunLogs", "scalar_tags"]


class Logger(Protocol):
    """What `Trainer(loggers=[...])` takes: `log(row, rank)` for each row (rank 0's rows, and the
    memory figures of rank k as a row with `rank=k`); optional `begin(step)` (a fit starts after
    `step`) and `flush()` (a fit ended)."""

    def log(self, row: dict, rank: int) -> None: ...


def scalar_tags(row: dict, rank: int = 0) -> dict[str, float]:
    """The numbers of `row` by TensorBoard tag (module docstring). Rows of ranks other than 0 give
    only their memory figures."""
    tags = {}
    for key, value in row.items():
        if key in ("step", "rank") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("mem_"):
            tags[f"memory/rank{rank}/{key[4:]}"] = float(value)
        elif rank != 0:
            continue
        elif key.startswith("eval_"):
            tags[f"eval/{key[5:]}"] = float(value)
        elif key == "step_time" or key.startswith("time_"):
            tags[f"time/{key.removeprefix('time_')}"] = float(value)
        else:
            tags[f"train/{key}"] = float(value)
    return tags


class TensorBoardLogger:
    """Scalars into TensorBoard event files under `log_dir` (`torch.utils.tensorboard`).

    The writer opens on rank 0's first `begin`. A fit that starts again at an earlier step (a
    resume from a checkpoint) opens a new writer with `purge_step`, so TensorBoard drops the
    abandoned run's later points instead of drawing a zigzag. Each row is flushed to the file as it
    is written: an engine killed mid-run loses no row it logged, and whoever logs on after it (a
    replacement, or a survivor standing in while it is replaced) starts where it stopped.
    """

    def __init__(self, log_dir: str | os.PathLike):
        if importlib.util.find_spec("tensorboard") is None:  # on every rank, before any work
            raise ImportError("TensorBoard logs need the tensorboard package: pip install tensorboard "
                              "(or colab-par[finetune]), or leave log_dir out")
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._last_step = -1

    def begin(self, step: int) -> None:
        if self._writer is not None and step >= self._last_step:
            return
        from torch.utils.tensorboard import SummaryWriter

        if self._writer is not None:
            self._writer.close()
        self._after_every_event_file()
        self._writer = SummaryWriter(str(self.log_dir), purge_step=step + 1)
        self._last_step = step

    def _after_every_event_file(self) -> None:
        """Wait, if need be, for the second after the newest event file's. TensorBoard reads a
        folder's files in name order, and a file is named by the second it opened, then host and
        pid: a writer that opens in the same second as an earlier one (a survivor standing in for a
        killed rank 0 moments after it began) may sort before it, and the earlier file's purge then
        drops the later file's rows."""
        files = self.log_dir.glob("events.out.tfevents.*") if self.log_dir.is_dir() else []
        newest = max((int(name.split(".")[3]) for name in (path.name for path in files)
                      if name.split(".")[3].isdigit()), default=-1)
        while int(time.time()) <= newest:
            time.sleep(0.02)

    def log(self, row: dict, rank: int = 0) -> None:
        if self._writer is None:
            self.begin(int(row["step"]) - 1)
        step = int(row["step"])
        for tag, value in scalar_tags(row, rank).items():
            self._writer.add_scalar(tag, value, step)  # NaN too: a diverged loss should show
        samples = valid_samples(row.get(SAMPLES_COLUMN)) if rank == 0 else None
        if samples is not None:  # what a GRPO policy wrote, in the text tab
            self._writer.add_text(f"train/{SAMPLES_COLUMN}", samples_markdown(samples), step)
        self._writer.flush()
        self._last_step = max(self._last_step, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class RunLogs:
    """Trainer's side of the loggers: rank 0 passes on every row `history` gained, and at each log
    step the other ranks' memory figures (module docstring); the other ranks only join the gather."""

    def __init__(self, loggers: Sequence[Any], rank: int):
        for logger in loggers:
            if not callable(getattr(logger, "log", None)):
                raise TypeError(f"{type(logger).__name__} is not a logger: a logger has log(row, rank) "
                                "(e.g. colab_par.training.loggers.TensorBoardLogger(log_dir))")
        self.loggers, self.rank = list(loggers), rank
        self._written = 0  # rows of history already passed on

    @classmethod
    def build(cls, log_dir: str | os.PathLike | None, loggers: Sequence[Any] | None,
              rank: int) -> "RunLogs | None":
        chosen = [TensorBoardLogger(log_dir)] if log_dir is not None else []
        chosen += list(loggers or [])
        return cls(chosen, rank) if chosen else None

    def begin(self, history: list[dict], step: int, device: torch.device) -> None:
        """A fit starts after `step`; rows already in `history` were logged by whoever made them.
        Rank 0 opens the logs; if that fails, every rank raises (one tiny all-reduce per fit)
        rather than wait in the first step's collectives."""
        self._written = len(history)
        failure = None
        if self.rank == 0:
            try:
                self.open(history, step)
            except Exception as error:  # a folder it may not write, a logger's own error
                failure = error
        if _any_rank(failure is not None, device):
            if failure is not None:
                raise failure
            raise RuntimeError("rank 0 could not open the logs (its error says why); fix log_dir or "
                               "the logger, or leave them out")

    def open(self, history: list[dict], step: int) -> None:
        """Rank 0's part of `begin`, with no collective: also what a survivor standing in for a
        lost rank 0 calls (`training/resilience/degraded.py`), which then passes rows on itself."""
        self._written = len(history)
        self._each("begin", step)

    def after_step(self, history: list[dict], row: dict | None, device: torch.device) -> None:
        """Call on every rank after each step (`row`: its log row or None)."""
        memory = _gather_memory(row, device) if row is not None else None
        if self.rank != 0:
            return
        self.pass_on(history)
        for rank, figures in enumerate(memory or []):
            for logger in self.loggers if rank else ():  # rank 0's figures are in its row
                logger.log({"step": row["step"], **figures}, rank)

    def end(self, history: list[dict], *, close: bool = False) -> None:
        """After a fit (also one that failed): pass on what is left and flush (`close`: and close,
        for a stand-in's logs); no collective."""
        if self.rank == 0:
            self.pass_on(history)
            self._each("flush")
            if close:
                self._each("close")

    def pass_on(self, history: list[dict]) -> None:
        """Every row `history` gained since the last call, to each logger."""
        for row in history[self._written:]:
            for logger in self.loggers:
                logger.log(row, 0)
        self._written = len(history)

    def _each(self, method: str, *args: Any) -> None:
        for logger in self.loggers:
            call = getattr(logger, method, None)
            if callable(call):
                call(*args)


def _any_rank(flag: bool, device: torch.device) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _gather_memory(row: dict, device: torch.device) -> list[dict] | None:
    """Every rank's `mem_*` figures of this log step on rank 0 (None elsewhere, and when the rows
    hold none or there is one rank). One gather of a float64 vector: every rank's rows have the
    same memory keys (the same telemetry on the same kind of device)."""
    keys = sorted(key for key, value in row.items() if key.startswith("mem_") and value is not None)
    if not keys or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = torch.tensor([float(row[key]) for key in keys], dtype=torch.float64, device=device)
    rank = dist.get_rank()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather(mine, gathered, dst=0)
    if gathered is None:
        return None
    return [dict(zip(keys, values.tolist())) for values in gathered]
