"""Every chunk's stores, one per kind of state (master, exp_avg, exp_avg_sq, grads, params), and
the moves that give a kind a store in another tier, values carried over.

Also the one count of bytes read and written between tiers (`moved`): the stores' reads and
write-backs, and what the step, the gradients and the transfers add to it; the optimizer takes
it once per step (`TieredAdamW.last_moved`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colab_par.compat import storage_holder
from colab_par.memory_tiers.chunks import Chunk, Slot, build_chunks, local
from colab_par.memory_tiers.stores import DiskStore, MemoryStore, RunFolder, check_disk_room

__all__ = ["ChunkStores"]


class ChunkStores:
    """The chunks of one rank (None until built), their stores by kind, and the run's disk folder
    (made when the first disk store is). `cuda`: the rank's device is a GPU (the host tier is
    then pinned host memory; on a CPU rank host memory is the device)."""

    def __init__(self, device: torch.device, disk_root: str, rank: int):
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.chunks: list[Chunk] | None = None
        self.stores: list[dict[str, Any]] = []
        self.slot_of: dict[int, tuple[Chunk, Slot]] = {}
        self.folder: RunFolder | None = None
        self.moved = 0  # bytes read + written between tiers since the optimizer last took them
        self._disk_root = disk_root

    def build(self, groups: list[list[nn.Parameter]], order: list[nn.Parameter], chunk_bytes: int) -> None:
        """Chunks of `groups`' parameters in first-use `order` (`chunks.build_chunks`), no stores yet."""
        self.chunks = build_chunks(groups, order, chunk_bytes)
        self.stores = [{} for _ in self.chunks]
        self.slot_of = {id(slot.param): (chunk, slot) for chunk in self.chunks for slot in chunk.slots}

    def stream(self, index: int, prefetch: bool) -> None:
        """Start reading chunk `index`'s stores in, or write them back (gradients are never dirty
        after a step) and drop their pages."""
        for kind, store in self.stores[index].items():
            self.moved += store.prefetch() if prefetch else store.evict(dirty=kind != "grads")

    def new_store(self, chunk: Chunk, kind: str, tier: str) -> Any:
        dtype = chunk.dtype if kind in ("grads", "params") else torch.float32
        if tier == "disk":
            return DiskStore(self._disk_folder(), f"chunk{chunk.index}.{kind}", chunk.numel, dtype, self.rank)
        on_host = tier == "host" and self.cuda
        return MemoryStore(chunk.numel, dtype, torch.device("cpu") if on_host else chunk.device, tier,
                           pinned=on_host)

    def check_disk_room(self, moves: list[tuple[Chunk, dict[str, str]]]) -> None:
        """Refuse the placement before any value moves if its new disk files do not fit the folder."""
        need = sum(chunk.bytes_of(kind) for chunk, wanted in moves for kind, tier in wanted.items()
                   if tier == "disk" and getattr(self.stores[chunk.index].get(kind), "tier", None) != "disk")
        if need:
            check_disk_room(self._disk_folder(), need, self.rank)

    def move(self, chunk: Chunk, wanted: dict[str, str]) -> int:
        """Give each kind of `chunk` a store in its wanted tier, carrying values over. Returns the
        bytes of parameters whose storage became a disk store's (their own memory is freed)."""
        stores = self.stores[chunk.index]
        freed = 0
        for kind, tier in wanted.items():
            old = stores.get(kind)
            if old is not None and old.tier == tier:
                continue
            new = self.new_store(chunk, kind, tier)
            if old is not None:
                new.tensor.copy_(old.tensor)
                old.close()
            elif kind in ("master", "params"):
                for slot in chunk.slots:
                    slot.of(new.tensor).copy_(local(slot.param).detach())
            if kind == "params" and old is None:
                freed += self._rehome_parameters(chunk, new)
            new.evict(dirty=old is not None or kind in ("master", "params"))
            stores[kind] = new
        return freed

    def parameter_pages(self, param: nn.Parameter) -> tuple[int, int, Any] | None:
        """For `PagedParameters`: (chunk index, its parameter count, its parameters' disk store)."""
        found = self.slot_of.get(id(param))
        store = self.stores[found[0].index].get("params") if found else None
        return None if store is None else (found[0].index, len(found[0].slots), store)

    def placed_bytes(self) -> dict[str, dict[str, int]]:
        """tier -> {"params": bytes, "optimizer": bytes, "grads": bytes} of what the stores hold."""
        out = {tier: {"params": 0, "optimizer": 0, "grads": 0} for tier in ("device", "host", "disk")}
        for stores in self.stores:
            for kind, store in stores.items():
                out[store.tier][kind if kind in ("grads", "params") else "optimizer"] += store.nbytes
        return out

    def disk_stores(self) -> list[Any]:
        return [store for stores in self.stores for store in stores.values() if store.tier_on_disk]

    def close(self) -> None:
        """Close every store and remove the run's disk folder."""
        for stores in self.stores:
            for store in stores.values():
                store.close()
        self.stores = [{} for _ in self.stores]
        if self.folder is not None:
            self.folder.remove()

    def _disk_folder(self) -> str:
        if self.folder is None:
            self.folder = RunFolder(self._disk_root, self, self.rank)
        return self.folder.path

    @staticmethod
    def _rehome_parameters(chunk: Chunk, store: Any) -> int:
        """The chunk's parameters' storage becomes the store's file (`param_pages.py`)."""
        for slot in chunk.slots:
            storage_holder(slot.param).data = slot.of(store.tensor)
        return store.nbytes
