"""Cost of one generated token, cached (`ParallelModel.generate`) against a full re-forward, by prompt
length: with the KV cache a new token costs one position's forward whatever came before it; a
re-forward (`use_cache=False`) pays for the whole prefix at every step.

On a running `Cluster(n=--engines)` (2 by default; 4 for a 2d grid) a tiny GPT is parallelized
(`--layout`, dp2 by default) and every rank
times `pm.generate` of one prompt with 1 and with 1 + `--new` new tokens; the difference over
`--new` is the time of one decode step (the prefill cancels). Rounds alternate the order of the
arms (cached, re-forward), then reversed, and go through the prompt lengths in each; the median and
min-max over rounds of the slower rank's figure are printed, with the ratio re-forward / cached.

    python benchmarks/generate.py [--rounds 5] [--new 32] [--lengths 16,64,256,1024] [--layout dp2] [--engines 2]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

MODEL = dict(vocab_size=256, seq_len=1100, n_layer=2, n_head=4, d_model=64, kernels="torch")


def time_steps(layout: str, length: int, use_cache: bool, new: int, repeats: int) -> float:
    """On an engine: seconds per decode step (the best of `repeats` pairs, the parallel model built
    once per engine and layout)."""
    import __main__

    import torch

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    built = __main__.__dict__.setdefault("_generate_benchmark_models", {})  # lives between calls
    if layout not in built:
        torch.manual_seed(0)
        built[layout] = parallelize(GPT(GPTConfig(**MODEL)), layout)
    pm = built[layout]
    prompt = torch.randint(0, MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))

    def seconds(tokens: int) -> float:
        started = time.perf_counter()
        pm.generate(prompt, tokens, use_cache=use_cache)
        return time.perf_counter() - started

    return min((seconds(1 + new) - seconds(1)) / new for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lengths", default="16,64,256,1024")
    parser.add_argument("--layout", default="dp2")
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) + 1 + args.new > MODEL["seq_len"]:
        raise SystemExit(f"prompt {max(lengths)} + {1 + args.new} new tokens exceed the model's "
                         f"{MODEL['seq_len']} positions")

    from colab_par import Cluster

    arms = {"cached": True, "re-forward": False}
    per_token: dict[tuple[str, int], list[float]] = {(arm, n): [] for arm in arms for n in lengths}
    load = []
    with Cluster(n=args.engines, backend="gloo") as cluster:
        cluster.run(time_steps, args.layout, lengths[0], True, 2, 1)  # warm-up: build, first calls
        for round_ in range(args.rounds):
            for arm in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                for length in lengths:
                    ranks = cluster.run(time_steps, args.layout, length, arms[arm], args.new, args.repeats)
                    per_token[(arm, length)].append(max(ranks))
            load.append(os.getloadavg()[0])
    print(f"GPT {MODEL}, layout {args.layout} on {args.engines} gloo engines, one prompt, {args.new} new tokens "
          f"(per-step time = (t(1+{args.new}) - t(1)) / {args.new}, best of {args.repeats}), "
          f"{args.rounds} rounds (arms alternated), {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}), "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print(f"{'prompt':>7} | {'cached ms/token':>28} | {'re-forward ms/token':>28} | ratio (medians)")
    for length in lengths:
        cells = []
        for arm in arms:
            values = [1e3 * v for v in per_token[(arm, length)]]
            cells.append(f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})")
        medians = {arm: statistics.median(per_token[(arm, length)]) for arm in arms}
        ratio = medians["re-forward"] / medians["cached"]
        print(f"{length:>7} | {cells[0]:>28} | {cells[1]:>28} | {ratio:.2f}")


if __name__ == "__main__":
    main()
