"""Train many trials at once on the running engines: the model-selection sweep driver.

The notebook's kernel schedules; engines compute. Each engine is sent one task at a time through
ipyparallel (a trial's init, or one forward/backward of one of its shards); when it returns, the
engine is free and the policy (`policies.py`) gives it the runnable trial it prefers. Trials that
fit an engine are one shard and run task-parallel; trials that do not are spilled (`shards.py`)
and their shards run wherever an engine is free (shard parallelism), through the shared-memory
spill store. No torch.distributed collective is involved: trials are independent.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Iterable

import cloudpickle

from colab_par.selection import worker
from colab_par.selection.halving import Halving
from colab_par.selection.policies import POLICIES
from colab_par.selection.predict import predict_makespan, slowest
from colab_par.selection.results import SweepResult
from colab_par.selection.schedule import PLACEMENTS, Schedule, TrialRun, TrialShape
from colab_par.selection.shards import ShardPlan, plan_shards
from colab_par.selection.store import SpillStore
from colab_par.selection.trial import Trial
from colab_par.cluster.ship import ship_by_value

__all__ = ["select"]

_POLL_S = 0.002
_ALIVE_CHECK_S = 0.5


def select(trials: Iterable[Trial], *, cluster: Any = None, budget: int | None = None,
           scheduler: str = "lrtf", placement: str = "shard", halving: Halving | None = None,
           seed: int = 0, view: Any = "auto") -> SweepResult:
    """Train every trial on the running cluster's engines and return their results.

    `budget`: bytes of shards one engine may hold at once (its device memory); it defaults to the
    smallest free device memory on GPU engines and must be given for CPU engines. `scheduler`:
    "lrtf" (Sharded-LRTF), "fifo" or "random". `placement`: "shard" (a trial's next shard runs on
    whichever engine is free), "pinned" (each trial stays on the first engine it ran on: task
    parallelism without migration) or "model-parallel" (Hydra's baseline: each trial split over
    all engines, trained one after another). `halving`: successive halving, e.g.
    `Halving(first=4)` keeps the better half of the trials at steps 4, 8, 16, … (the others end
    "pruned"); the predicted makespan is then an upper bound. `view`: "auto" shows the live selection view in a
    notebook, None shows nothing, or an object with `update(result)`/`finish(result)`.
    Interrupting (the stop button) ends the sweep after the tasks in flight and keeps the results;
    an engine that dies hands its trials to the others, each from the start of the step it was in.
    """
    trials = list(trials)
    cluster = _running_cluster(cluster)
    _check(trials, scheduler, placement, halving)
    budget = _budget(cluster, budget)
    parts = cluster.n if placement == "model-parallel" else None
    plans = [plan_shards(trial, budget, parts) for trial in trials]  # refuses bad trials before any work
    shapes = [trial_shape(trial, plan) for trial, plan in zip(trials, plans)]
    schedule = Schedule(shapes, scheduler=scheduler, placement=placement, engines=cluster.n, seed=seed,
                        halving=halving)
    display = _view(view)
    store, sweep_id = SpillStore.create(), uuid.uuid4().hex
    ship_by_value(*[fn for trial in trials for fn in (trial.model, trial.data, trial.loss)])
    payload = cloudpickle.dumps((trials, plans))
    result = SweepResult([run.result for run in schedule.runs], [], 0.0, scheduler, {}, budget, placement)
    try:
        opened = [cluster.submit(rank, worker.open_sweep, sweep_id, str(store.root), payload, budget,
                                 device) for rank, device in enumerate(cluster.devices)]
        speeds = []
        for rank, async_result in enumerate(opened):
            if not async_result.wait(cluster.timeout) or async_result.error:
                cluster.check_alive([rank])
            speeds.append(async_result.get(0))
        result.predicted_makespan = predict_makespan(plans, shapes, cluster.n, scheduler, placement, seed,
                                                     slowest(speeds), _round_trip(cluster), halving)
        t0 = _drive(cluster, schedule, sweep_id, result, display)
        result.makespan = time.time() - t0
    finally:
        dead = set(cluster.dead_ranks())
        for rank in [r for r in range(cluster.n) if r not in dead]:
            peak = cluster.submit(rank, worker.close_sweep, sweep_id).get(timeout=cluster.timeout)
            result.peak_resident[rank] = max(result.peak_resident.get(rank, 0), peak)
        store.remove()
    if display is not None:
        display.finish(result)
    return result


def _drive(cluster: Any, schedule: Schedule, sweep_id: str, result: SweepResult, display: Any) -> float:
    """Run tasks until none is left; returns the time the sweep's clock started, which is after
    the view's first frame (matplotlib's import and the figure take longer than most tasks)."""
    in_flight: dict[int, tuple[TrialRun, dict[str, Any], Any]] = {}
    stopping = False
    try:
        if display is not None:
            display.update(result)
    except KeyboardInterrupt:
        stopping = True
        schedule.stop()
    t0 = time.time()
    while True:
        try:
            if not stopping:
                for rank in [r for r in schedule.alive if r not in in_flight]:
                    assigned = schedule.assign(rank)
                    if assigned is not None:
                        run, task = assigned
                        in_flight[rank] = (run, task, cluster.submit(rank, worker.run_task, sweep_id, task))
            if not in_flight:
                return t0
            if display is not None:  # drawn while the engines compute, never while one waits
                result.makespan = time.time() - t0
                display.update(result)
            _collect(cluster, schedule, in_flight, t0, result)
        except KeyboardInterrupt:
            stopping = True  # finish what runs, start nothing new, keep the results
            schedule.stop()


def _collect(cluster: Any, schedule: Schedule, in_flight: dict, t0: float, result: SweepResult) -> None:
    """Wait until at least one task ends or an engine dies, and record what happened."""
    checked = time.monotonic()
    while not any(async_result.ready() for _, _, async_result in in_flight.values()):
        time.sleep(_POLL_S)
        if time.monotonic() - checked > _ALIVE_CHECK_S:
            if _lose_dead_engines(cluster, schedule, in_flight, result):
                return
            checked = time.monotonic()
    for rank in [r for r, (_, _, ar) in in_flight.items() if ar.ready()]:
        run, task, async_result = in_flight.pop(rank)
        try:
            out = async_result.get()
        except Exception as exc:  # noqa: BLE001 - the trial's error is its result; the rest go on
            if rank in cluster.dead_ranks():  # the engine died under it: no fault of the trial
                in_flight[rank] = (run, task, async_result)
                _lose_dead_engines(cluster, schedule, in_flight, result)
                continue
            run.fail(f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}")
            continue
        result.peak_resident[rank] = max(result.peak_resident.get(rank, 0), out["peak"])
        result.timeline.append(run.complete(task, out, rank, t0))


def _lose_dead_engines(cluster: Any, schedule: Schedule, in_flight: dict, result: SweepResult) -> bool:
    """Hand the trials of engines that died to the others; raise when none is left."""
    lost = [rank for rank in cluster.dead_ranks() if rank in schedule.alive]
    for rank in lost:
        run = in_flight.pop(rank, (None,))[0]
        schedule.engine_lost(rank, run)
        result.lost_engines.append(rank)
    if lost and not schedule.alive:
        cluster.check_alive(lost)  # raises DeadEngineError naming them
    return bool(lost)


def trial_shape(trial: Trial, plan: ShardPlan) -> TrialShape:
    return TrialShape(trial.name, trial.steps, len(plan.shards), plan.param_bytes, dict(trial.config))


def _round_trip(cluster: Any, tries: int = 5) -> float:
    """Seconds a no-op task takes from the notebook to an engine and back (the fastest of a few)."""
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        cluster.submit(0, worker.ping).get(timeout=cluster.timeout)
        best = min(best, time.perf_counter() - started)
    return best


def _running_cluster(cluster: Any) -> Any:
    if cluster is None:
        from colab_par.notebook.magics import default_cluster
        cluster = default_cluster()
    if cluster is None or not cluster.running:
        raise RuntimeError("no engines are running: start them with `%colossal start` (or "
                           "Cluster(n=2).start()) and pass cluster= to select()")
    return cluster


def _check(trials: list[Trial], scheduler: str, placement: str, halving: Halving | None) -> None:
    if not trials:
        raise ValueError("no trials to select from: pass a list of Trial, e.g. grid(make, lr=[1e-3, 3e-3])")
    if scheduler not in POLICIES:
        raise ValueError(f"scheduler={scheduler!r} is not one of {', '.join(POLICIES)}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not one of {', '.join(PLACEMENTS)}")
    names = [trial.name for trial in trials]
    unnamed = [i for i, name in enumerate(names) if not name]
    if unnamed:
        raise ValueError(f"trial(s) at position {unnamed} have no name; give each Trial a name= "
                         "or build them with grid(), which names them")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"trial names must be unique; {', '.join(duplicates)} repeat")
    if halving is not None:
        if not isinstance(halving, Halving):
            raise TypeError(f"halving={halving!r}: pass Halving(first=..., factor=2) or None")
        longest = max(trial.steps for trial in trials)
        if not halving.rungs(longest):
            raise ValueError(f"halving's first rung, step {halving.first}, is not before the longest trial's "
                             f"last step ({longest}): use Halving(first={max(1, longest // 4)}) or fewer")


def _budget(cluster: Any, budget: int | None) -> int:
    if budget is not None:
        if budget <= 0:
            raise ValueError(f"budget={budget!r} must be a positive number of bytes, e.g. 512 * 2**20")
        return int(budget)
    if all(str(device).startswith("cuda") for device in cluster.devices):
        return min(cluster.run(_free_device_memory))
    raise ValueError("on CPU engines the per-engine budget is an explicit number of bytes: pass "
                     "budget=, e.g. select(trials, budget=256 * 2**20)")


def _free_device_memory() -> int:
    import torch
    return torch.cuda.mem_get_info()[0]


def _view(view: Any) -> Any:
    if view == "auto":
        from colab_par.selection.view import SelectionView
        return SelectionView()
    return view
