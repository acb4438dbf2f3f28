"""Train many trials at once on the running engines: the model-selection sweep driver.

The notebook's kernel schedules; engines compute. Each engine is sent one task at a time through
ipyparallel (a trial's init, or one forward/backward of one of its shards); when it returns, the
engine is free and the policy (`policies.py`) gives it the runnable trial it prefers. Trials that
fit an engine are one shard and run task-parallel; trials that do not are spilled (`shards.py`)
and their shards run wherever an engine is free (shard parallelism), through the shared-memory
spill store. No torch.distributed collective is involved: trials are independent.
"""
from __future__ import annotations

import random
import time
import uuid
from typing import Any, Iterable

import cloudpickle

from colab_par.selection import worker
from colab_par.selection.policies import POLICIES, pick
from colab_par.selection.results import Span, SweepResult, TrialResult
from colab_par.selection.shards import ShardPlan, plan_shards
from colab_par.selection.store import SpillStore
from colab_par.selection.trial import Trial
from colab_par.ship import ship_by_value

__all__ = ["select"]

_POLL_S = 0.002
_ALIVE_CHECK_S = 0.5


class _TrialState:
    """The scheduler's view of one trial: where its step is, its shards' versions, its timing."""

    def __init__(self, index: int, trial: Trial, plan: ShardPlan):
        self.index, self.trial, self.plan = index, trial, plan
        n = len(plan.shards)
        self.tasks = ([("forward", k) for k in range(n - 1)] + [("forward_backward", n - 1)]
                      + [("backward", k) for k in range(n - 2, -1, -1)])
        self.result = TrialResult(trial.name, dict(trial.config), trial.steps, shards=n)
        self.step, self.position, self.initialised = 0, 0, False
        self.versions = [0] * n
        self.shapes: dict[str, list[int]] = {}
        self.in_flight, self.pinned = False, None
        self.step_seconds: list[float] = []
        self.current_step_seconds = 0.0

    @property
    def finished(self) -> bool:
        return self.result.status in ("done", "failed", "stopped")

    def runnable(self, rank: int, migrate: bool) -> bool:
        return not self.finished and not self.in_flight and (migrate or self.pinned in (None, rank))

    def remaining_seconds(self, fallback_rate: float = 1e-9) -> float:
        """Measured (or, before the first step, size-estimated) step time × the steps left."""
        per_step = (sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds
                    else self.plan.param_bytes * fallback_rate)
        done = self.position / len(self.tasks)
        return per_step * (self.trial.steps - self.step - done)

    def next_task(self) -> dict[str, Any]:
        if not self.initialised:
            return {"trial": self.index, "kind": "init"}
        kind, k = self.tasks[self.position]
        task = {"trial": self.index, "kind": kind, "shard": k, "step": self.step,
                "version": self.versions[k], "input_shape": self.shapes.get(f"act{k}"),
                "grad_shape": self.shapes.get(f"grad{k + 1}")}
        following = self.tasks[(self.position + 1) % len(self.tasks)][1]
        if following != k:  # the shard this trial needs next: worth fetching beside this one
            task["prefetch"] = (following, self.versions[following])
        return task

    def complete(self, task: dict[str, Any], out: dict[str, Any], rank: int, t0: float) -> Span:
        self.in_flight = False
        seconds = out["end"] - out["start"]
        self.result.seconds += seconds
        self.result.engines.add(rank)
        if task["kind"] == "init":
            self.initialised = True
            return Span(rank, self.trial.name, 0, -1, "init", out["start"] - t0, out["end"] - t0)
        k = task["shard"]
        if "output_shape" in out:
            self.shapes[f"act{k + 1}"] = out["output_shape"]
        if "grad_shape" in out:
            self.shapes[f"grad{k}"] = out["grad_shape"]
        if task["kind"] != "forward":
            self.versions[k] += 1
        if out.get("loss") is not None:
            self.result.losses.append(out["loss"])
        self.current_step_seconds += seconds
        self.position += 1
        if self.position == len(self.tasks):
            self.position, self.step = 0, self.step + 1
            self.step_seconds.append(self.current_step_seconds)
            self.current_step_seconds = 0.0
            if self.step == self.trial.steps:
                self.result.status = "done"
        return Span(rank, self.trial.name, task["step"], k, task["kind"], out["start"] - t0, out["end"] - t0)

    def fail(self, error: str) -> None:
        self.in_flight = False
        self.result.status, self.result.error = "failed", error


