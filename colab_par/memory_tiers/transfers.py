"""Copies between the GPU and host memory for the tiers, off the compute stream.

Why: on CUDA the host step brings each chunk's gradients (and float32 parameters without a
master) down, updates them on the host and sends the parameters back up. Copied one tensor at a
time into pageable memory on the compute stream, every copy stalls the GPU and the host in turn.
Here copies run on a side stream into pinned memory (truly asynchronous), so the next chunk comes
down while the host updates this one, and a gradient written out in FSDP's post-reduce hook
does not hold up the rest of backward. On a CPU rank (no stream) they are plain copies.

Ordering: the side stream first waits for the work the current stream queued (the tensors it is
about to read), and its copies run in the order issued, so an event recorded after a copy also
marks every earlier one done. A device source a copy reads is recorded on the side stream, so
freeing it (`p.grad = None`) cannot hand its memory out before the copy ran.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["Transfers"]


class Transfers:
    """The side stream of one rank's tiers, and two pinned staging buffers per kind, used in turn
    by consecutive chunks (one coming down while the other is being updated)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._staging: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}
        self.moved = 0  # bytes copied between the device and host memory (the caller resets it)

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def staging(self, turn: int, kind: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Pinned host memory of `numel` elements: buffer `turn % 2` of `kind` and `dtype`, grown
        as needed (a buffer dropped while a copy still reads it is kept by torch's pinned allocator
        until that copy is done)."""
        key = (turn % 2, kind, dtype)
        held = self._staging.get(key)
        if held is None or held.numel() < numel:
            held = torch.empty(numel, dtype=dtype, pin_memory=self.asynchronous)
            self._staging[key] = held
        return held[:numel]

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Start `destination.copy_(source)` for each pair after the current stream's queued work;
        returns the event that marks them (and every earlier copy) done, None on a CPU rank."""
        self.moved += sum(destination.numel() * destination.element_size() for destination, source in pairs
                          if destination.device.type != source.device.type)
        if self.stream is None:
            for destination, source in pairs:
                destination.copy_(source)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
                if source.device.type == "cuda":
                    source.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait_host(self, event: Any = None) -> None:
        """Block the host until `event` (default: every copy issued so far) is done."""
        if event is not None:
            event.synchronize()
        elif self.stream is not None:
            self.stream.synchronize()

    def join(self) -> None:
        """The current stream waits for every copy issued (parameters sent up before the next forward)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
