"""Which ranks of a world differ: one representative rank per rank role, so a dry run traces each
distinct rank once instead of every rank.

Ranks differ only where the layout gives them different work: each pipeline rank holds its own
stages (several under the interleaved and V schedules, so roles are per pp rank, not per stage).
Data, context and tensor parallel ranks, and expert groups, hold equal shares (the layout's rules
make experts divide evenly over ep), and memory tiers are one placement for every rank, so
without a pipeline every rank is alike.
"""
from __future__ import annotations

from colab_par.layout import Layout
from colab_par.parallel.pipeline.stages import stage_ids

__all__ = ["rank_roles"]


def rank_roles(layout: "Layout | str", world_size: int) -> dict[str, int]:
    """{role name: its representative global rank}: "all ranks" -> 0 when every rank is alike;
    under pp one role per pp rank ("pp stage 1 of 4", or "pp rank 1 of 2 (stages 1, 2)" when it
    holds several), represented by its first rank (mesh order pp, dp, cp, tp: pp is outermost)."""
    layout = Layout.parse(layout)
    if layout.world_size != world_size:
        raise ValueError(f"layout {layout} spans {layout.world_size} ranks, not world_size={world_size}; "
                         f"give a layout whose sizes multiply to {world_size}")
    if layout.pp == 1:
        return {"all ranks": 0}
    per_stage = world_size // layout.pp
    roles = {}
    for pp_rank in range(layout.pp):
        stages = stage_ids(layout, pp_rank)
        name = (f"pp stage {stages[0]} of {layout.pp}" if len(stages) == 1 else
                f"pp rank {pp_rank} of {layout.pp} (stages {', '.join(map(str, stages))})")
        roles[name] = pp_rank * per_stage
    return roles
