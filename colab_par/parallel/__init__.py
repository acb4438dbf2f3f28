"""``parallelize(model, layout)``: one call that spreads a model over the ranks of a Layout.

Runs on every engine (torch.distributed already initialised). The order is the one torchtitan uses,
and each step is a file of its own: mesh -> tensor (+ sequence) parallel -> context parallel ->
activation checkpointing -> FSDP / ZeRO / DDP -> pipeline split and schedule (for pipeline
parallel the model is split first and every step is applied to each local stage module).
The returned `ParallelModel` trains on the GLOBAL batch: it takes this rank's data- and
context-parallel slice itself, so a training loop is the same for every layout.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from colab_par.layout import Layout
from colab_par.models.hf import causal_lm_logits, is_hf_model
from colab_par.parallel.checkpointing import apply_activation_checkpointing
from colab_par.parallel.context import apply_context_parallel, sequence_positions, shard_sequence
from colab_par.parallel.data_parallel import (GradientAverager, apply_ddp, apply_fsdp, build_optimizer,
                                              needs_gradient_averager)
from colab_par.parallel.memory import memory_report
from colab_par.parallel.mesh import broadcast_from_rank0, build_mesh, default_device
from colab_par.parallel.pipeline import PipelineRunner, split_model
from colab_par.parallel.tensor_parallel import apply_tensor_parallel, gpt_tp_plan, hf_tp_plan

__all__ = ["parallelize", "ParallelModel", "memory_report"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class ParallelModel:
    """A model spread over a mesh, with one training API for every layout (see module docstring)."""

    def __init__(self, parts: list[nn.Module], layout: Layout, mesh: Any, optimizer: torch.optim.Optimizer,
                 loss_fn: LossFn, device: torch.device, hf: bool,
                 grad_averager: GradientAverager | None, runner: Any = None, *,
                 optimizer_fn: Callable | None = None, model_factory: Callable | None = None,
                 takes_positions: bool = True):
        self.model_parts, self.layout, self.mesh, self.optimizer = parts, layout, mesh, optimizer
        self.model = parts[0]
        self.loss_fn, self.device, self._hf = loss_fn, device, hf
        # What re-layout needs to build the same model and optimizer again under another layout.
        self.optimizer_fn, self.model_factory = optimizer_fn, model_factory
        self._takes_positions = takes_positions
        self._grad_averager, self._runner = grad_averager, runner
        self.dp_rank, self.dp_size = mesh["dp"].get_local_rank(), layout.dp
        self.cp_rank, self.cp_size = mesh["cp"].get_local_rank(), layout.cp
        self.pp_rank = mesh["pp"].get_local_rank()
        self.tp_rank = mesh["tp"].get_local_rank()
        self.is_last_stage = self.pp_rank == layout.pp - 1

    # ---- training ------------------------------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """forward + backward + optimizer step on the GLOBAL batch; the global mean loss."""
        loss = self.forward_backward(inputs, targets)
        self.optimizer_step()
        return loss

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0,
                         sync_grads: bool = True, local: bool = False) -> float:
        """Accumulate gradients of `loss_scale` × loss; returns the unscaled global mean loss."""
        inputs, targets = self._dp_slice(inputs, local), self._dp_slice(targets, local)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        self._set_gradient_sync(sync_grads)
        if self._runner is not None:
            loss_sum = torch.tensor(self._runner.step(inputs, targets, loss_scale=loss_scale),
                                    dtype=torch.float64, device=self.device)
            dist.all_reduce(loss_sum)
        else:
            loss_sum, pending = self._forward_backward_local(inputs, targets, loss_scale)
            pending.wait()
        if sync_grads and self._grad_averager is not None:
            self._grad_averager()
        return loss_sum.item() / dist.get_world_size()

    def _forward_backward_local(self, inputs: torch.Tensor, targets: torch.Tensor,
                                loss_scale: float) -> tuple[torch.Tensor, Any]:
        """Forward and backward; the loss's all-reduce is started before backward to overlap it.

        Every rank holds the mean over its equal share of tokens (tp ranks repeat it), so the sum
        over all ranks divided by the world size is the global mean.
        """
        positions = torch.arange(inputs.shape[1], device=self.device)
        if self.cp_size > 1:
            mode = self.layout.cp_mode
            inputs = shard_sequence(inputs, self.cp_rank, self.cp_size, mode, dim=1)
            targets = shard_sequence(targets, self.cp_rank, self.cp_size, mode, dim=1)
            positions = sequence_positions(positions.numel(), self.cp_rank, self.cp_size, mode, self.device)
        autocast = (self.layout.precision == "bf16" and not isinstance(self.model, FSDPModule))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = self._logits(inputs, positions)
            loss = self.loss_fn(logits, targets)
        loss_sum = loss.detach().to(torch.float64)
        pending = dist.all_reduce(loss_sum, async_op=True)
        (loss * loss_scale).backward()
        return loss_sum, pending

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._hf:
            return causal_lm_logits(self.model, tokens, positions)
        if not self._takes_positions:  # a user's model without positions (cp == 1 is enforced)
            return self.model(tokens)
        return self.model(tokens, positions)

    def _dp_slice(self, batch: torch.Tensor, local: bool) -> torch.Tensor:
        if local or self.dp_size == 1:
            return batch
        if batch.shape[0] % self.dp_size:
            raise ValueError(f"global batch of {batch.shape[0]} sequences does not split over "
                             f"dp={self.dp_size} ranks; use a batch size that is a multiple of {self.dp_size}")
        return batch.chunk(self.dp_size)[self.dp_rank]

    def _set_gradient_sync(self, enabled: bool) -> None:
        for part in self.model_parts:
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(enabled)
            elif isinstance(part, DistributedDataParallel):
                part.require_backward_grad_sync = enabled

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so their total 2-norm over ALL shards (dp/tp/pp) is at most `max_norm`."""
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = [p.grad for part in self.model_parts for p in part.parameters() if p.grad is not None]
        # One reduction per kind of sharding, not one per parameter: DTensors sharing a mesh and
        # placements stack into one norm whose full_tensor() is a single collective.
        kinds: dict[Any, list[torch.Tensor]] = {}
        for grad in grads:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            kinds.setdefault(key, []).append(grad)
        # Norms in the gradients' own dtype (torch's foreach kernels, no float64 copies); float32
        # norms are exact to ~1e-7 relative, and their squares are summed in float64.
        for members in kinds.values():
            norm = torch.nn.utils.get_total_norm(members)
            squares += (norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2
        if self.layout.pp > 1:
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        total = squares.sqrt().item()
        scale = max_norm / (total + 1e-6)
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)
        return total

    @property
    def last_bubble(self) -> float:
        """Share of the last step this rank sat idle in the pipeline (0 without pipeline parallel)."""
        return self._runner.last_bubble if self._runner is not None else 0.0

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- state ---------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters (original FQNs, on the CPU) on global rank 0; {} elsewhere."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        mine: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            state = get_model_state_dict(part, options=options)
            mine.update({k: v.detach().cpu().clone() for k, v in state.items()})
        if self.layout.pp == 1:
            return mine if dist.get_rank() == 0 else {}
        first_of_stage = self.dp_rank == 0 and self.cp_rank == 0 and self.tp_rank == 0
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine if first_of_stage else {}, gathered, dst=0)
        if gathered is None:
            return {}
        return {k: v for piece in gathered for k, v in piece.items()}


