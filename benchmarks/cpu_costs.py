"""CPU engine costs that need a process group to measure, written to `colab_par/cpu_costs.json`,
which the planner reads (`colab_par.devices.CPU_COSTS`).

- `wrapper_cost`: the extra host time per layer pass of DTensor tensor parallelism (`tpN sp`),
  FSDP (`dpN zero3`) and ring context parallelism (`cpN`), in plain layer passes. Measured on a
  GPT so small that only host costs remain: forward + backward under `parallelize`, minus the
  plain model on the same local work, minus the wrapper's collective hops at the measured gloo
  latency, per layer, divided by the cost of one plain layer pass (`cpu_compute_costs`).
- `process_bytes`: what an engine process holds before any model (interpreter, torch, ipyparallel,
  the gloo group and the kit's parallel modules imported): VmRSS after a garbage collection and a
  heap trim, the fuller engine.

Every round measures all of it on every engine at once (the engines share the cores, as they do
when training); the wrappers are timed in alternating order, bracketed by two plain passes. The
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

PACKAGE_FILE = Path(__file__).resolve().parents[1] / "colab_par" / "cpu_costs.json"
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

    from colab_par.devices import cpu_compute_costs

    costs = cpu_compute_costs()
    n = dist.get_world_size()
    small, big = torch.zeros(2), torch.zeros(2 ** 20)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(small)
    latency = (time.perf_counter() - start) / reps / (2 * (n - 1))  # per hop of the ring
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(big)
    seconds = (time.perf_counter() - start) / 3
    bandwidth = 2 * (n - 1) / n * big.numel() * 4 / max(seconds - 2 * (n - 1) * latency, 1e-9)
    overheads = _wrapper_overheads(n, latency, order, max(3, reps // 2))
    return dict(costs, latency=latency, bandwidth=bandwidth,
                **{f"wrapper_{k}": v for k, v in overheads.items()})


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
            "process_bytes": max(memory), "process_bytes_per_engine": memory}


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
