"""This process's resident memory, as the kernel counts it (Linux /proc): the measurement that
places chunks and that the budget is checked against, never a book-keeping of tensor sizes."""
from __future__ import annotations

import torch

__all__ = ["resident_bytes", "reset_peak", "peak_bytes", "counted_bytes"]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def resident_bytes(device: torch.device) -> int:
    """Bytes resident now: VmRSS (heap, touched pages of mapped files, everything); on CUDA the
    allocator's bytes in use."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _status_bytes("VmRSS")


def reset_peak(device: torch.device) -> bool:
    """Start a new peak: VmHWM is reset by writing "5" to /proc/self/clear_refs (CUDA: the
    allocator's peak). False where the kernel refuses, then the peak is the process's lifetime one."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def peak_bytes(device: torch.device) -> int:
    """The peak since `reset_peak`: VmHWM (CUDA: max_memory_allocated)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_bytes("VmHWM")


def counted_bytes(device: torch.device, tensors: list[torch.Tensor]) -> int:
    """The bytes of `tensors` that `peak_bytes(device)` counts: on CUDA those in the GPU's memory
    (the allocator never counts host memory, pinned or not), on a CPU rank those in host memory."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == kind)
