"""glibc's heap under a training step: its default (dynamic mmap threshold) against the fixed
1 MiB threshold memory tiers switch to where a budget binds (`colab_par/host_heap.py`), and the
32 MiB threshold they leave behind when the optimizer goes.

Each sample is a fresh 2-engine gloo cluster (one torch thread per engine) training the reference
GPT under `--layout` on one fixed batch: one warm-up step, then `--steps` timed steps; the
threshold is set on the engines before the model is built. Reported per arm: step seconds (median
over steps of the slowest rank) and the training peak above what the rank held before the timed
steps (VmHWM after clear_refs: activations, gathered parameters, allocator retention). Arms are
alternated round by round; median and range over rounds.

    python benchmarks/host_heap.py                       # 1024x12 under dp2 zero3 bf16, 3 rounds
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402  (peak probes and the GPT family)

cloudpickle.register_pickle_by_value(scale)
ARMS = {"glibc default": 0, "fixed 1 MiB (tiers, budget binds)": 2 ** 20, "fixed 32 MiB (after tiers)": 32 * 2 ** 20}


def train(sizes: dict[str, Any], layout: str, steps: int, threshold: int) -> dict[str, Any]:
    """On every engine: the threshold, the model, a warm-up step, `steps` timed steps."""
    import ctypes
    import gc

    import torch

    from colab_par import parallelize
    from colab_par.host_heap import M_MMAP_THRESHOLD
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


if __name__ == "__main__":
    main()
