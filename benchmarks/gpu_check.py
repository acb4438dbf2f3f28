"""Everything a lent GPU should confirm, in one command: ``python benchmarks/gpu_check.py [--quick]``.

Without a CUDA GPU it prints one line saying so and exits 0. With one (one GPU is the usual lease):
1. engine: a `Cluster(n=1, backend="nccl")` engine bound to cuda:0, one nccl all-reduce on it;
2. kernels: every compiled Triton kernel against float64 first (a mismatch fails, nothing is
   timed), then against its torch reference (`benchmarks/kernels.py`: norms' GB/s
   against the card's measured copy bandwidth, fused linear cross-entropy's peak memory against
   eager);
3. a 1.3 B GPT in bf16 on the GPU (the engine's), eager and with the layout option `compile`:
   tokens/s and MFU from the Trainer's telemetry (the card's exact datasheet peak, found by its
   product name in `colab_par.planning.devices`), the compile seconds of the first step, and the planner's
   predicted step time, tokens/s and memory beside each; then the Trainer's waits for the GPU
   (`trainer_syncs`, torch's sync debug mode): none in a step without a row, and as many in a
   logged step with 4 micro-steps as with 1;
4. memory telemetry: the Trainer's reading of the CUDA allocator's peak over a step against the
   allocator's peak over a step of the same shape taken outside the Trainer (each reader its own
   span: `memory_tiers.measure.PeakWindow`), and the kit's own accounting (model state +
   activations) beside both;
5. memory tiers on the GPU: a small GPT with its AdamW moments on the host (pinned) and on disk,
   in float32 and bf16, against the same run with everything on the GPU (learnable data): the
   losses' largest relative difference (the host step's fused AdamW against torch's CUDA AdamW),
   the allocator peak (the moments must not reach the GPU), step time, bytes the tiers moved
   against `expected_moved` (float32) and the planner's host <-> device bytes and peak;
6. memory tier checks (`tier_check_section`): dp1 (dp2 zero3 on two GPUs) with the state on the host,
   on disk, under a budget, compiled, staged (a user's foreach AdamW), gradients held on the host
   under accumulation (zero3): no
   moment on the GPU (AdamW's state nor the DTensors its state dict hands DCP; the allocator holds
   the moments' bytes less),
   a checkpoint round trip equal, the bytes moved per step as computed;
7. an NCCL timeout (`nccl_timeout_section`): a collective queued past its group's timeout on an
   engine leaves the engine alive and makes the group's next call raise; barrier() knows its GPU.
This process itself never initialises CUDA (a context there would sit on the engines' GPU): the
GPUs' names come from a child (`cuda_probe.py`), the kernels run in a spawned child, the rest on
engines; a failure if it did.
Exit status 1 if a check of 2, 3, 5, 6 or 7 fails.
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
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cuda_probe import probe  # noqa: E402  (the GPUs' names, asked in a child process)
from colab_par.training.options import Logs
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
    gpus = probe()  # in a child process: this one never initialises CUDA (the engines own the GPUs)
    if not gpus.count:
        print("gpu_check: no CUDA GPU on this machine; nothing to check (run it where a GPU is lent)")
        return 0
    card = gpus.names[0]
    sections = [f"{time.strftime('%Y-%m-%d')}, `python benchmarks/gpu_check.py{' --quick' if args.quick else ''}`"]
    kernel_table, kernel_failures = in_child(kernel_section, args.quick)  # its CUDA context ends with it
    sections.append(kernel_table)
    training_table, training_failures = training_section(QUICK if args.quick else GPT_1_3B, args.steps, card)
    sections.append(training_table)
    tiers_table, tiers_failures = tiers_section(card)
    sections.append(tiers_table)
    tier_table, tier_failures = tier_check_section(gpus=gpus.count)
    sections.append(tier_table)
    nccl_table, nccl_failures = nccl_timeout_section()
    sections.append(nccl_table)
    failures = (kernel_failures + training_failures + tiers_failures + tier_failures + nccl_failures
                + driver_failures())
    write_section(args.results, card, "\n\n".join(sections))
    print(f"wrote the section '{HEADING}{card}' into {args.results}")
    for failure in failures:
        print(f"gpu_check: FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def in_child(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a spawned process (no CUDA state inherited), its result returned: the
    CUDA context and allocator reservation of its GPU work end with it, before any engine starts."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def driver_failures() -> list[str]:
    """The driver process must hold no CUDA state: its GPU work ran in children and engines."""
    import torch

    if torch.cuda.is_initialized():
        return ["the gpu_check process itself initialised CUDA (a context on the engines' GPU)"]
    return []


# ---- kernels: benchmarks/kernels.py on this card -------------------------------------------------
def kernel_section(quick: bool) -> tuple[str, list[str]]:
    """(markdown, failures): benchmarks/kernels.py on this card, each compiled kernel checked against
    float64 before anything is timed (a mismatch is a failure and nothing is timed)."""
    spec = importlib.util.spec_from_file_location("kernels_benchmark", HERE / "kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with tempfile.TemporaryDirectory() as folder:
        failures = bench.run_cuda(Path(folder), quick)
        return ("Triton kernels against float64, then against torch eager and torch.compile "
                "(`benchmarks/kernels.py`):\n\n" + (Path(folder) / "kernels.md").read_text(), failures)


# ---- the engine, training and memory --------------------------------------------------------------
def engine_measurements(model: dict, micro_batch: int, steps: int) -> dict:
    """Engine side (rank 0 of one nccl engine): where it runs, then per arm (eager, compiled) the
    Trainer's rows and an allocator peak over one step taken outside the Trainer."""
    import torch
    import torch.distributed as dist

    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.memory_tiers.measure import PeakWindow
    from colab_par.models import GPT, GPTConfig

    ones = torch.ones(1, device="cuda")
    dist.all_reduce(ones)
    device = torch.device("cuda", torch.cuda.current_device())
    out = {"device": str(device), "backend": dist.get_backend(), "all_reduce": ones.item(), "arms": {}}
    window = PeakWindow(device)  # this check's own span of the allocator's peak (the Trainer has its own)
    data = SyntheticDataset(model["vocab_size"], model["seq_len"], micro_batch)
    for arm, layout in (("eager", "dp1 bf16"), ("compiled", "dp1 bf16 compile")):
        torch.manual_seed(0)
        with torch.device("meta"):
            gpt = GPT(GPTConfig(**model))
        pm = parallelize(gpt, layout)
        params = sum(p.numel() for p in pm.model.parameters())
        rows = Trainer(pm, data, steps=steps + 1, logs=Logs(telemetry=True)).fit()
        inputs, targets = (t.cuda() for t in data.batch(0))
        torch.cuda.synchronize()
        window.mark()
        pm.train_step(inputs, targets)
        torch.cuda.synchronize()
        out["arms"][arm] = {"params": params, "rows": rows, "allocator_peak": window.bytes()}
        del pm, gpt
        torch.cuda.empty_cache()
    return out


