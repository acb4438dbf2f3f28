"""Memory tiers on this machine: the largest GPT that trains with a disk tier, the largest under a
budget per rank, and what the feature costs a model that fits.

Every run is a fresh 2-engine cluster (gloo CPU engines, one torch thread each) training the
reference GPT (`colab_par.models.GPT`, heads of 128, vocabulary 8192, sequence 128, global batch 2)
on one fixed batch, so the loss must fall within a few steps. Each engine's resident peak is its
VmHWM (reset through /proc/self/clear_refs before parallelize and again before training, as
`scale.py` does), the process baseline included; the planner's prediction (`planner.estimate`
with the layout's tiers) is printed beside every measurement. Disk folders are removed after
each run, whatever happens.

    python benchmarks/offload.py largest --only 3072x36      # the >= 4 B run, optimizer on disk
    python benchmarks/offload.py budget --budget 8GiB         # largest under 8 GiB per rank, +/- disk
    python benchmarks/offload.py overhead                     # fits: tiers auto vs off, alternated
    python benchmarks/offload.py checkpoint                   # save / load: resident rise and seconds
    python benchmarks/offload.py largest --only 512x4 --steps 3   # a one-minute smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import cloudpickle

# the planner is loaded before a run of many minutes starts, so an edit of the tree meanwhile
# cannot break the report at its end
from colab_par.planning.devices import measure_cpu_device
from colab_par.planning.largest_model import gpt_ladder, largest_under_budget
from colab_par.planning.planner import ModelSpec, estimate
from colab_par.layout.tier_options import parse_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402  (the peak probes and the GPT family of the in-memory search)

cloudpickle.register_pickle_by_value(scale)

GiB = 2 ** 30
SEQ, GLOBAL_BATCH, VOCAB = scale.SEQ, scale.GLOBAL_BATCH, scale.VOCAB
DISK_LAYOUT = "dp2 zero3 bf16 optimizer@disk"
LR = 3e-4  # AdamW's 1e-3 overshoots a 4 B model's third step on one batch (measured 2026-11-26)


def parse_size(text: str) -> tuple[int, int]:
    width, depth = text.lower().split("x")
    return int(width), int(depth)


# ---- on the engines ------------------------------------------------------------------------------
def train_tiered(sizes: dict[str, Any], layout: str, steps: int) -> dict[str, Any]:
    """Build shard-first under `layout`, train `steps` steps on one fixed batch; peaks, step
    seconds, losses and the memory report's tier figures after the last step."""
    import gc

    import torch

    from colab_par import parallelize
    from colab_par.models.gpt import GPT, GPTConfig
    from colab_par.parallel import memory_report

    torch.set_num_threads(1)  # two engines share the two cores
    config = GPTConfig(**sizes)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, config.seq_len), generator=generator)
    batch = (inputs, torch.roll(inputs, -1, dims=1))
    result: dict[str, Any] = {"baseline": scale._reset_peak()}
    torch.manual_seed(0)
    start = time.perf_counter()
    pm = parallelize(lambda: GPT(config), layout, optimizer_fn=lambda params: torch.optim.AdamW(params, lr=LR))
    result["init_s"] = time.perf_counter() - start
    result["init_peak"] = scale._peak()
    scale._reset_peak()
    times, losses, peaks = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(pm.train_step(*batch))
        times.append(time.perf_counter() - start)
        peaks.append(scale._peak())
    report = memory_report(pm)
    result.update(step_s=times, losses=losses, step_peaks=peaks, train_peak=max(peaks),
                  tiers={k: v for k, v in report.items() if k.startswith("tier_")},
                  heap_tightened=getattr(pm.optimizer, "heap_tightened", False))
    del pm
    gc.collect()
    return result


# ---- in this process -----------------------------------------------------------------------------
def run(sizes: dict[str, Any], layout: str, steps: int) -> list[dict[str, Any]] | str:
    """One run in a fresh cluster; its disk folder (a fresh one under the layout's) removed after."""
    from colab_par import Cluster

    try:
        with Cluster(n=2, backend="gloo", timeout=1800.0, dashboard=False) as cluster:
            return cluster.run(train_tiered, sizes, layout, steps)
    except Exception as error:  # an engine killed by the kernel's OOM killer lands here too
        return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def predict(sizes: dict[str, Any], layout: str) -> Any:
    return estimate(sizes, layout, device=measure_cpu_device(2), global_batch=GLOBAL_BATCH, seq_len=SEQ)


