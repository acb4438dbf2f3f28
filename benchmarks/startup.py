"""Start-up cost of the engines vs torchrun, and the round trip of a warm %%colossal cell.

Measured side by side in one run:
- cold `Cluster(n=2).start()` until a gloo all_reduce has returned on both ranks, vs
  `torchrun --nproc-per-node 2` running init_process_group + one all_reduce (spawn to exit);
- a warm `%%colossal` round trip of a trivial cell on 2 engines (median of many).
Goals from the issue: start-up ratio <= 1.0, warm round trip <= 0.1 s.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from colab_par import Cluster, magics

TORCHRUN_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    dist.destroy_process_group()
""")


def all_reduce_once() -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


def time_cluster_start() -> tuple[float, Cluster]:
    started = time.perf_counter()
    cluster = Cluster(n=2, backend="gloo", dashboard=False).start()
    assert cluster.run(all_reduce_once) == [2.0, 2.0]
    return time.perf_counter() - started, cluster


def time_torchrun() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "allreduce.py"
        script.write_text(TORCHRUN_SCRIPT)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", "29512", str(script)]
        started = time.perf_counter()
        subprocess.run(torchrun, check=True, capture_output=True)
        return time.perf_counter() - started


def time_warm_cell(cluster: Cluster, repeats: int = 30) -> float:
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_par")
    magics.use_cluster(cluster)
    shell.run_cell_magic("colossal", "", "x = 1")  # first call pays one-time imports
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        shell.run_cell_magic("colossal", "", "x = 1")
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    torchrun_s = time_torchrun()
    start_s, cluster = time_cluster_start()
    try:
        cell_s = time_warm_cell(cluster)
    finally:
        cluster.stop()
    rows = [
        ("cold start to first all_reduce: Cluster(n=2)", f"{start_s:.2f} s"),
        ("cold start to first all_reduce: torchrun --nproc-per-node 2", f"{torchrun_s:.2f} s"),
        ("ratio Cluster / torchrun (goal <= 1.0)", f"{start_s / torchrun_s:.2f}"),
        ("warm %%colossal round trip, trivial cell, median of 30 (goal <= 0.1 s)", f"{cell_s * 1000:.1f} ms"),
    ]
    print("| measurement | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
