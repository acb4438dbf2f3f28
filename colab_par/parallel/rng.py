"""One random stream per mesh role, so dropout is right under every layout.

Ranks that compute one model replica together must draw the same masks for activations they all
hold: tensor-parallel ranks hold the output of a row-parallel layer (GPT-2's `resid_dropout`), the
embeddings and the norms' inputs whole, and a different mask on each would give the replicated
parameters different gradients and let them drift apart. So the stream is the same across "tp"
(as Megatron's default generator and the seed torch's DTensor RNG tracker asks every rank of an
SPMD region to share) and distinct across "dp" (other data, other masks), "cp" (each rank holds
other positions of the sequence; no activation is replicated over it) and "pp" (each stage holds
other layers), as torchtitan offsets the seed of a distinct mesh dim by its coordinate.

The stream is torch's default generator, so `torch.get_rng_state()` (what checkpoints save per
rank) is exactly its state. Activation checkpointing replays it in recompute (`checkpointing.py`).
Where a tensor-parallel rank holds a slice (attention heads, sequence-parallel shards), the ranks
draw the same mask for their different slices: consistent, though correlated between slices.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["DISTINCT_DIMS", "stream_index", "stream_seed", "seed_streams"]

DISTINCT_DIMS = ("pp", "dp", "cp")  # outermost first; "tp" shares its stream


def stream_index(mesh: Any) -> int:
    """This rank's stream among the (pp, dp, cp) coordinates of `mesh` (the kit's 4-dim mesh);
    equal for every rank of a tp group, and the global rank when tp is 1."""
    index = 0
    for dim in DISTINCT_DIMS:
        index = index * mesh[dim].size() + mesh[dim].get_local_rank()
    return index


def stream_seed(seed: int, index: int) -> int:
    """The seed of stream `index` for a run seeded `seed` (a one-process reference of data-parallel
    replica d, with no cp or pp, uses `stream_seed(seed, d)`)."""
    return seed * 1_000_003 + index


def seed_streams(seed: int, mesh: Any | None) -> None:
    """Seed this rank's stream (all devices' default generators); without a mesh (no parallel
    model), stream 0."""
    torch.manual_seed(stream_seed(seed, 0 if mesh is None else stream_index(mesh)))
