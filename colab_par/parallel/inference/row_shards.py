"""A rollout's rows shared out over the data-parallel ranks, and the decoded shares gathered back.

Colocated GRPO wants every rank to hold the whole rollout (each scores all of it), but decoding
all of it on every rank repeats the work dp times. Under pure data parallel (dp > 1 with zero 0-3,
offload, memory tiers, bf16, recompute; tp = pp = cp = ep = 1) a rank's forward needs no other
rank except for zero3's weight all-gathers, which `gathered.py` makes once, at the prefill every
rank runs (a model whose forward sums over the ranks, as MoE balance statistics do, is left out). So there each rank decodes the contiguous share of rows it trains on (`Rollout.rows`)
on its own, with no per-token collective (a rank whose rows all end early just stops), and one
all-gather afterwards brings every rank the whole batch. With per-row seeded draws
(`sampling.row_generator`) a row's tokens are those any other layout draws for it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["decoded_share", "gathered_shares"]


def decoded_share(pm: Any, rows: int) -> slice | None:
    """The rows this rank decodes alone, or None where every rank decodes the whole batch: any
    layout with tp, pp, cp or ep, a single dp rank, rows that dp does not divide, and a model whose
    forward itself sums over the dp ranks (mixture-of-experts layers given a `stats_group` for
    their balance statistics: a rank that stopped early would leave the others waiting)."""
    layout = pm.layout
    alone = layout.dp > 1 and layout.tp == layout.pp == layout.cp == layout.ep == 1
    if not alone or rows % layout.dp or _forward_communicates(pm):
        return None
    share = rows // layout.dp
    return slice(pm.dp_rank * share, (pm.dp_rank + 1) * share)


def _forward_communicates(pm: Any) -> bool:
    return any(getattr(module, "stats_group", None) is not None
               for part in pm.model_parts for module in part.modules())


def gathered_shares(pm: Any, completions: torch.Tensor, logps: torch.Tensor, max_new_tokens: int,
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (completion ids, sampling log-probabilities), in dp rank order, on every rank,
    in one all-gather: each share padded to `max_new_tokens` (with `pad_id`, log-probability 0,
    as a finished row continues) beside the steps it took, then cut to the most steps any rank
    took (what decoding the whole batch on one rank gives). Token ids travel exactly as float64."""
    rows, steps = completions.shape
    packed = torch.zeros(rows, 1 + 2 * max_new_tokens, dtype=torch.float64, device=completions.device)
    packed[:, 0] = steps
    packed[:, 1:1 + max_new_tokens] = pad_id
    packed[:, 1:1 + steps] = completions
    packed[:, 1 + max_new_tokens:1 + max_new_tokens + steps] = logps
    pieces = [torch.empty_like(packed) for _ in range(pm.layout.dp)]
    dist.all_gather(pieces, packed, group=pm.mesh["dp"].get_group())
    whole = torch.cat(pieces)
    width = int(whole[:, 0].max())
    return (whole[:, 1:1 + width].long(),
            whole[:, 1 + max_new_tokens:1 + max_new_tokens + width].to(torch.float32))
