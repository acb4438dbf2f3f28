"""Moving `RankCopy`s between ranks over a gloo group of host tensors (the default group may be
NCCL): every rank hands its copy to a buddy and takes another's, or a source sends its copy to the
ranks that need it. Three messages each: the sizes, the JSON header, the bytes."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from colab_par.training.resilience.rank_copy import RankCopy, from_bytes, to_bytes

__all__ = ["host_group", "exchange", "send_copies", "gathered_ints", "gathered_texts", "agreed_max"]

_group: tuple[Any, Any] | None = None  # (the world it was made for, its gloo group)


def host_group() -> Any:
    """A gloo group over the whole world (one per process group: re-made after the world is re-formed)."""
    global _group
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:
        _group = (world, dist.new_group(backend="gloo"))
    return _group[1]


def gathered_ints(values: list[int], group: Any) -> list[list[int]]:
    """`values` (the same length on every rank) from every rank, in rank order."""
    mine = torch.tensor(values, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [row.tolist() for row in everyone]


def gathered_texts(text: str, group: Any) -> list[str]:
    """`text` from every rank, in rank order (UTF-8 bytes in a padded tensor: nothing is unpickled)."""
    mine = text.encode()
    sizes = [row[0] for row in gathered_ints([len(mine)], group)]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else padded[:0]
    everyone = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(everyone, padded, group=group)
    return [bytes(row[:size].numpy()).decode() for row, size in zip(everyone, sizes)]


def agreed_max(value: int, group: Any) -> int:
    """The largest of every rank's `value`."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor)


def _swap(outgoing: torch.Tensor | None, to: int | None, incoming: torch.Tensor | None, source: int | None,
          group: Any, tag: int) -> None:
    works = []
    if outgoing is not None:
        works.append(dist.isend(outgoing, to, group=group, tag=tag))
    if incoming is not None:
        works.append(dist.irecv(incoming, source, group=group, tag=tag))
    for work in works:
        work.wait()


def _move(copy: RankCopy | None, to: int | None, source: int | None, group: Any) -> RankCopy | None:
    """Send `copy` to `to` and receive one from `source` at once (either may be None)."""
    header, payload = to_bytes(copy) if copy is not None else (b"", None)
    sizes_out = torch.tensor([len(header), payload.numel()], dtype=torch.int64) if copy is not None else None
    sizes_in = torch.empty(2, dtype=torch.int64) if source is not None else None
    _swap(sizes_out, to, sizes_in, source, group, tag=71)
    header_out = torch.frombuffer(bytearray(header), dtype=torch.uint8) if copy is not None else None
    header_in = torch.empty(int(sizes_in[0]), dtype=torch.uint8) if source is not None else None
    _swap(header_out, to, header_in, source, group, tag=72)
    payload_in = torch.empty(int(sizes_in[1]), dtype=torch.uint8) if source is not None else None
    _swap(payload, to, payload_in, source, group, tag=73)
    return from_bytes(bytes(header_in.numpy()), payload_in) if source is not None else None


def exchange(copy: RankCopy, to: int, source: int, group: Any) -> RankCopy:
    """Give `copy` to rank `to` and take rank `source`'s (every rank calls it, a ring)."""
    return _move(copy, to, source, group)


def send_copies(plan: dict[int, int], copy_of: Any, group: Any) -> RankCopy | None:
    """`plan`: {receiving rank: sending rank} (the same dict on every rank). A sender calls
    `copy_of(receiver)` for what to send each of its receivers; returns what this rank received."""
    rank, received = dist.get_rank(group), None
    for receiver, sender in sorted(plan.items()):
        if sender == receiver:
            continue
        if rank == sender:
            _move(copy_of(receiver), receiver, None, group)
        elif rank == receiver:
            received = _move(None, None, sender, group)
    return received
