"""What an engine keeps in its own memory so that a lost peer costs few steps or none.

Kept per checkpoint folder (the Trainer's `Checkpoints.dir` names a run) in this process, so it
outlives the cell: when an engine dies, the others keep their processes and run the cell again.
- The live state: the Trainer that finished the newest whole step, by reference (its model and
  optimizer do not change before the next optimizer step), with its loop's state at that moment
  (data position, random stream, rows: these move on in the next step's forward). Under a layout
  whose every dp peer holds the same state (no ZeRO, no tiers), a peer's live state is the lost
  rank's state too. Cleared before each optimizer step and set after the step's row: a rank that
  failed in between is not a source.
- Snapshots, every K steps (`Checkpoints(snapshot_every=K)`): a host copy of this rank's state, and
  its buddy's copy received over the network; the buddy lives `stride` ranks on (on another host
  when the world spans hosts). The previous pair is dropped only once every rank has the new one,
  so a rank lost during the copy leaves the older pair everywhere.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from colab_par.training.resilience import peers
from colab_par.training.resilience.rank_copy import RankCopy, take

__all__ = ["Kept", "kept_for", "forget", "buddy_stride", "take_snapshot", "SNAPSHOT_BUDGET"]

SNAPSHOT_BUDGET = 0.03  # snapshot_every="auto": snapshots may cost this share of the step time


@dataclass
class Kept:
    """One run's state in this process. `own` / `held`: step -> this rank's snapshot / the snapshot
    of rank (rank - stride) % world that this rank keeps."""

    live: Any = None  # the Trainer that finished a whole step (None while its optimizer steps)
    live_loop: dict | None = None  # its loop's state at that step's end (`rank_copy.loop_state`)
    own: dict[int, RankCopy] = field(default_factory=dict)
    held: dict[int, RankCopy] = field(default_factory=dict)
    stride: int = 1

    @property
    def live_step(self) -> int:
        return -1 if self.live is None else int(self.live_loop["trainer"]["step"])


_KEPT: dict[str, Kept] = {}


def kept_for(run: str) -> Kept:
    return _KEPT.setdefault(str(run), Kept())


def forget(run: str) -> None:
    """Drop what is kept for `run` (after a recovery used it, or when a run ends cleanly)."""
    _KEPT.pop(str(run), None)


def buddy_stride(group: Any) -> int:
    """How many ranks on a rank's buddy lives: the ranks per host when the world spans several hosts
    (a host lost whole keeps its snapshots elsewhere), else 1."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    per_host = hosts.count(hosts[0])
    return per_host if per_host < len(hosts) else 1


def take_snapshot(kept: Kept, pm: Any, trainer: Any) -> float:
    """Copy this rank's state to host memory and swap copies with the buddies; returns the seconds."""
    start = time.perf_counter()
    group = peers.host_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = take(pm, trainer, world)
    kept.own[mine.step] = mine
    if world > 1:
        theirs = peers.exchange(mine, (rank + kept.stride) % world, (rank - kept.stride) % world, group)
        kept.held[theirs.step] = theirs
    dist.barrier(group=group)  # every rank holds the new pair: the older ones can go
    for pairs in (kept.own, kept.held):
        for step in [step for step in pairs if step < mine.step]:
            del pairs[step]
    return time.perf_counter() - start
