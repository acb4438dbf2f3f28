"""Start-up of 2 engines vs torchrun, each until the first all_reduce, and a warm cell's round trip.

Both arms end at the same point: **the launching process knows that a gloo all_reduce over the
2 ranks has completed.** For `Cluster(n=2).start()` that is `cluster.run(all_reduce)` returning
[2.0, 2.0] in this process; for `torchrun --nproc-per-node 2` it is this process reading rank 0's
line "all_reduce done" from the pipe (printed and flushed right after the all_reduce returned on
rank 0, which needs both ranks). That point, not teardown, is what a user waits for before the
first real work: a notebook keeps its engines up, and a torchrun job's exit comes after its
training. Teardown is printed separately (torchrun: line read to process exit; Cluster: stop()).

Samples alternate (cluster, torchrun), (torchrun, cluster), ... so load from other jobs on a
shared machine hits both arms alike; medians, min-max and the ratio of medians are printed.
Phases, to see what stands in the way of ratio <= 1.0:
- torchrun: launcher (interpreter + `import torch` in the agent, spawning workers), worker
  `import torch`, rendezvous (init_process_group), the all_reduce, and the line reaching us;
- Cluster: ipyparallel launching controller + engines, the client connecting to the controller,
  engine registration, bootstrap (device binding, rendezvous, pushing rank variables), and the
  first all_reduce's round trip; engines import torch meanwhile, during launch and registration;
- a bare `python -c "import torch.distributed"` per round, the import both arms pay.

    python benchmarks/startup.py [--samples 5]
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator

import ipyparallel as ipp

from colab_par import Cluster, magics

TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, time
    stamps = {"script": time.time()}
    import torch, torch.distributed as dist
    stamps["torch"] = time.time()
    dist.init_process_group("gloo")
    stamps["rendezvous"] = time.time()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    stamps["all_reduce"] = time.time()
    if dist.get_rank() == 0:
        print("all_reduce done", json.dumps(stamps), flush=True)
    dist.destroy_process_group()
""")


def all_reduce_once() -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


@contextlib.contextmanager
def ipyparallel_phases(stamps: dict[str, float]) -> Iterator[None]:
    """Record when the ipyparallel calls inside `Cluster.start()` return (public API only)."""
    patched = [(ipp.Cluster, "start_cluster", "launched"), (ipp.Cluster, "connect_client", "connected"),
               (ipp.Client, "wait_for_engines", "registered")]
    originals = [getattr(owner, name) for owner, name, _ in patched]

    def stamped(original, label):
        if inspect.iscoroutinefunction(original):
            async def call_async(*args, **kwargs):
                result = await original(*args, **kwargs)
                stamps[label] = time.perf_counter()
                return result
            return call_async

        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            stamps[label] = time.perf_counter()
            return result
        return call

    for (owner, name, label), original in zip(patched, originals):
        setattr(owner, name, stamped(original, label))
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patched, originals):
            setattr(owner, name, original)


def sample_cluster() -> dict[str, float]:
    stamps: dict[str, float] = {}
    started = time.perf_counter()
    with ipyparallel_phases(stamps):
        cluster = Cluster(n=2, backend="gloo", dashboard=False).start()
    stamps["bootstrapped"] = time.perf_counter()
    assert cluster.run(all_reduce_once) == [2.0, 2.0]
    done = time.perf_counter()
    cluster.stop()
    order = ["launched", "connected", "registered", "bootstrapped"]
    marks = [started] + [stamps[k] for k in order] + [done]
    phases = dict(zip(["launch controller + engines", "client connects", "engine registration",
                       "bootstrap: bind + rendezvous", "first all_reduce round trip"],
                      (b - a for a, b in zip(marks, marks[1:]))))
    return {"total": done - started, **phases, "teardown": time.perf_counter() - done}


def sample_torchrun(script: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), str(script)]
    launched_wall, started = time.time(), time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = ""
    while not line.startswith("all_reduce done"):
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"torchrun exited ({process.wait()}) before rank 0 reported")
    done, done_wall = time.perf_counter(), time.time()
    process.stdout.read()
    if process.wait() != 0:
        raise RuntimeError(f"torchrun failed with exit status {process.returncode}")
    stamps = json.loads(line.split(" ", 2)[2])
    marks = [launched_wall, stamps["script"], stamps["torch"], stamps["rendezvous"],
             stamps["all_reduce"], done_wall]
    phases = dict(zip(["launcher: agent + spawn", "worker import torch", "rendezvous",
                       "all_reduce", "line reaches us"], (b - a for a, b in zip(marks, marks[1:]))))
    return {"total": done - started, **phases, "teardown": time.perf_counter() - done}


def sample_import() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True)
    return time.perf_counter() - started


def time_warm_cell(repeats: int = 30) -> float:
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_par")
    with Cluster(n=2, backend="gloo", dashboard=False) as cluster:
        magics.use_cluster(cluster)
        shell.run_cell_magic("colossal", "", "x = 1")  # first call pays one-time imports
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            shell.run_cell_magic("colossal", "", "x = 1")
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s (min-max {min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5, help="samples per arm (at least 5)")
    args = parser.parse_args()
    if args.samples < 5:
        parser.error(f"--samples {args.samples}: take at least 5 for a median and a spread")
    arms = ["cluster", "torchrun"]
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    imports: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "allreduce.py"
        script.write_text(TORCHRUN_SCRIPT)
        for index in range(args.samples):
            for arm in (arms if index % 2 == 0 else arms[::-1]):
                samples[arm].append(sample_torchrun(script) if arm == "torchrun" else sample_cluster())
            imports.append(sample_import())
    cell_s = time_warm_cell()

    totals = {arm: [s["total"] for s in runs] for arm, runs in samples.items()}
    ratio = statistics.median(totals["cluster"]) / statistics.median(totals["torchrun"])
    print(f"{args.samples} alternated samples per arm; end point: the launching process knows the "
          "first all_reduce completed")
    print("| measurement | median (min-max) |\n|---|---|")
    print(f"| Cluster(n=2).start() + first all_reduce | {_spread(totals['cluster'])} |")
    print(f"| torchrun --nproc-per-node 2 to first all_reduce | {_spread(totals['torchrun'])} |")
    print(f"| ratio of medians Cluster / torchrun (goal <= 1.0) | **{ratio:.2f}** |")
    print(f"| bare `python -c 'import torch.distributed'` | {_spread(imports)} |")
    print(f"| warm %%colossal round trip, trivial cell, median of 30 (goal <= 0.1 s) | "
          f"{cell_s * 1000:.1f} ms |")
    for arm, runs in samples.items():
        print(f"\nphases of {arm} (median s):")
        for phase in runs[0]:
            if phase != "total":
                print(f"  {phase:<32} {statistics.median(run[phase] for run in runs):.3f}")


if __name__ == "__main__":
    main()
