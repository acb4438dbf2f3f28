"""The trainer–generator mismatch: how far the log-probabilities the training forward gives the
sampled tokens are from the ones generation drew them with, as TRL logs it with vLLM.

Both should be the same policy's: generation decodes with a KV cache one token at a time, the
training forward scores whole rows at once (another kernel order, bf16 rounding, sharded
matrices), so they differ by rounding, and by more where something is wrong (weights not
synced, a cache bug). With `top_k` / `top_p` cuts the sampling distribution is renormalized over
the tokens kept, which the training forward does not do (as TRL's), so the difference then also
holds log(kept probability) per token. Δ = training log-prob − sampling log-prob per unmasked
token; the measures, TRL's `sampling/...` metrics without its cap:

  logp_difference_mean / _max   mean and largest |Δ|   (TRL: sampling_logp_difference/mean, max)
  importance_ratio_mean / _min / _max   of exp(Δ), the per-token ratio that would correct for it
                                        (TRL: importance_sampling_ratio/mean, min, max)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["LogpMismatch", "logp_mismatch", "mismatch_over_ranks", "combined"]


@dataclass(frozen=True)
class LogpMismatch:
    """The measures (module docstring) over `tokens` unmasked tokens, as 0-d tensors (no device
    sync until `row`); all zero (ratios one) when no token counts."""

    logp_difference_mean: torch.Tensor
    logp_difference_max: torch.Tensor
    importance_ratio_mean: torch.Tensor
    importance_ratio_min: torch.Tensor
    importance_ratio_max: torch.Tensor
    tokens: torch.Tensor

    def row(self) -> dict[str, float]:
        """The measures as a history row's columns, named ``mismatch/<measure>``."""
        names = ("logp_difference_mean", "logp_difference_max", "importance_ratio_mean", "importance_ratio_min",
                 "importance_ratio_max")
        values = torch.stack([getattr(self, name).double() for name in names]).tolist()
        return {f"mismatch/{name}": value for name, value in zip(names, values)}


def logp_mismatch(train_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> LogpMismatch:
    """The mismatch of per-token log-probabilities (rows, tokens) from the training forward and
    from generation, over the tokens where `mask` (rows, tokens; bool or 0/1) is set."""
    if train_logps.shape != sampling_logps.shape or train_logps.shape != mask.shape:
        raise ValueError(f"training log-probs {tuple(train_logps.shape)}, sampling log-probs "
                         f"{tuple(sampling_logps.shape)} and mask {tuple(mask.shape)} must have one shape "
                         "(rows, completion tokens); compare the same rollout rows")
    dtype = torch.promote_types(train_logps.dtype, torch.float32)
    keep = mask.bool()
    delta = (train_logps.detach().to(dtype) - sampling_logps.detach().to(dtype))[keep]
    tokens = keep.sum()
    if delta.numel() == 0:
        zero, one = delta.new_zeros(()), delta.new_ones(())
        return LogpMismatch(zero, zero, one, one, one, tokens)
    ratio = delta.exp()
    return LogpMismatch(delta.abs().mean(), delta.abs().max(), ratio.mean(), ratio.min(), ratio.max(), tokens)


def combined(parts: list[LogpMismatch]) -> LogpMismatch | None:
    """The measures over the tokens of all `parts` (one rank's microbatches): means weighted by
    tokens, the extremes of all; None for no parts."""
    counted = [part for part in parts if int(part.tokens) > 0]
    if not counted:
        return parts[0] if parts else None
    tokens = sum(part.tokens for part in counted)
    weight = [part.tokens.to(part.logp_difference_mean.dtype) / tokens for part in counted]
    return LogpMismatch(sum(w * p.logp_difference_mean for w, p in zip(weight, counted)),
                        torch.stack([p.logp_difference_max for p in counted]).max(),
                        sum(w * p.importance_ratio_mean for w, p in zip(weight, counted)),
                        torch.stack([p.importance_ratio_min for p in counted]).min(),
                        torch.stack([p.importance_ratio_max for p in counted]).max(), tokens)


def mismatch_over_ranks(mine: LogpMismatch, group: dist.ProcessGroup | None) -> LogpMismatch:
    """`mine` (this rank's rows) combined with the other ranks' of `group` into the measures over
    every rank's tokens: means weighted by tokens, the extremes of all (two all-reduces)."""
    if group is None or dist.get_world_size(group) == 1:
        return mine
    sums = torch.stack([mine.logp_difference_mean * mine.tokens, mine.importance_ratio_mean * mine.tokens,
                        mine.tokens.to(mine.logp_difference_mean.dtype)])
    highs = torch.stack([mine.logp_difference_max, mine.importance_ratio_max, -mine.importance_ratio_min])
    highs = highs.masked_fill(mine.tokens == 0, -torch.inf)  # a rank without tokens: not its 0 / 1
    dist.all_reduce(sums, group=group)
    dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group)
    tokens = sums[2].round().long()
    if int(tokens) == 0:
        return mine
    return LogpMismatch(sums[0] / sums[2], highs[0], sums[1] / sums[2], -highs[2], highs[1], tokens)
