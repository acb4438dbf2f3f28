"""Cost of live telemetry: training step time with the dashboard on vs off, measured in one run.

"On" is what a notebook user gets: engines measure every step (memory, activations, grad norm,
MFU) and publish through ipyparallel's datapub, while the client polls and renders the dashboard
(SVG frames, a final matplotlib picture) into a display handle (an IPython shell in this process
records the frames). "Off" is `Trainer(..., telemetry=False)` with the client dashboard disabled.
Rounds alternate the order (off, on), (on, off), ... so load drift hits both. Two measures per
step of `fit()` (publishing included): wall time, and CPU time of all engines plus the client (its
polling and drawing), which other processes on a shared machine disturb far less. Goal (issue 4): on ≤ 1.03 × off.

`--in-process` isolates the engine-side part: one process (world of 1, one thread), alternating
Trainers with telemetry on and off, CPU time of `train_step` alone (no publishing, no client).

    python benchmarks/telemetry.py [--engines 2] [--layout "dp2 zero3"] [--steps 40] [--rounds 4]
    python benchmarks/telemetry.py --in-process [--steps 15] [--rounds 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.interactiveshell import InteractiveShell

from colab_par import Cluster
from colab_par.training.options import Logs

MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256, kernels="torch")


def seconds_per_step(layout: str, steps: int, telemetry: bool) -> tuple[float, float]:
    """On an engine: (wall, CPU) seconds per step of `fit()` after two warm-up steps."""
    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**MODEL)), layout)
    trainer = Trainer(pm, SyntheticDataset(256, MODEL["seq_len"], 8), steps=steps + 2, grad_clip=1.0, logs=Logs(telemetry=telemetry))
    trainer.fit(stop_at=2)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def in_process(steps: int, rounds: int) -> None:
    """Engine-side cost only: telemetry on/off in one process, CPU seconds of train_step."""
    import tempfile

    import torch.distributed as dist

    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    store = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cpu: dict[bool, list[float]] = {True: [], False: []}
    measuring: list[float] = []
    for round_ in range(rounds):
        for telemetry in ((False, True) if round_ % 2 == 0 else (True, False)):
            torch.manual_seed(0)
            pm = parallelize(GPT(GPTConfig(**MODEL)), "dp1")
            trainer = Trainer(pm, SyntheticDataset(256, MODEL["seq_len"], 4), steps=steps + 2, grad_clip=1.0, logs=Logs(telemetry=telemetry))
            for _ in range(2):
                trainer.train_step()
            start = time.process_time()
            for _ in range(steps):
                trainer.train_step()
            cpu[telemetry].append((time.process_time() - start) / steps)
            if telemetry:
                measuring += [row["time_telemetry"] for row in trainer.history[2:]]
    dist.destroy_process_group()
    off, on = statistics.median(cpu[False]), statistics.median(cpu[True])
    print(f"in-process, 1 thread, {steps} steps × {rounds} rounds, GPT {MODEL}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"train_step CPU: off {1e3 * off:.1f} ms, on {1e3 * on:.1f} ms, ratio on/off {on / off:.3f}, "
          f"best rounds {min(cpu[True]) / min(cpu[False]):.3f} (goal ≤ 1.03)")
    print(f"building a telemetry row: {1e3 * statistics.median(measuring):.2f} ms (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--layout", default="dp2 zero3")
    # A run pays the final matplotlib picture once (~0.2 s CPU here); 120-step runs measure
    # the steady per-step cost instead of that fixed cost spread over a few seconds.
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="engine-side cost only")
    args = parser.parse_args()
    if args.in_process:
        in_process(args.steps, args.rounds)
        return

    shell = InteractiveShell.instance()  # the dashboard draws its frames as in a notebook
    shell.display_pub = CapturingDisplayPublisher()
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    engine_cpu: dict[bool, list[float]] = {True: [], False: []}
    with Cluster(n=args.engines, backend="gloo", dashboard=False) as cluster:
        for round_ in range(args.rounds):
            for telemetry in ((False, True) if round_ % 2 == 0 else (True, False)):
                cluster.dashboard = telemetry
                client_cpu = time.process_time()
                per_rank = cluster.run(seconds_per_step, args.layout, args.steps, telemetry)
                client_cpu = (time.process_time() - client_cpu) / args.steps  # polling + drawing
                wall[telemetry].append(max(w for w, _ in per_rank))
                engine_cpu[telemetry].append(sum(c for _, c in per_rank))
                cpu[telemetry].append(engine_cpu[telemetry][-1] + client_cpu)
    outputs = shell.display_pub.outputs
    pictures = sum("image/png" in o["data"] for o in outputs)
    frames = f"{len(outputs) - pictures} live SVG frames and {pictures} final pictures"
    print(f"layout {args.layout!r}, {args.engines} engines, {args.steps} steps × {args.rounds} rounds, "
          f"GPT {MODEL}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"dashboard in the 'on' rounds: {frames} drawn")
    for name, unit, series in (("wall time per step", "ms", wall),
                               ("CPU time per step, all engines + client", "ms", cpu),
                               ("CPU time per step, engines only", "ms", engine_cpu)):
        off, on = statistics.median(series[False]), statistics.median(series[True])
        print(f"{name}: off {1e3 * off:.1f} {unit}, on {1e3 * on:.1f} {unit}, "
              f"ratio on/off {on / off:.3f} (goal ≤ 1.03)")
        for telemetry in (False, True):
            rounds = ", ".join(f"{1e3 * t:.1f}" for t in series[telemetry])
            print(f"    {'on ' if telemetry else 'off'} rounds: {rounds}")


if __name__ == "__main__":
    main()
