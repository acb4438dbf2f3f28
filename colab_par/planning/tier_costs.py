"""What memory tiers cost: where a rank's model state sits under a budget, what it moves per step,
and the seconds that movement adds, from rates `benchmarks/tier_costs.py` measured
(`tier_costs.json`).

Pure arithmetic, below the planner. It models the runtime's contract (`colab_par.memory_tiers`):
- a rank's local state (params, grads, optimizer: exp_avg + exp_avg_sq, and the fp32 master when
  the working params are bf16, i.e. the ZeRO accounting's 2 + 2 + 12 or 4 + 4 + 8 bytes) is cut
  into chunks of `chunk_bytes`;
- kinds pinned to a tier go there; "auto" parameters stay on the device (the runtime never moves
  them); "auto" grads, then optimizer state, fill the device under the budget less its
  `SLACK` (as the runtime fills it) - parameters - working
  memory - streaming buffers (two chunks, the one in use and the prefetched one, per kind that is
  not wholly on the device); what does not fit goes to the host (CUDA; on a CPU the host is the
  device) and then the disk. Working memory (activations, gathered
  parameters, communication buffers) is the planner's peak less the local state.
- on a CPU, where the budget binds at the measured step (auto grads or optimizer state would
  leave the device, or nothing fits) with the working memory glibc's default heap holds, the
  runtime fixes the heap's mmap threshold (`host_heap.tighten_heap`): the step then holds only its
  live working memory and runs slower, both by the ratios `benchmarks/host_heap.py` measured
  (`host_heap.json`; `TierPlan.tight_heap`, priced by the planner);
- per step the disk reads optimizer state, grads once (twice when the run clips: the norm reads
  them first) and params twice (forward, backward) of what it holds, and writes optimizer state,
  grads and params once each (`TierPlan.disk_read`, `disk_write`); on CUDA every byte off the
  device crosses PCIe the same way, and the optimizer chunks off the device are stepped on the
  host (`host_adam.py`; ZeRO-Offload's split: their grads come down, their params go back up, and
  come down first too where no float32 master lives on the host).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from colab_par.layout.tier_options import DEFAULT_DISK, SLACK, STATE_KINDS, MemoryTiers

__all__ = ["TierRates", "TIER_RATES", "TIER_COSTS_FILE", "load_tier_rates", "HeapCosts", "HEAP_COSTS",
           "HOST_HEAP_FILE", "load_heap_costs", "TierPlan", "place_state", "HostShare", "tier_plan",
           "disk_free_bytes", "TIERS_SHOWN"]

TIER_COSTS_FILE = Path(__file__).with_name("tier_costs.json")
HOST_HEAP_FILE = Path(__file__).with_name("host_heap.json")
TIERS_SHOWN = ("device", "host", "disk")


@dataclass(frozen=True)
class TierRates:
    """Measured bytes/s: sequential disk reads and writes of chunk-sized pieces (page cache
    dropped, fsync'd), pinned host <-> GPU copies (None: measured where the host is the device),
    and optimizer-state bytes per second of the host AdamW on `threads` threads. `chunk_bytes` is
    the chunk size measured with, the planner's chunk size too."""

    disk_read: float
    disk_write: float
    host_device: "float | None"
    host_adam: float
    chunk_bytes: int
    threads: int
    measured: str
    machine: str


def load_tier_rates(path: "str | os.PathLike" = TIER_COSTS_FILE) -> TierRates:
    """The rates `benchmarks/tier_costs.py` wrote to `path` (JSON)."""
    data = json.loads(Path(path).read_text())
    rates = data["rates"]
    return TierRates(disk_read=float(rates["disk_read"]), disk_write=float(rates["disk_write"]),
                     host_device=None if rates["host_device"] is None else float(rates["host_device"]),
                     host_adam=float(rates["host_adam"]), chunk_bytes=int(data["chunk_bytes"]),
                     threads=int(data["threads"]), measured=data["measured"], machine=data["machine"])


TIER_RATES = load_tier_rates()


@dataclass(frozen=True)
class HeapCosts:
    """A CPU step under a tightened heap against glibc's default, measured side by side: its time
    (`tight_step_ratio` > 1: large blocks are mapped and unmapped, their pages faulted in anew) and
    the working memory the default holds over the tight one (`default_working_ratio`)."""

    tight_step_ratio: float
    default_working_ratio: float
    measured: str


def load_heap_costs(path: "str | os.PathLike" = HOST_HEAP_FILE) -> HeapCosts:
    """The ratios `benchmarks/host_heap.py` wrote to `path` (JSON)."""
    data = json.loads(Path(path).read_text())
    return HeapCosts(tight_step_ratio=float(data["tight_step_ratio"]),
                     default_working_ratio=float(data["default_working_ratio"]), measured=data["measured"])


HEAP_COSTS = load_heap_costs()


def disk_free_bytes(folder: "str | None") -> float:
    """Free bytes where the disk tier would write: `folder` ("tmp": the system's temporary folder)
    or its nearest existing parent (the runtime creates it); 0 without a folder."""
    if folder is None:
        return 0.0
    path = Path(tempfile.gettempdir() if folder == DEFAULT_DISK else folder).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return float(shutil.disk_usage(path).free)


@dataclass(frozen=True)
class TierPlan:
    """One rank's state across tiers (bytes per kind in `device` / `host` / `disk`), the `working`
    memory and `streaming` buffers beside the device's share, the bytes moved per step and the
    seconds they add (`seconds`, exposed: see `tier_plan`). `fits` is False with `reason` when the
    budget or a tier's capacity cannot hold it."""

    device: Mapping[str, float]
    host: Mapping[str, float]
    disk: Mapping[str, float]
    working: float
    streaming: float
    budget: "float | None"
    fits: bool = True
    reason: str = ""
    disk_read: float = 0.0
    disk_write: float = 0.0
    host_device: float = 0.0
    seconds: float = 0.0
    times: Mapping[str, float] = field(default_factory=dict)
    tight_heap: bool = False

    def resident(self) -> dict[str, float]:
        """State bytes per tier (what the runtime reports as tier_device / tier_host / tier_disk)."""
        return {tier: float(sum(getattr(self, tier).values())) for tier in TIERS_SHOWN}

    @property
    def moved(self) -> float:
        """Bytes moved per step between tiers (disk reads and writes, PCIe copies)."""
        return self.disk_read + self.disk_write + self.host_device

    @property
    def device_total(self) -> float:
        """What the budget covers: the device's state, working memory and streaming buffers."""
        return self.resident()["device"] + self.working + self.streaming


def place_state(state: Mapping[str, float], tiers: MemoryTiers, working: float, *, one_memory: bool,
                chunk_bytes: float, host_capacity: float = math.inf,
                disk_capacity: float = math.inf, optimizer_arrays: int = 1) -> TierPlan:
    """Bytes of each kind per tier under `tiers` (see the module docstring for the policy).

    `one_memory`: host and device are the same memory (a CPU), so "host" means "device".
    `host_capacity` / `disk_capacity`: what this rank may put there. `optimizer_arrays`: float32
    arrays a chunk's optimizer state has (AdamW's two moments, plus the master for bf16 working
    shards): a streamed optimizer chunk is that many chunks of bytes."""
    pins = tiers.placements()
    budget = math.inf if tiers.budget is None else float(tiers.budget) * (1 - SLACK)  # what the runtime fills

    pins["params"] = "device" if pins["params"] == "auto" else pins["params"]  # as the runtime keeps them

    def tier_of(pin: str) -> str:
        return "device" if pin == "host" and one_memory else pin

    # which kinds stream decides the buffers, which decide the room: grow the streamed set until
    # the fill no longer adds to it (at most once per kind)
    streamed = {kind for kind in STATE_KINDS if pins[kind] != "auto" and tier_of(pins[kind]) != "device"}
    while True:
        placed = {tier: {kind: 0.0 for kind in STATE_KINDS} for tier in TIERS_SHOWN}
        for kind in STATE_KINDS:
            if pins[kind] != "auto":
                placed[tier_of(pins[kind])][kind] = state[kind]
        arrays = {"optimizer": optimizer_arrays}
        buffers = {kind: 2 * min(chunk_bytes * arrays.get(kind, 1), state[kind]) for kind in streamed}
        room = budget - working - sum(placed["device"].values()) - sum(buffers.values())
        overflow: dict[str, float] = {}
        for kind in (k for k in STATE_KINDS if pins[k] == "auto"):
            keep = min(max(room, 0.0), state[kind])
            placed["device"][kind] = keep
            room -= keep
            if keep < state[kind]:
                overflow[kind] = state[kind] - keep
        if set(overflow) <= streamed:
            break
        streamed |= set(overflow)
    rooms = {"host": 0.0 if one_memory else host_capacity - sum(placed["host"].values()),
             "disk": (disk_capacity if tiers.uses_disk else 0.0) - sum(placed["disk"].values())}
    unplaced = 0.0
    for kind, rest in overflow.items():
        for tier in ("host", "disk"):
            take = min(rest, max(rooms[tier], 0.0))
            placed[tier][kind] += take
            rooms[tier] -= take
            rest -= take
        unplaced += rest
    plan = TierPlan(placed["device"], placed["host"], placed["disk"], working, sum(buffers.values()),
                    tiers.budget)
    return _with_verdict(plan, budget, unplaced, min(rooms.values()) < 0, tiers.uses_disk, one_memory)


def _with_verdict(plan: TierPlan, budget: float, unplaced: float, overfull: bool, uses_disk: bool,
                  one_memory: bool) -> TierPlan:
    """`plan`, or a copy that does not fit and says why and what to change (`budget`: the share of
    the budget the runtime fills)."""
    gib = 2 ** 30
    if plan.working + plan.streaming > budget:
        reason = (f"the working memory ({plan.working / gib:.2f} GiB: activations, gathered parameters, "
                  f"buffers) and streaming buffers ({plan.streaming / gib:.2f} GiB) alone exceed the "
                  f"budget's {budget / gib:.2f} GiB that are filled: raise it, or shrink the working memory "
                  "(ac-full, a smaller batch, more sharding)")
    elif plan.device_total > budget:
        reason = (f"the state kept on the device (the parameters, and kinds pinned there) needs "
                  f"{plan.device_total / gib:.2f} GiB, over the budget's "
                  f"{budget / gib:.2f} GiB that are filled: pin less to the device or raise the budget")
    elif unplaced > 0:
        where = "disk" if one_memory else "host or disk"
        reason = (f"{unplaced / gib:.2f} GiB of state has no room under the budget nor on the {where}: "
                  + ("the disk folder has too little free space; name another ('disk:/folder')" if uses_disk
                     else "add a disk tier ('disk' or 'disk:/folder') or raise the budget"))
    elif overfull:
        reason = ("a kind pinned to the host or disk exceeds that tier's room per rank (host: this "
                  "machine's memory shared by the ranks of a host; disk: the folder's free space): pin it "
                  "elsewhere or use more ranks")
    else:
        return plan
    return replace(plan, fits=False, reason=reason)


def _io_bytes(plan: TierPlan, state: Mapping[str, float], one_memory: bool, clip: bool,
              master: bool) -> dict[str, float]:
    """Bytes per step per phase: disk reads / writes and PCIe copies in forward + backward
    ("fb_*"), clipping's norm ("clip_read") and the optimizer step ("step_*").

    Disk: params read in forward and backward and written after the step, grads written in
    backward and read in the step (and once before it, by the norm, when `clip`), optimizer state
    read and written in the step. PCIe (CUDA): the
    same for everything off the device, except that what the host steps (a share f of the optimizer
    off the device) needs its grads brought down once and its params sent back up once (brought
    down first too without a float32 `master` on the host), and does not cross again."""
    disk = plan.disk
    io = {"fb_read": 2 * disk["params"], "fb_write": disk["grads"],
          "step_read": disk["optimizer"] + disk["grads"], "step_write": disk["optimizer"] + disk["params"],
          "clip_read": disk["grads"] if clip else 0.0, "fb_copy": 0.0, "step_copy": 0.0}
    if not one_memory:
        off = {kind: plan.host[kind] + disk[kind] for kind in STATE_KINDS}
        f = off["optimizer"] / state["optimizer"] if state["optimizer"] else 0.0
        io["fb_copy"] = 2 * off["params"] + off["grads"]
        params_crossings = 1 if master else 2
        io["step_copy"] = (off["params"] * (1 - f) + off["grads"] * (1 - f)
                           + f * (state["grads"] - off["grads"] + params_crossings * (state["params"] - off["params"])))
    return io


@dataclass(frozen=True)
class HostShare:
    """What one rank has of the machine it runs on, which decides where its state may go and how
    fast it moves: `one_memory` (a CPU: host and device are the same memory), the `ranks` of this
    host sharing its disk and the host side of its PCIe links, the rank's `core_share` of the
    cores (its host AdamW's speed), its `capacity` of host memory in bytes, and the host <-> device
    `link_bandwidth` in bytes/s (the device catalogue's PCIe figure) for where the rates file has
    no measured copy rate."""

    one_memory: bool
    ranks: int = 1
    core_share: float = 1.0
    capacity: float = math.inf
    link_bandwidth: float = math.inf


def tier_plan(state: Mapping[str, float], tiers: MemoryTiers, working: float, *, host: HostShare,
              compute: float, optimizer_time: float, optimizer_bytes_per_param: float, clip: bool = False,
              rates: TierRates = TIER_RATES, heap: HeapCosts = HEAP_COSTS) -> TierPlan:
    """Placement, bytes moved and exposed seconds per step of one rank's state under `tiers`.

    Prefetch overlaps I/O with compute: the forward + backward traffic (params read twice, grads
    written) hides behind `compute`, the step's traffic (optimizer state, grads read, params
    written) behind the optimizer step (`optimizer_time` on a CPU, where every chunk is stepped on
    the host; on CUDA the host AdamW of the chunks off the device). What shows is
        max(0, io_fb - compute) + max(0, max(io_step, host_adam) - optimizer_time) + 2 · chunk / read
    (the first chunk of each phase waits for its read), plus, when the run clips (`clip`), the
    norm's read of the gradients on disk, which nothing hides. The `host.ranks` share the disk and
    the PCIe links' host side: each gets its share of the measured rates; a CPU rank's host AdamW
    runs at the measured rate times its `host.core_share`. Host <-> device copies run at the
    measured rate where the rates file has one (measured on CUDA), else at `host.link_bandwidth`.
    `tight_heap` says whether a CPU rank tightens its heap (`heap`).
    """
    one_memory, ranks_per_host = host.one_memory, host.ranks
    free = disk_free_bytes(tiers.disk_folder) / ranks_per_host if tiers.uses_disk else 0.0
    plan = place_state(state, tiers, working, one_memory=one_memory, chunk_bytes=rates.chunk_bytes,
                       optimizer_arrays=max(1, round(optimizer_bytes_per_param / 4)),
                       host_capacity=host.capacity, disk_capacity=free)
    tight_heap = one_memory and tiers.budget is not None and _binds(place_state(
        state, tiers, working * heap.default_working_ratio, one_memory=True, chunk_bytes=rates.chunk_bytes,
        optimizer_arrays=max(1, round(optimizer_bytes_per_param / 4)), disk_capacity=free), tiers, state)
    io = _io_bytes(plan, state, one_memory, clip, master=optimizer_bytes_per_param > 8)
    read, write = rates.disk_read / ranks_per_host, rates.disk_write / ranks_per_host
    copy = (host.link_bandwidth if rates.host_device is None else rates.host_device) / ranks_per_host
    io_fb = io["fb_read"] / read + io["fb_write"] / write + io["fb_copy"] / copy
    io_step = io["step_read"] / read + io["step_write"] / write + io["step_copy"] / copy
    off_optimizer = 0.0 if one_memory else plan.host["optimizer"] + plan.disk["optimizer"]
    host_adam = off_optimizer * 8 / optimizer_bytes_per_param / (rates.host_adam * host.core_share)
    first = 2 * min(rates.chunk_bytes, sum(plan.disk.values())) / read
    times = {"tier_fb": max(0.0, io_fb - compute),
             "tier_step": max(0.0, max(io_step, host_adam) - (optimizer_time if one_memory else 0.0)),
             "tier_first": first, "tier_clip": io["clip_read"] / read}
    return replace(plan, disk_read=io["fb_read"] + io["clip_read"] + io["step_read"],
                   disk_write=io["fb_write"] + io["step_write"],
                   host_device=io["fb_copy"] + io["step_copy"], seconds=sum(times.values()),
                   times={"io_fb": io_fb, "io_step": io_step, "host_adam": host_adam, **times},
                   tight_heap=tight_heap)


def _binds(loose: TierPlan, tiers: MemoryTiers, state: Mapping[str, float]) -> bool:
    """Whether the runtime's placement at the measured step (`loose`: with the working memory
    glibc's default heap holds) finds no fit or moves auto grads or optimizer state off the device."""
    pins = tiers.placements()
    return not loose.fits or any(pins[kind] == "auto" and loose.device[kind] < state[kind]
                                 for kind in ("grads", "optimizer"))
