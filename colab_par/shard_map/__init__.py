"""The map of shards: which rank holds which slice of each parameter, and the bytes per rank.

``colab_par.show(pm)`` on every rank (a ``%%colossal`` cell) describes what each rank holds from its
real tensors (`describe.py`), gathers the descriptions and returns a `ShardMap`: the value of a
cell shows it as a picture in the notebook (drawn there from the data the engines sent), and
``print(colab_par.show(pm, text=True))`` prints it as a table.
"""
from __future__ import annotations

from typing import Any

from colab_par.shard_map.view import Row, ShardMap

__all__ = ["show", "ShardMap", "Row"]


def show(pm: Any, *, text: bool = False) -> "ShardMap | str":
    """The shard map of ParallelModel `pm` (its text with ``text=True``). Call it on every rank of
    the world: the ranks exchange what they hold."""
    import torch.distributed as dist

    from colab_par.shard_map.describe import describe_rank

    mine = describe_rank(pm)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    shard_map = ShardMap(every)
    return str(shard_map) if text else shard_map
