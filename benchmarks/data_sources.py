"""Cost of the user's own data and of TensorBoard logs: wall time per step of `fit()` on gloo
engines, measured in one run, arms alternated round by round.

Data arms (telemetry off, so only the data path differs; the rows are precomputed tensors, so the
dataset itself costs nothing and what is measured is the kit's handling):
- `batchlist`: global batches in a `BatchList`; every rank gets the whole batch, the model slices;
- `map`: a torch map-style Dataset; each rank reads and collates only its own rows;
- `stream`: an IterableDataset; rank 0 reads every row and scatters each rank's share (one
  `scatter_object_list` per micro-step).
Log arms (telemetry on, a row every step): `telemetry` vs `telemetry+tensorboard` (`log_dir`: rank 0
writes ~30 scalars per row, after one gather of every rank's memory figures).

    python benchmarks/data_sources.py [--engines 2] [--layout dp2] [--steps 30] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch.utils.data import Dataset, IterableDataset

from colab_par import Cluster

MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256, kernels="torch")
BATCH, ROWS = 8, 512
ARMS = ("batchlist", "map", "stream", "telemetry", "telemetry+tensorboard")


def windows() -> torch.Tensor:
    """ROWS learnable token windows of seq_len + 1 (counting with a stride), precomputed."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(256, (ROWS, 1), generator=g)
    stride = torch.randint(1, 8, (ROWS, 1), generator=g)
    return (start + stride * torch.arange(MODEL["seq_len"] + 1)) % 256


class Rows(Dataset):
    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple:
        return self.tokens[i, :-1], self.tokens[i, 1:]


class Stream(IterableDataset):
    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __iter__(self):
        return ((row[:-1], row[1:]) for row in self.tokens)


def per_step(arm: str, layout: str, steps: int, log_dir: str) -> dict[str, float]:
    """On an engine: wall seconds per step of `fit()` after two warm-up steps, and the median
    data phase of a step."""
    from colab_par import Trainer, parallelize
    from colab_par.data import BatchList
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**MODEL)), layout)
    tokens = windows()
    options = dict(steps=steps + 2, telemetry=arm.startswith("telemetry"))
    if arm == "batchlist":
        data = BatchList([(tokens[i:i + BATCH, :-1], tokens[i:i + BATCH, 1:]) for i in range(0, ROWS, BATCH)])
    else:
        data = Stream(tokens) if arm == "stream" else Rows(tokens)
        options["batch_size"] = BATCH
    if arm == "telemetry+tensorboard":
        options["log_dir"] = log_dir
    trainer = Trainer(pm, data, **options)
    trainer.fit(stop_at=2)
    start = time.perf_counter()
    trainer.fit()
    return {"step": (time.perf_counter() - start) / steps,
            "data": statistics.median(row["time_data"] for row in trainer.history[2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--layout", default="dp2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    step: dict[str, list[float]] = {arm: [] for arm in ARMS}
    data: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with Cluster(n=args.engines, backend="gloo", dashboard=False) as cluster, \
            tempfile.TemporaryDirectory() as logs:
        for round_ in range(args.rounds):
            shift = round_ % len(ARMS)
            for arm in ARMS[shift:] + ARMS[:shift]:  # each round starts with another arm
                per_rank = cluster.run(per_step, arm, args.layout, args.steps, os.path.join(logs, str(round_)))
                step[arm].append(max(r["step"] for r in per_rank))
                data[arm].append(max(r["data"] for r in per_rank))
    print(f"{time.strftime('%Y-%m-%d')}, layout {args.layout!r}, {args.engines} engines, {args.steps} steps × "
          f"{args.rounds} rounds, GPT {MODEL}, global batch {BATCH}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    for arm in ARMS:
        s, d = statistics.median(step[arm]), statistics.median(data[arm])
        print(f"{arm:>22}: step {1e3 * s:7.1f} ms (rounds {', '.join(f'{1e3 * t:.1f}' for t in step[arm])}), "
              f"data phase {1e3 * d:.2f} ms (rounds {', '.join(f'{1e3 * t:.2f}' for t in data[arm])})")
    ratio = {arm: statistics.median(step[arm]) for arm in ARMS}
    print(f"step ratios: map/batchlist {ratio['map'] / ratio['batchlist']:.3f}, stream/batchlist "
          f"{ratio['stream'] / ratio['batchlist']:.3f}, tensorboard/telemetry "
          f"{ratio['telemetry+tensorboard'] / ratio['telemetry']:.3f}")


if __name__ == "__main__":
    main()
