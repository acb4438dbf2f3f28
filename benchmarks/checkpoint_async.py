"""How long a checkpoint stops training: an asynchronous save's pause against a synchronous save
of the same state.

Run: ``python benchmarks/checkpoint_async.py [--rounds 5] [--d-model 768] [--layers 12]
[--vocab 8192]``. On each engine of a `Cluster(n=2)` (gloo, `dp2`), a GPT (default ~100 M
parameters) takes one AdamW step so that its optimizer state exists; then each round times both
arms, their order alternating from round to round (the machine is shared: its load hits both
alike), into a fresh folder under the system temp dir (keep=1):
- "sync": `checkpoint.save`, the whole DCP write, digests, commit and LATEST, all on the training
  thread;
- "async pause": how long `checkpoint_async.save_async` held the training thread (the copy of the
  rank's state to host memory, plus the save's collectives and staging folder), and "async
  write": from its return until `wait_for_saves()` saw the commit (beside training: here the
  thread is idle, so it is the background write's own time).
A first round of each arm runs untimed (the async arm's first save allocates its host copies:
its pause is printed apart). Reported: median and min-max over rounds and ranks, and the pause as
a share of the synchronous save (the issue's goal: <= 10 %).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def measure_on_engine(model: dict, rounds: int, root: str) -> dict:
    """One rank's seconds per arm and round (after an untimed first round of each)."""
    import torch

    from colab_par import parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig
    from colab_par.training.checkpoint import save
    from colab_par.training.checkpoint_async import save_async, wait_for_saves
    from colab_par.training.trainer import Trainer

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**model)), "dp2",
                     optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-4))
    data = SyntheticDataset(vocab_size=model["vocab_size"], seq_len=model["seq_len"], batch_size=2, seed=1)
    trainer = Trainer(pm, data, steps=1)
    trainer.fit()

    def sync() -> dict:
        start = time.perf_counter()
        save(pm, f"{root}/sync", trainer=trainer, keep=1)
        return {"sync": time.perf_counter() - start}

    def asynchronous() -> dict:
        started = save_async(pm, f"{root}/async", trainer=trainer, keep=1)
        returned = time.perf_counter()
        wait_for_saves()
        return {"async pause": started.pause_s, "async write": time.perf_counter() - returned}

    first = {**sync(), **asynchronous()}
    samples: dict[str, list[float]] = {}
    for round_ in range(rounds):
        for arm in ((sync, asynchronous) if round_ % 2 == 0 else (asynchronous, sync)):
            for name, seconds in arm().items():
                samples.setdefault(name, []).append(seconds)
    return {"first": first, "samples": samples,
            "parameters": sum(p.numel() for part in pm.model_parts for p in part.parameters())}


def report(results: list[dict], model: dict, rounds: int) -> None:
    merged: dict[str, list[float]] = {}
    for result in results:
        for name, values in result["samples"].items():
            merged.setdefault(name, []).extend(values)
    medians = {name: statistics.median(values) for name, values in merged.items()}
    print(f"GPT {model}: {results[0]['parameters'] / 1e6:.1f} M parameters, AdamW, dp2 on 2 gloo engines, "
          f"{rounds} rounds x 2 ranks, arms alternated, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'arm':<12} {'median s':>9}  {'min-max s':>15}  share of sync")
    for name, values in merged.items():
        print(f"{name:<12} {medians[name]:9.3f}  {min(values):7.3f}-{max(values):<7.3f}  "
              f"{100 * medians[name] / medians['sync']:6.1f} %")
    print("first async pause (allocates the host copies), per rank: "
          + ", ".join(f"{r['first']['async pause']:.3f} s" for r in results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    model = dict(vocab_size=args.vocab, seq_len=64, n_layer=args.layers, n_head=max(1, args.d_model // 64),
                 d_model=args.d_model, kernels="torch")

    from colab_par import Cluster

    root = tempfile.mkdtemp(prefix="colab_par-ckpt-bench-")
    try:
        with Cluster(n=2, backend="gloo") as cluster:
            results = cluster.run(measure_on_engine, model, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results, model, args.rounds)


if __name__ == "__main__":
    main()
