"""Per-token log-probabilities of completions from the policy's own forward, and the GRPO loss as
the ParallelModel's batch loss while a rollout trains.

The model sees each row as prompt + completion, with the positions and padding mask generation
used (positions counted over real tokens; colab_par's GPT masks left padding through a
`KVCache`, which attends exactly as generation's cache does, a Hugging Face causal LM through its
2D attention mask). Token j of a completion is scored by the logits at position
prompt_length + j - 1, divided by the sampling temperature (TRL's convention), through
log_softmax. Training goes through `pm.forward_backward_tensor`, so data parallel, ZeRO, tensor
parallel, recompute and memory tiers work as for any batch: `loss_installed` swaps
`pm.batch_loss_fn` for the rollout's GRPO loss while it trains and puts the model's back after.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.data.batch import call_model
from colab_par.models.gpt import KVCache
from colab_par.models.hf import is_hf_model
from colab_par.parallel.adapters.model import is_auxiliary_wrapper, is_tuner_layer
from colab_par.parallel.inference.state import bare_module, training_state_kept
from colab_par.training.grpo.objective import GrpoLoss, grpo_loss
from colab_par.training.grpo.options import GrpoLossOptions
from colab_par.training.grpo.rollout import Rollout

__all__ = ["policy_inputs", "completion_logps", "forward_logps", "adapters_disabled", "RolloutLoss",
           "loss_installed"]


def policy_inputs(model: nn.Module, rows: Rollout) -> dict[str, Any]:
    """What `model`'s forward takes for `rows` (prompts + completions), as generation fed them;
    a fresh dict per forward (the GPT's padding mask is a cache that one forward fills)."""
    model = bare_module(model)
    tokens = torch.cat([rows.prompt_ids, rows.completion_ids], dim=1)
    keep = torch.cat([rows.prompt_mask, torch.ones_like(rows.completion_ids, dtype=torch.bool)], dim=1)
    positions = (keep.long().cumsum(dim=-1) - 1).masked_fill(~keep, 0)
    if is_hf_model(model):
        inputs: dict[str, Any] = {"input_ids": tokens, "attention_mask": keep.long(), "position_ids": positions,
                                  "use_cache": False}
        if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
            inputs["logits_to_keep"] = rows.completion_ids.shape[1] + 1  # only the positions scored
        return inputs
    padded = not bool(rows.prompt_mask.all())
    return {"tokens": tokens, "positions": positions, **({"cache": KVCache(keep)} if padded else {})}


def completion_logps(outputs: Any, completion_ids: torch.Tensor, temperature: float,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log-probabilities (rows, tokens), the logits they come from (at least float32)
    divided by the temperature (rows, tokens, vocab)) of the completions, from the model's outputs."""
    logits = getattr(outputs, "logits", outputs)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"the model returned logits over {logits.shape[-1]} tokens, its vocabulary has "
                         f"{vocab_size}: a tensor-parallel plan left the output head's logits split by "
                         "vocabulary; gather them (style 'colwise_gather_output', or "
                         "ColwiseParallel(output_layouts=Replicate()))")
    length = completion_ids.shape[1]
    scores = logits[:, -(length + 1):-1]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature
    logps = scores.log_softmax(dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    return logps, scores


def forward_logps(pm: Any, rows: Rollout, temperature: float) -> torch.Tensor:
    """`completion_logps` of `rows` without gradient, training state kept (no dropout, RNG
    untouched, FSDP resharded after): the sampling or reference policy's log-probabilities."""
    model = bare_module(pm.model)
    with training_state_kept(pm), pm._autocast():
        outputs = call_model(model, policy_inputs(model, rows))
        return completion_logps(outputs, rows.completion_ids, temperature, vocab_size(model))[0]


def vocab_size(model: nn.Module) -> int:
    return bare_module(model).config.vocab_size


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone: every peft tuner layer and trained copy of a module switched off, as
    peft's `PeftModel.disable_adapter()` does, and back on after (which parameters train is kept
    as it was: peft's switch also sets requires_grad)."""
    switched = [module for module in model.modules() if is_tuner_layer(module) or is_auxiliary_wrapper(module)]
    trains = [(p, p.requires_grad) for p in model.parameters()]
    was_disabled = [module.disable_adapters for module in switched]
    for module in switched:
        module.enable_adapters(False)
    try:
        yield
    finally:
        for module, disabled in zip(switched, was_disabled):
            module.enable_adapters(not disabled)
        for p, requires_grad in trains:
            p.requires_grad_(requires_grad)


class RolloutLoss:
    """`pm.batch_loss_fn` while this rank's `rows` train: the GRPO loss of the model's outputs.
    `num_items_in_batch` is the unmasked tokens of the whole rollout (dapo). Gradients are averaged
    over data-parallel ranks, so each rank's share of the objective is scaled to make that average
    the objective (objective.py's notes): grpo and dr_grpo are means over equal shares of rows
    already, dapo's sum over the global token count is multiplied by the dp size, bnpo is each
    rank's own token mean (as TRL's bnpo is per process). `last` is the last forward's `GrpoLoss`."""

    def __init__(self, rows: Rollout, options: GrpoLossOptions, temperature: float, num_items_in_batch: int,
                 dp_size: int, vocab: int):
        self.rows, self.options, self.temperature, self.vocab = rows, options, temperature, vocab
        self.num_items_in_batch, self.dp_size = num_items_in_batch, dp_size
        self.last: GrpoLoss | None = None

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        logps, scores = completion_logps(outputs, self.rows.completion_ids, self.temperature, self.vocab)
        old = self.rows.old_logps if self.rows.old_logps is not None else logps.detach()
        self.last = grpo_loss(logps, old, self.rows.advantages, self.rows.mask, self.options,
                              ref_logps=self.rows.ref_logps, num_items_in_batch=self.num_items_in_batch,
                              logits=scores)
        return self.last.loss * (self.dp_size if self.options.loss_type == "dapo" else 1)


@contextlib.contextmanager
def loss_installed(pm: Any, loss: RolloutLoss) -> Iterator[RolloutLoss]:
    """`pm` scores dict batches with `loss` inside, with its own loss again after."""
    own = pm.batch_loss_fn
    pm.batch_loss_fn = loss
    try:
        yield loss
    finally:
        pm.batch_loss_fn = own
