"""Where a fit's rows go while it runs: through datapub to the notebook's dashboard on an engine,
or, in a plain process (no cluster), to a dashboard of its own on rank 0."""
from __future__ import annotations

from typing import Any

from colab_par.training import telemetry as telem

__all__ = ["RunPublisher"]


class RunPublisher:
    def __init__(self, header: dict[str, Any], rank: int) -> None:
        self._dashboard = None
        self._publisher = telem.Publisher(header, local_sink=self._show)
        if not self._publisher.on_engine and rank == 0:
            from colab_par.views.dashboard import LiveDashboard

            self._dashboard = LiveDashboard()

    def _show(self, per_rank: list[dict | None]) -> None:
        if self._dashboard is not None:
            self._dashboard.update(per_rank)

    def publish(self, history: list[dict], *, force: bool = False) -> None:
        self._publisher.publish(history, force=force)

    def finish(self, history: list[dict]) -> None:
        self._publisher.publish(history, force=True, done=True)
        if self._dashboard is not None:
            self._dashboard.finish()