def select(trials: Iterable[Trial], *, cluster: Any = None, budget: int | None = None,
           scheduler: str = "lrtf", migrate: bool = True, seed: int = 0, view: Any = "auto") -> SweepResult:
    """Train every trial on the running cluster's engines and return their results.

    `budget`: bytes of shards one engine may hold at once (its device memory); it defaults to the
    smallest free device memory on GPU engines and must be given for CPU engines. `scheduler`:
    "lrtf" (Sharded-LRTF), "fifo" or "random". `migrate=False` keeps each trial on the first engine
    it ran on (task parallelism without shard migration). `view`: "auto" shows the live selection
    view in a notebook, None shows nothing, or an object with `update(result)`/`finish(result)`.
    Interrupting (the stop button) ends the sweep after the tasks in flight and keeps the results.
    """
    trials = list(trials)
    cluster = _running_cluster(cluster)
    _check(trials, scheduler)
    budget = _budget(cluster, budget)
    plans = [plan_shards(trial, budget) for trial in trials]  # refuses bad trials before any work
    states = [_TrialState(i, trial, plan) for i, (trial, plan) in enumerate(zip(trials, plans))]
    display = _view(view)
    store, sweep_id = SpillStore.create(), uuid.uuid4().hex
    ship_by_value(*[fn for trial in trials for fn in (trial.model, trial.data, trial.loss)])
    payload = cloudpickle.dumps((trials, plans))
    timeline: list[Span] = []
    t0 = time.time()
    result = SweepResult([s.result for s in states], timeline, 0.0, scheduler, {}, budget)
    try:
        opened = [cluster.submit(rank, worker.open_sweep, sweep_id, str(store.root), payload, budget,
                                 device) for rank, device in enumerate(cluster.devices)]
        for rank, async_result in enumerate(opened):
            if not async_result.wait(cluster.timeout) or async_result.error:
                cluster.check_alive([rank])
            async_result.get(0)
        _drive(cluster, states, sweep_id, scheduler, migrate, random.Random(seed), timeline, t0,
               result, display)
    finally:
        dead = set(cluster.dead_ranks())
        for rank in [r for r in range(cluster.n) if r not in dead]:
            peak = cluster.submit(rank, worker.close_sweep, sweep_id).get(timeout=cluster.timeout)
            result.peak_resident[rank] = max(result.peak_resident.get(rank, 0), peak)
        store.remove()
    result.makespan = time.time() - t0
    if display is not None:
        display.finish(result)
    return result


def _drive(cluster: Any, states: list[_TrialState], sweep_id: str, scheduler: str, migrate: bool,
           rng: random.Random, timeline: list[Span], t0: float, result: SweepResult, display: Any) -> None:
    in_flight: dict[int, tuple[_TrialState, dict[str, Any], Any]] = {}
    stopping = False
    while True:
        try:
            if not stopping:
                _dispatch(cluster, states, sweep_id, scheduler, migrate, rng, in_flight)
            if not in_flight:
                return
            _collect(cluster, in_flight, timeline, t0, result)
            if display is not None:
                result.makespan = time.time() - t0
                display.update(result)
        except KeyboardInterrupt:
            stopping = True  # finish what runs, start nothing new, keep the results
            for state in states:
                if not state.finished:
                    state.result.status = "stopped"


def _dispatch(cluster: Any, states: list[_TrialState], sweep_id: str, scheduler: str, migrate: bool,
              rng: random.Random, in_flight: dict) -> None:
    rate = _seconds_per_param_byte(states)
    for rank in range(cluster.n):
        if rank in in_flight:
            continue
        runnable = [s for s in states if s.runnable(rank, migrate)]
        if not runnable:
            continue
        state = pick(scheduler, [_Estimate(s, rate) for s in runnable], rng).state
        state.pinned = rank if state.pinned is None else state.pinned
        task = state.next_task()
        state.in_flight = True
        state.result.status = "running"
        in_flight[rank] = (state, task, cluster.submit(rank, worker.run_task, sweep_id, task))


def _collect(cluster: Any, in_flight: dict, timeline: list[Span], t0: float, result: SweepResult) -> None:
    """Wait until at least one task ends, never on a dead engine; record every ended one."""
    checked = time.monotonic()
    while not any(async_result.ready() for _, _, async_result in in_flight.values()):
        time.sleep(_POLL_S)
        if time.monotonic() - checked > _ALIVE_CHECK_S:
            cluster.check_alive(in_flight)
            checked = time.monotonic()
    for rank in [r for r, (_, _, ar) in in_flight.items() if ar.ready()]:
        state, task, async_result = in_flight.pop(rank)
        try:
            out = async_result.get()
        except Exception as exc:  # noqa: BLE001 - the trial's error is its result; the rest go on
            cluster.check_alive([rank])  # unless the engine died: that is no fault of the trial
            state.fail(f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}")
            continue
        result.peak_resident[rank] = max(result.peak_resident.get(rank, 0), out["peak"])
        timeline.append(state.complete(task, out, rank, t0))


class _Estimate:
    """A trial as the policy sees it: its order and its estimated remaining time."""

    def __init__(self, state: _TrialState, rate: float):
        self.state, self.index, self._rate = state, state.index, rate

    def remaining_seconds(self) -> float:
        return self.state.remaining_seconds(self._rate)


def _seconds_per_param_byte(states: list[_TrialState]) -> float:
    """From the trials measured so far: how step time grows with size, to estimate the others."""
    measured = [(sum(s.step_seconds) / len(s.step_seconds), s.plan.param_bytes)
                for s in states if s.step_seconds]
    return sum(t for t, _ in measured) / sum(b for _, b in measured) if measured else 1e-9


def _running_cluster(cluster: Any) -> Any:
    if cluster is None:
        from colab_par.magics import default_cluster
        cluster = default_cluster()
    if cluster is None or not cluster.running:
        raise RuntimeError("no engines are running: start them with `%colossal start` (or "
                           "Cluster(n=2).start()) and pass cluster= to select()")
    return cluster


def _check(trials: list[Trial], scheduler: str) -> None:
    if not trials:
        raise ValueError("no trials to select from: pass a list of Trial, e.g. grid(make, lr=[1e-3, 3e-3])")
    if scheduler not in POLICIES:
        raise ValueError(f"scheduler={scheduler!r} is not one of {', '.join(POLICIES)}")
    names = [trial.name for trial in trials]
    unnamed = [i for i, name in enumerate(names) if not name]
    if unnamed:
        raise ValueError(f"trial(s) at position {unnamed} have no name; give each Trial a name= "
                         "or build them with grid(), which names them")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"trial names must be unique; {', '.join(duplicates)} repeat")


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
