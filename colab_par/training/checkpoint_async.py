"""Checkpoints that do not stop training: the step pauses only to copy this rank's state to host
memory; DCP's write, the digests, the commit marker, the rename and `LATEST` run on a background
thread, through the same `checkpoint.commit` as a synchronous save (as atomic, as verified).

The kit stages itself rather than through DCP's `async_save`, because the commit after DCP's write
(digests gathered over all ranks, rank 0's rename agreed by every rank) must run off the training
thread too, and async_save's future covers the DCP write only. The background collectives use a
dedicated gloo group, made once per process group (collective: every rank's first asynchronous
save makes it), so they never interleave with training's collectives on the default group.

Host copies are kept between saves (one more copy of this rank's model and optimizer state in
host memory, pinned when it comes from a GPU) and reused, so a save allocates nothing after the
first. State the memory tiers keep on disk (`optimizer@disk`, `params@disk`) is refused: copying
it to host memory is what those tiers exist to avoid.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from colab_par.compat import dtensor_over
from colab_par.training import checkpoint_background as background
from colab_par.training.checkpoint import LATEST, CheckpointError, local_optimizer, commit, stage
from colab_par.training.checkpoint_background import wait_for_saves
from colab_par.training.checkpoint_files import gathered
from colab_par.training.checkpoint_pages import disk_pages

__all__ = ["save_async", "wait_for_saves", "StartedSave", "check_async_supported"]

_writer_group: tuple[Any, Any] | None = None  # (the default group it was made for, the gloo group)


@dataclass(frozen=True)
class StartedSave:
    """What an asynchronous save cost the caller: `pause_s` seconds on the training thread, of
    which part waited for the previous save when `waited` (it was still in flight)."""

    final: Path  # the version folder it will commit
    pause_s: float
    waited: bool


def save_async(pm: Any, path: str | os.PathLike, *, trainer: Any = None, keep: int = 2) -> StartedSave:
    """Start a save of `pm` (and the trainer's loop state) under `path`; call on every rank.

    Waits for the previous asynchronous save (raising its failure), copies this rank's tensors to
    host memory and returns while they are written and committed in the background.
    `wait_for_saves()` waits for that and raises its failure, naming the checkpoint.
    """
    start = time.perf_counter()
    waited = background.in_flight()
    wait_for_saves()
    check_async_supported(pm)
    staged = stage(pm, path, trainer=trainer, keep=keep, to_host=_HOST_COPIES.copy)
    group = _group()
    root = staged.root
    background.start(lambda: commit(staged, group), f"step {staged.step} to {staged.final}",
                     lambda: _what_remains(root))
    return StartedSave(staged.final, time.perf_counter() - start, waited)


def check_async_supported(pm: Any) -> None:
    """Refuse, on every rank, a model whose state the memory tiers keep on disk."""
    on_disk = any(gathered(bool(disk_pages(local_optimizer(pm)))))
    if on_disk:
        raise CheckpointError(
            f"an asynchronous save copies each rank's state to host memory, but this model's layout "
            f"({pm.layout}) keeps optimizer state on disk to stay within memory; save synchronously: "
            "Checkpoints(dir, every=..., asynchronous=False) or colab_par.save(pm, dir)")


def _what_remains(root: Path) -> str:
    """For a failed save's message: the version a load of `root` still finds."""
    pointer = root / LATEST
    if pointer.is_file():
        return f"{root} still loads as {root / pointer.read_text().strip()}"
    return f"{root} holds no committed checkpoint"


def _group() -> Any:
    """The gloo group the background commits run on (None without torch.distributed)."""
    global _writer_group
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _writer_group is None or _writer_group[0] is not world:
        _writer_group = (world, dist.new_group(backend="gloo"))
    return _writer_group[1]


class _HostCopies:
    """This rank's tensors copied into host buffers kept from one save to the next (a buffer is
    reused only after the save that wrote it committed: `save_async` waits first)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    @torch.no_grad()
    def copy(self, tensors: dict[str, dict]) -> dict[str, dict]:
        copied = {part: {key: self._copied((part, key), value) for key, value in values.items()}
                  for part, values in tensors.items()}
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies below are non-blocking from a GPU
        return copied

    def _copied(self, name: tuple[str, str], value: torch.Tensor) -> torch.Tensor:
        if isinstance(value, DTensor):  # the local shard, under the same placements and mesh
            local = self._buffer(name, value.to_local())
            return dtensor_over(local, value)
        return self._buffer(name, value)

    def _buffer(self, name: tuple[str, str], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[name] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)


_HOST_COPIES = _HostCopies()
