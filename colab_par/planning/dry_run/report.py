"""The value a dry run hands back: one rank's traced memory per phase of a training step and the
collectives it issued per mesh dimension. Plain data (it crosses from the child process by pickle)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryKinds", "CollectiveCount", "DryRunReport", "KINDS"]

# MemTracker's kinds -> the planner's names (buffers and other tensors count as parameters'
# neighbours: the planner has no column for them, so they join "other")
KINDS = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations",
         "Temp": "temporaries", "Buffer": "other", "Other": "other"}
MiB = 2 ** 20


@dataclass(frozen=True)
class MemoryKinds:
    """Bytes live at one instant, by kind; `total` is their sum (what the tracker's peak is)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    temporaries: int = 0
    other: int = 0

    @classmethod
    def of(cls, kinds: dict[str, int]) -> "MemoryKinds":
        """From the tracker's {kind: bytes} (`compat.fake_world.tracked_kinds`)."""
        sizes: dict[str, int] = {}
        for kind, size in kinds.items():
            if kind in KINDS:
                sizes[KINDS[kind]] = sizes.get(KINDS[kind], 0) + size
        return cls(**sizes)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries + self.other


@dataclass(frozen=True)
class CollectiveCount:
    """Every call of one collective op on one mesh dimension: how many and their payload bytes
    (the full buffer, as `parallel.collective_bytes.CollectiveBytes` counts it)."""

    dim: str
    op: str
    calls: int
    bytes: int


@dataclass(frozen=True)
class DryRunReport:
    """One rank's traced training step (the last of `steps`; earlier ones create optimizer state).

    `phases` maps "forward", "backward", "optimizer" to the memory at that phase's peak, `peak`
    is the step's whole peak (the loss between forward and backward included); `collectives` are
    the step's, per mesh dimension ("world" for the whole-world group). `seconds` is the child's
    wall time for build and steps; `world` tells whether the world was "fake" or a real backend,
    `tensors` whether the tensors were "real" (small models) or "fake" (no storage: any size);
    `flops` the traced step's floating-point operations on this rank (torch's FlopCounterMode:
    matmuls and attention, forward, backward and recompute; `step_time.traced_step_seconds`).

    `host`: the part of `peak` a GPU run keeps off the device: under `offload` (FSDP's
    CPUOffloadPolicy) and for kinds the memory tiers pin to "host" or "disk", the resting model
    state of those kinds (the sharded parameters and gradients as the optimizer step holds them,
    the optimizer state); a parameter gathered for compute and a gradient before its
    reduce-scatter are device bytes. A tier budget whose placement is decided while training
    ("auto") counts as device. `device_peak` is what the device must hold: the question "does it
    fit" asks of it. `scaled_from`: (k, 2k) when the step's microbatches were not all traced but
    scaled from traces of k and 2k (`microbatch_scaling`), None when every one ran."""

    @property
    def device_peak(self) -> int:
        """Bytes of the step's peak on the device: `peak.total` less `host`."""
        return self.peak.total - self.host.total

    layout: str
    world_size: int
    rank: int
    batch: tuple[int, int]
    phases: dict[str, MemoryKinds]
    peak: MemoryKinds
    collectives: tuple[CollectiveCount, ...] = ()
    seconds: float = 0.0
    world: str = "fake"
    steps: int = 2
    tensors: str = "real"
    flops: float = 0.0
    host: MemoryKinds = MemoryKinds()
    scaled_from: tuple[int, int] | None = None

    def collective_bytes(self) -> dict[str, int]:
        """Payload bytes per mesh dimension."""
        per_dim: dict[str, int] = {}
        for row in self.collectives:
            per_dim[row.dim] = per_dim.get(row.dim, 0) + row.bytes
        return per_dim

    def __str__(self) -> str:
        lines = [f"dry run of {self.layout!r}, rank {self.rank} of {self.world_size} ({self.world} world, {self.tensors} tensors), "
                 f"batch {self.batch[0]} x {self.batch[1]}, {self.seconds:.1f} s"
                 + (f", scaled from {self.scaled_from[0]} and {self.scaled_from[1]} microbatches traced"
                    if self.scaled_from else ""),
                 f"{'phase':<10}" + "".join(f"{name:>13}" for name in (*MemoryKinds.__dataclass_fields__, "total"))]
        for name, kinds in (*self.phases.items(), ("peak", self.peak)):
            sizes = [getattr(kinds, part) for part in MemoryKinds.__dataclass_fields__] + [kinds.total]
            lines.append(f"{name:<10}" + "".join(f"{size / MiB:10.2f} MiB" for size in sizes))
        if self.host.total:
            sizes = [getattr(self.host, part) for part in MemoryKinds.__dataclass_fields__] + [self.host.total]
            lines.append(f"{'off device':<10}" + "".join(f"{size / MiB:10.2f} MiB" for size in sizes))
        lines += [f"  {row.dim:<6} {row.op:<32} x{row.calls:<4} {row.bytes / MiB:10.3f} MiB"
                  for row in self.collectives]
        return "\n".join(lines)
