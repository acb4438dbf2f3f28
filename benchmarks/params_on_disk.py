"""params@disk: what it saves of each rank's resident peak, on engines that ran other work first,
and what the per-forward heap trim (`memory_tiers/param_pages.py`) costs and buys.

One 2-engine gloo cluster (as the test fixtures share one) first trains a run whose budget binds
(glibc's heap tightened, then loosened: its free holes stay), then alternates three arms, several
rounds: `dp2 optimizer@disk`, `dp2 params@disk optimizer@disk`, and the same without the trim
(the engine's `param_pages.trim_host_heap` replaced by a no-op for that run only). Per run and
rank: the training peak (VmHWM, reset after parallelize) over the RSS before the model, and the
median step time of steps 2-4. The model is the tier tests' 50 M GPT (192 MiB of parameters per
rank under dp2), 2 MiB chunks.

    python benchmarks/params_on_disk.py --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys

import cloudpickle

from colab_par import Cluster

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GPT_SIZES = dict(vocab_size=64, seq_len=16, n_layer=4, n_head=8, d_model=1024, kernels="torch")
ARMS = {"optimizer@disk": ("dp2 optimizer@disk", True),
        "params@disk": ("dp2 params@disk optimizer@disk", True),
        "params@disk, no trim": ("dp2 params@disk optimizer@disk", False)}


def train(layout: str, trim: bool, steps: int = 5) -> dict:
    """Engine side: (peak over the RSS before the model in bytes, step times in s)."""
    import gc
    import time

    import torch

    import colab_par.memory_tiers.chunks as chunks
    import colab_par.memory_tiers.param_pages as pages
    from colab_par import parallelize
    from colab_par.memory_tiers.host_heap import trim_host_heap
    from colab_par.memory_tiers.measure import PeakWindow, resident_bytes
    from colab_par.models import GPT, GPTConfig

    chunks.CHUNK_BYTES = 2 * 2 ** 20
    pages.trim_host_heap = trim_host_heap if trim else (lambda: None)
    gc.collect()
    trim_host_heap()
    before = resident_bytes(torch.device("cpu"))
    torch.manual_seed(0)
    pm = parallelize(lambda: GPT(GPTConfig(**GPT_SIZES)), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))
    window = PeakWindow(torch.device("cpu"))  # the peak from here on
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pm.train_step(tokens, torch.roll(tokens, -1, 1))
        times.append(time.perf_counter() - start)
    peak = window.bytes()
    pages.trim_host_heap = trim_host_heap
    del pm
    gc.collect()
    trim_host_heap()
    return {"over": peak - before, "step": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    samples: dict[str, list[dict]] = {name: [] for name in ARMS}
    with Cluster(n=2, backend="gloo", timeout=300.0, dashboard=False) as cluster:
        cluster.run(train, "dp2 mem900MiB disk", True)  # history: a binding budget tightened the heap
        for round_ in range(args.rounds):
            for name, (layout, trim) in ARMS.items():
                results = cluster.run(train, layout, trim)
                samples[name] += results
                print(round_, name, [f"{r['over'] / 2 ** 20:.0f} MiB {r['step']:.2f} s" for r in results], flush=True)
    print("\narm: peak over the RSS before the model, per rank (median, min-max); step s (median, min-max)")
    for name, runs in samples.items():
        over = [r["over"] / 2 ** 20 for r in runs]
        step = [r["step"] for r in runs]
        print(f"{name:>22}: {statistics.median(over):.0f} MiB ({min(over):.0f}-{max(over):.0f}); "
              f"{statistics.median(step):.2f} s ({min(step):.2f}-{max(step):.2f})")


if __name__ == "__main__":
    main()
