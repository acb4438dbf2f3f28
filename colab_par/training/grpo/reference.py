"""The reference policy of GRPO's KL term, without a second model.

With LoRA the reference is the base model: the policy's own forward with the adapters switched
off (`adapters_disabled`), nothing copied. With full weights it is the policy's weights as GRPO
found them: once, at construction, each trainable parameter's local tensor on this rank (DDP's
and ZeRO-1's whole tensor, ZeRO-2/3's shard, a tensor-parallel shard, an offloaded shard on the
host) is cloned, frozen (no gradient, no optimizer state). Parameters that do not train never
move, so the policy's own serve the reference. The copy costs one sharded copy of the trainable
weights on every rank (the planner's `ModelSpec.frozen_copies`) and no second module.

A reference forward exchanges the copy with the live local tensors in place, one parameter at a
time (a scratch tensor the size of one shard), runs the policy's no-grad forward (`forward_logps`,
with every layout's collectives: the numbers the policy's forward gave at the start) and
exchanges them back. In place, because FSDP gathers from the storage its sharded parameters view
and the optimizer holds these very tensors; exchanges are exact copies, so the policy's weights
come back bit for bit. beta = 0 needs no reference: the caller builds none.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from colab_par.parallel.inference.state import bare_module
from colab_par.training.grpo.logprobs import adapters_disabled, forward_logps
from colab_par.training.grpo.rollout import Rollout

__all__ = ["ReferencePolicy", "AdaptersOff", "FrozenCopy", "reference_policy"]


class ReferencePolicy(Protocol):
    """What GRPO asks of its reference: per-token log-probabilities of a rollout's rows (as
    `forward_logps` gives the policy's), this rank's bytes held for it, and its tensors for a
    checkpoint (loaded in place: a resumed run keeps the reference of the run's start)."""

    @property
    def nbytes(self) -> int: ...

    def logps(self, pm: Any, rows: Rollout, temperature: float) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


def reference_policy(pm: Any) -> ReferencePolicy:
    """The reference for `pm` as it is now: LoRA's base (`AdaptersOff`) when `pm` trains
    adapters, else a frozen copy of its trainable weights (`FrozenCopy`). Call on every rank."""
    return AdaptersOff() if pm.adapters is not None else FrozenCopy(pm)


class AdaptersOff:
    """LoRA's reference: the base model, every adapter switched off for the forward (peft's
    `disable_adapter()`), so it holds nothing."""

    nbytes = 0

    def logps(self, pm: Any, rows: Rollout, temperature: float) -> torch.Tensor:
        with adapters_disabled(*(bare_module(part) for part in pm.model_parts)):
            return forward_logps(pm, rows, temperature)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}


class FrozenCopy:
    """The trainable weights of `pm` now, kept as this rank's local tensors (module docstring)."""

    def __init__(self, pm: Any):
        self._model = pm.model
        named = list(_trainable_parameters(pm))
        self._params = dict(named)
        if len(self._params) < len(named):
            raise ValueError("two trainable parameters of this rank's model parts share a name, so a checkpoint "
                             "could not tell their reference copies apart; give the parts distinct names")
        if not self._params:
            raise ValueError("the model has no parameter that trains, so the policy is its own reference: "
                             "use beta=0, or unfreeze the weights GRPO should train")
        with torch.no_grad():
            self._kept = {name: _local(param).detach().clone() for name, param in self._params.items()}

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the copy."""
        return sum(kept.numel() * kept.element_size() for kept in self._kept.values())

    def logps(self, pm: Any, rows: Rollout, temperature: float) -> torch.Tensor:
        """`forward_logps` of `rows` under the copied weights; the policy's come back unchanged."""
        if pm.model is not self._model:
            raise ValueError("this reference was copied from another ParallelModel (a relayout rebuilt the "
                             "model?): build one for this model with reference_policy(pm) and load the saved "
                             "reference into it (ref.state_dict() loaded in place)")
        with self._swapped(pm):
            return forward_logps(pm, rows, temperature)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The copy under the parameters' names, laid out as the parameters are (a DTensor wraps
        each sharded copy without copying it), so a checkpoint saves it and loads it in place
        under this layout or reshards it into another."""
        return {name: _like(self._params[name], kept) for name, kept in self._kept.items()}

    @contextlib.contextmanager
    def _swapped(self, pm: Any) -> Iterator[None]:
        for part in pm.model_parts:  # FSDP gathers from the shards: none may stay gathered across it
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    def _exchange(self) -> None:
        with torch.no_grad():
            for name, param in self._params.items():
                live, kept = _local(param), self._kept[name]
                scratch = live.clone()
                live.copy_(kept)
                kept.copy_(scratch)


def _trainable_parameters(pm: Any) -> Iterator[tuple[str, nn.Parameter]]:
    """Each trainable parameter of every part once (a tied one under its first name)."""
    seen: set[int] = set()
    for part in pm.model_parts:
        for name, param in bare_module(part).named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                yield name, param


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `param`, sharing its storage (inside no_grad)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _like(param: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return kept
    return DTensor.from_local(kept, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
