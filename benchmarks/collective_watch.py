"""What watching a running cell for stuck collectives costs the engines (colab_par.cluster.task_watch).

While a cell runs, the notebook asks every engine once a second where its main thread is; the
engine answers from its control thread (`probe.where`). Two figures:

1. One answer's cost to an engine: `probe.where` alone (called in a loop on an engine), and all
   included (the control message received, decoded, answered, ipykernel's busy/idle status sent):
   the engine process's CPU time over a few hundred requests sent one after the other to an
   idle engine, per request.
2. A training-like loop (an MLP's forward, backward and gradient all-reduce on 2 gloo engines,
   the same work in every round) run in a cell with the watch on, and with it off
   (`task_watch.START_AFTER_S = inf` in this process: the notebook never asks). Rounds alternate
   the order (on, off), (off, on), ...; each round's figure is the slowest rank's steps per second;
   medians, min-max, the ratio of medians and the ratios within each pair of rounds are printed,
   with the answers each engine gave.

Idle engines cost nothing by construction: no thread, timer or hook is added (the engine's thread
count is printed before and after a watched cell).

    python benchmarks/collective_watch.py [--rounds 6] [--seconds 4]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import math
import statistics

from colab_par import Cluster, compat
from colab_par.cluster import probe, task_watch

CELL = """
import time, threading, torch, torch.distributed as dist
from colab_par.cluster import probe
torch.manual_seed(0)
_net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
_x = torch.randn(64, 256)
_answered = probe.ANSWERED["where"]
_steps, _end = 0, time.perf_counter() + {seconds}
while True:
    _net(_x).square().mean().backward()
    for _p in _net.parameters():
        dist.all_reduce(_p.grad)
        _p.grad = None
    _steps += 1
    _flag = torch.tensor([float(time.perf_counter() < _end)])
    dist.all_reduce(_flag, op=dist.ReduceOp.MIN)
    if not _flag.item():
        break
_rate = _steps / ({seconds} + (time.perf_counter() - _end))
_result = (_rate, probe.ANSWERED["where"] - _answered, threading.active_count())
"""


def answer_cost(repeats: int = 2000) -> float:
    """µs per `probe.where` answer on this engine (its own main thread inspected)."""
    import time

    from colab_par.cluster import probe

    probe.where({})
    started = time.perf_counter()
    for _ in range(repeats):
        probe.where({})
    return (time.perf_counter() - started) / repeats * 1e6


def cpu_seconds() -> float:
    import time

    return time.process_time()  # every thread of the engine process


def request_cost(cluster: Cluster, requests: int = 400) -> float:
    """Engine CPU µs per where request, everything included (median of the engines)."""
    ids = cluster._client.ids[:cluster.n]
    # what reading the clock through ipyparallel costs the engine by itself
    base = [b - a for a, b in zip(cluster.run(cpu_seconds), cluster.run(cpu_seconds))]
    before = cluster.run(cpu_seconds)
    for _ in range(requests):
        concurrent.futures.wait(compat.send_control_requests(cluster._client, ids, probe.WHERE_REQUEST, {}))
    after = cluster.run(cpu_seconds)
    return statistics.median((b - a - c) / requests * 1e6 for a, b, c in zip(before, after, base))


def result() -> tuple[float, int, int]:
    from IPython import get_ipython

    return get_ipython().user_ns["_result"]  # what CELL left on the engine


def threads() -> int:
    import threading

    return threading.active_count()


def round_of(cluster: Cluster, watched: bool, seconds: float) -> tuple[float, list[int]]:
    task_watch.START_AFTER_S = 0.5 if watched else math.inf
    cluster.execute(CELL.format(seconds=seconds))
    rates, answered, _ = zip(*cluster.run(result))
    return min(rates), list(answered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    default_start = task_watch.START_AFTER_S
    with Cluster(n=2, backend="gloo", dashboard=False) as cluster:
        print(f"probe.where alone: {statistics.median(cluster.run(answer_cost)):.1f} µs per answer; "
              f"all included: {request_cost(cluster):.0f} µs of engine CPU per request (medians of ranks)")
        before = cluster.run(threads)
        round_of(cluster, True, 1.0)  # warm-up
        rates: dict[bool, list[float]] = {True: [], False: []}
        answers = []
        for index in range(args.rounds):
            for watched in ((True, False) if index % 2 == 0 else (False, True)):
                rate, answered = round_of(cluster, watched, args.seconds)
                rates[watched].append(rate)
                if watched:
                    answers.append(min(answered))
        after = cluster.run(threads)
        task_watch.START_AFTER_S = default_start
    for watched, name in ((True, "watched"), (False, "unwatched")):
        values = rates[watched]
        print(f"{name:>9}: {statistics.median(values):8.1f} steps/s (min {min(values):.1f}, "
              f"max {max(values):.1f}, {len(values)} rounds of {args.seconds:.0f} s)")
    paired = [w / u for w, u in zip(rates[True], rates[False])]
    print(f"ratio watched/unwatched: {statistics.median(rates[True]) / statistics.median(rates[False]):.3f} "
          f"of medians; per round pair: median {statistics.median(paired):.3f} "
          f"(min {min(paired):.3f}, max {max(paired):.3f})")
    print(f"answers per engine per watched round: {min(answers)}-{max(answers)}")
    print(f"engine threads before / after the watched cells: {before} / {after}")


if __name__ == "__main__":
    main()
