"""Gradients held in grads stores instead of `.grad` tensors, where the placement moves them off
the fast tier: each is written into its chunk as soon as it is complete (FSDP calls the hook after
its reduce-scatter) and its tensor freed, so a backward never has them all resident; gradient
accumulation adds into the store, clipping scales them when the step reads them.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.layout.tier_options import MemoryTiers
from colab_par.memory_tiers.chunk_stores import ChunkStores
from colab_par.memory_tiers.chunks import Chunk, Slot, local
from colab_par.memory_tiers.placement import FAST
from colab_par.memory_tiers.transfers import Transfers

__all__ = ["HeldGradients"]


class HeldGradients:
    """The gradients of this step that are in `home`'s grads stores (`written`), and their tier.
    `pinned`: the tier the layout pins gradients to (grads@host on CUDA, grads@disk) where they may
    move, else None; `tier` is the fast tier until the placement (or the pin) moves them."""

    def __init__(self, home: ChunkStores, transfers: Transfers, tiers: MemoryTiers, device: torch.device,
                 grads_movable: bool):
        self._home, self._transfers = home, transfers
        pinned = tiers.grads if tiers.grads in ("disk", "host") and grads_movable else None
        self.pinned = None if pinned == "host" and device.type != "cuda" else pinned
        self.tier = FAST
        self.written: set[int] = set()  # parameters whose gradient of this step is in a grads store
        self._scale = 1.0  # clipping's factor for the held gradients, applied when the step reads them
        self._arrivals: dict[int, int] = defaultdict(int)  # gradients written per chunk since zero_grad

    def pin(self) -> None:
        """Stores in the pinned tier for every chunk's gradients, from the warm-up's backward."""
        self.tier = self.pinned
        for chunk in self._home.chunks:
            self._home.stores[chunk.index]["grads"] = self._home.new_store(chunk, "grads", self.tier)

    def take(self, p: nn.Parameter) -> None:
        """`p`'s gradient is complete: into its chunk's store (off the fast tier only) and freed."""
        if self.tier == FAST or p.grad is None:
            return  # gradients stay ordinary tensors (for now: auto placement waits for the warm-up)
        chunk, slot = self._home.slot_of[id(p)]
        store = self._home.stores[chunk.index]["grads"]
        view, grad = slot.of(store.tensor), local(p.grad)
        if id(p) in self.written:  # gradient accumulation: a second backward adds in place, where the store is
            self._transfers.wait_host()  # the first backward's copy has landed
            if grad.device != view.device:
                grad = grad.to(view.device)
                self._home.moved += grad.numel() * grad.element_size()
            view.add_(grad)
        else:  # on CUDA a copy on the side stream: backward goes on meanwhile (transfers.py)
            self._transfers.copy([(view, grad)])
            self.written.add(id(p))
        p.grad = None
        self._arrivals[chunk.index] += 1
        if self._arrivals[chunk.index] % len(chunk.slots) == 0:  # every slot's gradient of this backward is in
            if store.tier_on_disk:
                self._transfers.wait_host()  # written to the file only once it has landed
            self._home.moved += store.evict(dirty=True)

    def of(self, chunk: Chunk, slot: Slot) -> torch.Tensor | None:
        """The gradient the step reads for `slot`: the held one (scaled), else `.grad`'s local piece."""
        if id(slot.param) in self.written:
            held = slot.of(self._home.stores[chunk.index]["grads"].tensor)
            return held if self._scale == 1.0 else held * self._scale
        grad = slot.param.grad
        return None if grad is None else local(grad)

    def squares(self) -> dict[int, float]:
        """id(param) -> the sum of squares of this rank's piece of its held gradient: read a chunk
        at a time and dropped again, so a norm never has them all resident."""
        out: dict[int, float] = {}
        self._transfers.wait_host()
        for chunk in self._home.chunks or []:
            slots = [slot for slot in chunk.slots if id(slot.param) in self.written]
            if not slots:
                continue
            store = self._home.stores[chunk.index]["grads"]
            self._home.moved += store.prefetch()
            for slot in slots:  # in the gradient's own dtype, as for gradients that stayed tensors
                out[id(slot.param)] = float(torch.linalg.vector_norm(slot.of(store.tensor)).double() ** 2)
            store.evict(dirty=False)
        return out

    def scale(self, factor: float) -> None:
        """Clipping: the held gradients count `factor` times when the step reads them (scaling them
        in place would read and write every chunk once more)."""
        self._scale *= factor

    def clear(self) -> None:
        """zero_grad: no gradient of the next step is held yet."""
        self.written.clear()
        self._arrivals.clear()
        self._scale = 1.0

    def give_back(self, chunk: Chunk) -> None:
        """Gradients back to ordinary `.grad` tensors: `chunk`'s held ones copied out, its store closed."""
        store = self._home.stores[chunk.index].pop("grads", None)
        if store is None:
            return
        self._transfers.wait_host()  # gradients still coming down
        for slot in chunk.slots:
            if id(slot.param) in self.written:
                slot.param.grad = _like(slot.param, slot.of(store.tensor).to(chunk.device, copy=True))
                self.written.discard(id(slot.param))
        self._arrivals.pop(chunk.index, None)
        store.close()


def _like(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """A gradient (this rank's piece, on the parameter's device) as its parameter is: a DTensor
    of the same mesh and placements."""
    if not isinstance(param, DTensor):
        return grad
    return DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
