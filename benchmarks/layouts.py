"""Every layout on this machine: step time, tokens/s, model-state bytes per rank vs the formula,
and communication volume per step; plus dp2 through `parallelize` vs a plain DDP loop.

Run: ``python benchmarks/layouts.py [--world 2] [--steps 8]``. Everything is measured in one run,
on real engines (colab_par.Cluster, gloo on CPU / nccl on GPUs):
- bytes: `memory_report` after a backward (params + grads) and after a step (optimizer state),
  against fp32 Adam's 16Ψ split by the layout's sharding (ZeRO-3: 16Ψ/N);
- comm: payload of every c10d collective on rank 0 during one step (the full buffer: an
  all-reduce's tensor, an all-gather's output, a reduce-scatter's input, a send's tensor), counted
  by `CollectiveBytes` (a TorchDispatchMode): DDP's buckets, FSDP's all-gather/reduce-scatter,
  DTensor redistributions, ZeRO-1's broadcasts and pipeline send/recv all pass through the c10d ops. Ring traffic per rank
  is (N-1)/N of the payload (twice that for an all-reduce);
- dp2 vs DDP: the same model, optimizer and batches in a plain `DistributedDataParallel` loop on
  the same engines, one step of each in turn (A B B A ...) so machine load hits both alike.
"""
from __future__ import annotations

import argparse
import statistics
import time

from colab_par import Cluster

SIZES = dict(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=128, kernels="torch")
BATCH = 8
LAYOUTS_2 = ["dp2", "dp2 zero1", "dp2 zero2", "dp2 zero3", "dp2 zero3 offload", "tp2", "tp2 sp",
             "cp2", "cp2 ulysses", "pp2 1f1b mb4", "dp2 ac-full"]


def _data(steps: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    shape = (BATCH, SIZES["seq_len"] + 1)
    return [(seq[:, :-1], seq[:, 1:]) for seq in
            (torch.randint(0, SIZES["vocab_size"], shape, generator=gen) for _ in range(steps))]


def measure_layout(layout: str, steps: int) -> dict:
    """Engine side: bytes, one counted step, then `steps` timed steps."""
    import torch
    import torch.distributed as dist

    from colab_par import memory_report, parallelize
    from colab_par.models import GPT, GPTConfig
    from colab_par.parallel.collective_bytes import CollectiveBytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SIZES))
    psi = sum(p.numel() for p in model.parameters())
    pm = parallelize(model, layout)
    data = _data(steps + 2)
    pm.forward_backward(*data[0])
    after_backward = memory_report(pm)
    pm.optimizer_step()
    after_step = memory_report(pm)
    counter = CollectiveBytes()
    with counter:
        pm.train_step(*data[1])
    dist.barrier()
    start = time.perf_counter()
    for x, y in data[2:]:
        pm.train_step(x, y)
    dist.barrier()
    elapsed = (time.perf_counter() - start) / steps
    state = {k: after_backward[k] + after_backward[f"host_{k}"] for k in ("params", "grads")}
    state["optimizer"] = after_step["optimizer"] + after_step["host_optimizer"]
    return {"psi": psi, "state": state, "comm": counter.bytes, "step_s": elapsed}


def compare_with_ddp(rounds: int) -> dict:
    """Engine side: the same dp2 training through parallelize and through plain DDP, one step of
    each in turn (which goes first alternates), so the machine's load hits both alike."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**SIZES)), "dp2")
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**SIZES))
    ddp = DistributedDataParallel(plain)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()

    def ddp_step(x, y):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = plain.loss_fn(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(step, batch) -> float:
        dist.barrier()
        start = time.perf_counter()
        step(*batch)
        dist.barrier()
        return time.perf_counter() - start

    data = _data(rounds)
    times: dict = {pm.train_step: [], ddp_step: []}
    for i, batch in enumerate(data):
        order = (pm.train_step, ddp_step) if i % 2 == 0 else (ddp_step, pm.train_step)
        for step in order:
            times[step].append(timed(step, batch))
    warm = rounds // 10  # the first steps build buckets and optimizer state
    return {"parallelize_s": statistics.median(times[pm.train_step][warm:]),
            "ddp_s": statistics.median(times[ddp_step][warm:])}


def formula_bytes(layout_text: str, psi: int) -> float:
    """fp32 Adam model state per rank: 4Ψ params + 4Ψ grads + 8Ψ optimizer, each / its sharding.

    FSDP2 keeps parameters sharded at rest for zero=2 as well (it only keeps the gathered copy from
    forward to backward), so zero=2 and zero=3 both hold 16Ψ/N between steps.
    """
    from colab_par import Layout

    layout = Layout.parse(layout_text)
    local = psi / (layout.tp * layout.pp)
    shard = {0: (1, 1, 1), 1: (1, 1, layout.dp), 2: (layout.dp, layout.dp, layout.dp),
             3: (layout.dp, layout.dp, layout.dp)}[layout.zero]
    return local * (4 / shard[0] + 4 / shard[1] + 8 / shard[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=100, help="alternating dp2/DDP steps")
    parser.add_argument("--ddp-only", action="store_true", help="only the dp2 vs plain DDP timing")
    args = parser.parse_args()
    tokens = BATCH * SIZES["seq_len"]
    with Cluster(n=args.world, dashboard=False) as cluster:
        print(f"GPT {SIZES}, global batch {BATCH}x{SIZES['seq_len']}, world {args.world}\n")
        print("| layout | step ms | tokens/s | state bytes/rank (max) | formula | ratio | comm MB/step (rank 0) |")
        print("|---|---|---|---|---|---|---|")
        for layout in [] if args.ddp_only else LAYOUTS_2:
            results = cluster.run(measure_layout, layout, args.steps)
            measured = max(sum(r["state"].values()) for r in results)
            formula = formula_bytes(layout, results[0]["psi"])
            step = max(r["step_s"] for r in results)
            print(f"| {layout} | {step * 1e3:.1f} | {tokens / step:,.0f} | {measured:,} | "
                  f"{formula:,.0f} | {measured / formula:.3f} | {results[0]['comm'] / 1e6:.2f} |")
        timing = cluster.run(compare_with_ddp, args.rounds)[0]
        ratio = timing["parallelize_s"] / timing["ddp_s"]
        print(f"\ndp2 step: parallelize {timing['parallelize_s'] * 1e3:.1f} ms vs plain DDP "
              f"{timing['ddp_s'] * 1e3:.1f} ms -> ratio {ratio:.3f} (goal <= 1.03; medians over "
              f"{args.rounds} alternating steps each)")


if __name__ == "__main__":
    main()
