"""A Hugging Face MoE's balance loss under pipeline parallel: the family's own loss over every
layer's router logits, though each stage holds only its own layers'.

transformers' ``load_balancing_loss_func`` is not a sum of per-layer terms (Qwen3-MoE, Mixtral, ...
take the product of the token shares and the mean probabilities over ALL layers' rows), so a
stage cannot compute its part alone. It can compute its exact gradient share, though: the loss
L(x_1, ..., x_p) of the stages' logits has the total derivative Σ_s ∂L/∂x_s, and stage s needs
only ∂L/∂x_s, the family's function evaluated on every stage's logits with the others held fixed.
So after each microbatch's forward a stage exchanges its (global-batch,
`GlobalBalanceLoss.gather`) router logits with the other stages: its sends and its receives
posted together, non-blocking, as one `batch_isend_irecv` on a group of their own, and in that
microbatch's backward, when every stage's forward of it has run, it waits for theirs and
differentiates the family's loss with respect to its own (`_StageLoss`). Pairing matters on
NCCL: a send beyond its buffers waits for the peer's receive, and a pair's operations run in
order, so sends posted in forward ahead of receives posted in backward could wait on each other
(gloo buffers sends, so the CPU would never show it). The receive sizes are known in forward
without asking: the rows are the microbatch's (the same on every stage) and each stage's router
count is exchanged once, when the stages are set up. The value is the same on every stage and
counted once, on the first. Every stage exchanges in microbatch order, so messages match in that
order (NCCL ignores tags); what a forward without backward received is dropped when the step
finishes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from colab_par.parallel.hf_experts import GlobalBalanceLoss

__all__ = ["StageBalance"]


class _StageLoss(torch.autograd.Function):
    """A zero in forward whose backward is this stage's share of the family's balance-loss
    gradient for microbatch `index` (times the incoming gradient: the microbatch's loss weight)."""

    @staticmethod
    def forward(ctx: Any, balance: "StageBalance", index: int, *logits: torch.Tensor) -> torch.Tensor:
        ctx.balance, ctx.index = balance, index
        ctx.save_for_backward(*logits)
        return logits[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        own = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            loss = ctx.balance.loss(ctx.index, own)
            grads = torch.autograd.grad(loss, own)
        return (None, None, *(g * grad.to(g.dtype) for g in grads))


class StageBalance:
    """One pipeline rank's side of the family's balance loss: `after_forward` per microbatch,
    `finish` once per step (returns the step's weighted balance loss where it is counted)."""

    def __init__(self, balance: GlobalBalanceLoss, group: dist.ProcessGroup, device: torch.device):
        """`group`: this rank's pp ranks, in stage order, used for nothing else."""
        self.balance, self.group, self.device = balance, group, device
        self.stage, size = dist.get_rank(group), dist.get_world_size(group)
        self.peers = {s: dist.get_global_rank(group, s) for s in range(size) if s != self.stage}
        layers = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
        dist.all_gather(layers, torch.tensor([balance.layers], device=device), group=group)
        self.layers = [int(count) for count in layers]  # each stage's routers, in stage order
        self.begin()

    def begin(self) -> None:
        self.works: list[list[Any]] = []  # per microbatch, its exchange's sends and receives
        self.buffers: list[torch.Tensor] = []  # what the sends read, alive until they complete
        self.own: list[list[torch.Tensor]] = []  # per microbatch, this stage's logits (detached)
        self.received: list[dict[int, list[torch.Tensor]]] = []  # per microbatch, in order
        self.values: dict[int, float] = {}
        self.weights: list[float] = []

    def after_forward(self, weight: float) -> torch.Tensor | None:
        """This microbatch's logits go to the other stages; the returned zero (None without
        routers on this stage) carries this stage's gradient share in its backward."""
        logits, mask = self.balance.gather()
        if mask is not None:
            raise ValueError("an attention mask cannot reach the balance loss of a model cut into pipeline "
                             "stages; train without padding masks or set config.output_router_logits=False")
        index = len(self.own)
        self.own.append([t.detach() for t in logits])
        self.weights.append(weight)
        self._exchange(self.own[-1])
        return _StageLoss.apply(self, index, *logits) if logits else None

    def loss(self, index: int, own: list[torch.Tensor]) -> torch.Tensor:
        """The family's loss of microbatch `index` on every stage's logits, `own` in this
        stage's place (the value is recorded, once)."""
        others = self._receive(index)
        layers = [t for stage in sorted([*others, self.stage])
                  for t in (own if stage == self.stage else others[stage])]
        dtype = own[0].dtype if own else layers[0].dtype
        loss = self.balance.loss([t.to(dtype) for t in layers])
        self.values[index] = float(loss.detach())
        return loss

    def finish(self) -> float:
        """Value the microbatches whose backward did not run (none on this stage), wait for the
        exchanges not yet waited for; the step's weighted loss on the first stage, 0 elsewhere."""
        for index, own in enumerate(self.own):
            if index not in self.values:
                with torch.no_grad():
                    self.loss(index, own)
        for works in self.works:
            for work in works:
                work.wait()
        total = sum(self.values[i] * w for i, w in enumerate(self.weights)) if self.stage == 0 else 0.0
        self.begin()
        return total

    def _exchange(self, logits: list[torch.Tensor]) -> None:
        """Post this microbatch's exchange: this stage's logits to every other stage, theirs
        (sized by their router counts and this microbatch's rows) from each, as one batch."""
        rows = logits[0].shape[0]
        payload = torch.cat(logits).float()
        got = {stage: torch.empty(self.layers[stage] * rows, self.balance.n_experts, device=self.device)
               for stage in self.peers}
        ops = [op for stage, peer in self.peers.items()
               for op in (dist.P2POp(dist.isend, payload, peer, self.group),
                          dist.P2POp(dist.irecv, got[stage], peer, self.group))]
        self.buffers.append(payload)
        self.works.append(dist.batch_isend_irecv(ops))
        self.received.append({stage: list(buffer.split(rows)) for stage, buffer in got.items()})

    def _receive(self, index: int) -> dict[int, list[torch.Tensor]]:
        """The other stages' logits of microbatch `index`, once its exchange completed."""
        for work in self.works[index]:
            work.wait()
        self.works[index] = []  # waited for (a gloo work waited for twice never returns)
        return self.received[index]