def training_section(model: dict, steps: int, card: str) -> tuple[str, list[str]]:
    """(markdown, failures): train on one nccl engine, eager and compiled, the table with the
    planner's figures beside; then the Trainer's waits for the GPU (`trainer_syncs`)."""
    import statistics

    from colab_par import Cluster
    from colab_par.planning.devices import device_for_product
    from colab_par.models import GPTConfig
    from colab_par.planning.planner import estimate

    cluster = Cluster(n=1, backend="nccl", dashboard=False)
    cluster.start()
    try:
        (run,) = cluster.run(engine_measurements, model, MICRO_BATCH, steps)
        (syncs,) = cluster.run(trainer_syncs, SYNC_GPT)
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
    table, failures = sync_table(syncs)
    return "\n".join(lines) + "\n\n" + table, failures


SYNC_GPT = dict(vocab_size=4096, seq_len=128, n_layer=2, n_head=4, d_model=256, kernels="torch")  # the loop's waits
SYNC_ACCUM = (1, 4)


def trainer_syncs(model: dict, steps: int = 5) -> dict[int, list[tuple[bool, int]]]:
    """Engine side: per gradient accumulation of `SYNC_ACCUM`, for each step after the first (dp1,
    telemetry on, a row every second step), whether it logged a row and how often the host waited
    for the GPU in it: torch's sync debug mode warns at every synchronising CUDA call."""
    import warnings

    import torch

    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models import GPT, GPTConfig

    out = {}
    for accum in SYNC_ACCUM:
        torch.manual_seed(0)
        pm = parallelize(lambda: GPT(GPTConfig(**model)), "dp1", optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))
        trainer = Trainer(pm, SyntheticDataset(model["vocab_size"], model["seq_len"], 4), steps=steps, grad_accum=accum, logs=Logs(every=2))
        trainer.train_step()  # the first (CUDA's lazy set-up, the allocator's first blocks): not counted
        seen = []
        for _ in range(steps - 1):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    row = trainer.train_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            seen.append((row is not None, sum("synchronizing" in str(w.message) for w in caught)))
        out[accum] = seen
        del pm, trainer
        torch.cuda.empty_cache()
    return out


