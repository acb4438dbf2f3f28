"""Cutting a trial's model into shards that fit one engine's memory budget (Hydra's partitioner).

A model is a chain of units: the layers of colab_par's GPT or of a Hugging Face decoder
(the first unit also holds the embedding, the last the final norm and head), or the children of an
``nn.Sequential``. A short probe runs the model once on the meta device with the trial's first
batch: it costs no memory or time, yet gives each unit's parameter bytes and the activation bytes
autograd saves in it, and it finds a factory that fails or data the model cannot take before any
engine works. A shard is a run of consecutive units whose resident bytes (parameters, gradients,
optimizer state, saved activations) fit half the budget, so the next shard can be prefetched
beside it (double buffering); a unit over half the budget gets a shard of its own, without a
prefetch; a unit over the whole budget is refused, by name.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from colab_par.parallel.pipeline import balanced_cuts, layer_count, layer_stage, layer_units
from colab_par.selection.costs import OpCounter, optimizer_key
from colab_par.selection.trial import Trial

__all__ = ["Unit", "ShardPlan", "plan_shards", "unit_modules", "shard_module", "meta_model"]


@dataclass(frozen=True)
class Unit:
    """One unit's memory and the work of one forward (and backward) of the trial's batch; the loss
    is counted in the last unit, and backward's ops and bytes are shared out in proportion to the
    forward's (a step's backward is probed whole)."""

    name: str
    param_bytes: int
    activation_bytes: int
    flops: int = 0  # matmul FLOPs of the forward
    ops: int = 0  # ATen ops the forward dispatches
    written: int = 0  # bytes they write
    backward_ops: int = 0
    backward_written: int = 0
    tensors: int = 0  # parameter tensors (a foreach=False optimizer steps each on its own)


@dataclass(frozen=True)
class ShardPlan:
    """How one trial is cut: `shards[k]` is a range of unit indices; `shard_bytes[k]` what shard k
    holds while it runs. One shard: the trial fits an engine and runs task-parallel."""

    trial: str
    units: tuple[Unit, ...]
    shards: tuple[range, ...]
    shard_bytes: tuple[int, ...]
    budget: int
    state_tensors: int  # optimizer state tensors per parameter
    optimizer: str  # the `costs.optimizer_key` of the trial's optimizer setting

    @property
    def spilled(self) -> bool:
        return len(self.shards) > 1

    @property
    def param_bytes(self) -> int:
        return sum(unit.param_bytes for unit in self.units)

    def shard_total(self, k: int, field: str) -> int:
        """A `Unit` field summed over shard k's units, e.g. ``shard_total(k, "flops")``."""
        return sum(getattr(self.units[i], field) for i in self.shards[k])

    @property
    def prefetch(self) -> bool:
        """Whether two shards fit side by side, so the next one may be fetched while one runs."""
        return max(self.shard_bytes) * 2 <= self.budget


def meta_model(trial: Trial) -> nn.Module:
    """The trial's model on the meta device (no memory, no init); a failing factory is named."""
    try:
        with torch.device("meta"):
            return trial.model()
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported with its trial
        raise ValueError(f"trial {trial.name!r}: its model factory failed: "
                         f"{type(exc).__name__}: {exc}") from exc


