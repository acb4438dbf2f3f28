"""AdamW on one chunk where its state lives, and AdamW's per-parameter state over the chunk's stores.

A chunk kept resident steps with torch's own AdamW function and the user's foreach/fused choice,
exactly as plain AdamW. A chunk whose state is off the fast tier steps with the fast host kernel
(`host_adam.py`) where the user named no AdamW implementation; on CUDA that is ZeRO-Offload's
split: gradients (and float32 parameters without a master) come down through pinned staging on
the side stream (`transfers.py`), the next chunk's while the host updates this one, and the
parameters go back up; the moments never cross.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.adamw import adamw

from colab_par.memory_tiers.chunk_stores import ChunkStores
from colab_par.memory_tiers.chunks import Chunk, local
from colab_par.memory_tiers.held_grads import HeldGradients
from colab_par.memory_tiers.host_adam import AdamWHyper, host_adamw_step
from colab_par.memory_tiers.placement import FAST
from colab_par.memory_tiers.transfers import Transfers

__all__ = ["MOMENTS", "ChunkUpdater"]

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Operands:
    """One chunk's AdamW operands, slot by slot, for the parameters that have a gradient."""

    ids: list[int] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)  # the float32 values updated (master or parameter)
    grads: list[torch.Tensor] = field(default_factory=list)
    avgs: list[torch.Tensor] = field(default_factory=list)
    squares: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (working parameter, its master)


