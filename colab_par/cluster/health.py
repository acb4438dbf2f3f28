"""Which ranks are gone, and what a crashed one left behind.

Read from the shared state alone (the hub's registrations, this host's processes, the stack files
faulthandler writes): every room checks its targets here before it sends them anything.
"""
from __future__ import annotations

from typing import Iterable

from colab_par import compat
from colab_par.cluster.processes import pid_alive
from colab_par.cluster.state import ClusterState
from colab_par.cluster.output import DeadEngineError


def dead_ranks(state: ClusterState) -> list[int]:
    """Ranks whose engine the hub no longer knows, or whose process on this host ended."""
    registered = set(state.client.ids) if state.client is not None else set()
    dead = []
    for rank, eid in enumerate(state.engine_ids):
        info = state.hosts[rank] if rank < len(state.hosts) else None
        if eid not in registered or (info and state.is_local(info) and not pid_alive(info["pid"])):
            dead.append(rank)
    return dead


def live_ranks(state: ClusterState) -> list[int]:
    dead = set(dead_ranks(state))
    return [rank for rank in range(state.n) if rank not in dead]


def raise_if_dead(state: ClusterState, ranks: Iterable[int]) -> None:
    """Raise DeadEngineError naming any of `ranks` whose engine died, with what a crash left."""
    dead = [r for r in dead_ranks(state) if r in set(ranks)]
    if dead:
        pids = ", ".join(f"rank {r}: pid {state.hosts[r]['pid']} on {state.hosts[r]['host']}"
                         f"{crash_of(state, r)}" for r in dead)
        raise DeadEngineError(dead, pids)


def crash_of(state: ClusterState, rank: int, lines: int = 12) -> str:
    """What a crashed rank's fatal signal left in its stack file (faulthandler's report): the
    signal, and the Python stacks of the thread that crashed and of the engine's main thread
    (the innermost `lines` calls of each), when the rank ran on this host."""
    if rank >= len(state.stack_files) or not state.is_local(state.hosts[rank]):
        return ""
    try:
        with open(state.stack_files[rank], errors="replace") as dump:
            text = dump.read()
    except OSError:
        return ""
    start = text.rfind("Fatal Python error")
    if start < 0:
        return ""
    signal_line, *threads = text[start:].strip().split("\n\n")
    shown = [t for t in threads if t.startswith("Current thread")]
    shown += [t for t in threads if compat.ENGINE_MAIN_FILE in t and t not in shown]
    stacks = ["\n".join(t.splitlines()[:lines + 1]) for t in shown]
    return "; it crashed:\n" + "\n".join([signal_line.splitlines()[0], *stacks]) + "\n"