def unit_modules(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The model's units in forward order: (name, the modules whose parameters it holds)."""
    if layer_count(model) is not None:
        first, layers, last = layer_units(model)
        units = [(name, [layer]) for name, layer in layers]
        units[0] = (units[0][0], first + units[0][1])
        units[-1] = (units[-1][0], units[-1][1] + last)
        return units
    if isinstance(model, nn.Sequential):
        return [(name, [child]) for name, child in model.named_children()]
    raise TypeError(f"model selection cuts colab_par's GPT, Hugging Face decoders and "
                    f"nn.Sequential models into shards; {type(model).__name__} is none of them: "
                    "write it as an nn.Sequential of its blocks")


def shard_module(model: nn.Module, shards: tuple[range, ...], k: int) -> nn.Module:
    """Shard `k` as a module of its own; its parameters keep the model's names."""
    units = shards[k]
    if layer_count(model) is not None:
        return layer_stage(model, k, len(shards), units)
    children = list(model.named_children())
    return nn.Sequential(OrderedDict(children[i] for i in units))


def plan_shards(trial: Trial, budget: int, parts: int | None = None) -> ShardPlan:
    """Probe the trial on meta and cut it into shards for `budget` bytes per engine; `parts`
    instead cuts it into that many shards of balanced size (model parallelism over `parts` engines)."""
    model = meta_model(trial)
    units = _probe(trial, model)
    per_param = 2 + trial.state_tensors_per_param  # weight, gradient, optimizer state
    need = [unit.param_bytes * per_param + unit.activation_bytes for unit in units]
    too_big = [(unit, n) for unit, n in zip(units, need) if n > budget]
    if too_big:
        unit, n = max(too_big, key=lambda pair: pair[1])
        raise ValueError(f"trial {trial.name!r}: its unit {unit.name!r} alone needs {_mib(n)} "
                         f"(parameters, gradients, {trial.optimizer} state and activations) but the "
                         f"budget per engine is {_mib(budget)}; raise the budget to at least {_mib(n)} "
                         "or make that layer smaller")
    if parts is not None:
        return _balanced_plan(trial, units, need, budget, min(parts, len(units)))
    if sum(need) <= budget:
        return _plan(trial, units, (range(len(units)),), (sum(need),), budget)
    shards, sizes, start, size = [], [], 0, 0
    for i, n in enumerate(need):
        if i > start and size + n > budget // 2:
            shards.append(range(start, i))
            sizes.append(size)
            start, size = i, 0
        size += n
    shards.append(range(start, len(units)))
    sizes.append(size)
    return _plan(trial, units, tuple(shards), tuple(sizes), budget)


def _balanced_plan(trial: Trial, units: tuple[Unit, ...], need: list[int], budget: int,
                   parts: int) -> ShardPlan:
    starts = [0, *balanced_cuts(need, parts), len(units)]
    shards = tuple(range(a, b) for a, b in zip(starts, starts[1:]))
    sizes = tuple(sum(need[i] for i in shard) for shard in shards)
    if max(sizes) > budget:
        raise ValueError(f"trial {trial.name!r} split over {parts} engines still needs {_mib(max(sizes))} "
                         f"on one of them, over the budget of {_mib(budget)}: raise the budget or use "
                         "placement='shard', which spills")
    return _plan(trial, units, shards, sizes, budget)


def _plan(trial: Trial, units: tuple[Unit, ...], shards: tuple[range, ...], sizes: tuple[int, ...],
          budget: int) -> ShardPlan:
    return ShardPlan(trial.name, units, shards, sizes, budget, trial.state_tensors_per_param,
                     optimizer_key(trial))


def _probe(trial: Trial, model: nn.Module) -> tuple[Unit, ...]:
    """Each unit's parameters, the bytes autograd saves while it runs forward and the work it
    dispatches (loss included in the last unit), from one step of the trial's first batch on meta."""
    named = unit_modules(model)
    saved = [0] * len(named)
    work = [[0, 0, 0] for _ in named]  # flops, ops, bytes written
    current = [0]
    flop_counter, op_counter = FlopCounterMode(display=False), OpCounter()
    counted = [0, 0, 0]

    def enter(i: int) -> None:  # the work so far belongs to the unit that was running
        totals = (flop_counter.get_total_flops(), op_counter.ops, op_counter.written)
        for j, total in enumerate(totals):
            work[current[0]][j] += total - counted[j]
            counted[j] = total
        current[0] = i

    hooks = [module.register_forward_pre_hook(lambda *_, i=i: enter(i))
             for i, (_, modules) in enumerate(named) for module in modules]
    seen: dict[int, torch.Tensor] = {}  # kept alive, so an id is never reused during the probe

    def count(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in seen and tensor.is_floating_point():
            seen[id(tensor)] = tensor
            saved[current[0]] += tensor.numel() * tensor.element_size()
        return tensor

    try:
        inputs, targets = (tensor.to("meta") for tensor in trial.data(0))
        for param in model.parameters():
            param.requires_grad_(True)
        with saved_tensors_hooks(count, lambda tensor: tensor), flop_counter, op_counter:
            loss = trial.loss(model(inputs), targets)
            enter(current[0])
        backward = OpCounter()
        with backward:
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - a shape mismatch surfaces as any error of the model
        shapes = _shapes(trial)
        raise ValueError(f"trial {trial.name!r}: its data does not fit its model: {shapes} gave "
                         f"{type(exc).__name__}: {exc}") from exc
    finally:
        for hook in hooks:
            hook.remove()
    ops_ratio, bytes_ratio = backward.ops / max(counted[1], 1), backward.written / max(counted[2], 1)
    claimed: set[int] = set()
    units = []
    for (name, modules), activation, (flops, ops, written) in zip(named, saved, work):
        params = [p for module in modules for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        units.append(Unit(name, sum(p.numel() * p.element_size() for p in params), activation, flops, ops,
                          written, round(ops * ops_ratio), round(written * bytes_ratio), len(params)))
    return tuple(units)


def _shapes(trial: Trial) -> str:
    try:
        inputs, targets = trial.data(0)
    except Exception as exc:  # noqa: BLE001
        return f"data(0) itself failed ({type(exc).__name__}: {exc}), which"
    return (f"data(0) = inputs {tuple(inputs.shape)} {inputs.dtype}, targets "
            f"{tuple(targets.shape)} {targets.dtype}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
