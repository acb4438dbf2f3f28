"""The rates the planner's memory-tier model reads, written to `colab_par/planning/tier_costs.json`
(`colab_par.planning.tier_costs.TIER_RATES`).

- `disk_write` / `disk_read`: bytes/s of the runtime's own disk store in a folder (`--folder`,
  default the system's temporary folder, where the disk tier writes by default), chunk by chunk
  (`--chunk-mib`, default the runtime's chunk size): each write ends with the store's msync inside
  the timing (the bytes are on the disk, not in the page cache); before the reads the files' pages
  are dropped from the page cache (`os.posix_fadvise(..., POSIX_FADV_DONTNEED)`), so they come
  from the disk, read with the next chunk prefetched as the optimizer step does. The files are
  removed afterwards, whatever happens.
- `host_device`: bytes/s of chunk-sized copies between pinned host memory and the GPU, the slower
  direction (CUDA only; on a CPU machine the host tier is the device and it is null).
- `host_adam`: optimizer-state bytes (exp_avg + exp_avg_sq, 8 per parameter) per second that
  `adamw_chunk_step` updates over chunk-sized float32 chunks on `--threads` threads (1: what a CPU
  engine has when two engines share two cores).
Every round measures each once, in rotating order; the file gets the medians over rounds with the
range, the date, the machine and torch's version.

    python benchmarks/tier_costs.py                          # 5 rounds, writes the package file
    python benchmarks/tier_costs.py --quick --out rates.json # a smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from colab_par.memory_tiers.chunks import CHUNK_BYTES
from colab_par.memory_tiers.host_adam import AdamWHyper, adamw_chunk_step
from colab_par.memory_tiers.stores import DiskStore

PACKAGE_FILE = Path(__file__).resolve().parents[1] / "colab_par" / "planning" / "tier_costs.json"
MiB = 2 ** 20


class DiskProbe:
    """`pieces` chunks of the runtime's own disk store (`memory_tiers.stores.DiskStore`: a
    memory-mapped file per chunk, written back with msync and dropped with MADV_DONTNEED, read in
    after MADV_WILLNEED), so the rates are those of the path the tiers take; `close` removes them."""

    def __init__(self, folder: Path, size: int, chunk: int):
        self.folder = Path(tempfile.mkdtemp(prefix="colab_par_tier_probe_", dir=folder))
        self.source = torch.rand(chunk // 4)  # incompressible float32
        self.stores = [DiskStore(str(self.folder), f"probe{i}", chunk // 4, torch.float32)
                       for i in range(max(1, size // chunk))]

    @property
    def size(self) -> int:
        return sum(store.nbytes for store in self.stores)

    def write(self) -> float:
        """Bytes/s of filling each chunk and evicting it dirty (msync inside the timing); the
        file pages are then dropped from the page cache too, so `read` comes from the disk."""
        start = time.perf_counter()
        for store in self.stores:
            store.prefetch()
            store.tensor.copy_(self.source)
            store.evict(dirty=True)
        seconds = time.perf_counter() - start
        for store in self.stores:
            with open(store.path, "rb") as handle:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return self.size / seconds

    def read(self) -> float:
        """Bytes/s of prefetching the next chunk while the current one is read (summed), then
        dropping it: the tiers' optimizer step without its arithmetic."""
        start = time.perf_counter()
        self.stores[0].prefetch()
        for index, store in enumerate(self.stores):
            if index + 1 < len(self.stores):
                self.stores[index + 1].prefetch()
            store.tensor.sum()
            store.evict(dirty=False)
        return self.size / (time.perf_counter() - start)

    def close(self) -> None:
        for store in self.stores:
            store.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def host_adam_rate(chunk: int, chunks: int, steps: int = 3) -> float:
    """Optimizer-state bytes per second of `adamw_chunk_step` over `chunks` float32 chunks."""
    n = chunk // 4
    state = [(torch.randn(n) * 0.02, torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n), torch.zeros(()))
             for _ in range(chunks)]
    hyper = AdamWHyper()
    for item in state:  # first touch
        adamw_chunk_step(*item[:4], item[4], hyper)
    start = time.perf_counter()
    for _ in range(steps):
        for item in state:
            adamw_chunk_step(*item[:4], item[4], hyper)
    return 8 * n * chunks * steps / (time.perf_counter() - start)


def host_device_rate(chunk: int, copies: int = 8) -> float | None:
    """Bytes/s of pinned-host <-> GPU copies, the slower direction; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(chunk // 4, pin_memory=True)
    device = torch.empty(chunk // 4, device="cuda")
    rates = []
    for direction in ((device, host), (host, device)):
        direction[0].copy_(direction[1], non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(copies):
            direction[0].copy_(direction[1], non_blocking=True)
        torch.cuda.synchronize()
        rates.append(copies * chunk / (time.perf_counter() - start))
    return min(rates)


def machine() -> str:
    """Cores, CPU model and memory of this machine, in words (as cpu_costs.py writes it)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()}-core machine ({model}), {memory:.1f} GiB RAM{gpu}"


def measure(folder: Path, file_mib: int, chunk_mib: int, rounds: int, adam_chunks: int) -> dict:
    chunk = chunk_mib * MiB
    probe = DiskProbe(folder, file_mib * MiB, chunk)
    samples: dict[str, list[float]] = {"disk_write": [], "disk_read": [], "host_adam": [], "host_device": []}
    def disk() -> None:
        samples["disk_write"].append(probe.write())
        samples["disk_read"].append(probe.read())

    measures: dict[str, Callable[[], None]] = {
        "disk": disk,
        "host_adam": lambda: samples["host_adam"].append(host_adam_rate(chunk, adam_chunks)),
        "host_device": lambda: samples["host_device"].append(host_device_rate(chunk)),
    }
    try:
        for round_ in range(rounds):
            shift = round_ % len(measures)
            names = list(measures)
            for name in names[shift:] + names[:shift]:
                measures[name]()
    finally:
        probe.close()
    rates, ranges = {}, {}
    for name, values in samples.items():
        values = [v for v in values if v is not None]
        rates[name] = round(statistics.median(values)) if values else None
        ranges[name] = [round(min(values)), round(max(values))] if values else None
    return {"measured": datetime.date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
            "script": "python benchmarks/tier_costs.py", "rounds": rounds, "folder": str(folder),
            "file_bytes": probe.size, "chunk_bytes": chunk, "threads": torch.get_num_threads(),
            "rates": rates, "ranges": ranges,
            "units": "bytes/s; host_adam: optimizer-state bytes (exp_avg + exp_avg_sq) per second; "
                     "host_device: null where the host is the device (CPU)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--file-mib", type=int, default=1024, help="size of the probe file")
    parser.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES // MiB, help="default: the runtime's chunks")
    parser.add_argument("--adam-chunks", type=int, default=8, help="chunks per host AdamW sample")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a 64 MiB file, 1 round")
    parser.add_argument("--out", type=Path, default=PACKAGE_FILE, help=f"default {PACKAGE_FILE}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    file_mib, rounds, adam_chunks = (64, 1, 2) if args.quick else (args.file_mib, args.rounds, args.adam_chunks)
    rates = measure(args.folder, file_mib, args.chunk_mib, rounds, adam_chunks)
    args.out.write_text(json.dumps(rates, indent=1) + "\n")
    print(json.dumps(rates, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
