"""Everything a lent GPU should confirm, in one command: ``python benchmarks/gpu_check.py [--quick]``.

Without a CUDA GPU it prints one line saying so and exits 0. With one (one GPU is the usual lease):
1. engine: a `Cluster(n=1, backend="nccl")` engine bound to cuda:0, one nccl all-reduce on it;
2. kernels: every Triton kernel against its torch reference (`benchmarks/kernels.py`: norms' GB/s
   against the card's measured copy bandwidth, fused linear cross-entropy's peak memory against
   eager);
3. a 1.3 B GPT in bf16 on the GPU (the engine's), eager and with the layout option `compile`:
   tokens/s and MFU from the Trainer's telemetry (the card's exact datasheet peak, found by its
   product name in `colab_par.devices`), the compile seconds of the first step, and the planner's
   predicted step time, tokens/s and memory beside each;
4. memory telemetry: the Trainer's reading of the CUDA allocator's peak over a step against
   `torch.cuda.max_memory_allocated` over a step of the same shape taken outside the Trainer, and
   the kit's own accounting (model state + activations) beside both;
5. memory tiers on the GPU: a small GPT with its AdamW moments on the host (pinned) and on disk,
   in float32 and bf16, against the same run with everything on the GPU (learnable data): the
   losses' largest relative difference (the host step's fused AdamW against torch's CUDA AdamW),
   the allocator peak (the moments must not reach the GPU), step time, bytes the tiers moved and
   the planner's host <-> device bytes and peak.
It writes its tables into benchmarks/RESULTS.md under a heading with the date and the card's name
(a later run on the same card replaces that section).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
GiB = 2 ** 30
# GPT-3 XL's shape (2048 wide, 24 layers, 16 heads) with the kit's SwiGLU block: 1.4 B parameters.
GPT_1_3B = dict(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, d_model=2048)
QUICK = dict(GPT_1_3B, n_layer=4, seq_len=1024)
MICRO_BATCH = 4
HEADING = "## GPU check on "


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, sequences of 1024, small kernel shapes")
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per arm")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check (run it where a GPU is lent)")
        return 0
    card = torch.cuda.get_device_name(0)
    sections = [f"{time.strftime('%Y-%m-%d')}, `python benchmarks/gpu_check.py{' --quick' if args.quick else ''}`"]
    sections.append(kernel_section(args.quick))
    sections.append(training_section(QUICK if args.quick else GPT_1_3B, args.steps, card))
    sections.append(tiers_section(card))
    write_section(args.results, card, "\n\n".join(sections))
    print(f"wrote the section '{HEADING}{card}' into {args.results}")
    return 0


# ---- kernels: benchmarks/kernels.py on this card -------------------------------------------------
def kernel_section(quick: bool) -> str:
    """Run benchmarks/kernels.py's CUDA comparison and return its markdown tables."""
    spec = importlib.util.spec_from_file_location("kernels_benchmark", HERE / "kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with tempfile.TemporaryDirectory() as folder:
        bench.run_cuda(Path(folder), quick)
        return "Triton kernels against torch eager and torch.compile (`benchmarks/kernels.py`):\n\n" + \
            (Path(folder) / "kernels.md").read_text()


# ---- the engine, training and memory --------------------------------------------------------------
def engine_measurements(model: dict, micro_batch: int, steps: int) -> dict:
    """Engine side (rank 0 of one nccl engine): where it runs, then per arm (eager, compiled) the
    Trainer's rows and an allocator peak over one step taken outside the Trainer."""
    import torch
    import torch.distributed as dist

    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models import GPT, GPTConfig

    probe = torch.ones(1, device="cuda")
    dist.all_reduce(probe)
    out = {"device": str(torch.device("cuda", torch.cuda.current_device())), "backend": dist.get_backend(),
           "all_reduce": probe.item(), "arms": {}}
    data = SyntheticDataset(model["vocab_size"], model["seq_len"], micro_batch)
    for arm, layout in (("eager", "dp1 bf16"), ("compiled", "dp1 bf16 compile")):
        torch.manual_seed(0)
        with torch.device("meta"):
            gpt = GPT(GPTConfig(**model))
        pm = parallelize(gpt, layout)
        params = sum(p.numel() for p in pm.model.parameters())
        rows = Trainer(pm, data, steps=steps + 1, telemetry=True).fit()
        inputs, targets = (t.cuda() for t in data.batch(0))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        pm.train_step(inputs, targets)
        torch.cuda.synchronize()
        out["arms"][arm] = {"params": params, "rows": rows, "allocator_peak": torch.cuda.max_memory_allocated()}
        del pm, gpt
        torch.cuda.empty_cache()
    return out


def training_section(model: dict, steps: int, card: str) -> str:
    """Train on one nccl engine, eager and compiled; the table with the planner's figures beside."""
    import statistics

    from colab_par import Cluster
    from colab_par.devices import device_for_product
    from colab_par.models import GPTConfig
    from colab_par.planner import estimate

    cluster = Cluster(n=1, backend="nccl", dashboard=False)
    cluster.start()
    try:
        (run,) = cluster.run(engine_measurements, model, MICRO_BATCH, steps)
    finally:
        cluster.stop()
    catalogue = device_for_product(card)
    lines = [f"Engine: {run['device']}, backend {run['backend']}, all-reduce gave {run['all_reduce']:.0f}. "
             f"GPT {model} ({run['arms']['eager']['params'] / 1e9:.2f} B parameters), micro batch "
             f"{MICRO_BATCH}, {steps} timed steps after the first; medians over them. "
             f"Planner device: {catalogue.name if catalogue else 'not in the catalogue (no prediction, no MFU)'}.",
             "", "| arm | tokens/s | MFU | step s | compile s (first step) | planner step s | planner tokens/s "
             "| planner MFU | allocator peak GiB (telemetry / torch, one step) | kit accounting GiB | planner peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, result in run["arms"].items():
        rows, timed = result["rows"], result["rows"][1:]
        layout = "dp1 bf16 compile" if arm == "compiled" else "dp1 bf16"
        plan = (estimate(GPTConfig(**model), layout, device=catalogue.name, global_batch=MICRO_BATCH,
                         seq_len=model["seq_len"]) if catalogue else None)

        def median(key: str) -> float:
            values = [row.get(key) for row in timed]
            return statistics.median(values) if None not in values else float("nan")

        lines.append(
            f"| {arm} | {median('tokens_per_s'):,.0f} | {100 * median('mfu'):.1f} % | {median('step_time'):.3f} | "
            f"{rows[0].get('compile_s', 0.0):.1f} | "
            + (f"{plan.step_time:.3f} | {plan.tokens_per_s:,.0f} | {100 * plan.mfu:.1f} % | " if plan else "- | - | - | ")
            + f"{timed[-1]['mem_cuda_peak'] / GiB:.2f} / {result['allocator_peak'] / GiB:.2f} | "
            f"{timed[-1]['mem_total'] / GiB:.2f} | " + (f"{plan.memory.peak / GiB:.2f} |" if plan else "- |"))
    return "\n".join(lines)


# ---- memory tiers: ZeRO-Offload's host step on CUDA ------------------------------------------------
TIERS_GPT = dict(vocab_size=8192, seq_len=256, n_layer=4, n_head=8, d_model=512)
TIER_LAYOUTS = ("dp1", "dp1 optimizer@host", "dp1 optimizer@disk", "dp1 bf16", "dp1 bf16 optimizer@host")


def learnable_batches(vocab: int, seq_len: int, steps: int, device: str, batch: int = 4) -> list:
    """(inputs, targets) with a next-token rule plus 20 % noise: the loss falls, so a wrong update shows."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        seq = (torch.randint(0, vocab, (batch, 1), generator=gen) + 3 * torch.arange(seq_len + 1)) % vocab
        noise = torch.rand(seq.shape, generator=gen) < 0.2
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=gen), seq)
        out.append((seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)))
    return out


def tier_measurements(model: dict, steps: int, layouts: tuple[str, ...] = TIER_LAYOUTS) -> dict:
    """Engine side: per layout the losses, the CUDA allocator's peak over training (None on a CPU
    engine, where tests run this), the median step seconds and the tier report of the last step."""
    import statistics

    import torch

    cuda = torch.cuda.is_available()

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig
    from colab_par.parallel import memory_report

    out = {}
    batches = learnable_batches(model["vocab_size"], model["seq_len"], steps, "cuda" if cuda else "cpu")
    for layout in layouts:
        torch.manual_seed(0)
        pm = parallelize(lambda: GPT(GPTConfig(**model)), layout,
                         optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses, seconds = [], []
        for batch in batches:
            start = time.perf_counter()
            losses.append(pm.train_step(*batch))
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        report = memory_report(pm)
        out[layout] = {"losses": losses, "peak": torch.cuda.max_memory_allocated() if cuda else None,
                       "step_s": statistics.median(seconds[1:]), "moved": report.get("tier_moved", 0),
                       "host": report.get("tier_host", 0), "disk": report.get("tier_disk", 0)}
        getattr(pm.optimizer, "release", lambda: None)()
        del pm
        if cuda:
            torch.cuda.empty_cache()
    return out


def tiers_section(card: str, steps: int = 8, runs: dict | None = None) -> str:
    """Memory tiers on one nccl engine against the same run without them; the planner beside.
    `runs`: `tier_measurements`' result when already taken (tests, on a CPU engine)."""
    from colab_par import Cluster
    from colab_par.devices import device_for_product
    from colab_par.models import GPTConfig
    from colab_par.planner import estimate

    if runs is None:
        cluster = Cluster(n=1, backend="nccl", dashboard=False)
        cluster.start()
        try:
            (runs,) = cluster.run(tier_measurements, TIERS_GPT, steps)
        finally:
            cluster.stop()
    catalogue = device_for_product(card)
    lines = [f"Memory tiers on the GPU: GPT {TIERS_GPT}, micro batch 4, {steps} steps of learnable data, "
             "AdamW lr 1e-3; moments on the host or disk are stepped there (fused host AdamW), the GPU "
             "keeps parameters and gradients. Loss difference: largest relative, against the same "
             "precision without tiers.", "",
             "| layout | max rel loss diff | last loss | allocator peak MiB | step s | tiers moved MiB/step "
             "| host / disk MiB | planner host<->device MiB | planner peak MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for layout, run in runs.items():
        plain = runs[" ".join(token for token in layout.split() if "@" not in token)]  # the same, untiered
        diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain["losses"]))
        plan = (estimate(GPTConfig(**TIERS_GPT), layout, device=catalogue.name, global_batch=4,
                         seq_len=TIERS_GPT["seq_len"]) if catalogue else None)
        crossing = f"{plan.tiers.host_device / 2 ** 20:.1f}" if plan and plan.tiers else "-"
        peak = "-" if run["peak"] is None else f"{run['peak'] / 2 ** 20:.0f}"
        lines.append(f"| `{layout}` | {diff:.1e} | {run['losses'][-1]:.4f} | {peak} | "
                     f"{run['step_s']:.3f} | {run['moved'] / 2 ** 20:.1f} | {run['host'] / 2 ** 20:.0f} / "
                     f"{run['disk'] / 2 ** 20:.0f} | {crossing} | "
                     + (f"{plan.memory.peak / 2 ** 20:.0f} |" if plan else "- |"))
    return "\n".join(lines)


# ---- RESULTS.md --------------------------------------------------------------------------------------
def write_section(path: Path, card: str, body: str) -> None:
    """Put `body` under the heading of `card` in `path`: replacing that card's earlier section, else
    as the first section (after the file's title)."""
    heading = f"{HEADING}{card} — `benchmarks/gpu_check.py`"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines()
    section = [heading, "", body.strip(), ""]
    start = next((i for i, line in enumerate(lines) if line == heading), None)
    if start is None:
        first = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
        lines[first:first] = section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = section
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
