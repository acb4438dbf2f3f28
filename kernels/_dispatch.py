"""Which path a kernel call takes: compiled Triton, the Triton interpreter, or the torch reference.

Triton 3.x fixes interpretation at import time: ``@triton.jit`` (and Triton's own standard library,
``tl.sum``, ``tl.max``...) become interpreted functions only if ``TRITON_INTERPRET=1`` was set when
triton was imported. Setting the variable later cannot switch a process over, so ``backend()``
looks at what the kernels actually are, not at the environment variable alone.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections import Counter
from typing import Iterator

import torch
import triton.language as tl

from colab_par import compat

__all__ = ["backend", "is_dtensor", "launches", "triton_launches", "interpreter_active", "count_launch", "new_output",
           "poisoned_outputs", "next_power_of_2", "split_rows", "tile_rows", "row_block", "as_rows"]

launches: Counter[tuple[str, str]] = Counter()
"""Kernel launches per (kernel name, backend): lets tests prove which path really ran. The torch
path counts each forward call of its reference (its backward is autograd's) under "torch", so a
model whose modules call the kit's kernels shows it on a CPU engine too."""

_poison = False
_warned_late_interpret = False


def interpreter_active() -> bool:
    """True when triton was imported in interpreter mode (TRITON_INTERPRET=1 before the import)."""
    return compat.triton_interpreted(tl.sum)


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend(tensor: torch.Tensor) -> str:
    """The path a kernel takes for ``tensor``: "triton", "triton-interpreter" or "torch".

    The Triton kernels work on plain tensors; a DTensor always takes the torch reference.
    """
    global _warned_late_interpret
    if is_dtensor(tensor):
        return "torch"
    if interpreter_active():
        return "triton-interpreter" if tensor.device.type in ("cpu", "cuda") else "torch"
    if tensor.is_cuda:
        return "triton"
    if _interpret_requested() and not _warned_late_interpret:
        _warned_late_interpret = True
        warnings.warn("TRITON_INTERPRET=1 was set after triton was imported; triton decides interpretation "
                      "at import time, so colab_par.kernels runs the torch reference on CPU. Set "
                      "TRITON_INTERPRET=1 before importing torch/triton (or use "
                      "colab_par.kernels.InterpreterProcess).", RuntimeWarning, stacklevel=2)
    return "torch"


def is_dtensor(tensor: torch.Tensor) -> bool:
    """DTensors (e.g. sequence-parallel activations) take the torch path, which DTensor supports."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)


def count_launch(kernel_name: str, path: str) -> None:
    launches[(kernel_name, path)] += 1


def triton_launches() -> int:
    """Launches of Triton kernels so far, compiled or interpreted (the torch path's calls left out)."""
    return sum(count for (_, path), count in launches.items() if path != "torch")


def new_output(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised kernel output; NaN-filled inside ``poisoned_outputs()`` so unwritten elements show."""
    if _poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Fill every kernel output with NaN before the kernel writes it (tests)."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def split_rows(device: torch.device, n_rows: int, block_rows: int = 1) -> tuple[int, int]:
    """(programs, rows per program) for a persistent row loop: a few programs per SM on GPU, a few
    on the serial interpreter; rows per program is a multiple of ``block_rows``."""
    slots = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per_program = max(1, -(-n_rows // max(1, min(n_rows, slots))))
    per_program = -(-per_program // block_rows) * block_rows
    return max(1, -(-n_rows // per_program)), per_program


def tile_rows(n_rows: int, block: int, tile_elements: int = 4096) -> int:
    """Rows per tile when whole rows fit one block: narrow rows are batched so a program moves a few KB."""
    return max(1, min(next_power_of_2(n_rows), tile_elements // block))


def row_block(n_cols: int, max_block: int) -> tuple[int, int, bool]:
    """(block, num_warps, one_chunk) for a kernel that walks a row of ``n_cols`` in blocks."""
    block = min(next_power_of_2(n_cols), max_block)
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16
    return block, num_warps, block >= n_cols


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (rows, n) with unit stride along n, copying only when the layout demands it."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()
