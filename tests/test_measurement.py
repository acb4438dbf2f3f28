"""The process's peak memory has one counter per device (VmHWM, the CUDA allocator's peak) that any
reset clears for everyone: readers get their own spans of it (`PeakWindow`), measured here on the
host's real VmHWM with a real allocation."""
from __future__ import annotations

import torch

from colab_par.memory_tiers.measure import PeakWindow, resident_bytes

MiB = 2 ** 20


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def test_a_readers_mark_leaves_the_other_readers_peak_alone():
    """The tiers' window and telemetry's window (the two readers a training step has): a 96 MiB
    spike while both are open, then telemetry marks its next step, which resets the counter. The
    tiers' window still holds the spike; telemetry's new span does not (where the kernel lets the
    counter be reset at all)."""
    cpu = torch.device("cpu")
    tiers, telemetry = PeakWindow(cpu), PeakWindow(cpu)
    before = resident_bytes(cpu)
    spike = torch.ones(96 * MiB // 4)  # touched: every page resident
    del spike  # a large block: unmapped, the resident set falls back
    telemetry.mark()
    assert tiers.bytes() >= before + 90 * MiB, (tiers.bytes() - before) / MiB
    assert telemetry.bytes() >= resident_bytes(cpu)
    if _clear_refs_works():
        assert telemetry.bytes() < before + 48 * MiB, (telemetry.bytes() - before) / MiB