def sync_table(syncs: dict[int, list[tuple[bool, int]]]) -> tuple[str, list[str]]:
    """(markdown, failures) of `trainer_syncs`: a step without a row must not wait for the GPU at
    all, and a logged step's waits must not grow with its micro-steps (one read of its losses)."""
    failures = []
    for accum, steps in syncs.items():
        if any(count for logged, count in steps if not logged):
            failures.append(f"grad_accum={accum}: a step without a row waited for the GPU: {steps}")
    logged = {accum: sorted({count for was_logged, count in steps if was_logged}) for accum, steps in syncs.items()}
    if len({tuple(counts) for counts in logged.values()}) > 1:
        failures.append(f"the waits of a logged step grow with the micro-steps: {logged}")
    rows = [f"| {accum} | " + ", ".join(f"{count}*" if was_logged else f"{count}" for was_logged, count in steps) + " |"
            for accum, steps in syncs.items()]
    table = ("The Trainer's waits for the GPU per step (torch.cuda.set_sync_debug_mode), dp1, telemetry on, a row "
             "every second step (marked *): none without a row, the same few with one whatever the micro-steps.\n\n"
             "| grad_accum | waits per step |\n|---|---|\n" + "\n".join(rows))
    return table, failures


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
    from colab_par.memory_tiers.chunks import local
    from colab_par.memory_tiers.measure import PeakWindow
    from colab_par.models import GPT, GPTConfig
    from colab_par.parallel import memory_report

    out = {}
    batches = learnable_batches(model["vocab_size"], model["seq_len"], steps, "cuda" if cuda else "cpu")
    window = PeakWindow(torch.device("cuda", torch.cuda.current_device())) if cuda else None
    for layout in layouts:
        torch.manual_seed(0)
        pm = parallelize(lambda: GPT(GPTConfig(**model)), layout,
                         optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))
        if cuda:
            torch.cuda.synchronize()
            window.mark()  # its own span: the tiers' placement marks its own meanwhile
        losses, seconds = [], []
        for batch in batches:
            start = time.perf_counter()
            losses.append(pm.train_step(*batch))
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        report = memory_report(pm)
        out[layout] = {"losses": losses, "peak": window.bytes() if cuda else None,
                       "step_s": statistics.median(seconds[1:]), "moved": report.get("tier_moved", 0),
                       "host": report.get("tier_host", 0), "disk": report.get("tier_disk", 0),
                       "elements": sum(local(p).numel() for p in pm.model.parameters() if p.requires_grad)}
        getattr(pm.optimizer, "release", lambda: None)()
        del pm
        if cuda:
            torch.cuda.empty_cache()
    return out


