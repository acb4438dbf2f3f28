"""The GRPO objective with TRL's definitions (`GRPOTrainer._compute_loss`, token-level importance
sampling), so a TRL user gets the same loss from the same numbers.

Per completion token t of sequence i, with A_i the sequence's advantage:
    ratio = exp(logp - old_logp)
    policy term = -min(ratio * A_i, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A_i)
    KL term (beta > 0) = beta * (exp(ref_logp - logp) - (ref_logp - logp) - 1)    (the k3 estimator)
and the masked per-token losses l become one number by `loss_type`:
    grpo     mean over sequences of (sum_t l / tokens of the sequence)
    bnpo     sum l / unmasked tokens of this batch
    dr_grpo  sum l / (sequences in this batch * max_completion_length)
    dapo     sum l / num_items_in_batch, the unmasked tokens of the whole global batch
Each value is what TRL logs as the policy loss of one micro-batch. What TRL then does for
gradient accumulation and data parallelism is the caller's: grpo, bnpo and dr_grpo are divided by
the number of micro-batches of an optimizer step; dapo is not (its denominator is already
global), so the dapo values of every micro-batch on every rank sum to the objective, and a rank
whose gradients are averaged over dp (DDP) multiplies its dapo loss by the dp size (TRL divides
num_items_in_batch by the number of processes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from colab_par.training.grpo.options import GrpoLossOptions

__all__ = ["GrpoLoss", "grpo_loss", "completion_mask", "token_entropy"]


@dataclass(frozen=True)
class GrpoLoss:
    """The loss to differentiate and what TRL logs beside it. The diagnostics are detached means
    over the unmasked tokens of this batch (`tokens` of them: weight by it to combine micro-batches
    or ranks into TRL's global means): the share of tokens clipped below (`clip_low`: ratio under
    1 - epsilon_low with a negative advantage), above (`clip_high`: over 1 + epsilon_high with a
    positive advantage) and either (`clip_region`); the k3 KL to the reference (None without
    one); the policy's entropy (None without logits)."""

    loss: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    clip_region: torch.Tensor
    kl: torch.Tensor | None
    entropy: torch.Tensor | None
    tokens: torch.Tensor


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              options: GrpoLossOptions, *, ref_logps: torch.Tensor | None = None,
              num_items_in_batch: int | torch.Tensor | None = None,
              logits: torch.Tensor | None = None) -> GrpoLoss:
    """The objective (module docstring) of completions' per-token log-probabilities `logps`
    (batch, tokens; the gradient flows through these only) under the policy being trained, under
    the policy that sampled them (`old_logps`) and under the reference (`ref_logps`, needed when
    `options.beta > 0`; given with beta 0 it is only measured), with one advantage per completion
    (`advantages`: (batch,), or (batch, tokens)) and the completion `mask` (1 on tokens that count:
    `completion_mask`). `num_items_in_batch` (dapo only) is the number of unmasked tokens over
    every micro-batch and rank of the optimizer step. `logits` (batch, tokens, vocab), already
    divided by the sampling temperature, add the entropy diagnostic."""
    _check_inputs(logps, old_logps, advantages, mask, ref_logps, logits, options, num_items_in_batch)
    dtype = torch.promote_types(logps.dtype, torch.float32)  # token counts stay exact under bf16
    mask = mask.to(dtype)
    advantages = advantages.detach().to(dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logps - old_logps.detach())
    clipped = ratio.clamp(1 - options.epsilon_low, 1 + options.epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    kl = None
    if ref_logps is not None:
        log_ref_ratio = ref_logps.detach() - logps
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if options.beta != 0:
            per_token = per_token + options.beta * kl
    loss = _aggregated(per_token * mask, mask, options, num_items_in_batch)
    with torch.no_grad():
        tokens = mask.sum()

        def masked_mean(values: torch.Tensor) -> torch.Tensor:
            return (values.to(mask.dtype) * mask).sum() / tokens.clamp(min=1)

        low = (ratio < 1 - options.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + options.epsilon_high) & (advantages > 0)
        return GrpoLoss(loss=loss, clip_low=masked_mean(low), clip_high=masked_mean(high),
                        clip_region=masked_mean(low | high),
                        kl=None if kl is None else masked_mean(kl),
                        entropy=None if logits is None else masked_mean(token_entropy(logits)),
                        tokens=tokens)


def _aggregated(masked: torch.Tensor, mask: torch.Tensor, options: GrpoLossOptions,
                num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
    """The masked per-token losses as one number, by TRL's definition of each loss type (an empty
    sequence or batch counts one token, as TRL's clamp(min=1))."""
    if options.loss_type == "grpo":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).mean()
    if options.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    if options.loss_type == "dr_grpo":
        return masked.sum() / (masked.shape[0] * options.max_completion_length)
    total = torch.as_tensor(num_items_in_batch, dtype=masked.dtype, device=masked.device)
    return masked.sum() / total.clamp(min=1)


def _check_inputs(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, ref_logps: torch.Tensor | None, logits: torch.Tensor | None,
                  options: GrpoLossOptions, num_items_in_batch: int | torch.Tensor | None) -> None:
    """Shapes and the inputs each option needs, checked without reading any value (no device sync)."""
    if not isinstance(options, GrpoLossOptions):
        raise TypeError(f"options={options!r} must be a GrpoLossOptions, e.g. GrpoLossOptions(loss_type='dapo')")
    if logps.dim() != 2:
        raise ValueError(f"logps has shape {tuple(logps.shape)}: pass (completions, tokens)")
    shaped = {"old_logps": old_logps, "mask": mask, "ref_logps": ref_logps}
    for name, value in shaped.items():
        if value is not None and value.shape != logps.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, logps {tuple(logps.shape)}: one value "
                             "per completion token")
    if advantages.shape not in (logps.shape[:1], logps.shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}: pass one per completion "
                         f"({logps.shape[0]},) or one per token {tuple(logps.shape)}")
    if logits is not None and logits.shape[:-1] != logps.shape:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: pass (completions, tokens, vocab) for "
                         f"logps {tuple(logps.shape)}")
    if options.beta != 0 and ref_logps is None:
        raise ValueError(f"beta={options.beta} weighs the KL to the reference policy: pass ref_logps=, or "
                         "use beta=0 (no reference)")
    if options.loss_type == "dapo" and num_items_in_batch is None:
        raise ValueError("loss_type='dapo' divides by the unmasked tokens of the whole global batch: pass "
                         "num_items_in_batch= (mask.sum() summed over every micro-batch and rank of the "
                         "step; mask.sum() when this batch is all of it)")
    if options.loss_type == "dr_grpo" and options.max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by batch size * max_completion_length: pass "
                         "GrpoLossOptions(max_completion_length=...) (the max_new_tokens of generation, e.g. "
                         "256), or use loss_type='dapo'")
    if options.loss_type == "dr_grpo" and logps.shape[1] > options.max_completion_length:
        raise ValueError(f"completions of {logps.shape[1]} tokens are longer than max_completion_length="
                         f"{options.max_completion_length} that dr_grpo divides by: pass the generation's "
                         "max_new_tokens")


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | Sequence[int], *,
                    mask_truncated: bool = False) -> torch.Tensor:
    """1 on each completion's tokens up to and including its first end-of-sequence token (any of
    `eos_token_id`), 0 on the padding after it, as TRL's completion mask. A completion with no end
    token was cut off by the length budget; `mask_truncated=True` (TRL's
    `mask_truncated_completions`, `GrpoLossOptions.mask_truncated`) gives it 0 everywhere, so an
    answer that merely ran out of room is neither rewarded nor punished."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids:
        raise ValueError("eos_token_id=[] names no end token: pass the tokenizer's eos_token_id")
    is_end = torch.isin(completion_ids, torch.tensor(ids, device=completion_ids.device))
    ended = is_end.any(dim=1)
    length = completion_ids.shape[1]
    first_end = torch.where(ended, is_end.int().argmax(dim=1), length)
    mask = torch.arange(length, device=completion_ids.device)[None, :] <= first_end[:, None]
    if mask_truncated:
        mask &= ended[:, None]
    return mask.long()


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy in nats of each position's next-token distribution (logits (..., vocab) ->
    (...)), TRL's `entropy_from_logits`; computed without gradient, as a diagnostic."""
    with torch.no_grad():
        logp = torch.log_softmax(logits, dim=-1)
        return -(logp.exp() * logp).sum(dim=-1)