class ChunkUpdater:
    """The update of `home`'s chunks, one at a time, and AdamW's step counts (`steps`, by id of
    the parameter). `fused_by_compile`: the groups' ``fused=True`` is the `compile` option's,
    not the user's."""

    def __init__(self, home: ChunkStores, grads: HeldGradients, transfers: Transfers, fused_by_compile: bool):
        self._home, self._grads, self._transfers = home, grads, transfers
        self._fused_by_compile = fused_by_compile
        self.steps: dict[int, torch.Tensor] = {}

    def host_step(self, group: dict[str, Any], stores: dict[str, Any]) -> bool:
        """Whether this chunk steps with the fast host kernel, where the user named no AdamW
        implementation: on a CPU rank when any of its state is off the fast tier (host memory is
        the device there); on CUDA when its moments are off the device, so they are updated where
        they are, never staged to the GPU. A chunk kept resident steps with the user's own choice,
        exactly as plain AdamW. `fused` that `compile` chose (`fused_by_compile`) is no user's choice."""
        if group.get("foreach") is not None or (group.get("fused") and not self._fused_by_compile):
            return False
        if self._home.cuda:
            return stores["exp_avg"].tier != FAST
        return any(store.tier != FAST for store in stores.values())

    def state_of(self, group: dict[str, Any], chunk: Chunk) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """torch's AdamW state of each parameter of `chunk`: plain views of the chunk's stores, where
        the stores live (a DTensor's local shape; `state_dict` wraps them, `load_state_dict` fills them)."""
        stores, device = self._home.stores[chunk.index], self._step_device(group, chunk)
        out = {}
        for slot in chunk.slots:
            p = slot.param
            step = self.steps.get(id(p))
            if step is None or step.device != device:
                step = torch.zeros((), dtype=torch.float32, device=device) if step is None else step.to(device)
                self.steps[id(p)] = step
            out[p] = {"step": step, **{kind: slot.of(stores[kind].tensor) for kind in MOMENTS}}
        return out

    def download(self, group: dict[str, Any], chunk: Chunk) -> dict[str, Any] | None:
        """On CUDA, for a chunk the host steps: start bringing its gradients on the device and its
        float32 parameters without a master down into pinned staging (the next chunk's come down
        while the host updates this one). {"event", "params": {id: host}, "grads": {id: host}}."""
        if not self._home.cuda or not self.host_step(group, self._home.stores[chunk.index]):
            return None
        pairs, params, grads = [], {}, {}
        for slot in chunk.slots:
            held = id(slot.param) in self._grads.written
            grad = None if held else slot.param.grad
            if grad is None and not held:
                continue
            if grad is not None:
                grad = local(grad)
                grads[id(slot.param)] = slot.of(self._transfers.staging(chunk.index, "grads", grad.dtype, chunk.numel))
                pairs.append((grads[id(slot.param)], grad))
            if not chunk.master:
                param = local(slot.param)
                params[id(slot.param)] = slot.of(self._transfers.staging(chunk.index, "params", param.dtype,
                                                                         chunk.numel))
                pairs.append((params[id(slot.param)], param))
        return {"event": self._transfers.copy(pairs), "params": params, "grads": grads}

    def update(self, group: dict[str, Any], chunk: Chunk, staged: dict[str, Any] | None = None) -> None:
        """One AdamW step of `chunk` (`staged`: what `download` started bringing down for it)."""
        operands = self._operands(chunk)
        if not operands.params:
            return
        if self.host_step(group, self._home.stores[chunk.index]):
            self._update_on_host(group, operands, staged)
        else:
            self._update_on_device(group, chunk, operands)

    def _operands(self, chunk: Chunk) -> _Operands:
        stores = self._home.stores[chunk.index]
        out = _Operands()
        for slot in chunk.slots:
            grad = self._grads.of(chunk, slot)
            if grad is None:
                continue
            target = slot.of(stores["master"].tensor) if chunk.master else local(slot.param)
            out.ids.append(id(slot.param))
            out.params.append(target)
            out.grads.append(grad)
            out.avgs.append(slot.of(stores["exp_avg"].tensor))
            out.squares.append(slot.of(stores["exp_avg_sq"].tensor))
            out.steps.append(self.steps[id(slot.param)])
            if chunk.master:
                out.back.append((local(slot.param), target))
        return out

    def _update_on_host(self, group: dict[str, Any], operands: _Operands, staged: dict[str, Any] | None) -> None:
        """ZeRO-Offload's split on CUDA: gradients come down (in their own dtype, widened on the
        host), float32 parameters without a master come down too, and go back up updated, through
        pinned staging on the side stream (`download`, transfers.py); the moments never cross. On a
        CPU rank every tensor is already here."""
        params, grads = operands.params, operands.grads
        if staged is not None:
            self._transfers.wait_host(staged["event"])
            params_here = [staged["params"].get(key, p) for key, p in zip(operands.ids, params)]
            grads = [staged["grads"].get(key, g) for key, g in zip(operands.ids, grads)]
        else:
            params_here = params
        beta1, beta2 = group["betas"]
        host_adamw_step(params_here, [g.to(p.dtype) for g, p in zip(grads, params_here)], operands.avgs,
                        operands.squares, operands.steps,
                        AdamWHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                   weight_decay=group["weight_decay"], maximize=group.get("maximize", False)))
        self._transfers.copy([(home, here) for home, here in zip(params, params_here) if here is not home]
                             + operands.back)

    def _update_on_device(self, group: dict[str, Any], chunk: Chunk, operands: _Operands) -> None:
        """torch's AdamW with the user's choice of kernel, the state staged to the chunk's device
        where it lives elsewhere (CUDA ranks) and written back."""
        params, grads = operands.params, operands.grads
        staged = [_on(t, chunk.device) for t in params + operands.avgs + operands.squares] \
            if self._home.cuda else None
        work = [s for s, _ in staged] if staged else params + operands.avgs + operands.squares
        n = len(params)
        device_grads = [g.to(chunk.device, p.dtype) for g, p in zip(grads, params)]
        beta1, beta2 = group["betas"]
        adamw(work[:n], device_grads, work[n:2 * n], work[2 * n:], [], operands.steps,
              foreach=group.get("foreach"), fused=group.get("fused"), amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=group.get("maximize", False))
        for on_device, home in staged or []:
            if on_device is not home:
                home.copy_(on_device)
        for working, master in operands.back:
            working.copy_(master.to(working.device))
        # what crossed between the GPU and host memory: staged state down and back up, gradients
        # held on the host down, a host master up
        self._home.moved += sum(2 * _nbytes(home) for on_device, home in staged or [] if on_device is not home) + \
            sum(_nbytes(g) for g in grads if g.device != chunk.device) + \
            sum(_nbytes(master) for working, master in operands.back if master.device != working.device)

    def _step_device(self, group: dict[str, Any], chunk: Chunk) -> torch.device:
        """Where AdamW's step counts of `chunk` live: on its device for torch's fused kernel there,
        on the host for the host step and the foreach path (as torch's AdamW keeps them)."""
        on_device = group.get("fused") and not self.host_step(group, self._home.stores[chunk.index])
        return chunk.device if on_device else torch.device("cpu")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _on(tensor: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor on `device`, the tensor): a copy only where it lives elsewhere (CUDA ranks)."""
    return (tensor if tensor.device == device else tensor.to(device, non_blocking=True)), tensor
