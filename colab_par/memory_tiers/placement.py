"""Placement: which tier each chunk's kinds of state live in, from the budget and measured memory.

Pure arithmetic over byte counts (no tensors), so it is decided the same way on every call and
can be read on its own. Pinned kinds go where the layout pins them. "auto" kinds fill the fast
tier (the device; on a CPU-only machine device and host are one memory) in the order gradients,
then optimizer state chunk by chunk (parameters stay resident unless pinned to disk: in `fixed`), under
budget - fixed - working - streaming buffers; the rest goes to the overflow tier (host memory on
CUDA, else the disk tier). Everything outside the budget is the process's baseline: what it held
before the model was built (interpreter, torch, communication buffers).
"""
from __future__ import annotations

from dataclasses import dataclass

from colab_par.layout.tier_options import SLACK, MemoryTiers, format_bytes

__all__ = ["TierBudgetError", "Measured", "place", "budget_text"]

FAST = "device"


class TierBudgetError(ValueError):
    """The budget cannot hold what the step needs even with everything movable moved out."""


@dataclass(frozen=True)
class Measured:
    """Bytes this rank needs besides the placed state (all but `grads` measured, not computed)."""

    fixed: int  # resident beyond the baseline when the tiers were applied: the parameters, layout buffers
    working: int  # the step's own peak beyond that: activations, gathered parameters, temporaries
    grads: int  # the local gradients, when held as ordinary .grad tensors
    params_chunk: int = 0  # the largest chunk of parameters on disk (params@disk), streamed by the step


def _tier_of(pinned: str, cuda: bool) -> str:
    return FAST if pinned == "host" and not cuda else pinned


def place(tiers: MemoryTiers, chunks: list[dict[str, int]], measured: Measured, *, cuda: bool,
          grads_movable: bool, has_disk: bool, rank: int,
          pessimistic: bool = False) -> tuple[dict[str, str], list[dict[str, str]]]:
    """({"grads": tier}, per chunk {kind: tier}) for `chunks` (per chunk, kind -> bytes of that
    chunk's optimizer state kinds). Raises `TierBudgetError` when nothing fits. `pessimistic`
    (before a step was measured): auto kinds go to the overflow tier, and come back to the fast
    tier as far as the measured step shows they fit."""
    overflow = "host" if cuda and not has_disk else ("disk" if has_disk else None)
    grads = _tier_of(tiers.grads, cuda) if tiers.grads != "auto" else FAST
    plan = [{kind: (_tier_of(tiers.optimizer, cuda) if tiers.optimizer != "auto" else FAST) for kind in chunk}
            for chunk in chunks]
    if tiers.budget is None:
        return {"grads": grads}, plan
    if pessimistic:
        if overflow is not None:
            if tiers.grads == "auto" and grads_movable:
                grads = overflow
            if tiers.optimizer == "auto":
                plan = [{kind: overflow for kind in chunk} for chunk in chunks]
        # without an overflow tier nothing can leave: whether it fits is the measured step's to say,
        # under the heap it will have then (not the warm-up's first-call growth)
        return {"grads": grads}, plan
    budget = int(tiers.budget * (1 - SLACK))
    # the chunk in use and the prefetched one, where anything can stream
    stream = 0 if overflow is None else 2 * (max((sum(chunk.values()) for chunk in chunks), default=0)
                                             + measured.params_chunk)
    used = measured.fixed + measured.working + stream
    if tiers.grads == "auto" and grads_movable and overflow is not None and used + measured.grads > budget:
        grads = overflow
    if grads == FAST:
        used += measured.grads
    for chunk, tiers_of_chunk in zip(chunks, plan):
        size = sum(chunk.values())
        if tiers.optimizer == "auto":
            if used + size <= budget or overflow is None:
                used += size
            else:
                tiers_of_chunk.update({kind: overflow for kind in chunk})
        elif all(tier == FAST for tier in tiers_of_chunk.values()):
            used += size
    if used > budget:
        # what must stay: everything where nothing can leave, else all but the movable state
        held = used if overflow is None else (measured.fixed + measured.working + stream
                                              + (measured.grads if not grads_movable else 0))
        smallest = held / (1 - SLACK)
        way_out = ("add a disk tier ('disk' or 'disk:/path') so state can leave memory, "
                   if overflow is None else "")
        raise TierBudgetError(
            f"rank {rank}: a budget of {format_bytes(tiers.budget)} cannot hold this step: parameters and layout "
            f"buffers {_show(measured.fixed)}, measured working memory (activations, gathered "
            f"parameters) {_show(measured.working)}, streaming buffers {_show(stream)}, "
            f"resident state {_show(used - measured.fixed - measured.working - stream)}; the "
            f"smallest budget that works is about {budget_text(smallest)}. Raise the budget, "
            f"{way_out}shard more (zero3, more dp ranks) or recompute activations ('ac-full')")
    return {"grads": grads}, plan


def budget_text(count: float) -> str:
    """A budget a user can type: `count` rounded up to whole MiB, e.g. "648MiB"."""
    return format_bytes(-(-int(count) // 2 ** 20) * 2 ** 20)


def _show(count: int) -> str:
    return f"{count / 2 ** 20:.0f} MiB"
