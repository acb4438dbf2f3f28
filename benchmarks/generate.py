"""Cost of one generated token, cached (`ParallelModel.generate`) against a full re-forward, by prompt
length: with the KV cache a new token costs one position's forward whatever came before it; a
re-forward (`use_cache=False`) pays for the whole prefix at every step. With `--gather`: what a
generate call costs under zero3 with the weights gathered once per call, against the same call
gathering every unit at every token (what generate did before, `weights_gathered` swapped for a
no-op in the engine) and against replicated weights (dp2: no gathers at all).

On a running `Cluster(n=--engines)` (2 by default; 4 for a 2d grid) a tiny GPT is parallelized
(`--layout`, dp2 by default) and every rank
times `pm.generate` of one prompt with 1 and with 1 + `--new` new tokens; the difference over
`--new` is the time of one decode step (the prefill cancels). Rounds alternate the order of the
arms (cached, re-forward), then reversed, and go through the prompt lengths in each; the median and
min-max over rounds of the slower rank's figure are printed, with the ratio re-forward / cached.

    python benchmarks/generate.py [--rounds 5] [--new 32] [--lengths 16,64,256,1024] [--layout dp2] [--engines 2]
    python benchmarks/generate.py --gather [--rounds 5] [--new 32] [--batch 8]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

MODEL = dict(vocab_size=256, seq_len=1100, n_layer=2, n_head=4, d_model=64, kernels="torch")
GATHER_MODEL = dict(vocab_size=512, seq_len=128, n_layer=8, n_head=8, d_model=256, kernels="torch")
GATHER_ARMS = {"zero3, gathered once": ("dp2 zero3", True), "zero3, gathered per token": ("dp2 zero3", False),
               "dp2, replicated": ("dp2", True)}
PROMPT = 16


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


def time_generate(arm: str, batch: int, new: int, repeats: int) -> tuple[float, int]:
    """On an engine: (seconds of one generate call of `batch` prompts and `new` tokens, the best of
    `repeats`; the all-gathers of one call). The models are built once per engine."""
    import contextlib

    import __main__

    import torch
    from torch.profiler import ProfilerActivity, profile

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig
    from colab_par.parallel.inference import generation

    layout, gather_once = GATHER_ARMS[arm]
    built = __main__.__dict__.setdefault("_gather_benchmark_models", {})
    if layout not in built:
        torch.manual_seed(0)
        built[layout] = parallelize(GPT(GPTConfig(**GATHER_MODEL)), layout)
    pm = built[layout]
    prompts = torch.randint(0, GATHER_MODEL["vocab_size"], (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    own = generation.weights_gathered
    if not gather_once:
        generation.weights_gathered = lambda pm: contextlib.nullcontext()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            pm.generate(prompts, new, do_sample=True, temperature=1.0, seed=0)
        gathers = sum(1 for event in profiled.events() if event.name == "c10d::_allgather_base_")
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            pm.generate(prompts, new, do_sample=True, temperature=1.0, seed=0)
            seconds.append(time.perf_counter() - started)
    finally:
        generation.weights_gathered = own
    return min(seconds), gathers


def gather_main(args: argparse.Namespace) -> None:
    from colab_par import Cluster

    samples: dict[str, list[float]] = {arm: [] for arm in GATHER_ARMS}
    gathers: dict[str, int] = {}
    load = []
    with Cluster(n=2, backend="gloo") as cluster:
        for arm in GATHER_ARMS:  # warm-up: build, first calls
            cluster.run(time_generate, arm, args.batch, 2, 1)
        for round_ in range(args.rounds):
            for arm in (list(GATHER_ARMS) if round_ % 2 == 0 else list(GATHER_ARMS)[::-1]):
                ranks = cluster.run(time_generate, arm, args.batch, args.new, args.repeats)
                samples[arm].append(max(seconds for seconds, _ in ranks))
                gathers[arm] = ranks[0][1]
            load.append(os.getloadavg()[0])
    print(f"GPT {GATHER_MODEL}, 2 gloo engines, {args.batch} prompts of {PROMPT} tokens, {args.new} new tokens "
          f"(sampled, KV cache), best of {args.repeats} per sample, {args.rounds} rounds (arms alternated), "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"load average {min(load):.1f}-{max(load):.1f}")
    medians = {arm: statistics.median(values) for arm, values in samples.items()}
    print(f"{'arm':>26} | {'s per generate call':>24} | {'all-gathers per call':>20} | tokens/s (median)")
    for arm, values in samples.items():
        print(f"{arm:>26} | {medians[arm]:8.3f} ({min(values):.3f}-{max(values):.3f}) | {gathers[arm]:>20} | "
              f"{args.batch * args.new / medians[arm]:.0f}")
    once, per_token = medians["zero3, gathered once"], medians["zero3, gathered per token"]
    print(f"per token / once: {per_token / once:.2f}x; once / replicated: {once / medians['dp2, replicated']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lengths", default="16,64,256,1024")
    parser.add_argument("--layout", default="dp2")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--gather", action="store_true", help="zero3: weights gathered once vs per token")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if args.gather:
        gather_main(args)
        return
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
