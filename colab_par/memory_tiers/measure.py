"""This process's resident memory, as the kernel counts it (Linux /proc): the measurement that
places chunks and that the budget is checked against, never a book-keeping of tensor sizes."""
from __future__ import annotations

import weakref

import torch

__all__ = ["resident_bytes", "PeakWindow", "counted_bytes"]


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


def _reset_counter(device: torch.device) -> None:
    """Restart the process's one peak counter from what is held now: VmHWM through
    /proc/self/clear_refs ("5"; left alone where the kernel refuses: the peak is then the
    process's lifetime one), on CUDA the allocator's peak. Only `PeakWindow` calls it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


def _counter(device: torch.device) -> int:
    """The peak counter now: VmHWM (CUDA: max_memory_allocated)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_bytes("VmHWM")


def _key(device: torch.device) -> str:
    """One counter per GPU (cuda and cuda:<current> are the same one), one for the host."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
    return "cpu"


class PeakWindow:
    """One reader's peak since its own `mark`. The process has one peak counter per device
    (VmHWM, the CUDA allocator's peak) and every reset clears it for everyone, so readers never
    reset it themselves: a mark folds the counter into every other open window of the device
    (what they would have read until now) before restarting it, and a window reads the larger
    of what was folded into it and the counter. Telemetry and the tiers' placement each hold one
    and never cut each other's spans short."""

    _open: dict[str, "weakref.WeakSet[PeakWindow]"] = {}

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._held = 0
        self._open.setdefault(_key(self.device), weakref.WeakSet()).add(self)
        self.mark()

    def mark(self) -> None:
        """Start this window's span now (the others keep theirs)."""
        now = _counter(self.device)
        for other in self._open[_key(self.device)]:
            if other is not self:
                other._held = max(other._held, now)
        _reset_counter(self.device)
        self._held = 0

    def bytes(self) -> int:
        """The peak since this window's last `mark`."""
        return max(self._held, _counter(self.device))


def counted_bytes(device: torch.device, tensors: list[torch.Tensor]) -> int:
    """The bytes of `tensors` that a `PeakWindow` of `device` counts: on CUDA those in the GPU's
    memory (the allocator never counts host memory, pinned or not), on a CPU rank those in host
    memory."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == kind)
