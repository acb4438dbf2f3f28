"""Chunks: a rank's trainable local tensors grouped into runs of about `CHUNK_BYTES`, in the order
the step first uses them, so one chunk of state is read, updated and written back at a time.

A chunk never mixes parameter groups (their AdamW settings differ), dtypes or devices. Each
parameter owns a slot (offset, length) in its chunk; every kind of state of that chunk (master
copy, exp_avg, exp_avg_sq, gradients) is one flat tensor with the same slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["CHUNK_BYTES", "Slot", "Chunk", "build_chunks", "local"]

CHUNK_BYTES = 64 * 2 ** 20  # float32 bytes per chunk; tests lower it to get several chunks


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor (a DTensor's local shard, shared storage; else itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class Slot:
    param: nn.Parameter
    offset: int  # elements from the start of the chunk
    numel: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This slot's piece of one of the chunk's flat tensors, shaped as the local parameter."""
        return flat[self.offset:self.offset + self.numel].view(local(self.param).shape)


@dataclass
class Chunk:
    index: int
    group: int  # index into the optimizer's param_groups
    dtype: torch.dtype  # of the local parameters (not float32: the chunk keeps a float32 master)
    device: torch.device
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0

    @property
    def master(self) -> bool:
        return self.dtype != torch.float32

    def state_kinds(self) -> tuple[str, ...]:
        """The optimizer's kinds of state in this chunk (all float32)."""
        return ("master", "exp_avg", "exp_avg_sq") if self.master else ("exp_avg", "exp_avg_sq")

    def bytes_of(self, kind: str) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size() if kind in ("grads", "params") else 4
        return self.numel * itemsize


def build_chunks(groups: list[list[nn.Parameter]], order: list[nn.Parameter], chunk_bytes: int) -> list[Chunk]:
    """Chunks of `groups`' parameters taken in `order` (first use; parameters never used come
    last, in group order). A parameter larger than a chunk gets a chunk of its own."""
    group_of = {id(p): index for index, params in enumerate(groups) for p in params}
    seen: set[int] = set()
    ordered = []
    for p in [p for p in order if id(p) in group_of] + [p for params in groups for p in params]:
        if id(p) not in seen:
            seen.add(id(p))
            ordered.append(p)
    limit = max(chunk_bytes // 4, 1)
    chunks: list[Chunk] = []
    open_chunks: dict[tuple, Chunk] = {}
    for p in ordered:
        piece = local(p)
        key = (group_of[id(p)], piece.dtype, piece.device)
        chunk = open_chunks.get(key)
        if chunk is None or (chunk.numel and chunk.numel + piece.numel() > limit):
            chunk = Chunk(len(chunks), key[0], piece.dtype, piece.device)
            chunks.append(chunk)
            open_chunks[key] = chunk
        chunk.slots.append(Slot(p, chunk.numel, piece.numel()))
        chunk.numel += piece.numel()
    return chunks
