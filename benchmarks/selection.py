"""Model selection on 2 engines: Sharded-LRTF against FIFO, task parallelism without migration, and
Hydra's baseline (each model split over the engines as a pipeline without micro-batches, trained
one after another); then the measured shard times replayed for Hydra's setting (8 devices, 12
models); and the planner's predicted makespan against each measurement.

A mixed workload of 6 GPT trials (two widths and depths, two learning rates each; the wider ones
do not fit the per-engine budget and are spilled) runs under every arm on one `Cluster(n=2)`.
Rounds alternate the arms' order (forward, then reversed) so other load on the machine hits them
alike; the median and min-max of each arm's makespan over rounds are printed, and the ratio to
Hydra's baseline per round (median and min-max). Every arm's losses are checked against the
first arm's, trial by trial (within 1e-5 relative: equal whatever the schedule). The simulator then replays
the Sharded-LRTF run's median task times with 12 models (each trial twice) on 8 devices.

    python benchmarks/selection.py [--rounds 3] [--steps 8] [--budget-mib 160]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import torch

from colab_par import Cluster
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.selection import Trial, select
from colab_par.selection.simulate import TrialProfile, measured_profiles, simulate

VOCAB, SEQ, BATCH = 512, 128, 8
SIZES = ((192, 3), (224, 4), (256, 4))  # (d_model, n_layer); the last spills at the default budget
LRS = (1e-3, 3e-3)
ARMS = {  # name -> select() options
    "sharded-lrtf": dict(scheduler="lrtf", placement="shard"),
    "fifo": dict(scheduler="fifo", placement="shard"),
    "task-parallel": dict(scheduler="lrtf", placement="pinned"),
    "model-parallel": dict(scheduler="fifo", placement="model-parallel"),
}
BASELINE = "model-parallel"


def gpt(d_model: int, n_layer: int):
    def build() -> GPT:
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=4, d_model=d_model,
                             kernels="torch"))
    return build


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    sample = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return sample[:, :-1], sample[:, 1:]


def workload(steps: int) -> list[Trial]:
    return [Trial(gpt(d, n), tokens, steps, name=f"d{d} L{n} lr{lr:g}", lr=lr, config={"d": d, "L": n, "lr": lr})
            for d, n in SIZES for lr in LRS]


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):7.2f}  (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget-mib", type=float, default=160)
    args = parser.parse_args()
    budget = int(args.budget_mib * 2 ** 20)
    trials = workload(args.steps)
    makespans: dict[str, list[float]] = {arm: [] for arm in ARMS}
    predicted: dict[str, list[float]] = {arm: [] for arm in ARMS}
    ratios: dict[str, list[float]] = {arm: [] for arm in ARMS}
    reference, lrtf_result = None, None
    with Cluster(n=2, dashboard=False) as cluster:
        # warm up: the engines' imports and every trial's kernels, for whichever arm runs first
        select(workload(1), cluster=cluster, budget=budget, view=None)
        for r in range(args.rounds):
            order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
            this_round = {}
            for arm in order:
                result = select(trials, cluster=cluster, budget=budget, view=None, **ARMS[arm])
                losses = {t.name: t.losses for t in result.trials}
                if reference is None:
                    reference = losses
                    print("trials: " + ", ".join(f"{t.name} ({t.shards} shard{'s' * (t.shards > 1)})"
                                                 for t in result.trials), flush=True)
                mismatch = [n for n in losses if len(losses[n]) != len(reference[n]) or any(
                    abs(a - b) > 1e-5 * abs(b) for a, b in zip(losses[n], reference[n]))]
                if mismatch:
                    sys.exit(f"{arm}: losses differ from the first arm's for {mismatch}")
                makespans[arm].append(result.makespan)
                predicted[arm].append(result.predicted_makespan)
                this_round[arm] = result.makespan
                if arm == "sharded-lrtf":
                    lrtf_result = result
                print(f"round {r + 1} {arm:15s} makespan {result.makespan:6.2f} s  predicted "
                      f"{result.predicted_makespan:6.2f} s", flush=True)
            for arm in ARMS:
                ratios[arm].append(this_round[BASELINE] / this_round[arm])

    print(f"\n2 CPU engines, {len(trials)} trials x {args.steps} steps, budget {args.budget_mib:g} MiB/engine, "
          f"{args.rounds} rounds")
    print(f"{'arm':15s} {'makespan s':40s} {'speed-up over ' + BASELINE:44s} planner error")
    for arm in ARMS:
        errors = [p / m - 1 for p, m in zip(predicted[arm], makespans[arm])]
        print(f"{arm:15s} {spread(makespans[arm]):40s} {spread(ratios[arm]):44s} "
              f"{statistics.median(errors):+.0%} (min {min(errors):+.0%}, max {max(errors):+.0%})")

    profiles = measured_profiles(lrtf_result)
    twelve = profiles + [TrialProfile(replace(p.shape, name=p.shape.name + " b"), p.task_seconds) for p in profiles]
    hydra = {arm: simulate(twelve, 8, **ARMS[arm]).makespan for arm in ARMS}
    print(f"\nsimulated, Hydra's setting: 8 devices, {len(twelve)} models, measured task times")
    for arm in ARMS:
        print(f"{arm:15s} makespan {hydra[arm]:7.2f} s  speed-up over {BASELINE} {hydra[BASELINE] / hydra[arm]:5.2f}x")


if __name__ == "__main__":
    main()
