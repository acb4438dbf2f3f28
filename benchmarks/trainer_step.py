"""The kit's whole training step as a user runs it, against a plain torchrun DDP script.

Kit arm: a `%%colossal` cell on a running `Cluster(n=2)` (the dashboard on, as `%colossal start`
makes it; an IPython shell in this process records the frames the client draws) that builds the
GPT, `parallelize(model, "dp2")` and runs `Trainer.fit()` with its telemetry (memory, activations,
grad norm, MFU, datapub publishing) and its data path (`SyntheticDataset.batch` per step).
DDP arm: this file run by `torchrun --nproc-per-node 2` (`--ddp-worker`): the same GPT wrapped in
`DistributedDataParallel`, the same AdamW, the same batches (the same dataset object's `batch`
per step), forward / cross-entropy / backward / step / zero_grad and nothing else.

Both arms run `--warmup` untimed steps and then time `--steps` steps on each rank from the end of
the warm-up to the end of the loop (the kit's includes its publishing between steps); a round's
figure is the slowest rank's seconds per step. Rounds alternate the order (kit, ddp), (ddp, kit),
... so other load on the machine hits both arms alike; medians and min-max over rounds are printed
with the ratio of medians. The engines of the kit's cluster stay up (idle) while torchrun runs,
as in a notebook session; start-up is not part of either figure (see startup.py).

    python benchmarks/trainer_step.py [--rounds 4] [--steps 20] [--warmup 3] [--d-model 384]

`--own-work` measures the Trainer's own work directly instead of against torchrun, so the figure
does not drown in this machine's wall-clock noise: on each engine of a `Cluster(n=2)` (dashboard
on), CPU time of `Trainer.fit()` over the timed steps, minus the CPU time spent inside the model's
work (`ParallelModel.forward_backward_tensor` and `optimizer_step`, timed by wrapping them on the
engine, process CPU clock: gloo's threads work for them), plus the activation meter's hooks, which run
inside forward and backward but are telemetry. What is left is the Trainer's: data, LR, grad
norm, memory and throughput rows, step clock, publishing. Its parts are timed the same way
(thread CPU clock). Each round builds a fresh model; the share is reported per rank and round
(median, min-max). Goal (issue 23): own work <= 3 % of the step's CPU.

    python benchmarks/trainer_step.py --own-work [--rounds 6] [--steps 30] [--warmup 3] [--d-model 384]
                                      [--layout dp2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=6, d_model=384, kernels="torch")
BATCH = 8  # global: 4 sequences per rank on dp2
LR = 1e-3
PHASES = ("time_data", "time_forward_backward", "time_clip", "time_optimizer", "time_telemetry")

KIT_CELL = """
import json, time, torch
from colab_par import Trainer, parallelize
from colab_par.data import SyntheticDataset
from colab_par.models import GPT, GPTConfig
torch.manual_seed(0)
_pm = parallelize(GPT(GPTConfig(**{model!r})), "dp2",
                  optimizer_fn=lambda params: torch.optim.AdamW(params, lr={lr!r}))
_trainer = Trainer(_pm, SyntheticDataset({vocab}, {seq}, {batch}), steps={warmup} + {steps})
_trainer.fit(stop_at={warmup})
_started = time.perf_counter()
_trainer.fit()
_seconds = time.perf_counter() - _started
_rows = _trainer.history[{warmup}:]
with open(f"{out}/kit-{{rank}}.json", "w") as _f:
    json.dump({{"per_step": _seconds / {steps}, "step_time": sum(r["step_time"] for r in _rows) / len(_rows),
               **{{k: sum(r.get(k, 0.0) for r in _rows) / len(_rows) for k in {phases!r}}}}}, _f)
"""


def ddp_worker(steps: int, warmup: int, out: str) -> None:
    """One torchrun rank: the plain DDP loop, timed like the kit's."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from colab_par.data import SyntheticDataset
    from colab_par.models import GPT, GPTConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(**MODEL)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = SyntheticDataset(MODEL["vocab_size"], MODEL["seq_len"], BATCH)
    phases = {"time_data": 0.0, "time_forward_backward": 0.0, "time_optimizer": 0.0}

    def step(index: int) -> None:
        t0 = time.perf_counter()
        inputs, targets = data.batch(index, rank, world)
        t1 = time.perf_counter()
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if index >= warmup:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name] += seconds

    for index in range(warmup):
        step(index)
    started = time.perf_counter()
    for index in range(warmup, warmup + steps):
        step(index)
    seconds = time.perf_counter() - started
    with open(f"{out}/ddp-{rank}.json", "w") as handle:
        json.dump({"per_step": seconds / steps, "step_time": sum(phases.values()) / steps,
                   **{k: v / steps for k, v in phases.items()}}, handle)
    dist.destroy_process_group()


