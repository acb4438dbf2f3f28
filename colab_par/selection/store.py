"""The spill store: every trial's weights, optimizer state and boundary activations in host shared
memory, where any engine on the host can use them.

Each tensor is a file under /dev/shm mapped with ``torch.from_file(shared=True)``: an engine that
runs a trial's shard maps the same pages the previous engine wrote, so moving a shard between
engines copies nothing but its promotion into the engine's own (device) memory. Only one task of a
trial runs at a time, so no two engines write a trial's tensors at once.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["SpillStore"]


def _shared_memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class SpillStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def create(cls) -> "SpillStore":
        return cls(tempfile.mkdtemp(prefix="colab_par-sweep-", dir=_shared_memory_dir()))

    def _path(self, trial: int, key: str) -> Path:
        return self.root / f"t{trial}" / key

    def put(self, trial: int, key: str, tensor: torch.Tensor) -> list[int]:
        """Store `tensor` (any device) under `key`; returns its shape, which `get` needs."""
        path = self._path(trial, key)
        path.parent.mkdir(exist_ok=True)
        nbytes = tensor.numel() * tensor.element_size()
        if path.exists() and path.stat().st_size != nbytes:
            path.unlink()
        mapped = torch.from_file(str(path), shared=True, size=tensor.numel(), dtype=tensor.dtype)
        mapped.copy_(tensor.detach().reshape(-1))
        return list(tensor.shape)

    def get(self, trial: int, key: str, shape: list[int] | tuple[int, ...],
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored tensor, mapped (not copied): writes to it go to the store."""
        numel = 1
        for size in shape:
            numel *= size
        path = self._path(trial, key)
        if not path.exists():
            raise KeyError(f"the spill store at {self.root} has no {key!r} for trial {trial}")
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(tuple(shape))

    def put_json(self, trial: int, key: str, value: Any) -> None:
        path = self._path(trial, key)
        path.parent.mkdir(exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(value))
        partial.replace(path)

    def get_json(self, trial: int, key: str, default: Any = None) -> Any:
        path = self._path(trial, key)
        return json.loads(path.read_text()) if path.exists() else default

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