def parallelize(model: nn.Module, layout: Layout | str, *, optimizer_fn: Callable | None = None,
                loss_fn: LossFn | None = None) -> ParallelModel:
    """Spread `model` over this world as `layout` says; see the module docstring for the order."""
    layout = Layout.parse(layout)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run parallelize on the engines of a "
                           "colab_par.Cluster (e.g. inside a %%colossal cell)")
    config = getattr(model, "config", None)
    layout.validate(dist.get_world_size(), config)
    hf = is_hf_model(model)
    takes_positions = "positions" in inspect.signature(model.forward).parameters
    if layout.cp > 1 and not (hf or takes_positions):
        raise ValueError(f"context parallel gives each rank scattered sequence chunks, so "
                         f"{type(model).__name__}.forward must accept `positions` (the tokens' global "
                         "positions, for rotary/position embeddings); add it or use cp=1")
    optimizer_fn = optimizer_fn or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss_fn = loss_fn or getattr(model, "loss_fn", None) or _default_loss
    device = default_device()

    model.to(device)
    broadcast_from_rank0(model)
    mesh, dp_cp_mesh = build_mesh(layout, device)

    parts = [model]
    if layout.pp > 1:
        parts = split_model(model, layout, mesh["pp"].get_local_rank())
    parts = [_parallelize_part(part, layout, mesh, dp_cp_mesh, device, hf) for part in parts]

    params = [p for part in parts for p in part.parameters()]
    optimizer = build_optimizer(params, optimizer_fn, layout, mesh["dp"].get_group())
    averager = (GradientAverager(params, dp_cp_mesh.get_group())
                if needs_gradient_averager(parts[0], layout) else None)
    runner = None
    if layout.pp > 1:
        runner = PipelineRunner(parts, layout, mesh["pp"].get_group(), loss_fn, device)
    return ParallelModel(parts, layout, mesh, optimizer, loss_fn, device, hf, averager, runner,
                         optimizer_fn=optimizer_fn, model_factory=_rebuilder(model),
                         takes_positions=takes_positions)


def _rebuilder(model: nn.Module) -> Callable[[], nn.Module] | None:
    """`type(model)(model.config)` for models built from a config (GPT, Hugging Face), else None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    build = functools.partial(type(model), config)
    build.config = config  # type: ignore[attr-defined]
    return build


def _parallelize_part(part: nn.Module, layout: Layout, mesh: Any, dp_cp_mesh: Any,
                      device: torch.device, hf: bool) -> nn.Module:
    """TP(+SP) -> CP -> AC -> FSDP/DDP on one module (the whole model or one pipeline stage)."""
    if layout.tp > 1:
        plan = hf_tp_plan(part) if hf else gpt_tp_plan(part, layout.sequence_parallel)
        apply_tensor_parallel(part, mesh["tp"], plan)
    if layout.cp > 1:
        apply_context_parallel(part, mesh["cp"].get_group(), layout.cp_mode)
    apply_activation_checkpointing(part, layout.checkpointing)
    if layout.zero >= 2:
        return apply_fsdp(part, layout, dp_cp_mesh)
    if layout.dp * layout.cp > 1 and not needs_gradient_averager(part, layout):
        return apply_ddp(part, dp_cp_mesh.get_group(), device)
    return part