def own_work_on_engine(model: dict, batch: int, steps: int, warmup: int,
                       layout: str = "dp2", rounds: int = 1) -> list[dict[str, float]]:
    """On an engine: for each of `rounds` runs of `steps` steps of one `Trainer.fit()`, CPU seconds
    per step ("step"), of the model's work in it ("model") and of the Trainer's own work ("own",
    and its parts). The engine's other threads (heartbeat, messaging) add to "other" now and then:
    rounds let the caller take a median."""
    import torch

    from colab_par import Trainer, parallelize
    from colab_par.parallel import activations
    from colab_par.training import telemetry
    from colab_par.data import SyntheticDataset
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**model)), layout,
                     optimizer_fn=lambda params: torch.optim.AdamW(params, lr=LR))
    trainer = Trainer(pm, SyntheticDataset(model["vocab_size"], model["seq_len"], batch),
                      steps=warmup + rounds * steps)
    trainer.fit(stop_at=warmup)
    spent = dict.fromkeys(("model", "hooks", "data", "grad norm", "grad bytes", "row", "publish"), 0.0)

    def timed(function, part: str, clock=time.thread_time):
        def call(*args, **kwargs):
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent[part] += clock() - started
        return call

    # the model's work runs on gloo's threads too: the process clock; the Trainer's parts run
    # in this thread: its clock, which costs a tenth of the process clock in a many-threaded engine
    pm.forward_backward_tensor = timed(pm.forward_backward_tensor, "model", time.process_time)
    pm.optimizer_step = timed(pm.optimizer_step, "model", time.process_time)
    pm.clip_grad_norm_tensor = timed(pm.clip_grad_norm_tensor, "grad norm")  # no grad_clip: telemetry's norm
    trainer._measures.activations._pack = timed(trainer._measures.activations._pack, "hooks")  # forward
    unpack = activations._identity  # backward: the meter's other hook
    activations._identity = timed(unpack, "hooks")
    trainer._next_batch = timed(trainer._next_batch, "data")
    trainer._measures.add_to = timed(trainer._measures.add_to, "row")
    grad_bytes, publish = telemetry.grad_bytes, telemetry.Publisher.publish
    telemetry.grad_bytes = timed(grad_bytes, "grad bytes")
    telemetry.Publisher.publish = timed(publish, "publish")
    samples = []
    try:
        for done in range(1, rounds + 1):
            spent.update(dict.fromkeys(spent, 0.0))
            started = time.process_time()
            trainer.fit(stop_at=warmup + done * steps)
            total = time.process_time() - started
            parts = dict(spent)
            model_work = parts.pop("model") - parts["hooks"]
            figures = {"step": total, "model": model_work, "own": total - model_work, **parts}
            figures["other"] = figures["own"] - sum(parts.values())
            samples.append({name: seconds / steps for name, seconds in figures.items()})
    finally:
        telemetry.grad_bytes, telemetry.Publisher.publish = grad_bytes, publish
        activations._identity = unpack
    return samples


def own_work(args: argparse.Namespace) -> None:
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    from colab_par import Cluster

    InteractiveShell.instance().display_pub = CapturingDisplayPublisher()  # the dashboard draws
    samples: list[dict[str, float]] = []
    with Cluster(n=2, backend="gloo") as cluster:
        for _ in range(args.rounds):
            samples += [round_ for rank in cluster.run(own_work_on_engine, MODEL, BATCH, args.steps,
                                                       args.warmup, args.layout) for round_ in rank]
    shares = [s["own"] / s["step"] for s in samples]
    print(f"GPT {MODEL}, global batch {BATCH}, AdamW, {args.layout} on 2 gloo engines, telemetry "
          f"on, dashboard on, {args.steps} timed steps after {args.warmup}, {args.rounds} rounds x 2 ranks, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"Trainer's own work: median {100 * statistics.median(shares):.2f} % of the step's CPU "
          f"(min-max {100 * min(shares):.2f}-{100 * max(shares):.2f} %; goal <= 3 %)")
    print("CPU per step (ms): median (min-max) over ranks and rounds")
    for name in samples[0]:
        values = [1e3 * s[name] for s in samples]
        print(f"  {name:<11} {statistics.median(values):9.3f} ({min(values):.3f}-{max(values):.3f})")


def run_ddp(steps: int, warmup: int, out: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", "29513", __file__, "--ddp-worker", "--steps", str(steps),
               "--warmup", str(warmup), "--out", out, "--d-model", str(MODEL["d_model"]),
               "--n-layer", str(MODEL["n_layer"])]
    subprocess.run(command, check=True, capture_output=True)
    return [json.loads(Path(out, f"ddp-{rank}.json").read_text()) for rank in range(2)]


