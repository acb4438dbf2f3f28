"""`ParallelModel`: what `parallelize` returns, the same interface under every layout. It trains on
the GLOBAL batch (taking this rank's data- and context-parallel slice itself), clips through the
shards' own norm, evaluates and generates (`parallel/inference/`), and gathers a full state dict."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from colab_par.layout import Layout
from colab_par.models.hf import causal_lm_logits
from colab_par.parallel.adapters import Adapters
from colab_par.data.batch import LabelMean, batch_to, call_model, check_batch, label_count, labels_of, slice_batch
from colab_par.parallel.context import sequence_positions, shard_sequence
from colab_par.parallel.data_parallel import GradientAverager
from colab_par.parallel.grad_norm import total_gradient_norm
from colab_par.parallel.full_state import gather_full_state
from colab_par.parallel.rng import ModelStream, shared_seed

__all__ = ["ParallelModel"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class ParallelModel:
    """A model spread over a mesh, with one training API for every layout (see module docstring)."""

    def __init__(self, parts: list[nn.Module], layout: Layout, mesh: Any, optimizer: torch.optim.Optimizer,
                 loss_fns: tuple[LossFn, Callable], device: torch.device, hf: bool,
                 grad_averager: GradientAverager | None, runner: Any = None, *,
                 optimizer_fn: Callable | None = None, model_factory: Callable | None = None,
                 takes_positions: bool = True, options: dict[str, Any] | None = None):
        self.model_parts, self.layout, self.mesh, self.optimizer = parts, layout, mesh, optimizer
        self.model = parts[0]
        # Token batches are scored by loss_fn(logits, targets), other batches by loss_fn(outputs, batch).
        (self.loss_fn, self.batch_loss_fn), self.device, self._hf = loss_fns, device, hf
        # What re-layout needs to build the same model and optimizer again under another layout.
        self.optimizer_fn, self.model_factory = optimizer_fn, model_factory
        self.parallelize_options = dict(options or {})  # loss_fn, blocks, tp_plan as the user gave them
        self._whole_model_names: dict[str, list[str]] = {}  # name -> every name of that tensor
        self._fused_loss = False  # a Hugging Face decoder scored by the fused linear cross-entropy
        self._takes_positions = takes_positions
        self._grad_averager, self._runner = grad_averager, runner
        self.adapters: Adapters | None = None  # a PEFT model's adapters (parallel/adapters/)
        self.rng = ModelStream(mesh, device, shared_seed(device))  # its training passes' stream (rng.py)
        self.balance_loss: Any = None  # a Hugging Face MoE's global balance loss (hf_experts.py)
        self.dp_rank, self.dp_size = mesh["dp"].get_local_rank(), layout.dp
        self.cp_rank, self.cp_size = mesh["cp"].get_local_rank(), layout.cp
        self.pp_rank = mesh["pp"].get_local_rank()
        self.tp_rank = mesh["tp"].get_local_rank()
        self.is_last_stage = self.pp_rank == layout.pp - 1

    # ---- training ------------------------------------------------------------------------------
    def train_step(self, batch: Any, targets: torch.Tensor | None = None) -> float:
        """forward + backward + optimizer step on the GLOBAL batch; the global mean loss."""
        loss = self.forward_backward(batch, targets)
        self.optimizer_step()
        return loss

    def forward_backward(self, batch: Any, targets: torch.Tensor | None = None, *,
                         loss_scale: float = 1.0, sync_grads: bool = True, local: bool = False) -> float:
        """Accumulate gradients of `loss_scale` × loss; returns the unscaled global mean loss.

        Token models take `(inputs, targets)` as two arguments and `loss_fn(logits, targets)`; any
        other batch comes as one object (see `batch.py`) and is scored by `loss_fn(outputs, batch)`.
        `local`: the batch is already this rank's dp share.
        """
        return self.forward_backward_tensor(batch, targets, loss_scale=loss_scale, sync_grads=sync_grads,
                                            local=local).item()

    def forward_backward_tensor(self, batch: Any, targets: torch.Tensor | None = None, *,
                                loss_scale: float = 1.0, sync_grads: bool = True,
                                local: bool = False) -> torch.Tensor:
        """`forward_backward` without reading the loss: a float64 scalar on the device, so a loop
        of micro-steps never waits for the device (the Trainer reads its losses once per step)."""
        self._set_gradient_sync(sync_grads)
        with self.rng.active():  # dropout draws from this rank's stream (rng.py)
            if targets is None:
                loss_sum = self._forward_backward_batch(batch, loss_scale, local)
            else:
                loss_sum = self._forward_backward_tokens(batch, targets, loss_scale, local)
        if sync_grads and self._runner is not None:
            self._runner.sync_tied_gradients()
        if sync_grads and self._grad_averager is not None:
            self._grad_averager()
        return loss_sum / dist.get_world_size()

    def forward_backward_share(self, batch: Any, targets: torch.Tensor | None, loss_scale: float,
                               labels_total: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss on one dp share (float64, on the device), its gradient times `loss_scale`
        added to `.grad`, and no collective beyond this rank's dp replica: neither the loss's
        all-reduce over the world nor DDP's gradient sync (the module is called past its DDP
        wrapper); pipeline stages and tp / cp ranks talk over their own groups. For a world that
        lost a dp replica (`training/resilience/degraded.py` sums the gradients over the survivors
        itself, tied pipeline copies included). As in
        `forward_backward_tensor`, `targets` None means `batch` is a batch of the user's data; the
        default loss then divides by `labels_total`, the labels of the full world's shares
        (`share_labels` summed), as `_count_labels` does in a whole world."""
        module = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        with self.rng.active():
            if targets is not None:
                batch, targets = batch.to(self.device), targets.to(self.device)
                if self._runner is not None:  # the share's mean loss, on every pp rank
                    return self._runner.step(batch, targets, loss_scale=loss_scale, on_device=True).reshape(())
                loss, _ = self._token_loss(batch, targets, module)
            else:
                batch = batch_to(batch, self.device)
                inputs = batch if labels_total is None else self._divide_by_labels(batch, labels_total)
                if self._runner is not None:
                    return self._runner.step_batch(batch, loss_scale=loss_scale, on_device=True).reshape(())
                loss = self._batch_loss(module, inputs, batch)
            (loss * loss_scale).backward()
        return loss.detach().to(torch.float64)

    def share_labels(self, batch: Any) -> torch.Tensor | None:
        """The labels of this share of the user's data the default loss averages over (float64, on
        the device), or None where the loss does not count them (`LabelMean`)."""
        labels = labels_of(batch)
        if not isinstance(self.batch_loss_fn, LabelMean) or labels is None:
            return None
        return label_count(labels, self.batch_loss_fn.shifts).to(self.device, torch.float64)

    def _forward_backward_tokens(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float,
                                 local: bool) -> torch.Tensor:
        inputs, targets = self._dp_slice(inputs, local), self._dp_slice(targets, local)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        if self._runner is not None:
            loss_sum = self._runner.step(inputs, targets, loss_scale=loss_scale, on_device=True).reshape(())
            dist.all_reduce(loss_sum)
            return loss_sum
        loss_sum, pending = self._forward_backward_local(inputs, targets, loss_scale)
        pending.wait()
        return loss_sum

    def _forward_backward_batch(self, batch: Any, loss_scale: float, local: bool) -> torch.Tensor:
        check_batch(batch)
        if self.cp_size > 1:
            raise ValueError("context parallel splits token sequences; it takes (inputs, targets) "
                             "token batches, not a general batch; use cp=1")
        if not local and self.dp_size > 1:
            batch = slice_batch(batch, self.dp_size, self.dp_rank)
        batch = batch_to(batch, self.device)
        inputs = self._count_labels(batch)
        if self._runner is not None:
            loss_sum = self._runner.step_batch(batch, loss_scale=loss_scale, on_device=True).reshape(())
            dist.all_reduce(loss_sum)
            return loss_sum
        loss = self._batch_loss(self.model, inputs, batch)
        loss_sum = loss.detach().to(torch.float64)
        pending = dist.all_reduce(loss_sum, async_op=True)
        (loss * loss_scale).backward()
        pending.wait()
        return loss_sum

    def _forward_backward_local(self, inputs: torch.Tensor, targets: torch.Tensor,
                                loss_scale: float) -> tuple[torch.Tensor, Any]:
        """Forward and backward; the loss's all-reduce is started before backward to overlap it.

        Every rank holds the mean over its equal share of tokens (tp ranks repeat it), so the sum
        over all ranks divided by the world size is the global mean.
        """
        loss, _ = self._token_loss(inputs, targets)
        loss_sum = loss.detach().to(torch.float64)
        pending = dist.all_reduce(loss_sum, async_op=True)
        (loss * loss_scale).backward()
        return loss_sum, pending

    def _token_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                    model: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's mean loss on its tokens (its context-parallel share of the dp slice `inputs`),
        and the targets it scored; `model` replaces the wrapped model (evaluation calls DDP's
        module itself)."""
        model = self.model if model is None else model
        positions = torch.arange(inputs.shape[1], device=self.device)
        if self.cp_size > 1:
            mode = self.layout.cp_mode
            inputs = shard_sequence(inputs, self.cp_rank, self.cp_size, mode, dim=1)
            targets = shard_sequence(targets, self.cp_rank, self.cp_size, mode, dim=1)
            positions = sequence_positions(positions.numel(), self.cp_rank, self.cp_size, mode, self.device)
        with self._autocast():
            if self._fused_loss:  # through the model's own call, so DDP / FSDP wrap it as usual
                loss = model(input_ids=inputs, position_ids=positions.expand(inputs.shape[0], -1),
                             use_cache=False, colab_par_targets=targets)
            else:
                loss = self.loss_fn(self._logits(model, inputs, positions), targets)
        return self._with_balance_loss(loss), targets

    def _with_balance_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Add the routers' global-batch balance loss of the forward just run, where there is one
        and gradients are on (a training term: evaluation scores the data alone)."""
        balance = self.balance_loss.take() if self.balance_loss is not None and torch.is_grad_enabled() else None
        return loss if balance is None else loss + balance.to(loss.dtype)

    def _autocast(self) -> torch.autocast:
        """bf16 compute for bf16 layouts (FSDP casts its parameters itself instead)."""
        enabled = self.layout.precision == "bf16" and not isinstance(self.model, FSDPModule)
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _batch_loss(self, model: nn.Module, inputs: Any, batch: Any) -> torch.Tensor:
        """`batch_loss_fn` on `model` called with `inputs` (`batch` less what the loss takes itself)."""
        with self._autocast():
            return self._with_balance_loss(self.batch_loss_fn(call_model(model, inputs), batch))

    def _count_labels(self, batch: Any) -> Any:
        """With the default loss and labels: count them over the dp ranks and set `LabelMean`'s
        items for this step; returns what the model is called with (labels left out, the loss
        is computed here)."""
        counted = self.share_labels(batch)
        if counted is None:
            return batch
        if self.dp_size > 1:
            dist.all_reduce(counted, group=self.mesh["dp"].get_group())
        return self._divide_by_labels(batch, counted)

    def _divide_by_labels(self, batch: dict, counted: torch.Tensor) -> dict:
        """Set `LabelMean`'s items from `counted`, the labels of every dp rank's share: each piece's
        loss is then its labels' sum over counted / (ranks × microbatches); `batch` less its labels."""
        pieces = self.dp_size * (self.layout.microbatches if self._runner is not None else 1)
        self.batch_loss_fn.items = (counted.clamp(min=1.0) / pieces).float()  # stays on the device, unread
        return {k: v for k, v in batch.items() if k != "labels"}

    def _logits(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._hf:
            return causal_lm_logits(model, tokens, positions)
        if not self._takes_positions:  # a user's model without positions (cp == 1 is enforced)
            return model(tokens)
        return model(tokens, positions)

    def _dp_slice(self, batch: torch.Tensor, local: bool) -> torch.Tensor:
        if local or self.dp_size == 1:
            return batch
        return slice_batch(batch, self.dp_size, self.dp_rank)

    def _set_gradient_sync(self, enabled: bool) -> None:
        for part in self.model_parts:
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(enabled)
            elif isinstance(part, DistributedDataParallel):
                part.require_backward_grad_sync = enabled

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so their total 2-norm over ALL shards (dp/tp/pp) is at most `max_norm`.
        Gradients memory tiers hold are counted a chunk at a time and scaled when the step reads them."""
        return self.clip_grad_norm_tensor(max_norm).item()

    def clip_grad_norm_tensor(self, max_norm: float) -> torch.Tensor:
        """`clip_grad_norm_` with the norm as a float64 scalar on the device; `max_norm=inf` (a norm
        measured, nothing clipped) reads nothing from the device."""
        tiers = self.optimizer if hasattr(self.optimizer, "held_gradient_squares") else None
        held = tiers.held_gradient_squares() if tiers is not None else {}
        copies = self._runner.duplicate_copies() if self._runner is not None else set()  # tied across stages
        grads = [(p, None if id(p) in held else p.grad) for part in self.model_parts for p in part.parameters()
                 if p.grad is not None or id(p) in held]
        replicas = self.model_parts[0].process_group if all(  # DDP: every dp rank holds every gradient
            isinstance(part, DistributedDataParallel) for part in self.model_parts) else None
        total = total_gradient_norm([(p, grad) for p, grad in grads if id(p) not in copies], held, self.device,
                                    self.mesh["pp"].get_group() if self.layout.pp > 1 else None, replicas)
        if max_norm == float("inf"):
            return total
        scale = max_norm / (total.item() + 1e-6)
        if scale < 1.0:
            for _, grad in grads:
                if grad is not None:
                    grad.mul_(scale)
            if tiers is not None:
                tiers.scale_held_gradients(scale)
        return total

    @property
    def last_bubble(self) -> float:
        """Share of the last step this rank sat idle in the pipeline (0 without pipeline parallel)."""
        return self._runner.last_bubble if self._runner is not None else 0.0

    def bubble_reading(self) -> Callable[[], float]:
        """`last_bubble` of the step just run, computed when called (on CUDA it waits for that
        step's events, so a loop reads it once per optimizer step, not after every micro-step)."""
        return self._runner.bubble_reading() if self._runner is not None else (lambda: 0.0)

    @property
    def stage_ids(self) -> list[int]:
        """The pipeline stage id of each of `model_parts` ([0] without pipeline parallel)."""
        return list(self._runner.stage_ids) if self._runner is not None else [0]

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- evaluation and generation -------------------------------------------------------------
    def evaluate(self, data: Any, num_batches: int | None = None, *,
                 batch_size: int | None = None) -> dict[str, float]:
        """Mean loss of held-out `data` over all ranks (and perplexity for language models),
        changing no state; see `colab_par.parallel.inference.evaluation.evaluate`."""
        from colab_par.parallel.inference.evaluation import evaluate
        return evaluate(self, data, num_batches, batch_size)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, *, do_sample: bool = False,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 attention_mask: torch.Tensor | None = None, seed: int = 0,
                 use_cache: bool = True) -> torch.Tensor:
        """Prompts followed by up to `max_new_tokens` new tokens, the same on every rank, changing
        no training state; see `colab_par.parallel.inference.generation.generate`."""
        from colab_par.parallel.inference.generation import generate
        from colab_par.parallel.inference.sampling import Sampling
        return generate(self, input_ids, max_new_tokens,
                        Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p),
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        attention_mask=attention_mask, seed=seed, use_cache=use_cache)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def tied_names(self) -> dict[str, list[str]]:
        """With pipeline stages: each state-dict name of the model -> every name of the same tensor
        (a head tied to the embeddings lives on two stages under two names); {} without."""
        return {name: list(aliases) for name, aliases in self._whole_model_names.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters (original FQNs, on the CPU) on global rank 0; {} elsewhere, gathered
        one tensor at a time (`full_state.py`)."""
        first_of_stage = self.dp_rank == 0 and self.cp_rank == 0 and self.tp_rank == 0
        return gather_full_state(self.model_parts, self.layout.pp, first_of_stage, self.tied_names)
