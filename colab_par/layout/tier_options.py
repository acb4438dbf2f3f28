"""`MemoryTiers`: the one small options value of heterogeneous memory (a `Layout` field).

Pure Python, like layout.py: a notebook kernel without torch validates and prints it. A rank keeps
its model state (parameters, gradients, optimizer state) under `budget` bytes by placing chunks of
it across tiers: device, host (the same memory on a CPU-only machine, so one tier there) and disk
(files in `disk`). Each kind of state is placed "auto" (the placement policy decides from the
budget and a measured warm-up step) or pinned to a tier, as Gemini's static policy pins fractions.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryTiers", "TIERS", "STATE_KINDS", "parse_bytes", "format_bytes", "tier_token",
           "DEFAULT_DISK", "bf16_working_shards"]

TIERS = ("auto", "device", "host", "disk")
STATE_KINDS = ("params", "grads", "optimizer")
DEFAULT_DISK = "tmp"  # the system's temporary folder
# The fast tier is filled to (1 - SLACK) of the budget, by the runtime and the planner alike: a
# rank's resident memory varies by a few per cent from step to step with the allocator (measured
# 2026-11-26, gloo, 2 CPU engines: the same step's working memory differed by up to 5 % of the
# budget between ranks and steps).
SLACK = 1 / 16
_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kib": 2 ** 10, "kb": 10 ** 3, "m": 2 ** 20, "mib": 2 ** 20,
          "mb": 10 ** 6, "g": 2 ** 30, "gib": 2 ** 30, "gb": 10 ** 9, "t": 2 ** 40, "tib": 2 ** 40,
          "tb": 10 ** 12}


def parse_bytes(value: "int | str") -> int:
    """Bytes from an int or a size such as "8GiB", "512MiB", "1.5GB" (binary units for GiB/MiB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"a memory budget must be positive, got {value}; e.g. '8GiB'")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS or float(match[1]) <= 0:
        raise ValueError(f"memory size {value!r} is not understood; write e.g. '8GiB', '512MiB' or a "
                         "positive number of bytes")
    return int(float(match[1]) * _UNITS[unit])


def format_bytes(count: int) -> str:
    """The shortest exact binary spelling: 8589934592 -> "8GiB", 1536 MiB -> "1536MiB"."""
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count % size == 0:
            return f"{count // size}{unit}"
    return f"{count}B"


@dataclass(frozen=True)
class MemoryTiers:
    """Budget and placement of one rank's model state; the default (no budget, every kind "auto")
    is off: the layout trains exactly as without tiers.

    `budget`: bytes per rank (int or "8GiB"), or None. `disk`: the folder of the disk tier (each
    run writes its own subfolder and removes it), "tmp" for the system's temporary folder, or None:
    no disk tier unless a kind is pinned to disk (then "tmp"). `params` / `grads` / `optimizer`: "auto", "device", "host" or "disk".
    """

    budget: "int | str | None" = None
    disk: "str | None" = None
    params: str = "auto"
    grads: str = "auto"
    optimizer: str = "auto"

    def __post_init__(self) -> None:
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_bytes(self.budget))
        for kind in STATE_KINDS:
            if getattr(self, kind) not in TIERS:
                raise ValueError(f"{kind}={getattr(self, kind)!r} is not a tier; choose one of "
                                 f"{', '.join(TIERS)}")
        if self.disk is not None and (not isinstance(self.disk, str) or not self.disk or " " in self.disk):
            raise ValueError(f"disk={self.disk!r} must be a folder path without spaces, e.g. '/scratch/tiers'")

    @property
    def enabled(self) -> bool:
        """Whether anything is placed: a budget, or a kind pinned to a tier."""
        return self.budget is not None or any(getattr(self, kind) != "auto" for kind in STATE_KINDS)

    @property
    def uses_disk(self) -> bool:
        """Whether the disk tier may hold state: a folder given, or a kind pinned to disk."""
        return self.disk is not None or "disk" in (self.params, self.grads, self.optimizer)

    def placements(self) -> dict[str, str]:
        return {kind: getattr(self, kind) for kind in STATE_KINDS}

    def tokens(self) -> list[str]:
        """The layout-string tokens of this value (see `tier_token`), empty when off."""
        out = [] if self.budget is None else [f"mem{format_bytes(self.budget)}"]
        if self.disk is not None:
            out.append("disk" if self.disk == DEFAULT_DISK else f"disk:{self.disk}")
        out += [f"{kind}@{tier}" for kind, tier in self.placements().items() if tier != "auto"]
        return out

    @property
    def disk_folder(self) -> "str | None":
        """The folder the disk tier writes under (None: no disk tier); "tmp" is resolved on the
        rank that writes, as its system's temporary folder."""
        return self.disk if self.disk is not None else (DEFAULT_DISK if self.uses_disk else None)


def tier_token(token: str) -> "dict[str, Any] | None":
    """The MemoryTiers fields one layout token sets: "mem8GiB", "disk" / "disk:/path",
    "optimizer@disk" (any kind @ any tier); None when the token is not a tiers token."""
    match = re.fullmatch(r"mem(\d+(?:\.\d+)?[a-z]*)", token, flags=re.IGNORECASE)
    if match:
        return {"budget": parse_bytes(match[1])}
    if token.lower() == "disk":
        return {"disk": DEFAULT_DISK}
    if token.lower().startswith("disk:"):
        return {"disk": token[len("disk:"):]}
    match = re.fullmatch(r"(params|grads|optimizer)@(auto|device|host|disk)", token, flags=re.IGNORECASE)
    if match:
        return {match[1].lower(): match[2].lower()}
    return None


def bf16_working_shards(tiers: MemoryTiers, precision: str, zero: int) -> bool:
    """Whether a layout keeps its FSDP working shards (and so its gradients) in bf16 with the
    float32 master beside the optimizer state, as ZeRO-Offload splits them: bf16, zero2/3, the
    optimizer pinned off the device. Auto placement keeps FSDP's float32 shards, so a model that
    fits its budget trains exactly as without tiers."""
    return tiers.optimizer in ("host", "disk") and precision == "bf16" and zero >= 2