def run_kit(shell, steps: int, warmup: int, out: str) -> list[dict]:
    """One %%colossal cell; each rank's figures plus this process's CPU (polling, drawing)."""
    cell = KIT_CELL.format(model=MODEL, lr=LR, vocab=MODEL["vocab_size"], seq=MODEL["seq_len"],
                           batch=BATCH, warmup=warmup, steps=steps, out=out, phases=PHASES)
    cpu = time.process_time()
    shell.run_cell_magic("colossal", "", cell)
    client = (time.process_time() - cpu) / (warmup + steps)
    return [{**json.loads(Path(out, f"kit-{rank}.json").read_text()), "client_cpu": client}
            for rank in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=MODEL["d_model"])
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"])
    parser.add_argument("--arms", default="kit,ddp",
                        help="comma-separated arms; 'kit-nodash' is the kit with the client's "
                             "dashboard off (engines still measure and publish): a diagnosis")
    parser.add_argument("--layout", default="dp2", help="the --own-work run's layout")
    parser.add_argument("--own-work", action="store_true",
                        help="measure the Trainer's own CPU work per step on the engines instead")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    MODEL.update(d_model=args.d_model, n_layer=args.n_layer)
    if args.ddp_worker:
        ddp_worker(args.steps, args.warmup, args.out)
        return
    if args.own_work:
        own_work(args)
        return

    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    from colab_par import Cluster
    from colab_par.notebook import magics

    shell = InteractiveShell.instance()  # a notebook-like shell: the dashboard draws frames
    shell.display_pub = CapturingDisplayPublisher()  # the dashboard draws its frames as in a notebook
    shell.run_line_magic("load_ext", "colab_par")
    arms = args.arms.split(",")
    results: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    load = []
    with Cluster(n=2, backend="gloo") as cluster, tempfile.TemporaryDirectory() as out:
        magics.use_cluster(cluster)
        for round_ in range(args.rounds):
            for arm in (arms if round_ % 2 == 0 else arms[::-1]):
                cluster.dashboard = arm != "kit-nodash"
                results[arm].append(run_ddp(args.steps, args.warmup, out) if arm == "ddp"
                                    else run_kit(shell, args.steps, args.warmup, out))
                load.append(os.getloadavg()[0])
    outputs = shell.display_pub.outputs
    pictures = sum("image/png" in o["data"] for o in outputs)
    frames = f"{len(outputs) - pictures} live SVG frames and {pictures} final pictures"
    report(results, args, frames, load)


def report(results: dict, args: argparse.Namespace, frames: str, load: list[float]) -> None:
    print(f"GPT {MODEL}, global batch {BATCH}, AdamW lr {LR}, dp2 on 2 gloo ranks, "
          f"{args.steps} timed steps after {args.warmup} warm-up steps, {args.rounds} rounds "
          f"(alternated), {os.cpu_count()} CPUs, load average {min(load):.1f}-{max(load):.1f}, "
          f"dashboard: {frames} drawn")
    per_step = {arm: [max(rank["per_step"] for rank in round_) for round_ in rounds]
                for arm, rounds in results.items()}
    for arm in results:
        series = per_step[arm]
        print(f"{arm:>10}: median {1e3 * statistics.median(series):.1f} ms/step, "
              f"min-max {1e3 * min(series):.1f}-{1e3 * max(series):.1f}, rounds "
              + ", ".join(f"{1e3 * s:.1f}" for s in series))
    for arm in (a for a in results if a != "ddp"):
        ratio = statistics.median(per_step[arm]) / statistics.median(per_step["ddp"])
        pairs = [k / d for k, d in zip(per_step[arm], per_step["ddp"])]
        print(f"ratio {arm} / ddp (medians): {ratio:.3f} (goal <= 1.03); per round "
              + ", ".join(f"{p:.3f}" for p in pairs))
        print(f"median of the per-round ratios {arm} / ddp (each pair ran back to back, so it is "
              f"robust to the machine's drift): {statistics.median(pairs):.3f}")
    print("where a step goes (mean ms over timed steps and ranks, median over rounds):")
    for name in ("per_step", "step_time") + PHASES + ("client_cpu",):
        cells = []
        for arm in results:
            values = [statistics.mean(rank.get(name, 0.0) for rank in round_) for round_ in results[arm]]
            cells.append(f"{arm} {1e3 * statistics.median(values):8.2f}")
        print(f"  {name:<22} " + "  ".join(cells))


if __name__ == "__main__":
    main()
