"""Resilience on a real 2-engine cluster (issue 42): how long from a SIGKILLed engine to training
again and how many steps are lost, per layout and way back (live replicas, in-memory snapshots,
disk); and what in-memory snapshots every K steps cost the step. Where the survivors train on
degraded while the replacement starts (`training/resilience/degraded.py`), the kill to their first
degraded step and the kill to the full world training again apart, and how many steps ran
degraded. On 4 engines, replicas that span tp, pp or cp (`dp2 tp2`, `dp2 pp2`, `dp2 cp2`): the
whole replica trains on while the lost rank's replica waits.

It runs the fault-injection cell the tests prove recovery with (tests/resilience_cell.py), so the
figures are of the same code. Usage: python benchmarks/resilience.py [--rounds 3] [--engines 2 4]
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
from resilience_cell import degraded_steps, run_cell  # noqa: E402

from colab_par import Cluster  # noqa: E402
from colab_par.models import GPTConfig  # noqa: E402

# rank 1 killed in step 8's forward; 10 steps, disk saves every 4, snapshots (where used) every 2. The arms whose
# survivors train on degraded run 30 steps saving only at the end, so the degraded steps time training alone (a
# save due at step 8 would be written by the survivors within them)
TEN, THIRTY = dict(steps=10, every=4), dict(steps=30, every=1000)
RECOVERIES = (("dp2", None, "live replicas, the survivor trains on", THIRTY),
              ("dp2 zero3", 2, "in-memory snapshot", TEN), ("tp2", 2, "in-memory snapshot", TEN),
              ("dp2 zero3", None, "disk checkpoint", TEN))
REPLICAS = tuple((layout, None, "live replicas, the whole replica trains on", THIRTY)
                 for layout in ("dp2 tp2", "dp2 pp2", "dp2 cp2"))
MEDIUM = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=256, kernels="torch")  # ~3.4 M params


def _printed(run) -> str:
    """What `run()` had the notebook print (the cell's rank-0 output streams to this stdout)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        run()
    sys.stdout.write(buffer.getvalue())
    return buffer.getvalue()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "-"


def recovery_rows(cluster: Cluster, folder: Path, rounds: int, arms: tuple) -> list[str]:
    """Per arm: kill to the survivors' first degraded forward (where they train on), kill to the first
    forward of the cell run again (the full world), steps run degraded, steps lost. Rank 1 dies in
    step 8, so step 7 is the last whole one before the kill, or the last degraded step after it; a
    step lost is one trained before the cell ran again and not in the state it resumed from."""
    rows = []
    for layout, every, way, run in arms:
        survivors, world, ran_degraded, lost = [], [], [], set()
        for round_ in range(rounds):
            cluster.restart()
            name = f"{layout.replace(' ', '-')}-{every}-{round_}"
            said = _printed(lambda: run_cell(cluster, folder, name, [[1, "forward", 8]], layout=layout,
                                             snapshot_every=every, model=MEDIUM, batch=8, **run))
            killed, again = (float((folder / f"{name}.{end}").read_text()) for end in ("killed_at", "again_at"))
            world.append(again - killed)
            if (folder / f"{name}.degraded_at").exists():
                survivors.append(float((folder / f"{name}.degraded_at").read_text()) - killed)
            degraded = sorted(degraded_steps(folder, name))  # rank 0's rows (a waiting rank 0 took a trainer's)
            assert degraded == list(range(8, 8 + len(degraded))), degraded
            ran_degraded.append(len(degraded))
            found = re.search(r"resumed at step (\d+)|resumed from the checkpoint of step (\d+)", said)
            lost.add(max([7, *degraded]) - int(found.group(1) or found.group(2)))
        per_round = ", ".join(map(str, ran_degraded))
        rows.append(f"| {layout} | {way} | {_spread(survivors)} | {_spread(world)} "
                    f"| {min(ran_degraded)}-{max(ran_degraded)} ({per_round}) | {sorted(lost)} |")
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
    parser.add_argument("--engines", type=int, nargs="+", choices=(2, 4), default=(2, 4),
                        help="2: the dp, zero3, tp and disk arms and the snapshot costs; 4: the replicas spanning tp, pp, cp")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    recoveries, costs = [], []
    for engines in args.engines:
        with tempfile.TemporaryDirectory() as scratch, Cluster(n=engines, backend="gloo", timeout=120.0,
                                                               dashboard=False) as cluster:
            folder = Path(scratch)
            recoveries += recovery_rows(cluster, folder, args.rounds, RECOVERIES if engines == 2 else REPLICAS)
            if engines == 2:
                costs = snapshot_cost_rows(cluster, folder, args.rounds)
    print(f"\n{started}, {args.rounds} rounds, GPT 4 layers x 256 (3.4 M parameters), {' and '.join(map(str, args.engines))} engines")
    print("| layout | way back | kill to training again (survivors), s median (min-max) "
          "| kill to the full world again, s median (min-max) | steps run degraded, min-max (per round) "
          "| steps lost |\n|---|---|---|---|---|---|")
    print("\n".join(recoveries))
    if costs:
        print("\n| snapshot_every | ms per step, median (min-max) | vs none |\n|---|---|---|")
        print("\n".join(costs))


if __name__ == "__main__":
    main()