def tiers_section(card: str, steps: int = 8, runs: dict | None = None) -> tuple[str, list[str]]:
    """(markdown, failures): memory tiers on one nccl engine against the same run without them,
    the planner beside; a float32 tiered layout must move the bytes `expected_moved` computes.
    `runs`: `tier_measurements`' result when already taken (tests, on a CPU engine)."""
    from colab_par import Cluster
    from colab_par.planning.devices import device_for_product
    from colab_par.models import GPTConfig
    from colab_par.planning.planner import estimate

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
             "| expected MiB/step | host / disk MiB | planner host<->device MiB | planner peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    failures = []
    for layout, run in runs.items():
        tiers = " ".join(token for token in layout.split() if "@" in token)
        want = None if "bf16" in layout or not tiers else expected_moved(tiers, run["elements"], run["peak"] is not None)
        if want is not None and run["moved"] != want:
            failures.append(f"{layout}: the last step moved {run['moved']} bytes, expected {want}")
        plain = runs[" ".join(token for token in layout.split() if "@" not in token)]  # the same, untiered
        diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain["losses"]))
        plan = (estimate(GPTConfig(**TIERS_GPT), layout, device=catalogue.name, global_batch=4,
                         seq_len=TIERS_GPT["seq_len"]) if catalogue else None)
        crossing = f"{plan.tiers.host_device / 2 ** 20:.1f}" if plan and plan.tiers else "-"
        peak = "-" if run["peak"] is None else f"{run['peak'] / 2 ** 20:.0f}"
        lines.append(f"| `{layout}` | {diff:.1e} | {run['losses'][-1]:.4f} | {peak} | "
                     f"{run['step_s']:.3f} | {run['moved'] / 2 ** 20:.1f} | "
                     f"{'-' if want is None else f'{want / 2 ** 20:.1f}'} | {run['host'] / 2 ** 20:.0f} / "
                     f"{run['disk'] / 2 ** 20:.0f} | {crossing} | "
                     + (f"{plan.memory.peak / 2 ** 20:.0f} |" if plan else "- |"))
    return "\n".join(lines), failures


# ---- memory tiers: where the state lives on CUDA, checkpoints, accumulation, bytes moved -------------
CHECK_GPT = dict(vocab_size=4096, seq_len=128, n_layer=2, n_head=4, d_model=256)
LOSS_RTOL = 1e-4  # float32 AdamW on the host (fused CPU kernel) against torch's CUDA AdamW, 4 steps


def tier_check_arms(base: str, cuda: bool) -> dict[str, tuple[str, str, bool]]:
    """name -> (layout, the untiered arm it must train like, whether each step accumulates two
    half-weight backward passes). The compiled arm runs only on CUDA (inductor's C++ build on CPU
    engines costs minutes); its reference is itself (it is checked for where its state lives). The
    budget arm's budget is the plain run's peak less half its moments: auto placement must keep
    the allocator's peak under it (host-pinned stores are no part of that peak). The foreach arm
    names its AdamW implementation, so its host chunks are staged to the GPU (moments down and
    back up) instead of stepping on the host: bytes moved counted on that path too."""
    arms = {"plain": (base, "plain", False), "optimizer@host": (f"{base} optimizer@host", "plain", False),
            "optimizer@disk": (f"{base} optimizer@disk", "plain", False)}
    if "zero" in base:  # gradients leave the device only where FSDP shards them
        arms["plain accumulated"] = (base, "plain accumulated", True)
        arms["grads@host accumulated"] = (f"{base} optimizer@host grads@host", "plain accumulated", True)
    if cuda:
        arms["compile optimizer@host"] = (f"{base} compile optimizer@host", "compile optimizer@host", False)
        arms["budget"] = (f"{base} mem{{budget}}MiB", "plain", False)  # the plain peak less half the moments
        arms["optimizer@host foreach"] = (f"{base} optimizer@host", "plain", False)
    return arms


def check_base(ranks: int) -> str:
    """dp2 zero3 (FSDP: DTensor shards, gradients that can leave the GPU) where two GPUs are
    lent; on one, dp1 (the kit refuses zero over one rank): plain tensors, no gradient tiers."""
    return "dp2 zero3" if ranks >= 2 else "dp1"


