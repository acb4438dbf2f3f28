"""After a lost engine was replaced and the cell runs again: where each rank's state comes from.

Every rank states what it keeps (`memory.Kept`) in a few integers; all see the same table and
choose the same plan:
1. live replicas: under a layout whose dp peers hold the same state (no ZeRO, tiers, offload or
   experts), each group of peers with the same place in the other mesh dimensions takes the state of
   its member that finished the newest whole step (a member that finished it keeps its own); every
   group must have one at the same step. No step is lost.
2. in-memory snapshots: the newest step S for which every rank has its own snapshot or its buddy
   holds it. The steps after S are lost, and named.
3. neither: None, and the Trainer resumes from disk as before.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch.distributed as dist

from colab_par.layout.tier_options import MemoryTiers
from colab_par.training.resilience import memory, peers
from colab_par.training.resilience.rank_copy import RankCopy, put, take

__all__ = ["recover", "replica_plan", "snapshot_plan", "replica_key"]

_NONE = -1


def replica_key(pm: Any) -> int:
    """This rank's place in every mesh dimension but dp (its peers share it), or -1 when dp peers do
    not hold the same state."""
    layout = pm.layout
    if layout.zero or layout.offload or layout.ep > 1 or layout.tp_mode != "1d" or layout.tiers != MemoryTiers():
        return _NONE
    key = 0
    for dim in ("pp", "cp", "tp"):
        key = key * pm.mesh[dim].size() + pm.mesh[dim].get_local_rank()
    return key


def _two(steps: Any) -> list[int]:
    newest = sorted(steps, reverse=True)[:2]
    return newest + [_NONE] * (2 - len(newest))


def replica_plan(table: list[list[int]]) -> tuple[int, dict[int, int]] | None:
    """(the step, {rank: the rank whose live state it takes: itself where it finished that step})
    from rows [live step, ..., replica key]."""
    groups: dict[int, list[int]] = {}
    for rank, row in enumerate(table):
        if row[-1] == _NONE:
            return None
        groups.setdefault(row[-1], []).append(rank)
    steps = {max(table[rank][0] for rank in ranks) for ranks in groups.values()}
    if len(steps) != 1 or min(steps) < 0:
        return None
    step = steps.pop()
    plan = {}
    for ranks in groups.values():
        source = min(rank for rank in ranks if table[rank][0] == step)
        plan.update({rank: rank if table[rank][0] == step else source for rank in ranks})
    return step, plan


def snapshot_plan(table: list[list[int]], stride: int) -> tuple[int, dict[int, int]] | None:
    """(the step, {rank: the rank that holds its snapshot}) from rows [live, own x2, held x2, key]."""
    world = len(table)
    for step in sorted({s for row in table for s in row[1:5] if s >= 0}, reverse=True):
        plan = {}
        for rank in range(world):
            holder = (rank + stride) % world
            if step in table[rank][1:3]:
                plan[rank] = rank
            elif step in table[holder][3:5]:
                plan[rank] = holder
            else:
                break
        else:
            return step, plan
    return None


def recover(trainer: Any) -> str | None:
    """Restore `trainer` (and its freshly built `pm`) from what the engines keep in memory; call on
    every rank. Returns what was done, or None when the disk checkpoint is the way back."""
    kept, pm = memory.kept_for(trainer.ckpt_dir), trainer.pm
    group = peers.host_group()
    world = dist.get_world_size(group)
    live = kept.live is not None and str(kept.live.pm.layout) == str(pm.layout)  # a source of this layout
    stride = memory.buddy_stride(group)
    own = {s: c for s, c in kept.own.items() if c.layout == str(pm.layout) and c.world_size == world}
    held = {s: c for s, c in kept.held.items() if c.layout == str(pm.layout) and c.world_size == world}
    facts = [kept.live_step if live else _NONE, *_two(own), *_two(held), replica_key(pm)]
    table = peers.gathered_ints(facts, group)
    furthest = max(row[0] for row in table)
    chosen = replica_plan(table)
    if chosen is not None:
        step, plan = chosen
        _take_from_replicas(trainer, kept, plan, group)
        how = f"from live replicas (ranks {_sources(plan)}), no step lost"
    else:
        chosen = snapshot_plan(table, stride)
        if chosen is None:
            memory.forget(trainer.ckpt_dir)
            return None
        step, plan = chosen
        _take_from_snapshots(trainer, kept, own, held, step, plan, group)
        lost = list(range(step + 1, furthest + 1))
        how = (f"from in-memory snapshots (ranks {_sources(plan)}), "
               + (f"{len(lost)} step(s) lost: {lost[0]}..{lost[-1]}, trained again" if lost else "no step lost"))
    kept.live, kept.live_loop, kept.stride = None, None, stride
    return f"resumed at step {step} {how}"


def _sources(plan: dict[int, int]) -> str:
    moved = [f"{receiver}<-{sender}" for receiver, sender in sorted(plan.items()) if receiver != sender]
    return ", ".join(moved) if moved else "each its own"


def _take_from_replicas(trainer: Any, kept: Any, plan: dict[int, int], group: Any) -> None:
    """`kept`: this rank's `memory.Kept`; its live state is read only where the plan names this rank
    a source (it finished the chosen step under this layout)."""
    rank = dist.get_rank(group)
    mine: list[RankCopy] = []

    def copy_of(receiver: int) -> RankCopy:
        """This rank's state, with the receiver's own random stream at that step (`Keeper` gathers
        every rank's before each optimizer step: a lost rank's masks go on as if it had lived)."""
        if not mine:
            mine.append(take(kept.live.pm, kept.live, dist.get_world_size(group), kept.live_loop))
        if receiver == rank:
            return mine[0]
        streams = kept.live_loop.get("streams")
        return replace(mine[0], values={**mine[0].values, "rng": streams[receiver] if streams else None})

    received = peers.send_copies(plan, copy_of, group)
    if plan[rank] == rank:  # finished that step itself: its own state, stream and rows
        put(copy_of(rank), trainer.pm, trainer)
    else:  # a peer's model, optimizer and loop, this rank's stream; the rows are the peer's, relabelled
        put(received, trainer.pm, trainer, with_rng=received.values["rng"] is not None)
        trainer.history = [{**row, "rank": trainer.rank} for row in trainer.history]


def _take_from_snapshots(trainer: Any, kept: Any, own: dict[int, RankCopy], held: dict[int, RankCopy], step: int,
                         plan: dict[int, int], group: Any) -> None:
    rank = dist.get_rank(group)
    received = peers.send_copies(plan, lambda receiver: held[step], group)
    copy = own[step] if plan[rank] == rank else received
    put(copy, trainer.pm, trainer)
    kept.own[step] = copy
