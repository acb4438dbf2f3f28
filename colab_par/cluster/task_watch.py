"""Watching one running task for ranks stuck in collectives that can never complete.

While a task runs longer than `START_AFTER_S`, every `EVERY_S` the notebook asks each rank still
in it (and each rank outside it that is not idle) where its main thread is (`probe.where`,
answered from the engine's control thread), and hands the answers to `deadlock.Watch`, which
decides. A task that ends sooner is never asked anything; a long one costs each engine one short
answer per `EVERY_S`. Ranks that do not answer within `ANSWER_WITHIN_S` count as running.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from colab_par import compat
from colab_par.cluster.deadlock import Wait, Watch

__all__ = ["TaskWatch", "GRACE_S"]

START_AFTER_S = 0.5
EVERY_S = 1.0
ANSWER_WITHIN_S = 1.0
# How long a rank must sit in one call, and a peer must have returned, before it counts: long
# enough for data in flight (a broadcast root that returned first) to arrive.
GRACE_S = 1.5


class TaskWatch:
    """Probes the ranks of one task (`request(ranks) -> {rank: future}`) and reports stuck ones;
    ranks outside the task that `idle(ranks)` finds with nothing to run count as returned."""

    def __init__(self, result: Any, task_ranks: list[int], world_ranks: list[int],
                 request: Callable[[list[int]], dict[int, Any]], idle: Callable[[list[int]], set[int]],
                 *, what: str = "the cell"):
        self.result, self.task_ranks, self.world_ranks = result, task_ranks, world_ranks
        self._request, self._idle, self._what = request, idle, what
        self._decide = Watch(GRACE_S)
        self._round: dict[int, Any] = {}
        self._round_sent = 0.0
        self._next = time.monotonic() + START_AFTER_S
        self.gone: dict[int, str] = {}  # rank -> why it takes no more part in the task

    def poll(self, now: float) -> dict[int, str] | None:
        """The stuck ranks with why (see `deadlock.Watch.stuck`), or None; call it often."""
        if len(self.world_ranks) < 2:
            return None
        for rank, future in zip(self.task_ranks, compat.task_futures(self.result)):
            if future.done() and rank not in self.gone:
                self._leave(rank, f"returned from {self._what}", now)
        if self._round and (all(f.done() for f in self._round.values())
                            or now - self._round_sent > ANSWER_WITHIN_S):
            self._collect(now)
        if not self._round and now >= self._next:
            others = [r for r in self.world_ranks if r not in self.task_ranks and r not in self.gone]
            for rank in self._idle(others) if others else ():  # ranks a `targets` cell left out
                self._leave(rank, f"is not running {self._what}", now)
            asked = [rank for rank in self.world_ranks if rank not in self.gone]
            self._round, self._round_sent, self._next = self._request(asked), now, now + EVERY_S
        return self._decide.stuck() or None

    def _collect(self, now: float) -> None:
        for rank, future in self._round.items():
            if rank in self.gone:
                continue
            answer = future.result()["content"] if future.done() and not future.exception() else {}
            report = answer.get("wait") if answer.get("status") == "ok" else None  # no answer: running
            self._decide.observe(rank, Wait.from_report(report) if report else None, now)
        self._round = {}

    def _leave(self, rank: int, why: str, now: float) -> None:
        self.gone[rank] = why
        self._decide.gone(rank, why, now)
