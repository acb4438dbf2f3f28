"""One random stream per mesh role, so dropout is right under every layout.

Ranks that compute one model replica together must draw the same masks for activations they all
hold: tensor-parallel ranks hold the output of a row-parallel layer (GPT-2's `resid_dropout`), the
embeddings and the norms' inputs whole, and a different mask on each would give the replicated
parameters different gradients and let them drift apart. So the stream is the same across "tp"
(as Megatron's default generator and the seed torch's DTensor RNG tracker asks every rank of an
SPMD region to share) and distinct across "dp" (other data, other masks), "cp" (each rank holds
other positions of the sequence; no activation is replicated over it) and "pp" (each stage holds
other layers), as torchtitan offsets the seed of a distinct mesh dim by its coordinate.

The stream is a `ModelStream` of the parallel model, not the process's default generator: it is
swapped in only while the model trains (`ParallelModel.forward_backward`), so a hand-written loop
gets the same discipline as the Trainer, and what a cell draws between steps (a batch built on
every rank, as the global batch must be) stays the same on every rank whatever the layout.
`parallelize` seeds it from rank 0's generator; `Trainer(seed=...)` reseeds it; checkpoints save and
restore its state per rank. Activation checkpointing replays it in recompute (`checkpointing.py`:
recompute runs in backward, inside the swap, and restores the state the forward began with).
Where a tensor-parallel rank holds a slice (attention heads, sequence-parallel shards), the ranks
draw the same mask for their different slices: consistent, though correlated between slices.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["DISTINCT_DIMS", "stream_index", "stream_seed", "ModelStream", "shared_seed"]

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


class ModelStream:
    """This rank's random stream for a parallel model's training passes (see the module docstring):
    the states of torch's CPU generator and, on a GPU, of the model's device generator."""

    def __init__(self, mesh: Any | None, device: torch.device, seed: int):
        self.index = 0 if mesh is None else stream_index(mesh)
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self.seed(seed)

    def seed(self, seed: int) -> None:
        """Start this rank's stream of a run seeded `seed` (as a Trainer's `seed` does)."""
        value = stream_seed(seed, self.index)
        self._states = {"cpu": torch.Generator().manual_seed(value).get_state()}
        if self._cuda:
            self._states["cuda"] = torch.Generator(self._device).manual_seed(value).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stream inside the block; the process's generators are as they were after."""
        outside = self._read()
        self._write(self._states)
        try:
            yield
        finally:
            self._states = self._read()
            self._write(outside)

    def state(self) -> dict[str, torch.Tensor]:
        """The stream's generator states by device kind ("cpu", and "cuda" on a GPU)."""
        return dict(self._states)

    def load_state(self, states: dict[str, torch.Tensor]) -> None:
        """Continue the stream from `state()` of a run with the same layout."""
        if states.keys() != self._states.keys():
            raise ValueError(f"a stream saved for {sorted(states)} cannot continue one on {sorted(self._states)}")
        self._states = dict(states)

    def _read(self) -> dict[str, torch.Tensor]:
        states = {"cpu": torch.get_rng_state()}
        if self._cuda:
            states["cuda"] = torch.cuda.get_rng_state(self._device)
        return states

    def _write(self, states: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(states["cpu"])
        if self._cuda:
            torch.cuda.set_rng_state(states["cuda"], self._device)


def shared_seed(device: torch.device) -> int:
    """A seed every rank agrees on, read from rank 0's generator without drawing from it."""
    import hashlib

    import torch.distributed as dist

    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest()
    seed = torch.tensor([int.from_bytes(digest[:4], "little")], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.broadcast(seed, src=0)
    return int(seed.item())
