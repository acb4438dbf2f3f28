"""CPU engine costs that need a process group to measure, written to `colab_par/planning/cpu_costs.json`,
which the planner reads (`colab_par.planning.devices.CPU_COSTS`).

- `wrapper_cost`: the extra host time per layer pass of DTensor tensor parallelism (`tpN sp`),
  FSDP (`dpN zero3`) and ring context parallelism (`cpN`), in plain layer passes. Measured on a
  GPT so small that only host costs remain: forward + backward under `parallelize`, minus the
  plain model on the same local work, minus the wrapper's collective hops at the measured gloo
  latency, per layer, divided by the cost of one plain layer pass (`cpu_compute_costs`).
- `collective_bandwidth`: the bus bandwidth gloo reaches per collective (`all_reduce`,
  `all_gather`, `reduce_scatter`) with one engine per core: the bytes the planner's volume
  formulas count ((n−1)/n of the full tensor for a gather or a scatter, 2(n−1)/n for an
  all-reduce) per second, on a 64 MiB float32 tensor. gloo moves its bytes through the CPU, so
  these sit well below the raw loopback TCP rate and differ between collectives.
- `overlap`: the share of an engine's compute time that an asynchronous collective started before
  it hides (both timed alone, then together); with one core per engine gloo's copies take the
  core the compute needs, so it is near nothing here. The planner uses it for the data-parallel
  traffic it hides behind backward.
- `process_bytes`: what an engine process holds before any model (interpreter, torch, ipyparallel,
  the gloo group and the kit's parallel modules imported): VmRSS after a garbage collection and a
  heap trim, the fuller engine.

Every round measures all of it on every engine at once (the engines share the cores, as they do
when training; the collectives on a cluster of one engine per core, first); the wrappers are timed in alternating order, bracketed by two plain passes. The
file gets the medians over rounds (of the median over engines) with the spread, the date, the
machine and torch's version.

    python benchmarks/cpu_costs.py                           # 4 engines, 5 rounds, writes the file
    python benchmarks/cpu_costs.py --quick --out costs.json  # 2 engines, 1 round: a smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import this script

PACKAGE_FILE = Path(__file__).resolve().parents[1] / "colab_par" / "planning" / "cpu_costs.json"
# layout of each wrapper over n engines, and the collective hops one forward + backward takes on
# a GPT of L layers (besides the loss all-reduce every layout shares)
WRAPPERS = {
    "tp": ("tp{n} sp", lambda n, L: (4 * L + 2) * 2 * (n - 1)),
    "fsdp": ("dp{n} zero3", lambda n, L: 3 * (L + 1) * (n - 1)),
    "cp": ("cp{n}", lambda n, L: 3 * L * (n - 1)),
}


# ---- on the engines ------------------------------------------------------------------------------
def engine_costs(reps: int = 20, order: tuple[str, ...] = tuple(WRAPPERS)) -> dict[str, float]:
    """On every engine at once: compute costs, gloo latency per ring hop and bus bandwidth, and the
    wrappers' extra host seconds per layer pass (`wrapper_<name>`), timed in `order`."""
    import time

    import torch
    import torch.distributed as dist

    from colab_par.planning.devices import cpu_compute_costs

    costs = cpu_compute_costs()
    n = dist.get_world_size()
    small, big = torch.zeros(2), torch.zeros(2 ** 20)
    dist.all_reduce(small)  # the first call of a kind pays one-time setup, not latency
    dist.barrier()
    calls = []
    for _ in range(max(reps, 8)):  # the median call: one descheduled engine stalls a single call
        start = time.perf_counter()
        dist.all_reduce(small)
        calls.append(time.perf_counter() - start)
    latency = statistics.median(calls) / (2 * (n - 1))  # per hop of the ring
    dist.all_reduce(big)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(big)
    seconds = (time.perf_counter() - start) / 3
    bandwidth = 2 * (n - 1) / n * big.numel() * 4 / max(seconds - 2 * (n - 1) * latency, 1e-9)
    overheads = _wrapper_overheads(n, latency, order, max(3, reps // 2))
    return dict(costs, latency=latency, bandwidth=bandwidth,
                **{f"wrapper_{k}": v for k, v in overheads.items()})


def collective_costs(reps: int = 3, megabytes: int = 64) -> dict[str, float]:
    """On every engine at once: each collective's bus bandwidth (`bandwidth_<name>`) and the share
    of compute it hides when started asynchronously before that compute (`overlap_<name>`)."""
    import time

    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    full = torch.randn(megabytes * 2 ** 20 // 4)
    shard = torch.randn(full.numel() // n)
    collectives = {  # name: (call, bus bytes per full byte)
        "all_reduce": (lambda **kw: dist.all_reduce(full, **kw), 2 * (n - 1) / n),
        "all_gather": (lambda **kw: dist.all_gather_into_tensor(full, shard, **kw), (n - 1) / n),
        "reduce_scatter": (lambda **kw: dist.reduce_scatter_tensor(shard, full, **kw), (n - 1) / n),
    }
    a = torch.randn(512, 512)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def matmuls(k: int) -> None:
        for _ in range(k):
            a @ a

    per_matmul = timed(lambda: matmuls(20)) / 20
    out = {}
    for name, (call, bus) in collectives.items():
        call()
        alone = statistics.median(timed(call) for _ in range(reps))
        k = max(1, round(alone / per_matmul))  # compute about as long as the collective
        compute = statistics.median(timed(lambda: matmuls(k)) for _ in range(reps))
        both = statistics.median(timed(lambda: (call(async_op=True), matmuls(k))[0].wait())
                                 for _ in range(reps))
        out[f"bandwidth_{name}"] = bus * full.numel() * 4 / alone
        out[f"overlap_{name}"] = min(1.0, max(0.0, (alone + compute - both) / compute))
    return out


def _wrapper_overheads(n: int, hop_latency: float, order: tuple[str, ...], reps: int,
                       n_layer: int = 4) -> dict[str, float]:
    """Extra host seconds per layer pass of each wrapper (see the module docstring)."""
    import time

    import torch
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=8 * n, seq_len=8 * n, n_layer=n_layer, n_head=n, d_model=8 * n,
                       ffn_hidden=8 * n, kernels="torch")
    tokens = torch.zeros(n, config.seq_len, dtype=torch.long)

    def seconds(step) -> float:
        step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        dist.barrier()
        return (time.perf_counter() - start) / reps

    plain_model = GPT(config)

    def plain_step() -> None:
        plain_model.loss_fn(plain_model(tokens[:1]), tokens[:1]).backward()

    before = seconds(plain_step)
    wrapped = {}
    for name in order:
        pm = parallelize(GPT(config), WRAPPERS[name][0].format(n=n))
        wrapped[name] = seconds(lambda: pm.forward_backward(tokens, tokens))
    plain = (before + seconds(plain_step)) / 2
    exposed = {name: (hops(n, n_layer) + 2 * (n - 1)) * hop_latency for name, (_, hops) in WRAPPERS.items()}
    return {name: max(0.0, (wrapped[name] - plain - exposed[name]) / n_layer) for name in WRAPPERS}


def process_bytes() -> int:
    """On an engine, before any model: resident bytes with the kit's training modules imported."""
    import ctypes
    import gc

    import colab_par.models.gpt  # noqa: F401 - what parallelize loads, resident during training
    import colab_par.parallel  # noqa: F401

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


# ---- in this process -----------------------------------------------------------------------------
def machine() -> str:
    """Cores, CPU model and memory of this machine, in words."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return f"{os.cpu_count()}-core CPU VM ({model}), {memory:.1f} GiB RAM, {platform.system()}"


def measure(engines: int, rounds: int, reps: int) -> dict[str, Any]:
    """The costs file's content: medians over rounds, with their spread."""
    import torch

    from colab_par import Cluster

    per_round: dict[str, list[float]] = {}
    cores = os.cpu_count() or 1
    with Cluster(n=cores, backend="gloo", timeout=120.0, dashboard=False) as cluster:
        for _ in range(rounds):
            for key, value in _median_over_engines(cluster.run(collective_costs)).items():
                per_round.setdefault(key, []).append(value)
    collectives = {k.removeprefix("bandwidth_"): v for k, v in per_round.items() if k.startswith("bandwidth_")}
    overlap = [statistics.median(v) for k, v in per_round.items() if k.startswith("overlap_")]
    per_round.clear()
    with Cluster(n=engines, backend="gloo", timeout=120.0, dashboard=False) as cluster:
        memory = cluster.run(process_bytes)  # before any model: the first thing these engines do
        for i in range(rounds):
            order = tuple(WRAPPERS) if i % 2 == 0 else tuple(reversed(WRAPPERS))
            results = cluster.run(engine_costs, reps, order)
            for name in WRAPPERS:
                ratios = [r[f"wrapper_{name}"] / r["layer_overhead"] for r in results]
                per_round.setdefault(name, []).append(statistics.median(ratios))
    return {"measured": datetime.date.today().isoformat(), "machine": machine(),
            "torch": torch.__version__, "engines": engines, "rounds": rounds,
            "script": "python benchmarks/cpu_costs.py",
            "wrapper_cost": {k: round(statistics.median(v), 2) for k, v in per_round.items()},
            "wrapper_cost_range": {k: [round(min(v), 2), round(max(v), 2)] for k, v in per_round.items()},
            "process_bytes": max(memory), "process_bytes_per_engine": memory,
            "collective_engines": cores,
            "collective_bandwidth": {k: round(statistics.median(v)) for k, v in collectives.items()},
            "collective_bandwidth_range": {k: [round(min(v)), round(max(v))] for k, v in collectives.items()},
            "overlap": round(statistics.median(overlap), 3), "overlap_per_collective": [round(v, 3) for v in overlap]}


def _median_over_engines(results: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=4, help="gloo CPU engines sharing the cores")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20, help="all-reduces timed per round (steps: half)")
    parser.add_argument("--quick", action="store_true", help="2 engines, 1 round, few repetitions")
    parser.add_argument("--out", type=Path, default=PACKAGE_FILE, help=f"default {PACKAGE_FILE}")
    args = parser.parse_args()
    engines, rounds, reps = (2, 1, 4) if args.quick else (args.engines, args.rounds, args.reps)
    costs = measure(engines, rounds, reps)
    args.out.write_text(json.dumps(costs, indent=1) + "\n")
    print(json.dumps(costs, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
