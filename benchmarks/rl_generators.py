"""GRPO with separate generator engines against the colocated loop, on this machine, the same work.

The model on every arm: colab_par's GPT (vocabulary 64, 4 layers, d_model 128, 4 heads,
`torch.manual_seed(0)`), float32 on the CPU, SGD (lr 1e-3). Each step: 4 prompts of 4-7 tokens,
8 completions each (32 rows), 24 new tokens at most (end token 1, rare: rows run the full length
most of the time), reward: the share of even tokens, loss "dapo", one iteration.

Arms, each on two engines of one torch thread (the engines' default on 2 cores):
- colocated: `GRPO.fit()` on a `Cluster(n=2)`, layout "dp2" (both engines sample every row, as
  the colocated loop does, then each trains on its 16);
- separate, max_offpolicy_steps 0: one trainer engine ("dp1") and one generator engine ("dp1"),
  two clusters joined by the bridge (`Generators`); the generator waits for each step's weights;
- separate, max_offpolicy_steps 1: the same, the generator sampling the next rollout while the
  trainer trains.

Step time: the trainer's wall time per step (colocated: `rollout_s + train_s`; separate:
`trainer_wait_s + train_s + weights_sync_s`), the median over the steps after the first of a run;
a round runs each arm once, in an order that alternates between rounds; the table gives the median
(min-max) over the rounds, and completions/s = 32 / step time.

    python benchmarks/rl_generators.py [--rounds 3] [--steps 5]
"""
from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from colab_par import Cluster  # noqa: E402
from colab_par.cluster.generator_engines import Generators  # noqa: E402

CONFIG = dict(vocab_size=64, seq_len=64, n_layer=4, n_head=4, d_model=128, kernels="torch")
GROUP, PER_STEP, NEW = 8, 4, 24
PROMPTS = [[2 + (i * 7 + j * 3) % 60 for j in range(4 + i % 4)] for i in range(16)]


def even_share(prompts, completions, **_):
    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completions]


def build(role: str, steps: int):
    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig
    from colab_par.training.grpo import GRPO, Completions, GrpoLossOptions

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    layout = "dp2" if role == "colocated" else "dp1"
    pm = parallelize(model, layout, optimizer_fn=lambda params: torch.optim.SGD(params, lr=1e-3))
    return GRPO(pm, PROMPTS, even_share, group_size=GROUP, max_completion_length=NEW, steps=steps,
                prompts_per_step=PER_STEP, seed=1, completions=Completions(eos_token_id=1, pad_token_id=0),
                loss=GrpoLossOptions(loss_type="dapo"))


def colocated_rows(steps: int) -> list[dict]:
    return build("colocated", steps).fit()


def step_seconds(rows: list[dict]) -> float:
    """The trainer's median wall time per step, the first step (warm-up) left out."""
    def wall(row: dict) -> float:
        if "trainer_wait_s" in row:
            return row["trainer_wait_s"] + row["train_s"] + row["weights_sync_s"]
        return row["rollout_s"] + row["train_s"]
    return statistics.median(wall(row) for row in rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    options = dict(backend="gloo", timeout=120.0, dashboard=False)
    together, trainer, generator = Cluster(n=2, **options), Cluster(n=1, **options), Cluster(n=1, **options)
    arms = {
        "colocated (dp2)": lambda: together.run(colocated_rows, args.steps)[0],
        "separate, max_offpolicy_steps 0": lambda: Generators(generator, max_offpolicy_steps=0).fit(
            trainer, functools.partial(build, steps=args.steps)),
        "separate, max_offpolicy_steps 1": lambda: Generators(generator, max_offpolicy_steps=1).fit(
            trainer, functools.partial(build, steps=args.steps)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    waits: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for cluster in (together, trainer, generator):
            cluster.start()
        for round_ in range(args.rounds):
            order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
            for name in order:
                rows = arms[name]()
                seconds[name].append(step_seconds(rows))
                waits[name].append(statistics.median(row.get("trainer_wait_s", 0.0) for row in rows[1:]))
    finally:
        for cluster in (together, trainer, generator):
            cluster.stop()
    print(f"GRPO, separate generators against colocated: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads here, {args.rounds} rounds of {args.steps} steps "
          f"({GROUP * PER_STEP} completions of up to {NEW} tokens a step)")
    base = statistics.median(seconds["colocated (dp2)"])
    print(f"{'arm':34} {'step s, median (min-max)':>26} {'completions/s':>14} {'vs colocated':>13} "
          f"{'trainer waits s':>16}")
    for name, values in seconds.items():
        middle = statistics.median(values)
        print(f"{name:34} {middle:>9.3f} ({min(values):.3f}-{max(values):.3f})    "
              f"{GROUP * PER_STEP / middle:>14.1f} {base / middle:>12.2f}x {statistics.median(waits[name]):>16.3f}")


if __name__ == "__main__":
    main()
