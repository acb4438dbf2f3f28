"""How long `colab_par.plan` takes to rank every valid layout of a large model on many GPUs (the
README's "4096 GPUs in well under a second"): Llama 3 70B, global batch 2048 × 8192 tokens, H100.
Run: python benchmarks/plan_time.py (a few seconds); prints candidates and the median of 5 calls."""
from __future__ import annotations

import statistics
import time

from colab_par.planning.planner import plan

LLAMA3_70B = {"n_layer": 80, "d_model": 8192, "n_head": 64, "n_kv_head": 8, "ffn_hidden": 28672,
              "vocab_size": 128256, "seq_len": 8192}


def main() -> None:
    for world in (8, 64, 4096):
        seconds = []
        for _ in range(5):
            started = time.perf_counter()
            plans = plan(LLAMA3_70B, world, device="H100", global_batch=2048, seq_len=8192, top=None)
            seconds.append(time.perf_counter() - started)
        print(f"{world:>5} GPUs: {len(plans)} candidates, plan() {statistics.median(seconds):.3f} s "
              f"(min {min(seconds):.3f}, max {max(seconds):.3f})")


if __name__ == "__main__":
    main()
