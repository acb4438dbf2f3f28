"""What an engine does in a sweep: promote a trial's shard from the spill store into its own
memory, run one forward or backward of it, write the results back, and account for every byte of
shards it holds against its budget.

A trial's step over shards 0..n-1 is n-1 forwards without autograd (each writes its output, the
next shard's input, to the store), one forward+backward of the last shard with the loss, then
backwards n-2..0: each recomputes its shard's forward from the stored input and backpropagates the
gradient the shard above wrote. Every shard takes its optimizer step right after its backward. The
arithmetic is the one-process step's, cut at shard boundaries, so the losses are the same.

Shards stay resident after they ran (tagged with their version, which the scheduler counts), so a
trial that comes back to the same engine does not reload, and while one shard computes the next
one the scheduler expects is fetched beside it (double buffering) when the budget holds both.

The store keeps two slots of every shard's weights and optimizer state: version v is read from
slot v % 2 and its step writes v + 1 into the other slot. So when an engine dies mid-step, every
shard's weights as they were at the start of that step are still intact, and the scheduler
replays the step elsewhere (with a new epoch in the tag, so no copy from the lost step is reused).
"""
from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
from torch import nn

from colab_par.selection.costs import measure_speeds
from colab_par.selection.shards import ShardPlan, meta_model, shard_module
from colab_par.selection.store import SpillStore
from colab_par.selection.trial import Trial, make_optimizer

__all__ = ["open_sweep", "close_sweep", "run_task", "ping"]

_SWEEPS: dict[str, "_EngineSweep"] = {}


@dataclass
class _Resident:
    module: nn.Module
    optimizer: torch.optim.Optimizer
    tag: tuple[int, int]  # (epoch, version): see the module docstring
    charge: int  # bytes accounted for it (the plan's figure for the shard)


class _Residency:
    """The shards this engine holds, least recently used first, and the bytes they are charged."""

    def __init__(self, budget: int):
        self.budget, self.held, self.peak = budget, 0, 0
        self.shards: OrderedDict[tuple[int, int], _Resident] = OrderedDict()
        self.lock = threading.Lock()

    def reserve(self, charge: int, keep: set[tuple[int, int]]) -> bool:
        """Make room for `charge` bytes by dropping shards not in `keep`; False if it cannot fit."""
        with self.lock:
            for key in [k for k in self.shards if k not in keep]:
                if self.held + charge <= self.budget:
                    break
                self.held -= self.shards.pop(key).charge
            if self.held + charge > self.budget:
                return False
            self.held += charge
            self.peak = max(self.peak, self.held)
            return True

    def release(self, charge: int) -> None:
        with self.lock:
            self.held -= charge

    def add(self, key: tuple[int, int], resident: _Resident) -> None:
        with self.lock:
            old = self.shards.pop(key, None)
            if old is not None:
                self.held -= old.charge
            self.shards[key] = resident

    def drop(self, key: tuple[int, int]) -> None:
        with self.lock:
            old = self.shards.pop(key, None)
            if old is not None:
                self.held -= old.charge

    def get(self, key: tuple[int, int], tag: tuple[int, int]) -> _Resident | None:
        with self.lock:
            resident = self.shards.get(key)
            if resident is None or resident.tag != tag:
                return None
            self.shards.move_to_end(key)
            return resident


class _EngineSweep:
    def __init__(self, store: SpillStore, trials: list[Trial], plans: list[ShardPlan], budget: int,
                 device: torch.device):
        self.store, self.trials, self.plans, self.device = store, trials, plans, device
        self.residency = _Residency(budget)
        self.models: dict[int, nn.Module] = {}
        self.skeletons: dict[tuple[int, int], nn.Module] = {}

    def skeleton(self, t: int, k: int) -> nn.Module:
        if (t, k) not in self.skeletons:
            if t not in self.models:  # one meta build per trial, cut into each of its shards
                self.models[t] = meta_model(self.trials[t])
            self.skeletons[(t, k)] = shard_module(self.models[t], self.plans[t].shards, k)
        return self.skeletons[(t, k)]

    def load(self, t: int, k: int, tag: tuple[int, int]) -> _Resident:
        """Promote shard k of trial t, at the version in `tag`, from the store into this engine."""
        slot = tag[1] % 2
        module = copy.deepcopy(self.skeleton(t, k)).to_empty(device=self.device)
        params = dict(module.named_parameters())
        for name, param in params.items():
            param.data.copy_(self.store.get(t, f"param.{name}@{slot}", param.shape, param.dtype))
        optimizer = make_optimizer(self.trials[t], list(params.values()))
        for name, states in self.store.get_json(t, f"state{k}@{slot}.json", {}).items():
            param = params[name]
            optimizer.state[param] = {
                key: self.store.get(t, f"state.{name}.{key}@{slot}", shape, getattr(torch, dtype)).clone()
                .to(param.device if key != "step" else "cpu")
                for key, (shape, dtype) in states.items()}
        return _Resident(module, optimizer, tag, self.plans[t].shard_bytes[k])

    def write_back(self, t: int, k: int, resident: _Resident) -> None:
        """Store the shard's next version (weights and optimizer state) into the other slot."""
        epoch, version = resident.tag
        slot = (version + 1) % 2
        manifest = {}
        for name, param in resident.module.named_parameters():
            self.store.put(t, f"param.{name}@{slot}", param)
            states = resident.optimizer.state.get(param, {})
            manifest[name] = {key: (self.store.put(t, f"state.{name}.{key}@{slot}", value),
                                    str(value.dtype).removeprefix("torch."))
                              for key, value in states.items() if torch.is_tensor(value)}
        self.store.put_json(t, f"state{k}@{slot}.json", manifest)
        resident.tag = (epoch, version + 1)


