"""Which ranks of a running task wait in collectives that can never complete (notebook side, pure).

While a cell runs, the notebook asks every engine now and then what its main thread waits in
(`colab_par.cluster.probe`: the collective, its group, the group's sequence number, the cell line). A
rank is *blocked* when two answers at least `grace` apart show the same call (same group, same
sequence number: any new call on that group would have advanced it). A blocked rank is *stuck*
only when that is certain:

- a collective every member must enter together (all_reduce, all_gather, barrier, ...) is stuck
  when one member will never enter it: that member returned from the cell (or died) at least
  `grace` before, or is itself stuck in something else;
- a rooted collective, send or recv (whose peers may finish early: a broadcast's root, a reduce's
  senders) is stuck when none of the members it needs can still come (each is in the same call,
  or returned, died or is stuck elsewhere) and one of them never will: had it taken part, the
  data would have arrived within the grace;

where "stuck elsewhere" is decided for all ranks at once (the greatest set consistent with these
rules), so two ranks waiting in different collectives of one group, or a cycle of waits across
groups, are stuck together. Ranks running Python, or waiting in something the probe cannot name
(a functional collective, a `work.wait()` of the user's), may still come: they never make
another rank stuck. Ranks busy together in one slow collective are never stuck.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Wait", "Watch", "SYMMETRIC", "ROOTED"]

# Collectives that complete on no rank before every member entered them.
SYMMETRIC = frozenset({"all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
                       "all_gather_coalesced", "_all_gather_base", "all_to_all", "all_to_all_single",
                       "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "barrier",
                       "monitored_barrier"})
# Rooted collectives and point-to-point calls: the argument naming the root or the peer.
ROOTED = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst", "send": "dst",
          "recv": "src"}
_PAIRS = {"send": "recv", "recv": "send"}


@dataclass(frozen=True)
class Wait:
    """A collective call a rank's main thread is blocked in (as `probe.main_thread_wait` reports it)."""

    op: str
    group: str  # the process group's name, the same on every member
    ranks: tuple[int, ...]  # the group's members (global ranks)
    seq: int  # the group's sequence number on this rank: a new call on the group advances it
    root: int | None = None  # global rank of the root, or of the peer of a send/recv

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> "Wait":
        return cls(report["op"], report["group"], tuple(report["ranks"]), report["seq"], report.get("root"))

    def joins(self, other: "Wait", rank: int, other_rank: int) -> bool:
        """Whether `other` (on `other_rank`) is this very call's counterpart (this on `rank`)."""
        if other.group != self.group:
            return False
        if self.op in _PAIRS:  # a recv from any source (root None) takes any sender
            return (other.op == _PAIRS[self.op] and other.root in (None, rank)
                    and self.root in (None, other_rank))
        return other.op == self.op and other.root == self.root

    def needs(self, rank: int) -> set[int]:
        """The ranks this call cannot complete without (the peer of a send or recv from a known source)."""
        if self.op in _PAIRS and self.root is not None:
            return {self.root}
        return set(self.ranks) - {rank}

    def describe(self) -> str:
        root = {"src": f" from rank {self.root}", "dst": f" to rank {self.root}"}.get(
            ROOTED.get(self.op, ""), "") if self.root is not None else ""
        return f"{self.op}{root} on the group of ranks {','.join(map(str, self.ranks))}"


@dataclass
class _Seen:
    wait: Wait | None  # None: running (or waiting in something the probe cannot name)
    since: float  # when this call was first seen
    at: float  # when it was last seen


class Watch:
    """Follows the ranks of one task through the probes' answers and names the stuck ones."""

    def __init__(self, grace: float):
        self.grace = grace
        self._seen: dict[int, _Seen] = {}
        self._gone: dict[int, tuple[float, str]] = {}  # rank -> (since when, why: "returned", ...)

    def observe(self, rank: int, wait: Wait | None, now: float) -> None:
        """What a probe found `rank` doing at `now` (None: running Python, or unknown)."""
        seen = self._seen.get(rank)
        if seen is None or seen.wait is None or wait != seen.wait:
            self._seen[rank] = _Seen(wait, now, now)
        else:
            seen.at = now

    def gone(self, rank: int, why: str, now: float) -> None:
        """`rank` will take part in nothing more of this task (it returned, died, or never ran it)."""
        self._gone.setdefault(rank, (now, why))
        self._seen.pop(rank, None)

    def blocked(self) -> dict[int, Wait]:
        return {rank: seen.wait for rank, seen in self._seen.items()
                if seen.wait is not None and seen.at - seen.since >= self.grace}

    def stuck(self) -> dict[int, str]:
        """The stuck ranks, each with why in words: its call, and which peers will never join it."""
        blocked = self.blocked()
        stuck = set(blocked)
        changed = True
        while changed:  # drop ranks that can still complete until what is left is consistent
            changed = False
            for rank in sorted(stuck):
                if self._blocker(rank, blocked, stuck) is None:
                    stuck.discard(rank)
                    changed = True
        return {rank: f"its {blocked[rank].describe()} cannot complete: {self._blocker(rank, blocked, stuck)}"
                for rank in sorted(stuck)}

    def _blocker(self, rank: int, blocked: dict[int, Wait], stuck: set[int]) -> str | None:
        """Why `rank`'s call can never complete, or None while it still can."""
        wait = blocked[rank]
        never: dict[int, str] = {}
        present = 0
        for peer in sorted(wait.needs(rank)):
            peer_wait = blocked.get(peer)
            if peer_wait is not None and wait.joins(peer_wait, rank, peer):
                present += 1
            elif peer in self._gone and self._gone[peer][0] + self.grace <= self._seen[rank].at:
                never[peer] = self._gone[peer][1]
            elif peer in stuck and peer_wait is not None:
                never[peer] = (f"waits in {peer_wait.describe()}" if peer_wait.group != wait.group
                               else f"waits in {peer_wait.op} on the same group")
        if not never:
            return None
        if wait.op not in SYMMETRIC and len(never) + present < len(wait.needs(rank)):
            return None  # a rooted call: someone it needs may still come
        return "; ".join(f"rank {peer} {why}" for peer, why in never.items())