def describe(sizes: dict[str, Any], layout: str, results: list[dict[str, Any]] | str) -> dict[str, Any]:
    """One row: measured peak (fuller rank, baseline included) and step time (median after the
    first step, slowest rank) beside the planner's."""
    row: dict[str, Any] = {"model": f"{sizes['d_model']}x{sizes['n_layer']}",
                           "params": ModelSpec.of(sizes).n_params, "layout": layout}
    plan = predict(sizes, layout)
    row.update(pred_peak=plan.memory.peak, pred_step=plan.step_time)
    if isinstance(results, str):
        row["error"] = results
        return row
    later = [max(r["step_s"][i] for r in results) for i in range(1, len(results[0]["step_s"]))] or \
        [max(r["step_s"][0] for r in results)]
    row.update(peak=max(r["train_peak"] for r in results), init_peak=max(r["init_peak"] for r in results),
               baseline=max(r["baseline"] for r in results), step=statistics.median(later),
               step_range=(min(later), max(later)), init_s=max(r["init_s"] for r in results),
               losses=results[0]["losses"], tiers=results[0]["tiers"],
               heap_tightened=any(r["heap_tightened"] for r in results), pred_heap=plan.tiers is not None
               and plan.tiers.tight_heap)
    return row


def show(row: dict[str, Any]) -> None:
    head = f"{row['model']:>9} {row['params'] / 1e9:6.2f} B  {row['layout']:<44}"
    if "error" in row:
        print(f"{head} FAILED: {row['error']}  (planner: peak {row['pred_peak'] / GiB:.2f} GiB)", flush=True)
        return
    losses = " ".join(f"{x:.3f}" for x in row["losses"])
    tiers = row["tiers"]
    print(f"{head} peak {row['peak'] / GiB:6.2f} GiB (planner {row['pred_peak'] / GiB:6.2f}, baseline "
          f"{row['baseline'] / GiB:.2f}; build {row['init_peak'] / GiB:.2f})  step {row['step']:7.2f} s "
          f"({row['step_range'][0]:.2f}-{row['step_range'][1]:.2f}; planner {row['pred_step']:.2f})  "
          f"build {row['init_s']:.0f} s  losses {losses}  disk {tiers.get('tier_disk', 0) / GiB:.2f} GiB, "
          f"moved {tiers.get('tier_moved', 0) / GiB:.2f} GiB/step  heap tightened {row['heap_tightened']} "
          f"(planner {row['pred_heap']})", flush=True)


def with_folder(layout: str, root: str) -> tuple[str, str | None]:
    """The layout with a fresh disk folder under `root` when it uses a disk tier."""
    from colab_par.layout import Layout

    parsed = Layout.parse(layout)
    if not parsed.tiers.uses_disk:
        return layout, None
    folder = tempfile.mkdtemp(prefix="offload-", dir=root)
    return str(parsed.replace(tiers=dataclasses.replace(parsed.tiers, disk=folder))), folder


def measured(sizes: dict[str, Any], layout: str, steps: int, root: str) -> dict[str, Any]:
    layout, folder = with_folder(layout, root)
    try:
        row = describe(sizes, layout, run(sizes, layout, steps))
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    show(row)
    return row


def cmd_largest(args: argparse.Namespace) -> None:
    for text in args.only:
        width, depth = parse_size(text)
        measured(scale.gpt_config(width, depth, VOCAB, SEQ), args.layout, args.steps, args.disk)


