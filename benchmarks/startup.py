"""Cold start, restart, warm round trip and edit-run loop: colab_par vs Monarch vs torchrun.

Every sample runs in a fresh process; arms alternate round by round, so load from other jobs on a
shared machine hits them alike; medians, min-max and ratios of medians are printed.

Arms (2 workers, gloo, CPU):
- **colab_par** (this project's venv): `Cluster(n=2).start()` then `cluster.run(all_reduce)`.
  "script": a fresh process that nothing pre-started (`import colab_par; Cluster(...).start()`;
  also with the pool off, `COLAB_PAR_WARM_POOL=0`, for reference);
  "notebook": the same after `%load_ext colab_par` started the warm pool (the process waits until
  the pool is ready, as a user's next cell would find it), so only `%colossal start` is timed.
- **Monarch** (`torchmonarch==0.7.0`, installed by this script into its own virtual environment
  under ~/.cache/colab_par, reused when present; never into the project's): `this_host()
  .spawn_procs(per_host={"gpus": 2})`, `setup_torch_elastic_env`, an actor endpoint that joins the
  gloo group and all_reduces.
- **torchrun** `--nproc-per-node 2` of a script doing the same, until this process reads rank 0's
  line (the existing figure).

Every arm ends at the same point: **the launching process holds the result of a gloo all_reduce
over the 2 workers.** Cold start is reported from the moment the arm's process is launched and
after the library import (what `%colossal start` costs once the kernel has loaded the extension).
Restart: stop the workers, start fresh ones, all_reduce again (`Cluster.restart()`, which
`%colossal restart` and automatic recovery call; Monarch: `procs.stop()` and a new proc mesh).
Warm round trip: a no-op called on every worker, median of 50 (and for colab_par a trivial cell,
`cluster.execute("pass")`, what `%%colossal` runs). Edit-run: a function shipped by
value (as after an edit) that builds a small transformer, wraps it in DDP and trains one step,
median of 10, against a torchrun relaunch of the same work; the ratio is relaunch / warm call.

Phases of a script's cold start (`--phases`): fresh processes, each stamping, in seconds after
the library import, when each zygote of the warm pool serves, when the controller's connection
file appears, when both engines are registered, when `start()` returns (bootstrap done) and when the
first all_reduce is back (read by a watcher thread from the pool's sockets and the client's list
of engines).

Idle cost (`--idle`): a started 2-engine cluster left alone for 15 s, the CPU time of this process
and every process below it (controller, engines, zygotes) read from /proc before and after.

Edit-run in the first seconds after a start (`--first-seconds`): colab_par with the warm pool (whose
engine zygote makes its idle imports after serving a first start, see `colab_par/cluster/warm_pool.py`),
without it (`COLAB_PAR_WARM_POOL=0`) and Monarch, arms alternated, each sample a fresh process: from
the moment the start returns, an edit-run every `QUICK_S` for `EDIT_WINDOW_S` (what the pool did
before yielding: it imported 2 s after its last request, beside these cells), then a longer look
(`LOOK_S`: long enough for background work that waits for quiet to begin, so the next edit-run meets
it under way) and three more quick edits. Per sample: the median, mean and slowest edit-run of the
window (a cell that met background work is slower; a median hides a few such), and the first
edit-run after the look.

    python benchmarks/startup.py [--rounds 5] [--idle | --phases | --first-seconds]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import venv
from pathlib import Path

MONARCH = "torchmonarch==0.7.0"
MONARCH_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "colab_par" / "monarch-0.7.0"
WORK = textwrap.dedent("""
    def train_step():
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        torch.manual_seed(0)
        model = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        loss = ddp(torch.randn(4, 16, 64)).square().mean()
        loss.backward()
        optimizer.step()
        return float(loss.detach())
