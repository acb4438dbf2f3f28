"""Resilience on a real 2-engine cluster (issue 42): how long from a SIGKILLed engine to training
again and how many steps are lost, per layout and way back (live replicas, in-memory snapshots,
disk); and what in-memory snapshots every K steps cost the step.

It runs the fault-injection cell the tests prove recovery with (tests/resilience_cell.py), so the
figures are of the same code. Usage: python benchmarks/resilience.py [--rounds 3]
(asynchronous saves against synchronous ones: benchmarks/checkpoint_async.py)."""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from resilience_cell import run_cell  # noqa: E402

from colab_par import Cluster  # noqa: E402
from colab_par.models import GPTConfig  # noqa: E402

# rank 1 killed in step 8's forward; disk saves every 4 steps, snapshots (where used) every 2
RECOVERIES = (("dp2", None, "live replicas"), ("dp2 zero3", 2, "in-memory snapshot"), ("tp2", 2, "in-memory snapshot"),
              ("dp2 zero3", None, "disk checkpoint"))
MEDIUM = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=256, kernels="torch")  # ~3.4 M params


def _printed(run) -> str:
    """What `run()` had the notebook print (the cell's rank-0 output streams to this stdout)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        run()
    sys.stdout.write(buffer.getvalue())
    return buffer.getvalue()


def recovery_rows(cluster: Cluster, folder: Path, rounds: int) -> list[str]:
    rows = []
    for layout, every, way in RECOVERIES:
        seconds, lost = [], set()
        for round_ in range(rounds):
            cluster.restart()
            name = f"{layout.replace(' ', '-')}-{every}-{round_}"
            said = _printed(lambda: run_cell(cluster, folder, name, [[1, "forward", 8]], layout=layout,
                                             snapshot_every=every, steps=10, every=4, model=MEDIUM, batch=8))
            killed, again = (float((folder / f"{name}.{end}").read_text()) for end in ("killed_at", "again_at"))
            seconds.append(again - killed)
            found = re.search(r"resumed at step (\d+)|resumed from the checkpoint of step (\d+)", said)
            lost.add(7 - int(found.group(1) or found.group(2)))
        rows.append(f"| {layout} | {way} | {statistics.median(seconds):.2f} ({min(seconds):.2f}-{max(seconds):.2f}) "
                    f"| {sorted(lost)} |")
    return rows


def snapshot_cost_rows(cluster: Cluster, folder: Path, rounds: int) -> list[str]:
    arms = (None, 1, 5, "auto")
    seconds: dict = {arm: [] for arm in arms}
    for round_ in range(rounds):
        for arm in arms if round_ % 2 == 0 else arms[::-1]:  # alternated
            name = f"cost-{arm}-{round_}"
            run_cell(cluster, folder, name, [], layout="dp2 zero3", snapshot_every=arm, steps=20, every=1000,
                     model=MEDIUM, batch=8)
            seconds[arm].append(float((folder / f"{name}.seconds").read_text()) / 20)
    base = statistics.median(seconds[None])
    return [f"| {arm or 'none'} | {1e3 * statistics.median(s):.1f} ({1e3 * min(s):.1f}-{1e3 * max(s):.1f}) "
            f"| {statistics.median(s) / base:.3f}x |" for arm, s in seconds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as scratch, Cluster(n=2, backend="gloo", timeout=120.0,
                                                           dashboard=False) as cluster:
        folder = Path(scratch)
        recoveries = recovery_rows(cluster, folder, args.rounds)
        costs = snapshot_cost_rows(cluster, folder, args.rounds)
    print(f"\n{started}, {args.rounds} rounds, GPT 4 layers x 256 (3.4 M parameters), 2 engines")
    print("| layout | way back | kill to training again, s median (min-max) | steps lost |\n|---|---|---|---|")
    print("\n".join(recoveries))
    print("\n| snapshot_every | s per step, median (min-max) | vs none |\n|---|---|---|")
    print("\n".join(costs))


if __name__ == "__main__":
    main()