def cmd_budget(args: argparse.Namespace) -> None:
    """For each arm (in memory, with a disk tier) the planner's largest member under the budget is
    trained; a run that goes over the budget (measured) or fails steps one rung down."""
    budget = parse_bytes(args.budget)
    base = args.base_layout
    fits = largest_under_budget(base, budget, device=measure_cpu_device(2), global_batch=GLOBAL_BATCH,
                                seq_len=SEQ, disk=args.disk)
    ladder = gpt_ladder(VOCAB)
    for arm, suffix in (("memory", f" mem{args.budget}"), ("disk", f" mem{args.budget} disk")):
        fit = fits[arm]
        if fit is None:
            print(f"{arm}: the planner finds no member under {args.budget}")
            continue
        index = next(i for i, s in enumerate(ladder) if s["d_model"] == fit.sizes["d_model"])
        while index >= 0:
            sizes = {**ladder[index], "seq_len": SEQ, "kernels": "torch"}
            row = measured(sizes, base + suffix, args.steps, args.disk)
            over = "error" not in row and row["peak"] - row["baseline"] > budget
            if "error" not in row and not over:
                print(f"{arm}: largest under {args.budget}/rank: {row['model']} ({row['params'] / 1e9:.2f} B), "
                      f"peak above baseline {(row['peak'] - row['baseline']) / GiB:.2f} GiB", flush=True)
                break
            print(f"{arm}: {row['model']} {'over budget' if over else 'failed'}; one rung down", flush=True)
            index -= 1


