"""Where a training loop's rows go while it runs (`Logs`): live to the notebook's dashboard through
`RunPublisher` (datapub on an engine, a dashboard of its own in a plain process) when `telemetry`
is on, and to TensorBoard and the `loggers` through `RunLogs` (rank 0 writes). The Trainer and the
GRPO loop both open their sinks here, once per `fit`, so a row reaches the same places the same
way whichever loop made it."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from colab_par.training.checkpoint import shared_random_id
from colab_par.training.loggers import RunLogs
from colab_par.training.options import Logs
from colab_par.training.run_publisher import RunPublisher

__all__ = ["LiveRows", "RowSinks"]


class RowSinks:
    """One fit's open sinks on one rank: `after_step` after every step, `refresh` when rows were
    added outside a step (an evaluation) and should show now."""

    def __init__(self, history: list[dict], run_logs: RunLogs | None, publisher: RunPublisher | None,
                 device: torch.device):
        self._history, self._run_logs, self._publisher, self._device = history, run_logs, publisher, device

    def after_step(self, row: dict | None, last: bool) -> None:
        """Call on every rank after each step (`row`: its log row or None; `last`: the fit's last)."""
        if self._run_logs is not None:
            self._run_logs.after_step(self._history, row, self._device)
        if row is not None and self._publisher is not None:
            self._publisher.publish(self._history, force=last)

    def refresh(self) -> None:
        if self._publisher is not None:
            self._publisher.publish(self._history, force=True)


class LiveRows:
    """The sinks of one loop on one rank, opened for each `fit` (call on every rank: RunLogs and
    the run id are collective)."""

    def __init__(self, logs: Logs, rank: int):
        if not isinstance(logs, Logs):
            raise TypeError(f"logs={logs!r} must be a Logs, e.g. Logs(every=1, tensorboard='runs/grpo')")
        self.logs, self.rank = logs, rank
        self.run_logs = RunLogs.build(logs.tensorboard, list(logs.loggers), rank)

    def logged(self, step: int, steps: int) -> bool:
        """Whether (1-based) `step` of `steps` records a row."""
        return step % self.logs.every == 0 or step == steps

    @contextlib.contextmanager
    def fit(self, history: list[dict], step: int, header: dict[str, Any],
            device: torch.device) -> Iterator[RowSinks]:
        """Open the sinks for a fit that starts after `step` (the loop's collectives run on
        `device`). The rows already in `history` were sent by whoever made them; what is left of
        them is passed on and the dashboard gets its last frame also when the fit fails."""
        publisher = None
        if self.logs.telemetry:
            publisher = RunPublisher({"rank": self.rank, "run": shared_random_id(), **header}, self.rank)
        if self.run_logs is not None:
            self.run_logs.begin(history, step, device)
        try:
            yield RowSinks(history, self.run_logs, publisher, device)
        finally:
            if self.run_logs is not None:
                self.run_logs.end(history)
            if publisher is not None:
                publisher.finish(history)
