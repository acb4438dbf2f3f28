"""Training step time, eager vs compiled (layout option `compile`), on CPU engines.

Run: ``python benchmarks/compile.py [--layouts "dp2" "dp2 zero3" "tp2"] [--rounds 6] [--steps 6]
[--model gpt|moe]``. On a `Cluster(n=2)` (gloo), per layout: the reference GPT of
benchmarks/trainer_step.py (``--model moe``: the same GPT with 8 SwiGLU experts, 2 per token, in
every block; layouts such as "dp2 ep2") is parallelized twice from one seed, once eager and once
compiled, in the same engine processes. The compiled model's first step is timed apart (its
compile seconds from torch's own compile timers, the step's wall time, and how many graphs dynamo
made of the blocks); then both arms run one warm-up step and `--rounds` rounds of
`--steps` steps each, alternating the order (eager, compiled), (compiled, eager), ... so machine
load hits both alike. A round's figure is the slowest rank's seconds per step (barriers around
it); medians and min-max over rounds, the ratio of medians and the spread of per-round ratios
are printed. Inductor's on-disk cache is a fresh folder unless `--warm-cache`, so the compile
time is what a first session pays.

``--phases`` instead splits each arm's step into forward (to the loss), backward (with DDP's
gradient all-reduce or FSDP's reduce-scatter, which finish inside it) and the optimizer step,
medians over `--rounds` alternated steps after two warm-up steps: where eager time is left.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

from colab_par import Cluster

MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=6, d_model=384, kernels="torch")
MODELS = {"gpt": MODEL, "moe": {**MODEL, "n_experts": 8, "top_k": 2}}
BATCH = 8  # global
LR = 1e-3


def measure(layout: str, rounds: int, steps: int, model: dict) -> dict:
    """Engine side: compile time and per-round seconds per step of both arms."""
    import torch
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from colab_par import parallelize
    from colab_par.compat import compile_seconds
    from colab_par.models import GPT, GPTConfig

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model["vocab_size"], (BATCH, model["seq_len"] + 1), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def build(text: str):
        torch.manual_seed(0)
        return parallelize(GPT(GPTConfig(**model)), text,
                           optimizer_fn=lambda params: torch.optim.AdamW(params, lr=LR))

    def seconds_per_step(pm, count: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            pm.train_step(*batch)
        dist.barrier()
        return (time.perf_counter() - started) / count

    arms = {"eager": build(layout), "compiled": build(f"{layout} compile")}
    before = compile_seconds()
    first_step = seconds_per_step(arms["compiled"], 1)
    compiled_s = compile_seconds() - before
    graphs = counters["stats"]["unique_graphs"]  # dynamo's graphs: one per region between breaks
    seconds_per_step(arms["eager"], 1)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for round_ in range(rounds):
        order = ("eager", "compiled") if round_ % 2 == 0 else ("compiled", "eager")
        for arm in order:
            times[arm].append(seconds_per_step(arms[arm], steps))
    return {"compile_s": compiled_s, "first_step_s": first_step, "graphs": graphs, "times": times}


def phases(layout: str, rounds: int, model: dict) -> dict:
    """Engine side: median ms of forward, backward and optimizer step for both arms."""
    import torch
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model["vocab_size"], (BATCH, model["seq_len"] + 1), generator=gen)
    arms = {}
    for arm, text in (("eager", layout), ("compiled", f"{layout} compile")):
        torch.manual_seed(0)
        arms[arm] = parallelize(GPT(GPTConfig(**model)), text,
                                optimizer_fn=lambda params: torch.optim.AdamW(params, lr=LR))
    times = {arm: {"forward": [], "backward": [], "optimizer": []} for arm in arms}
    for round_ in range(rounds + 2):
        order = list(arms) if round_ % 2 == 0 else list(arms)[::-1]
        for arm in order:
            pm = arms[arm]
            mine = pm._dp_slice(tokens, local=False)  # this dp rank's share, as train_step takes it
            dist.barrier()
            marks = [time.perf_counter()]
            loss, _ = pm._token_loss(mine[:, :-1], mine[:, 1:])
            marks.append(time.perf_counter())
            loss.backward()
            marks.append(time.perf_counter())
            pm.optimizer_step()
            marks.append(time.perf_counter())
            if round_ >= 2:
                for phase, start, end in zip(times[arm], marks, marks[1:]):
                    times[arm][phase].append(1e3 * (end - start))
    return {arm: {phase: statistics.median(ms) for phase, ms in by_phase.items()}
            for arm, by_phase in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["dp2", "dp2 zero3", "tp2"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--phases", action="store_true",
                        help="split each arm's step into forward, backward, optimizer step")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's usual on-disk cache (compile time then reads it)")
    args = parser.parse_args()
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="colab_par_inductor_")
    print(f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; GPT {MODELS[args.model]}, global batch {BATCH}; {args.rounds} rounds x "
          f"{1 if args.phases else args.steps} steps per arm, alternated; inductor cache "
          f"{'warm' if args.warm_cache else 'cold'}")
    if args.phases:
        return print_phases(args.layouts, args.rounds, MODELS[args.model])
    print("| layout | eager ms/step | compiled ms/step | speed-up (medians) | per-round ratios | "
          "compile s | first compiled step s | graphs |")
    print("|---|---|---|---|---|---|---|---|")
    cluster = Cluster(n=2, backend="gloo", timeout=300.0, dashboard=False)
    cluster.start()
    try:
        for layout in args.layouts:
            ranks = cluster.run(measure, layout, args.rounds, args.steps, MODELS[args.model])
            # the slowest rank sets each round's pace
            eager = [max(r["times"]["eager"][i] for r in ranks) for i in range(args.rounds)]
            compiled = [max(r["times"]["compiled"][i] for r in ranks) for i in range(args.rounds)]
            ratios = [e / c for e, c in zip(eager, compiled)]
            print(f"| {layout} | {_spread(eager)} | {_spread(compiled)} | "
                  f"{statistics.median(eager) / statistics.median(compiled):.2f}× | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{max(r['compile_s'] for r in ranks):.1f} | "
                  f"{max(r['first_step_s'] for r in ranks):.1f} | {ranks[0]['graphs']} |", flush=True)
    finally:
        cluster.stop()


def print_phases(layouts: list[str], rounds: int, model: dict) -> None:
    print("| layout | arm | forward ms | backward + gradient sync ms | optimizer step ms |")
    print("|---|---|---|---|---|")
    cluster = Cluster(n=2, backend="gloo", timeout=300.0, dashboard=False)
    cluster.start()
    try:
        for layout in layouts:
            ranks = cluster.run(phases, layout, rounds, model)
            for arm in ("eager", "compiled"):
                slowest = {phase: max(r[arm][phase] for r in ranks) for phase in ranks[0][arm]}
                print(f"| {layout} | {arm} | {slowest['forward']:.1f} | {slowest['backward']:.1f} | "
                      f"{slowest['optimizer']:.1f} |", flush=True)
    finally:
        cluster.stop()


def _spread(seconds: list[float]) -> str:
    ms = [1e3 * s for s in seconds]
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})"


if __name__ == "__main__":
    main()