def tier_checks(model: dict, steps: int, folder: str, arms: dict | None = None) -> dict:
    """Engine side (every rank): per arm the losses, the state's devices (AdamW's own state and the
    DTensors its state dict hands DCP), the allocator's bytes after training and its peak, the
    tier report, whether every chunk took the host step, and a checkpoint round trip (saved, loaded
    into a fresh model of the same layout: the same optimizer state, the same loss two steps on,
    the first step that the loaded moments shape)."""
    import os

    import torch
    import torch.distributed as dist

    from colab_par import load, parallelize, save
    from colab_par.memory_tiers.chunks import local
    from colab_par.memory_tiers.measure import PeakWindow
    from colab_par.models import GPT, GPTConfig
    from colab_par.parallel import memory_report

    cuda = torch.cuda.is_available()
    arms = arms or tier_check_arms(check_base(dist.get_world_size()), cuda)
    window = PeakWindow(torch.device("cuda", torch.cuda.current_device())) if cuda else None
    batches = learnable_batches(model["vocab_size"], model["seq_len"], steps + 2, "cuda" if cuda else "cpu")

    def build(layout: str, foreach: bool | None = None) -> object:
        torch.manual_seed(0)
        return parallelize(lambda: GPT(GPTConfig(**model)), layout,
                           optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=foreach))

    def state_of(pm: object) -> dict:
        return {(index, kind): local(value).detach().cpu() for index, values in pm.optimizer.state_dict()["state"].items()
                for kind, value in values.items() if torch.is_tensor(value)}

    out = {}
    for name, (layout, _, accumulate) in arms.items():
        if "{budget}" in layout:
            budget = (out["plain"]["peak"] - 4 * out["plain"]["elements"]) // 2 ** 20
            layout = layout.format(budget=budget)
        foreach = True if "foreach" in name else None  # the user's choice: the staged path
        pm = build(layout, foreach)
        if cuda:
            torch.cuda.synchronize()
            window.mark()  # its own span: the tiers' placement marks its own meanwhile
        losses = []
        for batch in batches[:steps]:
            if accumulate:
                losses.append(pm.forward_backward(*batch, loss_scale=0.5))
                pm.forward_backward(*batch, loss_scale=0.5)
                pm.optimizer_step()
            else:
                losses.append(pm.train_step(*batch))
        if cuda:
            torch.cuda.synchronize()
        optimizer, params = pm.optimizer, [p for p in pm.model.parameters() if p.requires_grad]
        moments = [value for p in params for kind, value in optimizer.state.get(p, {}).items() if kind != "step"]
        handed = [local(value) for values in optimizer.state_dict()["state"].values()
                  for kind, value in values.items() if kind != "step"]
        stores = [store for chunk in getattr(optimizer, "_stores", []) for store in chunk.values()]
        report = memory_report(pm)
        run = {"layout": layout, "losses": losses, "elements": sum(local(p).numel() for p in params),
               "moments_on_gpu": sum(t.device.type == "cuda" for t in moments + handed),
               "allocated": torch.cuda.memory_allocated() if cuda else None,
               "peak": window.bytes() if cuda else None,
               "moved": report.get("tier_moved", 0), "host": report.get("tier_host", 0),
               "disk": report.get("tier_disk", 0),
               "host_step": bool(stores) and all(optimizer._host_step(optimizer.param_groups[chunk.group],
                                                                      optimizer._stores[chunk.index])
                                                 for chunk in optimizer._chunks)}
        saved_to = os.path.join(folder, name.replace(" ", "_").replace("@", "_"))
        save(pm, saved_to)
        again = build(layout, foreach)
        load(again, saved_to)
        mine, theirs = state_of(pm), state_of(again)
        run["round_trip_state"] = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        run["round_trip_loss"] = tuple([each.train_step(*batch) for batch in batches[steps:]][-1]
                                       for each in (pm, again))
        for each in (pm, again):
            getattr(each.optimizer, "release", lambda: None)()
        del pm, again, optimizer, moments, handed, stores
        if cuda:
            torch.cuda.empty_cache()
        out[name] = run
    return out


