"""Mixture of experts on this machine: dp2 against dp2 ep2 for a MoE GPT with 8 experts (step time,
model state per rank), and tokens/s as the expert count grows at fixed active parameters.

Run: ``python benchmarks/moe.py [--rounds 5] [--steps 4]``. Two real engines (colab_par.Cluster,
gloo on CPU / nccl on GPUs). Every arm is parallelized once on the engines; then each round runs
`steps` timed training steps of every arm, the arms' order rotating from round to round, so the
machine's load (shared here) hits all of them alike. Reported: the median of the rounds' mean step
times, with the range over rounds, and ratios to the first arm from those medians.
- memory per rank: `memory_report` after a backward (params + grads) and after a step (optimizer
  state), per rank (with ep each rank holds half of the experts and their Adam state);
- the expert-count sweep keeps top_k = 2 and each expert's width, so every token runs the same
  parameters (same FLOPs) while the experts' total grows with their count: what it costs is the
  routing, the all-to-all and the grouped matmuls over more, smaller groups.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from colab_par import Cluster

SIZES = dict(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=128, ffn_hidden=256,
             top_k=2, kernels="torch")
BATCH = 8  # global
HEAD_TO_HEAD = [("dp2", 8), ("dp2 ep2", 8)]  # (layout, experts)
SWEEP = [("dp2 ep2", experts) for experts in (2, 4, 8, 16, 32)]


def run_arms(arms: list[tuple[str, int]], rounds: int, steps: int) -> list[dict]:
    """Engine side: parallelize every arm, then `rounds` rounds of `steps` steps per arm in
    rotating order; per arm the per-round mean step seconds and this rank's model state."""
    import torch
    import torch.distributed as dist

    from colab_par import memory_report, parallelize
    from colab_par.models import GPT, GPTConfig

    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, SIZES["vocab_size"], (BATCH, SIZES["seq_len"] + 1), generator=gen)
            for _ in range(steps)]
    batches = [(seq[:, :-1], seq[:, 1:]) for seq in data]
    models, results = [], []
    for layout, experts in arms:
        torch.manual_seed(0)
        pm = parallelize(GPT(GPTConfig(**SIZES, n_experts=experts)), layout)
        pm.forward_backward(*batches[0])
        grads = memory_report(pm)
        pm.optimizer_step()
        state = memory_report(pm)
        models.append(pm)
        results.append({"layout": layout, "experts": experts, "seconds": [],
                        "params": state["params"], "grads": grads["grads"], "optimizer": state["optimizer"]})
    for round_ in range(rounds):
        order = [(round_ + i) % len(arms) for i in range(len(arms))]
        for index in order:
            dist.barrier()
            start = time.perf_counter()
            for inputs, targets in batches:
                models[index].train_step(inputs, targets)
            dist.barrier()
            results[index]["seconds"].append((time.perf_counter() - start) / steps)
    return results


def _predicted(layout: str, experts: int):
    """The planner's resting model state per rank for the arm (fp32 Adam on CPU)."""
    from colab_par.models import GPTConfig
    from colab_par.planning.planner import estimate

    return estimate(GPTConfig(**SIZES, n_experts=experts), layout, device="cpu", global_batch=BATCH,
                    seq_len=SIZES["seq_len"]).resting


def _summary(seconds: list[float]) -> tuple[float, float, float]:
    return statistics.median(seconds), min(seconds), max(seconds)


def _mib(value: float) -> str:
    return f"{value / 2 ** 20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"sizes {SIZES}, global batch {BATCH}, {args.rounds} rounds x {args.steps} steps")
    with Cluster(n=2, dashboard=False) as cluster:
        head = cluster.run(run_arms, HEAD_TO_HEAD, args.rounds, args.steps)
        sweep = cluster.run(run_arms, SWEEP, args.rounds, args.steps)
    print("\n| layout (8 experts) | step ms (median) | rounds | ratio | rank | params MiB | grads MiB | "
          "Adam state MiB | planner: params / Adam MiB |\n|---|---|---|---|---|---|---|---|---|")
    base = _summary(head[0][0]["seconds"])[0]
    for arm in range(len(HEAD_TO_HEAD)):
        median, low, high = _summary(head[0][arm]["seconds"])
        for rank, results in enumerate(head):
            r = results[arm]
            timing = (f"{median * 1e3:.1f} | {low * 1e3:.1f}–{high * 1e3:.1f} | {median / base:.3f}"
                      if rank == 0 else " | | ")
            predicted = _predicted(r["layout"], r["experts"])
            print(f"| `{r['layout']}` | {timing} | {rank} | {_mib(r['params'])} | {_mib(r['grads'])} | "
                  f"{_mib(r['optimizer'])} | {_mib(predicted.params)} / {_mib(predicted.optimizer)} |")
    tokens = BATCH * SIZES["seq_len"]
    print("\n| experts (top_k 2, `dp2 ep2`) | total params/rank MiB | step ms (median) | rounds | "
          "tokens/s | vs 2 experts |\n|---|---|---|---|---|---|")
    first = tokens / _summary(sweep[0][0]["seconds"])[0]
    for arm in range(len(SWEEP)):
        median, low, high = _summary(sweep[0][arm]["seconds"])
        r = sweep[0][arm]
        print(f"| {r['experts']} | {_mib(r['params'])} | {median * 1e3:.1f} | {low * 1e3:.1f}–{high * 1e3:.1f} | "
              f"{tokens / median:,.0f} | {tokens / median / first:.3f} |")


if __name__ == "__main__":
    main()
