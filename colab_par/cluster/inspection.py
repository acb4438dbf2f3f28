"""Looking into the engines: per-rank status, names, devices, post-mortem debugging, pulling variables.

Each question goes to idle ranks only (it would queue behind a running task) and is one short
task per rank (`colab_par.cluster.debugger`, `colab_par.cluster.postmortem`, `colab_par.cluster.pull`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import psutil

from colab_par.cluster import debugger, engine, postmortem
from colab_par.cluster import pull as pulled
from colab_par.cluster.backend import device_problems
from colab_par.cluster.calls import Calls
from colab_par.cluster.execution import Execution
from colab_par.cluster.health import dead_ranks, live_ranks
from colab_par.cluster.state import ClusterState
from colab_par.cluster.output import is_transport_error, ranks_text, size_text, values


class Inspection:
    """Answers about one cluster's ranks (`state`); `execution` runs what needs every rank."""

    def __init__(self, state: ClusterState, calls: Calls, execution: Execution):
        self.state, self.calls, self.execution = state, calls, execution

    def status(self) -> list[dict[str, Any]]:
        """Per rank: host, pid, device, alive, memory in use (busy ranks report what is known)."""
        state = self.state
        if not state.running:
            return []
        rows = []
        dead = set(dead_ranks(state))
        for rank, engine_id in enumerate(state.engine_ids):
            row = {"rank": rank, "engine_id": engine_id, **state.hosts[rank],
                   "device": state.devices[rank], "alive": rank not in dead, "memory_bytes": None}
            if row["alive"]:
                reply = state.client[[engine_id]].apply_async(engine.rank_status)
                if reply.wait(5.0) and reply.successful():
                    row["memory_bytes"] = reply.get()[0]["memory_bytes"]
                else:
                    row["busy"] = True
            rows.append(row)
        return rows

    def debug(self, rank: int | None, commands: Sequence[str] | None) -> None:
        """A post-mortem pdb on `rank`'s last error (the first rank whose error is its own by default)."""
        self._require_idle(range(self.state.n) if rank is None else [rank])
        if rank is None:
            rank = self._rank_to_debug()
            if rank is None:
                print("colab_par: no rank keeps an error to debug (a rank releases its last error at "
                      "its next successful cell)")
                return
        debugger.session(lambda fn, *args: self.call(rank, fn, *args), rank, commands)

    def clear_errors(self, ranks: Iterable[int] | None) -> list[int]:
        """Release each rank's last error's frames; the ranks that had one."""
        ranks = list(range(self.state.n)) if ranks is None else list(ranks)
        return [rank for rank in ranks if self.call(rank, postmortem.clear)]

    def _rank_to_debug(self) -> int | None:
        errors = {rank: self.call(rank, postmortem.last_error) for rank in live_ranks(self.state)}
        errors = {rank: error for rank, error in errors.items() if error is not None}
        own = [rank for rank, error in errors.items()
               if not is_transport_error(error["name"], error["value"]) and error["name"] != "KeyboardInterrupt"]
        candidates = own or list(errors)
        return candidates[0] if candidates else None

    def pull(self, name: str, rank: int, max_bytes: int | None) -> Any:
        """Engine variable `name` of `rank`, here on the CPU, refused above `max_bytes`."""
        self._require_idle([rank])
        described = self.execution.run(pulled.describe, name)
        mine = described[rank]
        if mine["kind"] == "missing":
            raise NameError(f"rank {rank}: {mine['why']}; nothing pulled")
        sharded = mine["kind"] in pulled.SHARDED
        if sharded and (odd := [r for r, d in enumerate(described) if d["kind"] != mine["kind"]]):
            raise ValueError(f"{name} is a {mine['kind']} on rank {rank} but not on rank(s) "
                             f"{ranks_text(odd)}: gathering it needs every rank's part; nothing pulled")
        size = sum({d["share"]: d["bytes"] for d in described}.values()) if sharded else mine["bytes"]
        available = psutil.virtual_memory().available
        limit = available // 3 if max_bytes is None else max_bytes
        if size > limit:
            raise MemoryError(
                f"{name} ({mine['what']}) is {size_text(size)} whole; the limit is {size_text(limit)} "
                f"({'max_bytes' if max_bytes is not None else 'a third of'} this host's "
                f"{size_text(available)} available, as the gathered copy, the message and the result "
                "coexist while it moves). Pull a part (a dotted name, e.g. one tensor of the model) or "
                "save it instead (colab_par.save, save_pretrained); nothing pulled")
        if sharded:
            found = self.execution.run(pulled.gather, name, rank)
        else:
            found = [self.call(rank, pulled.gather, name, rank)]
        return next(piece for piece in found if piece is not None)["value"]

    def _require_idle(self, ranks: Iterable[int], grace_s: float = 1.0) -> None:
        """Refuse ranks running a task (a `submit` still working): what is asked would queue
        behind it. The hub learns of a finished task a moment after its result, hence the grace."""
        ranks = list(ranks)
        self.calls.checked_ranks(ranks)
        deadline = time.monotonic() + grace_s
        while busy := [rank for rank in ranks if rank not in self.calls.idle_ranks(ranks)]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank(s) {ranks_text(busy)} are running a task; wait for it to "
                                   "finish (or interrupt it) and ask again")
            time.sleep(0.05)

    def names(self, rank: int) -> list[str]:
        """The variables `rank`'s engine holds (its interactive namespace, hidden names left out)."""
        return self.call(rank, engine.user_names)

    def call(self, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on one rank (the kit's own quick engine functions)."""
        result = self.calls.apply(self.calls.checked_ranks([rank]), fn, *args)
        if not result.wait(self.state.timeout):
            raise TimeoutError(f"rank {rank} did not answer within {self.state.timeout:.0f}s")
        return values(result, self.state.engine_ids)[0]

    def check_devices(self) -> list[str]:
        """What is wrong with where the engines compute (`backend.device_problems`)."""
        state = self.state
        return device_problems(state.backend, state.hosts, state.devices, self.execution.run(engine.device_report))