def open_sweep(sweep_id: str, store_root: str, payload: bytes, budget: int, device: str) -> dict[str, float]:
    """Join a sweep: its trials and plans arrive pickled by value (notebook definitions). Returns
    this engine's measured speeds, which the makespan prediction uses (`predict.py`)."""
    trials, plans = cloudpickle.loads(payload)
    _SWEEPS[sweep_id] = _EngineSweep(SpillStore(store_root), trials, plans, budget, torch.device(device))
    return measure_speeds(torch.device(device), trials)


def ping() -> None:
    """A task that does nothing: its round trip is the sweep's per-task dispatch cost."""


def close_sweep(sweep_id: str) -> int:
    """Leave a sweep, freeing its resident shards; returns the most shard bytes held at once."""
    sweep = _SWEEPS.pop(sweep_id, None)
    return 0 if sweep is None else sweep.residency.peak


def run_task(sweep_id: str, task: dict[str, Any]) -> dict[str, Any]:
    """Run one task (see the module docstring); returns its timing, loss and output shapes."""
    sweep = _SWEEPS[sweep_id]
    started = time.time()
    if task["kind"] == "init":
        out = _init(sweep, task["trial"])
    else:
        out = _run_shard(sweep, task)
    return {**out, "start": started, "end": time.time(), "peak": sweep.residency.peak}


def _init(sweep: _EngineSweep, t: int) -> dict[str, Any]:
    """Build the trial under its seed, as one process would, and write its weights to the store."""
    model = sweep.trials[t].build()
    for name, param in model.named_parameters():
        sweep.store.put(t, f"param.{name}@0", param)
    return {}


def _run_shard(sweep: _EngineSweep, task: dict[str, Any]) -> dict[str, Any]:
    t, k, kind, step = task["trial"], task["shard"], task["kind"], task["step"]
    trial, plan = sweep.trials[t], sweep.plans[t]
    key, tag = (t, k), (task["epoch"], task["version"])
    resident = sweep.residency.get(key, tag)
    if resident is None:
        sweep.residency.drop(key)
        if not sweep.residency.reserve(plan.shard_bytes[k], keep=set()):
            raise MemoryError(f"shard {k} of trial {trial.name!r} ({plan.shard_bytes[k]} bytes) does not "
                              f"fit this engine's budget of {plan.budget} bytes")
        resident = sweep.load(t, k, tag)
        sweep.residency.add(key, resident)
    hint = task.get("prefetch")
    prefetch = _start_prefetch(sweep, t, hint and (hint[0], (task["epoch"], hint[1])), keep={key})
    try:
        out = _compute(sweep, t, k, kind, step, task, resident)
    finally:
        if prefetch is not None:
            prefetch.join()
    if kind != "forward":  # its optimizer stepped: the store gets the new weights and state
        sweep.write_back(t, k, resident)
    return out


def _compute(sweep: _EngineSweep, t: int, k: int, kind: str, step: int, task: dict[str, Any],
             resident: _Resident) -> dict[str, Any]:
    trial, store, device = sweep.trials[t], sweep.store, sweep.device
    # the step's data only where it is used: the first shard's inputs, the last shard's targets
    batch = trial.data(step) if k == 0 or kind == "forward_backward" else None
    x = (batch[0] if k == 0 else store.get(t, f"act{k}", task["input_shape"])).to(device)
    if kind == "forward":
        with torch.no_grad():
            y = resident.module(x)
        return {"output_shape": store.put(t, f"act{k + 1}", y)}
    if k > 0:
        x = x.detach().clone().requires_grad_(True)
    y = resident.module(x)
    loss = None
    if kind == "forward_backward":
        loss = trial.loss(y, batch[1].to(device))
        loss.backward()
    else:
        y.backward(store.get(t, f"grad{k + 1}", task["grad_shape"]).to(device))
    out: dict[str, Any] = {"loss": None if loss is None else loss.item()}
    if k > 0:
        out["grad_shape"] = store.put(t, f"grad{k}", x.grad)
    resident.optimizer.step()
    resident.optimizer.zero_grad(set_to_none=True)
    return out


def _start_prefetch(sweep: _EngineSweep, t: int, hint: tuple[int, tuple[int, int]] | None,
                    keep: set[tuple[int, int]]) -> threading.Thread | None:
    """Fetch the shard the scheduler expects next (`hint`: shard, tag) into memory beside the
    running one, if the budget holds both; the running task does not wait for it until it ends."""
    if hint is None or not sweep.plans[t].prefetch:
        return None
    k, tag = hint
    key = (t, k)
    if sweep.residency.get(key, tag) is not None:
        return None
    sweep.residency.drop(key)
    if not sweep.residency.reserve(sweep.plans[t].shard_bytes[k], keep=keep):
        return None

    def fetch() -> None:
        try:
            sweep.residency.add(key, sweep.load(t, k, tag))
        except Exception:  # noqa: BLE001 - a failed prefetch only costs the load it saved
            sweep.residency.release(sweep.plans[t].shard_bytes[k])

    thread = threading.Thread(target=fetch, name="colab_par-prefetch", daemon=True)
    thread.start()
    return thread
