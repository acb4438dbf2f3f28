"""Reaching ranks: checked targets, tasks over the direct channel, control requests and signals.

Every room that talks to engines goes through one `Calls`: targets are checked (they exist, their
engine lives) before anything is sent, and a rank is asked from its control thread (answers while
a task runs) or signalled directly on this host, through ipyparallel's nanny on others.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
from typing import Any, Callable, Iterable, Sequence

from colab_par import compat
from colab_par.cluster.health import dead_ranks, live_ranks, raise_if_dead
from colab_par.cluster.state import ClusterState
from colab_par.cluster.output import ranks_text


class Calls:
    """The ways to reach the ranks of one cluster (`state`)."""

    def __init__(self, state: ClusterState):
        self.state = state

    def checked_ranks(self, targets: Sequence[int] | None) -> list[int]:
        """`targets` (default: every rank), refused when one does not exist or its engine died."""
        state = self.state
        state.require_running()
        ranks = list(range(state.n)) if targets is None else list(targets)
        bad = [r for r in ranks if not 0 <= r < state.n]
        if bad:
            raise ValueError(f"rank(s) {ranks_text(bad)} do not exist; this cluster has ranks "
                             f"0..{state.n - 1}")
        raise_if_dead(state, ranks)
        return ranks

    def apply(self, ranks: list[int], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start ``fn(*args, **kwargs)`` on `ranks` (direct channel where there is one,
        `colab_par.cluster.direct`); an ipyparallel AsyncResult with one result per rank."""
        return self.state.direct.apply([self.state.engine_ids[r] for r in ranks], fn, args, kwargs)

    def request(self, ranks: Iterable[int], request: str, content: dict | None = None) -> dict[int, Any]:
        """Send a `probe` request to the live ones of `ranks`; one future per rank for its reply."""
        live = set(live_ranks(self.state))
        ranks = [rank for rank in ranks if rank in live]
        if not ranks:
            return {}
        futures = compat.send_control_requests(self.state.client, [self.state.engine_ids[r] for r in ranks],
                                               request, content or {})
        return dict(zip(ranks, futures))

    @staticmethod
    def answers(futures: dict[int, Any], timeout: float) -> dict[int, dict[str, Any]]:
        """The replies that came within `timeout` and succeeded, by rank."""
        if futures:
            concurrent.futures.wait(list(futures.values()), timeout=timeout)
        replies = {rank: future.result()["content"] for rank, future in futures.items()
                   if future.done() and not future.exception()}
        return {rank: reply for rank, reply in replies.items() if reply.get("status") == "ok"}

    def idle_ranks(self, ranks: list[int]) -> set[int]:
        """The live ones of `ranks` that have no task queued or running: none the hub knows of, and
        none of this client's still unanswered (the direct channel's pass the hub by)."""
        state = self.state
        live = set(live_ranks(state))
        queues = state.client.queue_status(targets=[state.engine_ids[r] for r in ranks if r in live])
        waiting, calls = compat.unanswered(state.client), state.direct.unanswered()
        return {rank for rank in ranks if rank in live and queues[state.engine_ids[rank]]["queue"] == 0
                and not waiting.get(state.engine_ids[rank]) and not calls.get(state.engine_ids[rank])}

    def interrupt(self, ranks: Iterable[int] | None = None) -> None:
        """SIGINT to every engine (the notebook's stop button), or to `ranks`."""
        self.signal(signal.SIGINT, range(self.state.n) if ranks is None else ranks)

    def signal(self, signum: signal.Signals, ranks: Iterable[int]) -> None:
        """`signum` to the live ones of `ranks`: directly on this host, through the nanny on others."""
        state = self.state
        if not state.running:
            return
        remote = []
        for rank in set(ranks) - set(dead_ranks(state)):
            info = state.hosts[rank]
            if state.is_local(info):
                try:
                    os.kill(info["pid"], signum)
                except ProcessLookupError:
                    pass
            else:
                remote.append(state.engine_ids[rank])
        if remote:
            state.client.send_signal(signum.name, targets=remote, block=False)
