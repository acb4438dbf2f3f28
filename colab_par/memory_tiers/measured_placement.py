"""When the chunks' state is placed, and from what: pessimistically (auto kinds in the overflow
tier) before a step was measured, then from a measured training step's working memory under the
budget (`placement.place` decides, this measures and moves).

Memory this rank may use = the budget + the process's baseline: what it held before the model
was built (interpreter, torch, libraries), the stated fixed overhead outside the budget. `fixed`
is what the rank held beyond it when the tiers were applied (parameters, layout buffers); the
working memory is the measured step's peak beyond that and beyond the resident state.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from colab_par.layout.tier_options import MemoryTiers, format_bytes
from colab_par.memory_tiers.chunk_stores import ChunkStores
from colab_par.memory_tiers.chunks import local
from colab_par.memory_tiers.held_grads import HeldGradients
from colab_par.memory_tiers.host_heap import loosen_heap, tighten_heap, trim_host_heap
from colab_par.memory_tiers.measure import PeakWindow, counted_bytes, resident_bytes
from colab_par.memory_tiers.placement import FAST, Measured, TierBudgetError, budget_text, place

__all__ = ["MeasuredPlacement"]


class MeasuredPlacement:
    """The placement of `home`'s chunks (and of `grads`' tier) for one rank. `params`: every local
    parameter (their gradients count in the budget); `params_on_disk`: params@disk."""

    def __init__(self, tiers: MemoryTiers, home: ChunkStores, grads: HeldGradients, params: list[nn.Parameter], *,
                 device: torch.device, rank: int, baseline: int, grads_movable: bool, params_on_disk: bool):
        self.tiers, self._home, self._grads, self._params = tiers, home, grads, params
        self._device, self._rank = device, rank
        self._grads_movable, self._params_on_disk = grads_movable, params_on_disk
        self.placed = False
        self.working = 0  # measured working memory of a step (0 until measured)
        self._training_steps = 0  # steps with a forward since the tiers were applied
        self._measure_at = 2  # the training step whose working memory places the state
        self._loosen: weakref.finalize | None = None  # set while glibc hands freed large blocks back (_settle)
        self._peak: PeakWindow | None = None
        held = self._param_bytes()
        self._at_apply = resident_bytes(device)
        self.baseline = min(baseline, self._at_apply - held)
        self._fixed = self._at_apply - self.baseline

    def start_measuring(self) -> None:
        """Open this placement's own span of the process's peak (measure.py)."""
        self._peak = PeakWindow(self._device)

    def check_streaming_fits(self, elements: list[int], chunk_bytes: int) -> None:
        """Before training: what this rank holds now plus two streamed chunks must fit the budget,
        whatever the warm-up step will measure. `elements`: of each parameter whose state is here."""
        budget = self.tiers.budget
        if budget is None:
            return
        chunk = min(sum(elements), max([chunk_bytes // 4] + elements))
        arrays = 3 + self._params_on_disk  # master, exp_avg, exp_avg_sq (+ the parameters)
        stream = 2 * arrays * 4 * chunk  # the current and the prefetched chunk
        held = self._fixed - (self._param_bytes() if self._params_on_disk else 0)  # parameters leave
        if held + stream > budget:
            raise TierBudgetError(
                f"rank {self._rank}: a budget of {format_bytes(budget)} is below what this rank holds before "
                f"training: parameters and layout buffers {held / 2 ** 20:.0f} MiB plus two streamed "
                f"chunks {stream / 2 ** 20:.0f} MiB; give at least {budget_text(held + stream)}, or "
                "shard the parameters (zero3, more dp ranks)")

    def before_step(self, forward_seen: bool) -> bool:
        """At each step, before the update: measure the warm-up, place if nothing is placed yet, and
        place again at the measured step. Whether the state was placed (moved) now."""
        self._training_steps += forward_seen
        if forward_seen and self._training_steps == 1:
            self.working = self._measured_working()  # the warm-up's, reported until a step is measured
        if not self.placed:
            self.place(measured=False)
            return True
        if forward_seen and self._training_steps == self._measure_at and self.tiers.budget is not None:
            return self._settle()  # from a later step, whose peak no first-call growth inflates
        return False

    def after_step(self, forward_seen: bool) -> None:
        if forward_seen and self._training_steps < self._measure_at:
            self._peak.mark()  # the next step's peak is the one measured

    def place(self, measured: bool) -> None:
        """Place every chunk's state: pessimistically (auto kinds in the overflow tier) before a
        step was measured, else from the measured working memory; values move with their chunks."""
        grads, plan = self._plan(self.working, pessimistic=not measured)
        self._grads.tier = grads["grads"] if self._grads_movable else FAST
        moves = []
        for chunk, tiers in zip(self._home.chunks, plan):
            wanted = dict(tiers)
            if self._grads.tier != FAST:
                wanted["grads"] = self._grads.tier
            if self._params_on_disk:
                wanted["params"] = "disk"
            moves.append((chunk, wanted))
        self._home.check_disk_room(moves)
        for chunk, wanted in moves:
            if "grads" not in wanted:  # gradients back to ordinary .grad tensors
                self._grads.give_back(chunk)
            freed = self._home.move(chunk, wanted)  # parameters now in files: what was held at apply shrinks
            self._at_apply -= freed
            self._fixed -= freed
        if self._params_on_disk and not self.placed:
            trim_host_heap()  # the parameters' old memory: glibc would keep it resident
        self.placed = True

    @property
    def heap_tightened(self) -> bool:
        """Whether the budget bound at the measured step, so glibc now returns freed large blocks."""
        return self._loosen is not None and self._loosen.alive

    def release(self) -> None:
        """Undo the heap's tightening now (else with this placement)."""
        if self._loosen is not None:
            self._loosen()

    def _settle(self) -> bool:
        """At the measured step: place from its working memory. Where the budget binds and glibc's
        heap still keeps freed blocks resident (about half a step's working memory), hand them back
        from now on (`host_heap.tighten_heap`, undone at `release`) and measure the next step instead."""
        working = self._measured_working()
        if not self._home.cuda and self._loosen is None and self._budget_binds(working) and tighten_heap():
            self._loosen = weakref.finalize(self, loosen_heap)  # undone with this placement
            self._measure_at += 1
            return False
        self.working = working
        self.place(measured=True)
        return True

    def _plan(self, working: int, pessimistic: bool) -> tuple[dict[str, str], list[dict[str, str]]]:
        grad_bytes = self._param_bytes()  # a gradient per local parameter (under zero1 DDP holds all)
        chunks = self._home.chunks
        sizes = [{kind: chunk.bytes_of(kind) for kind in chunk.state_kinds()} for chunk in chunks]
        params_chunk = max(chunk.bytes_of("params") for chunk in chunks) if self._params_on_disk else 0
        return place(self.tiers, sizes, Measured(self._fixed, working, grad_bytes, params_chunk),
                     cuda=self._home.cuda, grads_movable=self._grads_movable, has_disk=self.tiers.uses_disk,
                     rank=self._rank, pessimistic=pessimistic)

    def _budget_binds(self, working: int) -> bool:
        """Whether, with this working memory, the budget pushes auto state off the fast tier (or
        cannot hold the step at all)."""
        try:
            grads, plan = self._plan(working, pessimistic=False)
        except TierBudgetError:
            return True
        auto_grads_out = self.tiers.grads == "auto" and self._grads_movable and grads["grads"] != FAST
        auto_state_out = self.tiers.optimizer == "auto" and any(tier != FAST for chunk in plan for tier in chunk.values())
        return auto_grads_out or auto_state_out

    def _measured_working(self) -> int:
        """The peak since the last reset beyond what was resident when the tiers were applied and
        the state resident now: activations, gathered parameters, temporaries, allocator slack."""
        resident = counted_bytes(self._device, [local(p.grad) for p in self._params if p.grad is not None]
                                 + [store.tensor for stores in self._home.stores for store in stores.values()
                                    if not store.tier_on_disk])
        return max(0, self._peak.bytes() - self._at_apply - resident)

    def _param_bytes(self) -> int:
        return sum(local(p).numel() * local(p).element_size() for p in self._params)
