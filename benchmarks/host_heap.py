"""glibc's heap under a training step: its default (dynamic mmap threshold) against the fixed
1 MiB threshold memory tiers switch to where a budget binds (`colab_par/memory_tiers/host_heap.py`), and the
32 MiB threshold they leave behind when the optimizer goes.

Each sample is a fresh 2-engine gloo cluster (one torch thread per engine) training the reference
GPT under `--layout` on one fixed batch: one warm-up step, then `--steps` timed steps; the
threshold is set on the engines before the model is built. Reported per arm: step seconds (median
over steps of the slowest rank) and the training peak above what the rank held before the timed
steps (VmHWM after clear_refs: activations, gathered parameters, allocator retention). Arms are
alternated round by round; median and range over rounds.

The planner reads what a binding budget costs from `colab_par/planning/host_heap.json`, which this script
writes: the tight threshold's step time over the default's (`tight_step_ratio`, per round, the
two arms side by side) and the default's working memory over the tight one's
(`default_working_ratio`: how much more a step holds before the runtime tightens the heap).

    python benchmarks/host_heap.py                       # 1024x12 under dp2 zero3 bf16, 3 rounds
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402  (peak probes and the GPT family)
from cpu_costs import machine  # noqa: E402

cloudpickle.register_pickle_by_value(scale)
PACKAGE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "colab_par", "planning", "host_heap.json")
ARMS = {"glibc default": 0, "fixed 1 MiB (tiers, budget binds)": 2 ** 20, "fixed 32 MiB (after tiers)": 32 * 2 ** 20}


def train(sizes: dict[str, Any], layout: str, steps: int, threshold: int) -> dict[str, Any]:
    """On every engine: the threshold, the model, a warm-up step, `steps` timed steps."""
    import ctypes
    import gc

    import torch

    from colab_par import parallelize
    from colab_par.memory_tiers.host_heap import M_MMAP_THRESHOLD
    from colab_par.models.gpt import GPT, GPTConfig

    if threshold:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)
    torch.set_num_threads(1)
    config = GPTConfig(**sizes)
    inputs = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(0))
    batch = (inputs, torch.roll(inputs, -1, dims=1))
    torch.manual_seed(0)
    pm = parallelize(lambda: GPT(config), layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=3e-4))
    pm.train_step(*batch)
    held = scale._reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pm.train_step(*batch)
        times.append(time.perf_counter() - start)
    above = scale._peak() - held
    del pm
    gc.collect()
    return {"times": times, "above": above}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1024x12")
    parser.add_argument("--layout", default="dp2 zero3 bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=PACKAGE_FILE, help=f"default {os.path.normpath(PACKAGE_FILE)}")
    args = parser.parse_args()
    from colab_par import Cluster

    width, depth = (int(x) for x in args.size.lower().split("x"))
    sizes = scale.gpt_config(width, depth, scale.VOCAB, scale.SEQ)
    samples: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    for round_ in range(args.rounds):
        order = list(ARMS) if round_ % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            with Cluster(n=2, backend="gloo", timeout=1800.0, dashboard=False) as cluster:
                ranks = cluster.run(train, sizes, args.layout, args.steps, ARMS[arm])
            step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
            above = max(r["above"] for r in ranks) / 2 ** 30
            samples[arm].append((step, above))
            print(f"round {round_}: {arm}: step {step:.2f} s, peak above held {above:.2f} GiB", flush=True)
    base = statistics.median(s for s, _ in samples["glibc default"])
    print(f"\n{args.size} under {args.layout!r}, {args.rounds} rounds x {args.steps} steps, arms alternated")
    print("| heap | step s | vs default | peak above held GiB |\n|---|---|---|---|")
    for arm, rows in samples.items():
        steps, peaks = [s for s, _ in rows], [p for _, p in rows]
        print(f"| {arm} | {statistics.median(steps):.2f} ({min(steps):.2f}-{max(steps):.2f}) | "
              f"{statistics.median(steps) / base:.2f}x | {statistics.median(peaks):.2f} ({min(peaks):.2f}-{max(peaks):.2f}) |")
    write_costs(args, samples)


def write_costs(args: argparse.Namespace, samples: dict[str, list[tuple[float, float]]]) -> None:
    import torch

    default, tight = samples["glibc default"], samples["fixed 1 MiB (tiers, budget binds)"]
    step_ratios = [t[0] / d[0] for d, t in zip(default, tight)]
    working_ratios = [d[1] / t[1] for d, t in zip(default, tight)]
    costs = {"measured": datetime.date.today().isoformat(), "machine": machine(),
             "torch": torch.__version__, "script": "python benchmarks/host_heap.py", "size": args.size,
             "layout": args.layout, "rounds": args.rounds, "steps": args.steps,
             "tight_step_ratio": round(statistics.median(step_ratios), 3),
             "tight_step_ratio_per_round": [round(r, 3) for r in step_ratios],
             "default_working_ratio": round(statistics.median(working_ratios), 3),
             "default_working_ratio_per_round": [round(r, 3) for r in working_ratios]}
    with open(args.out, "w") as out:
        out.write(json.dumps(costs, indent=1) + "\n")
    print(f"written to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