def expected_moved(name: str, elements: int, cuda: bool) -> int | None:
    """Bytes a step moves between tiers for float32 zero3 (4 bytes per local element): moments on
    disk are read and written (16); on CUDA the host step brings gradients and parameters down
    and sends parameters up (12), and held gradients came down in backward and, accumulated,
    came down once more (8 in all, parameters 8); staged to the GPU (foreach), the moments come
    down and go back up (16)."""
    crossing = {"optimizer@host": 12, "optimizer@disk": 12, "grads@host accumulated": 16,
                "optimizer@host foreach": 16}
    disk = {"optimizer@disk": 16}
    if name not in crossing:
        return None
    return elements * (disk.get(name, 0) + (crossing[name] if cuda else 0))


def _same_round_trip(run: dict) -> bool:
    """The loaded state equals the saved one, and the loss two steps on agrees (to 1e-6: the two
    models' reductions may order differently; a lost moment changes it by far more at lr 1e-3)."""
    continued, loaded = run["round_trip_loss"]
    return run["round_trip_state"] and abs(continued - loaded) <= 1e-6 * abs(continued)


def tier_check_failures(runs: dict, arms: dict, cuda: bool) -> list[str]:
    """What `tier_checks`' results say is wrong (empty when every check holds)."""
    failures = []
    for name, run in runs.items():
        layout, reference = run["layout"], arms[name][1]
        plain = runs[reference]["losses"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain))
        if diff > LOSS_RTOL:
            failures.append(f"{layout}: losses differ from {runs[reference]['layout']} by {diff:.1e} (> {LOSS_RTOL})")
        if not _same_round_trip(run):
            failures.append(f"{layout}: the checkpoint round trip changed the optimizer state or the loss "
                            f"{run['round_trip_loss']}")
        if name == "budget":
            budget = int(layout.rsplit("mem", 1)[1].removesuffix("MiB")) * 2 ** 20
            if run["peak"] > budget or not run["host"]:
                failures.append(f"{layout}: the allocator peaked at {run['peak'] / 2 ** 20:.0f} MiB with "
                                f"{run['host'] / 2 ** 20:.1f} MiB of state on the host")
            continue
        if "@" not in layout:
            continue
        if cuda and run["moments_on_gpu"]:
            failures.append(f"{layout}: {run['moments_on_gpu']} moment tensors (state or state dict) on the GPU")
        if cuda and "accumulated" not in name:
            moments = 8 * run["elements"]
            freed = runs["plain"]["allocated"] - run["allocated"]
            if freed < 0.95 * moments:
                failures.append(f"{layout}: the allocator holds {freed / 2 ** 20:.1f} MiB less than without tiers, "
                                f"the moments are {moments / 2 ** 20:.1f} MiB")
        if cuda and not run["host_step"] and "foreach" not in name:
            failures.append(f"{layout}: a chunk off the device was staged to the GPU instead of the host step")
        want = expected_moved(name, run["elements"], cuda)
        if want is not None and run["moved"] != want:
            failures.append(f"{layout}: the last step moved {run['moved']} bytes, expected {want}")
    return failures