""")

EDIT_WINDOW_S = 6.0  # how long after a start the quick edit-runs go on
QUICK_S, LOOK_S = 0.3, 2.5  # the pause before a quick edit-run, and the longer look after the window


def all_reduce() -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():  # Monarch's actors join here; colab_par's engines already did
        dist.init_process_group("gloo")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


def noop() -> int:
    return 1


def forked_from() -> str | None:
    """The warm pool's zygote this engine was forked from, if it was (`colab_par.cluster.warm_pool`)."""
    import os

    return os.environ.get("COLAB_PAR_FORKED_FROM")


def _median_ms(call, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def _train_step_fn():
    """A fresh function object each call, shipped by value: what an edited cell sends."""
    namespace: dict = {}
    exec(WORK, namespace)  # noqa: S102 - the fixed workload above
    return namespace["train_step"]


def _edit_runs_after_start(call) -> dict[str, float]:
    """Edit-runs from the moment a start returned (module docstring); `call(fn)` runs `fn` on
    every worker and returns their results."""
    def edit_run_ms(pause: float) -> float:
        time.sleep(pause)
        return _median_ms(lambda: call(_train_step_fn()), 1)

    began = time.monotonic()
    assert call(all_reduce) == [2.0, 2.0]
    first_ms = edit_run_ms(0.0)  # with the one-time imports (DDP, optim)
    window = []
    while time.monotonic() - began < EDIT_WINDOW_S:
        window.append(edit_run_ms(QUICK_S))
    after_look = [edit_run_ms(LOOK_S), *(edit_run_ms(QUICK_S) for _ in range(3))]
    return {"first_edit_ms": first_ms, "edit_mean_ms": statistics.mean(window),
            "edit_ms": statistics.median(window), "edit_max_ms": max(window), "after_look_ms": after_look[0],
            "after_look_quick_ms": statistics.median(after_look[1:])}


def arm_first_seconds_colab_par() -> dict[str, float]:
    """A script's first start (the pool, unless switched off, starts with it), then edit-runs."""
    from colab_par import Cluster

    cluster = Cluster(n=2, backend="gloo", dashboard=False).start()
    stamps = _edit_runs_after_start(cluster.run)
    stamps["forked"] = float(all(cluster.run(forked_from)))
    cluster.stop()
    return stamps


def arm_first_seconds_monarch() -> dict[str, float]:
    import cloudpickle
    from monarch.actor import Actor, endpoint, this_host
    from monarch.spmd import setup_torch_elastic_env

    class Worker(Actor):
        @endpoint
        def call(self, blob: bytes):
            return cloudpickle.loads(blob)()

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    setup_torch_elastic_env(procs)
    workers = procs.spawn("worker", Worker)
    stamps = _edit_runs_after_start(
        lambda fn: [value for _, value in workers.call.call(cloudpickle.dumps(fn)).get().items()])
    procs.stop().get()
    return stamps


def first_seconds(rounds: int) -> None:
    """The three arms alternated (who goes first rotates), `rounds` fresh processes each."""
    pythons = {"first_seconds": sys.executable, "first_seconds_nopool": sys.executable,
               "first_seconds_monarch": monarch_python()}
    arms = list(pythons)
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for index in range(rounds):
        for arm in arms[index % len(arms):] + arms[:index % len(arms)]:
            env = {**os.environ, **({"COLAB_PAR_WARM_POOL": "0"} if arm.endswith("nopool") else {})}
            done = subprocess.run([pythons[arm], __file__, "--arm", arm], capture_output=True, text=True,
                                  timeout=300, env=env)
            if done.returncode:
                raise RuntimeError(f"arm {arm} failed:\n{done.stderr[-3000:]}")
            samples[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {index + 1}/{rounds} done", file=sys.stderr)

    def column(arm: str, key: str) -> list[float]:
        return [sample[key] for sample in samples[arm]]

    print(f"edit-run (build + DDP + one step) every {QUICK_S} s in the first {EDIT_WINDOW_S:.0f} s after a "
          f"start, then after a {LOOK_S} s look; {rounds} rounds, arms rotated, each sample a fresh process; "
          "median over the samples (min-max)")
    print("| edit-run | colab_par, warm pool | colab_par, COLAB_PAR_WARM_POOL=0 | Monarch 0.7.0 |\n|---|---|---|---|")
    rows = (("first_edit_ms", "first (one-time imports)"), ("edit_ms", "in the window: median"),
            ("edit_mean_ms", "in the window: mean"), ("edit_max_ms", "in the window: slowest"),
            ("after_look_ms", f"first after the {LOOK_S} s look"),
            ("after_look_quick_ms", "the three quick ones after it"))
    for key, what in rows:
        print(f"| {what} | " + " | ".join(_spread(column(arm, key), "ms") for arm in arms) + " |")
    print()
    for key, what in rows[1:]:
        pool, nopool, monarch = (statistics.median(column(arm, key)) for arm in arms)
        print(f"{what}: pool on / pool off {pool / nopool:.2f} (goal <= 1.10), pool on / Monarch "
              f"{pool / monarch:.2f} (goal <= 1.0)")
    print("engines forked from the pool in every pool-on sample: "
          f"{all(s['forked'] == 1.0 for s in samples['first_seconds'])}, in none without it: "
          f"{not any(s['forked'] for s in samples['first_seconds_nopool'])}")


# ---- arms, each run in a fresh process: `python startup.py --arm NAME` prints one JSON line -----
def arm_colab_par(notebook: bool) -> dict[str, float]:
    stamps = {"process": time.time()}
    from colab_par import Cluster
    from colab_par.cluster import warm_pool
    assert warm_pool.FORKED_ENV == "COLAB_PAR_FORKED_FROM"

    stamps["imported"] = time.time()
    if notebook:
        warm_pool.prestart()  # what `%load_ext colab_par` does
        assert warm_pool.shared_pool().wait_ready(), "the warm pool did not come up"
        stamps["imported"] = time.time()
    cluster = Cluster(n=2, backend="gloo", dashboard=False).start()
    assert cluster.run(all_reduce) == [2.0, 2.0]
    stamps["all_reduce"] = time.time()
    forked = cluster.run(forked_from)
    cluster.restart()
    assert cluster.run(all_reduce) == [2.0, 2.0]
    stamps["restarted"] = time.time()
    stamps["warm_ms"] = _median_ms(lambda: cluster.run(noop), 50)
    stamps["cell_ms"] = _median_ms(lambda: cluster.execute("pass"), 50)  # what a trivial %%colossal cell costs
    cluster.run(_train_step_fn())  # one-time imports (DDP, optim) on the engines
    stamps["edit_run_ms"] = _median_ms(lambda: cluster.run(_train_step_fn()), 10)
    stamps["forked"] = float(all(forked))
    cluster.stop()
    return stamps


def arm_monarch() -> dict[str, float]:
    stamps = {"process": time.time()}
    import cloudpickle
    from monarch.actor import Actor, endpoint, this_host
    from monarch.spmd import setup_torch_elastic_env

    stamps["imported"] = time.time()

    class Worker(Actor):
        @endpoint
        def call(self, blob: bytes):
            return cloudpickle.loads(blob)()

    def start():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        setup_torch_elastic_env(procs)
        return procs, procs.spawn("worker", Worker)

    def on_all(workers, fn):
        return [value for _, value in workers.call.call(cloudpickle.dumps(fn)).get().items()]

    procs, workers = start()
    assert on_all(workers, all_reduce) == [2.0, 2.0]
    stamps["all_reduce"] = time.time()
    procs.stop().get()
    procs, workers = start()
    assert on_all(workers, all_reduce) == [2.0, 2.0]
    stamps["restarted"] = time.time()
    blob = cloudpickle.dumps(noop)
    stamps["warm_ms"] = _median_ms(lambda: workers.call.call(blob).get(), 50)
    on_all(workers, _train_step_fn())
    stamps["edit_run_ms"] = _median_ms(lambda: on_all(workers, _train_step_fn()), 10)
    procs.stop().get()
    return stamps


TORCHRUN_SCRIPT = WORK + textwrap.dedent("""
    import json, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    stamps = {"all_reduce": time.time()}
    train_step()
    stamps["train_step"] = time.time()
    if dist.get_rank() == 0:
        print("done", json.dumps(stamps), flush=True)
    dist.destroy_process_group()
""")


def sample_torchrun(script: Path) -> dict[str, float]:
    """From launch to rank 0's line (after the all_reduce and one training step)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), str(script)]
    launched = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = ""
    while not line.startswith("done"):
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"torchrun exited ({process.wait()}) before rank 0 reported")
    stamps = json.loads(line.split(" ", 1)[1])
    process.stdout.read()
    if process.wait() != 0:
        raise RuntimeError(f"torchrun failed with exit status {process.returncode}")
    return {"cold_s": stamps["all_reduce"] - launched, "relaunch_s": stamps["train_step"] - launched}


def sample_arm(python: str, arm: str) -> dict[str, float]:
    env = {**os.environ, **({"COLAB_PAR_WARM_POOL": "0"} if arm == "colab_par_nopool" else {})}
    launched = time.time()
    done = subprocess.run([python, __file__, "--arm", arm], capture_output=True, text=True, timeout=300,
                          env=env)
    if done.returncode:
        raise RuntimeError(f"arm {arm} failed:\n{done.stderr[-3000:]}")
    stamps = json.loads(done.stdout.strip().splitlines()[-1])
    return {"cold_s": stamps["all_reduce"] - launched,
            "cold_after_import_s": stamps["all_reduce"] - stamps["imported"],
            "restart_s": stamps["restarted"] - stamps["all_reduce"],
            "warm_ms": stamps["warm_ms"], "edit_run_ms": stamps["edit_run_ms"],
            **{key: stamps[key] for key in ("forked", "cell_ms") if key in stamps}}


def arm_phases() -> dict[str, float]:
    """One script cold start, with the time each phase ended (see the module's docstring)."""
    import threading

    from colab_par import Cluster
    from colab_par.cluster import warm_pool

    imported = time.time()
    stamps: dict[str, float] = {}
    cluster = Cluster(n=2, backend="gloo", dashboard=False)
    done = threading.Event()

    def mark(name: str) -> None:
        stamps.setdefault(name, time.time() - imported)

    def watch() -> None:
        while not done.is_set():
            pool = warm_pool._SHARED  # noqa: SLF001 - a benchmark reading the pool's state
            for target in ("controller", "engine"):
                if pool is not None and os.path.exists(pool.socket_path(target)):
                    mark(f"{target} zygote ready")
            ipp_cluster = cluster._ipp  # noqa: SLF001
            controller = ipp_cluster.controller if ipp_cluster is not None else None
            if controller is not None and os.path.exists(controller.connection_files["engine"]):
                mark("controller ready")
            client = cluster._client  # noqa: SLF001
            if client is not None and len(client.ids) >= 2:
                mark("engines registered")
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cluster.start()
    mark("bootstrap done")
    assert cluster.run(all_reduce) == [2.0, 2.0]
    mark("first all_reduce")
    done.set()
    watcher.join()
    cluster.stop()
    return stamps


def phases(rounds: int) -> None:
    samples = []
    for _ in range(rounds):
        done = subprocess.run([sys.executable, __file__, "--arm", "phases"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"the phases sample failed:\n{done.stderr[-3000:]}")
        samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"script cold start, {rounds} fresh processes: seconds after `import colab_par`, median (min-max)")
    names = sorted(samples[0], key=lambda name: statistics.median(s[name] for s in samples))
    for name in names:
        print(f"| {name} | {_spread([s[name] for s in samples])} |")


def _cpu_seconds(pids: set[int]) -> float:
    """utime + stime of `pids` from /proc (processes gone meanwhile count zero)."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def idle_cpu(seconds: float = 15.0) -> None:
    """Percent of one core that a running, idle 2-engine cluster costs (all its processes)."""
    from colab_par import Cluster
    from colab_par.cluster import descendant_pids

    cluster = Cluster(n=2, backend="gloo", dashboard=False).start()
    for _ in range(50):
        cluster.run(noop)  # the direct channels are open and used
    time.sleep(1.0)
    pids = descendant_pids() | {os.getpid()}
    before = _cpu_seconds(pids)
    time.sleep(seconds)
    spent = _cpu_seconds(pids) - before
    print(f"idle {seconds:.0f} s, {len(pids)} processes: {spent:.2f} s CPU = "
          f"{100 * spent / seconds:.1f} % of one core")
    cluster.stop()


def monarch_python() -> str:
    """Monarch's interpreter, in its own venv (created and filled once, then reused). torch is
    pinned to the project's version, so both arms import the same torch."""
    python = MONARCH_VENV / "bin" / "python"
    if not python.exists() or subprocess.run([python, "-c", "import monarch.actor"],
                                             capture_output=True).returncode:
        import torch

        print(f"installing {MONARCH} into {MONARCH_VENV} (once)", file=sys.stderr)
        venv.create(MONARCH_VENV, with_pip=True, clear=True)
        subprocess.run([python, "-m", "pip", "install", "-q", MONARCH,
                        f"torch=={torch.__version__.split('+')[0]}"], check=True)
    return str(python)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    values = [v * scale for v in values]
    digits = 1 if unit == "ms" else 2
    return (f"{statistics.median(values):.{digits}f} {unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="samples per arm (at least 3)")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # one sample, in this fresh process
    parser.add_argument("--idle", action="store_true", help="measure a running cluster's idle CPU")
    parser.add_argument("--phases", action="store_true", help="when each phase of a script's cold start ends")
    parser.add_argument("--first-seconds", action="store_true",
                        help="only the edit-run in the first seconds after a start: pool on, off, Monarch")
    args = parser.parse_args()
    if args.idle:
        idle_cpu()
        return
    if args.phases:
        phases(args.rounds)
        return
    if args.arm:
        runs = {"colab_par": lambda: arm_colab_par(False), "colab_par_nopool": lambda: arm_colab_par(False),
                "colab_par_notebook": lambda: arm_colab_par(True),
                "monarch": arm_monarch, "phases": arm_phases, "first_seconds": arm_first_seconds_colab_par,
                "first_seconds_nopool": arm_first_seconds_colab_par, "first_seconds_monarch": arm_first_seconds_monarch}
        print(json.dumps(runs[args.arm]()))
        return
    if args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: take at least 3 for a median and a spread")
    if args.first_seconds:
        first_seconds(args.rounds)
        return
    pythons = {"colab_par": sys.executable, "colab_par_nopool": sys.executable,
               "colab_par_notebook": sys.executable,
               "monarch": monarch_python()}
    arms = [*pythons, "torchrun"]
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "work.py"
        script.write_text(TORCHRUN_SCRIPT)
        for index in range(args.rounds):
            order = arms[index % len(arms):] + arms[:index % len(arms)]  # rotate who goes first
            for arm in order:
                samples[arm].append(sample_torchrun(script) if arm == "torchrun"
                                    else sample_arm(pythons[arm], arm))
            print(f"round {index + 1}/{args.rounds} done", file=sys.stderr)
    report(samples, args.rounds)


def report(samples: dict[str, list[dict[str, float]]], rounds: int) -> None:
    def column(arm: str, key: str) -> list[float]:
        return [sample[key] for sample in samples[arm]]

    def median(arm: str, key: str) -> float:
        return statistics.median(column(arm, key))

    print(f"{rounds} rounds, arms rotated; each sample a fresh process; median (min-max)")
    print("| measurement | colab_par | colab_par, warm pool (notebook) | Monarch 0.7.0 | torchrun |")
    print("|---|---|---|---|---|")
    print(f"| cold: launch to first all_reduce | {_spread(column('colab_par', 'cold_s'))} | "
          f"{_spread(column('colab_par_notebook', 'cold_s'))} | {_spread(column('monarch', 'cold_s'))} | "
          f"{_spread(column('torchrun', 'cold_s'))} |")
    print("| cold: after the library import (+ pool ready) | "
          + " | ".join(_spread(column(arm, "cold_after_import_s")) for arm in
                       ("colab_par", "colab_par_notebook", "monarch")) + " | - |")
    print("| restart + all_reduce | " + " | ".join(_spread(column(arm, "restart_s")) for arm in
                                                 ("colab_par", "colab_par_notebook", "monarch"))
          + f" | {_spread(column('torchrun', 'cold_s'))} (relaunch) |")
    print("| warm no-op on every worker | " + " | ".join(
        _spread(column(arm, "warm_ms"), "ms") for arm in ("colab_par", "colab_par_notebook", "monarch"))
          + " | - |")
    print("| warm trivial cell on every worker (`%%colossal pass`) | " + " | ".join(
        _spread(column(arm, "cell_ms"), "ms") for arm in ("colab_par", "colab_par_notebook")) + " | - | - |")
    print("| edit-run: build + DDP + one step | " + " | ".join(
        _spread(column(arm, "edit_run_ms"), "ms") for arm in ("colab_par", "colab_par_notebook", "monarch"))
          + f" | {_spread(column('torchrun', 'relaunch_s'))} (relaunch) |")
    forked = all(s["forked"] == 1.0 for s in samples["colab_par_notebook"] + samples["colab_par"])
    print(f"\nengines forked from the warm pool in every colab_par sample: {forked}; "
          f"in none with COLAB_PAR_WARM_POOL=0: {not any(s['forked'] for s in samples['colab_par_nopool'])}")
    print("without the pool (COLAB_PAR_WARM_POOL=0): " + "; ".join(
        f"{key} {_spread(column('colab_par_nopool', key))}"
        for key in ("cold_s", "cold_after_import_s", "restart_s")))
    monarch = {key: median("monarch", key)
               for key in ("cold_s", "cold_after_import_s", "restart_s", "warm_ms")}
    print("\n| ratio (colab_par / Monarch; lower is better) | script | notebook |\n|---|---|---|")
    for key, what, goal in (("cold_s", "cold, from launch", "<= 1.0"),
                            ("cold_after_import_s", "cold, after import", "<= 1.0"),
                            ("restart_s", "restart", "<= 1.0"), ("warm_ms", "warm round trip", "<= 2.0")):
        print(f"| {what} (goal {goal}) | {median('colab_par', key) / monarch[key]:.2f} | "
              f"{median('colab_par_notebook', key) / monarch[key]:.2f} |")
    print(f"| warm trivial cell / Monarch's warm call (goal <= 2.0) | "
          f"{median('colab_par', 'cell_ms') / monarch['warm_ms']:.2f} | "
          f"{median('colab_par_notebook', 'cell_ms') / monarch['warm_ms']:.2f} |")
    relaunch_ms = median("torchrun", "relaunch_s") * 1000
    print(f"| cold from launch vs torchrun (colab_par / torchrun) | "
          f"{median('colab_par', 'cold_s') / median('torchrun', 'cold_s'):.2f} | "
          f"{median('colab_par_notebook', 'cold_s') / median('torchrun', 'cold_s'):.2f} |")
    print(f"| edit-run: torchrun relaunch / warm call (goal >= 25) | "
          f"{relaunch_ms / median('colab_par', 'edit_run_ms'):.0f}x | "
          f"{relaunch_ms / median('colab_par_notebook', 'edit_run_ms'):.0f}x |")
    print(f"| edit-run, Monarch for reference: relaunch / warm call | "
          f"{relaunch_ms / median('monarch', 'edit_run_ms'):.0f}x | |")


if __name__ == "__main__":
    main()
