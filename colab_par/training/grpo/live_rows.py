"""Where a GRPO loop's rows go while it runs, the Trainer's way (`Logs`): live to the notebook's
dashboard through `RunPublisher` (datapub on an engine, a dashboard of its own in a plain process)
when `telemetry` is on, and to TensorBoard and the `loggers` through `RunLogs` (rank 0 writes;
every GRPO column becomes `train/<column>`, e.g. `train/reward/<function>`). `telemetry` measures
nothing more here: GRPO's rows always hold their timings (`rollout_s`, `train_s`). `profile_steps`
is refused: a GRPO step is a rollout and its training, which the step profiler does not mark."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from colab_par.training.checkpoint import shared_random_id
from colab_par.training.loggers import RunLogs
from colab_par.training.options import Logs
from colab_par.training.run_publisher import RunPublisher

__all__ = ["LiveRows"]

AfterStep = Callable[[dict | None, bool], None]  # (the step's row or None, whether it was the fit's last)


class LiveRows:
    """The sinks of one loop on one rank, opened for each `fit` (call on every rank: RunLogs and
    the run id are collective)."""

    def __init__(self, logs: Logs, rank: int):
        if not isinstance(logs, Logs):
            raise TypeError(f"logs={logs!r} must be a Logs, e.g. Logs(every=1, tensorboard='runs/grpo')")
        if logs.profile_steps is not None:
            raise ValueError(f"logs.profile_steps={logs.profile_steps!r}: GRPO steps are not profiled yet; "
                             "leave profile_steps out")
        self.logs, self.rank = logs, rank
        self.run_logs = RunLogs.build(logs.tensorboard, list(logs.loggers), rank)

    def logged(self, step: int, steps: int) -> bool:
        """Whether (1-based) `step` of `steps` records a row."""
        return step % self.logs.every == 0 or step == steps

    @contextlib.contextmanager
    def fit(self, history: list[dict], step: int, header: dict[str, Any],
            device: torch.device) -> Iterator[AfterStep]:
        """Open the sinks for a fit that starts after `step` (the loop's collectives run on
        `device`); yields what to call after each step. The rows already in `history` were sent by
        whoever made them."""
        publisher = None
        if self.logs.telemetry:
            publisher = RunPublisher({"rank": self.rank, "run": shared_random_id(), **header}, self.rank)
        if self.run_logs is not None:
            self.run_logs.begin(history, step, device)

        def after_step(row: dict | None, last: bool) -> None:
            if self.run_logs is not None:
                self.run_logs.after_step(history, row, device)
            if row is not None and publisher is not None:
                publisher.publish(history, force=last)

        try:
            yield after_step
        finally:
            if self.run_logs is not None:
                self.run_logs.end(history)
            if publisher is not None:
                publisher.finish(history)