def overhead_step(sizes: dict[str, Any], layout: str, steps: int) -> list[float]:
    """On every engine: seconds of `steps` training steps after two warm-up steps."""
    import torch

    from colab_par import parallelize
    from colab_par.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    config = GPTConfig(**sizes)
    inputs = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, config.seq_len),
                           generator=torch.Generator().manual_seed(0))
    batch = (inputs, torch.roll(inputs, -1, dims=1))
    torch.manual_seed(0)
    pm = parallelize(lambda: GPT(config), layout)
    for _ in range(2):  # the tiers measure their second step
        pm.train_step(*batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pm.train_step(*batch)
        times.append(time.perf_counter() - start)
    return times


def cmd_overhead(args: argparse.Namespace) -> None:
    """A model that fits: `--layout` plus a generous budget (auto places everything resident) vs
    `--layout` alone, arms alternated in one cluster, several rounds; median and spread."""
    from colab_par import Cluster

    width, depth = parse_size(args.size)
    sizes = scale.gpt_config(width, depth, VOCAB, SEQ)
    arms = {"off": args.layout, "auto": f"{args.layout} mem{args.budget}"}
    samples: dict[str, list[float]] = {arm: [] for arm in arms}
    with Cluster(n=2, backend="gloo", dashboard=False) as cluster:
        for round_ in range(args.rounds):
            for arm in (arms if round_ % 2 == 0 else reversed(list(arms))):
                per_rank = cluster.run(overhead_step, sizes, arms[arm], args.steps)
                samples[arm] += [max(ts) for ts in zip(*per_rank)]
    medians = {arm: statistics.median(values) for arm, values in samples.items()}
    for arm, values in samples.items():
        print(f"{arm:>5} ({arms[arm]}): {medians[arm] * 1e3:.1f} ms/step "
              f"({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}, {len(values)} steps)")
    print(f"auto / off = {medians['auto'] / medians['off']:.3f} (goal <= 1.03)")


def checkpoint_round(sizes: dict[str, Any], layout: str, folder: str) -> dict[str, Any]:
    """On every engine: one training step, then a save and a load into a fresh model: each one's
    seconds and resident rise (VmHWM over VmRSS just before, freed heap dropped first), the state
    on disk, and whether the loaded model's next loss equals the saved one's."""
    import gc

    import torch

    from colab_par import load, parallelize, save
    from colab_par.memory_tiers.host_heap import trim_host_heap
    from colab_par.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    config = GPTConfig(**sizes)
    inputs = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, config.seq_len),
                           generator=torch.Generator().manual_seed(0))
    batch = (inputs, torch.roll(inputs, -1, dims=1))

    def build() -> Any:
        gc.collect()
        trim_host_heap()
        torch.manual_seed(0)
        return parallelize(lambda: GPT(config), layout, optimizer_fn=lambda params: torch.optim.AdamW(params, lr=LR))

    def timed(work: Any, pm: Any) -> tuple[float, int]:
        gc.collect()
        trim_host_heap()
        before = scale._status("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        start = time.perf_counter()
        work(pm, folder)
        return time.perf_counter() - start, scale._status("VmHWM") - before

    saved = build()
    saved.train_step(*batch)
    placed = getattr(saved.optimizer, "placed_bytes", None)
    on_disk = sum(placed()["disk"].values()) if placed else 0
    save_s, save_rise = timed(save, saved)
    continued = saved.train_step(*batch)
    del saved
    fresh = build()
    load_s, load_rise = timed(load, fresh)
    same = fresh.train_step(*batch) == continued
    del fresh
    gc.collect()
    return {"on_disk": on_disk, "save_s": save_s, "save_rise": save_rise, "load_s": load_s,
            "load_rise": load_rise, "same": same}


def cmd_checkpoint(args: argparse.Namespace) -> None:
    """Save and load under `--layout` with its optimizer on disk and without tiers, arms
    alternated over `--rounds` in one cluster; per arm the median (min-max) over rounds of the
    slower rank's seconds and the larger rank's resident rise."""
    from colab_par import Cluster

    width, depth = parse_size(args.size)
    sizes = scale.gpt_config(width, depth, VOCAB, SEQ)
    arms = {"tiers": f"{args.layout} optimizer@disk", "plain": args.layout}
    samples: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with Cluster(n=2, backend="gloo", dashboard=False, timeout=1800.0) as cluster:
        for round_ in range(args.rounds):
            for arm in (arms if round_ % 2 == 0 else reversed(list(arms))):
                folder = tempfile.mkdtemp(prefix="colab_par_ckpt_", dir=args.disk)
                try:
                    per_rank = cluster.run(checkpoint_round, sizes, arms[arm], folder)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                assert all(rank["same"] for rank in per_rank), f"{arm}: the loaded model went on differently"
                samples[arm].append({key: max(rank[key] for rank in per_rank) for key in per_rank[0]})
    print(f"{args.size} ({ModelSpec.of(sizes).n_params / 1e6:.0f} M parameters), {args.rounds} rounds")
    for arm, rounds in samples.items():
        def spread(key: str, unit: float, fmt: str) -> str:
            values = [r[key] / unit for r in rounds]
            return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
        print(f"{arm:>6} ({arms[arm]}): on disk {rounds[0]['on_disk'] / 2 ** 20:.0f} MiB/rank; "
              f"save {spread('save_s', 1, '.2f')} s, rise {spread('save_rise', 2 ** 20, '.0f')} MiB; "
              f"load {spread('load_s', 1, '.2f')} s, rise {spread('load_rise', 2 ** 20, '.0f')} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    largest = sub.add_parser("largest", help="train the given sizes with a disk tier")
    largest.add_argument("--only", nargs="+", default=["3072x36"], help="d_model x n_layer sizes")
    largest.add_argument("--layout", default=DISK_LAYOUT)
    largest.add_argument("--steps", type=int, default=4)
    largest.add_argument("--disk", default=tempfile.gettempdir(), help="folder of the disk tier")
    largest.set_defaults(run=cmd_largest)
    budget = sub.add_parser("budget", help="largest under a budget per rank, with and without disk")
    budget.add_argument("--budget", default="8GiB")
    budget.add_argument("--base-layout", default="dp2 zero3 bf16")
    budget.add_argument("--steps", type=int, default=3)
    budget.add_argument("--disk", default=tempfile.gettempdir())
    budget.set_defaults(run=cmd_budget)
    checkpoint = sub.add_parser("checkpoint", help="save and load with the optimizer on disk vs without tiers")
    checkpoint.add_argument("--size", default="1536x12")
    checkpoint.add_argument("--layout", default="dp2 zero3")
    checkpoint.add_argument("--rounds", type=int, default=3)
    checkpoint.add_argument("--disk", default=tempfile.gettempdir())
    checkpoint.set_defaults(run=cmd_checkpoint)
    overhead = sub.add_parser("overhead", help="a model that fits: tiers auto vs off")
    overhead.add_argument("--size", default="768x8")
    overhead.add_argument("--layout", default="dp2 zero3")
    overhead.add_argument("--budget", default="16GiB")
    overhead.add_argument("--rounds", type=int, default=6)
    overhead.add_argument("--steps", type=int, default=4)
    overhead.set_defaults(run=cmd_overhead)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(scale.MMAP_THRESHOLD)  # engines inherit it (see scale.py)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f} GiB RAM", flush=True)
    args.run(args)


if __name__ == "__main__":
    main()