def tier_check_section(steps: int = 4, runs: dict | None = None, arms: dict | None = None,
                       cuda: bool = True, gpus: int = 1) -> tuple[str, list[str]]:
    """(markdown, failures): memory tiers on this machine's `gpus` GPUs (`check_base`): state on
    the host and on disk, under a budget, compiled, staged, and (dp2 zero3) gradients held on the
    host under accumulation. `runs`/`arms`: `tier_checks`' result when already taken (tests)."""
    if runs is None:
        from colab_par import Cluster

        cluster = Cluster(n=min(2, gpus), backend="nccl", dashboard=False)
        cluster.start()
        try:
            with tempfile.TemporaryDirectory() as folder:
                runs = cluster.run(tier_checks, CHECK_GPT, steps, folder)[0]
        finally:
            cluster.stop()
    arms = arms or tier_check_arms(runs["plain"]["layout"], cuda)
    failures = tier_check_failures(runs, arms, cuda)
    lines = [f"Memory tier checks: GPT {CHECK_GPT}, {steps} steps; AdamW state must stay off the GPU (state "
             "and state dict), a save/load round trip must give the same state and loss two steps on, bytes moved "
             "per step as computed.", "",
             "| arm | layout | max rel loss diff | moments on GPU | allocator MiB after / peak | moved MiB/step "
             "| expected MiB/step | host / disk MiB | round trip |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        plain = runs[arms[name][1]]["losses"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain))
        memory = "-" if run["allocated"] is None else f"{run['allocated'] / 2 ** 20:.0f} / {run['peak'] / 2 ** 20:.0f}"
        same, want = _same_round_trip(run), expected_moved(name, run["elements"], cuda)
        lines.append(f"| {name} | `{run['layout']}` | {diff:.1e} | {run['moments_on_gpu']} | {memory} | "
                     f"{run['moved'] / 2 ** 20:.2f} | {'-' if want is None else f'{want / 2 ** 20:.2f}'} | "
                     f"{run['host'] / 2 ** 20:.1f} / {run['disk'] / 2 ** 20:.1f} | "
                     f"{'equal' if same else 'DIFFERS'} |")
    lines += ["", "Failures: " + ("none" if not failures else "; ".join(failures))]
    return "\n".join(lines), failures


# ---- RESULTS.md --------------------------------------------------------------------------------------
# ---- an NCCL timeout: the engine lives on --------------------------------------------------------
def nccl_timeout_check(timeout_s: float = 2.0) -> dict:
    """Engine side (one nccl engine): whether the world was bound to its GPU (`init_process_group`'s
    device_id: `barrier()` then does not warn about guessing one); then a collective that cannot
    finish within its group's timeout (queued behind seconds of matmuls), the watchdog's handling
    (`engine.NCCL_ENVIRONMENT`: abort the communicators, keep the process), and whether the next
    collective on that group raises."""
    import os
    import time
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    guessed = [str(w.message)[:120] for w in caught if "device" in str(w.message).lower()]
    group = dist.new_group([0], timeout=timedelta(seconds=timeout_s))
    value = torch.ones(1, device="cuda")
    dist.all_reduce(value, group=group)
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    per_matmul = (time.perf_counter() - start) / 10
    for _ in range(int(4 * timeout_s / per_matmul)):  # ~4 timeouts of work ahead of the collective
        a @ a
    dist.all_reduce(value, group=group)
    time.sleep(6 * timeout_s)  # the watchdog sees the timeout and aborts the group's communicator
    torch.cuda.synchronize()
    try:
        dist.all_reduce(value, group=group)
        torch.cuda.synchronize()
        raised = None
    except Exception as error:  # noqa: BLE001 - what the user's next call on the group sees
        raised = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return {"pid": os.getpid(), "guessed_device": guessed, "raised": raised,
            "handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}


def nccl_timeout_section() -> tuple[str, list[str]]:
    """The table of `nccl_timeout_check` and what failed: the engine must answer afterwards (same
    process), the timed-out group's next collective must raise, barrier() must know its GPU."""
    import os

    from colab_par import Cluster

    cluster = Cluster(n=1, backend="nccl", dashboard=False)
    cluster.start()
    try:
        (run,) = cluster.run(nccl_timeout_check)
        alive = cluster.run(os.getpid)[0] == run["pid"]
    finally:
        cluster.stop()
    checks = {"the engine process survives the timeout": alive,
              "the timed-out group's next collective raises": run["raised"] is not None,
              "barrier() uses the bound GPU (device_id)": not run["guessed_device"]}
    rows = [f"| {name} | {'ok' if ok else 'FAILED'} |" for name, ok in checks.items()]
    table = ("An NCCL collective past its group's timeout on an engine (TORCH_NCCL_ASYNC_ERROR_HANDLING="
             f"{run['handling']}); the next call raised: {run['raised']}\n\n| check | result |\n|---|---|\n"
             + "\n".join(rows))
    return table, [name for name, ok in checks.items() if not ok]


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
