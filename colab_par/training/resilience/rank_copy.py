"""A rank's whole training state on the host: its shards of the model and optimizer, the Trainer's
loop state and history, and its random stream; taken at the end of a step, put back into a model
built with the same layout, and turned into bytes (a JSON header and one byte tensor: never a pickle)
to cross the network."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from colab_par.training.checkpoint import install_state, rank_state
from colab_par.training.checkpoint_files import rng_state, set_rng_state
from colab_par.training.checkpoint_format import CheckpointError, from_json, split_state, to_json

__all__ = ["RankCopy", "local_piece", "loop_state", "take", "put", "to_bytes", "from_bytes"]


@dataclass
class RankCopy:
    """`tensors`: "model.<name>" / "optim.<name>" -> this rank's local shard (a host tensor);
    `values`: JSON-able: the optimizer's non-tensor values ("others"), the Trainer's `state_dict`
    ("trainer") and rows ("history"), the model's random stream ("rng")."""

    step: int
    layout: str
    world_size: int
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]


def local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `tensor` (a view: writing it writes the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def loop_state(pm: Any, trainer: Any) -> dict[str, Any]:
    """The loop's part of a copy, as JSON: what the Trainer and the random stream hold now (the
    model and optimizer stay as they are until the next optimizer step; these move on sooner)."""
    return {"trainer": trainer.state_dict(), "rng": rng_state(pm.rng), "history": len(trainer.history)}


@torch.no_grad()
def take(pm: Any, trainer: Any, world_size: int, loop: dict[str, Any] | None = None) -> RankCopy:
    """This rank's state copied to host memory (nothing is shared with the live tensors): now, or
    with the loop's state as `loop_state` recorded it at the end of the last whole step."""
    tensors, others = split_state(rank_state(pm, trainer))
    encoded, refused = to_json(others)
    if refused:
        raise CheckpointError(f"cannot keep {refused[0]} in memory: only tensors and JSON values are copied")
    copies = {f"{part}.{key}": local_piece(value).detach().to("cpu", copy=True)
              for part, values in tensors.items() for key, value in values.items()}
    loop = loop if loop is not None else loop_state(pm, trainer)
    values = {"others": encoded, "trainer": loop["trainer"], "rng": loop["rng"],
              "history": json.loads(json.dumps(trainer.history[:loop["history"]]))}
    return RankCopy(int(loop["trainer"]["step"]), str(pm.layout), world_size, copies, values)


@torch.no_grad()
def put(copy: RankCopy, pm: Any, trainer: Any, *, with_rng: bool = True) -> None:
    """Make `pm`, its optimizer and `trainer` what `copy` holds (same layout, same world)."""
    if copy.layout != str(pm.layout):
        raise CheckpointError(f"a copy of layout {copy.layout!r} cannot go into a model laid out as {pm.layout}")
    state = rank_state(pm, trainer)
    tensors, others = split_state(state)
    for part, values in tensors.items():
        for key, value in values.items():
            local_piece(value).copy_(copy.tensors[f"{part}.{key}"])
    for name in others:
        part, key = name.split(".", 1)
        state[part][key] = from_json(copy.values["others"][name], name)
    install_state(pm, state)
    trainer.load_state_dict(copy.values["trainer"])
    trainer.history = list(copy.values["history"])
    if with_rng:
        set_rng_state(pm.rng, copy.values["rng"])


def to_bytes(copy: RankCopy) -> tuple[bytes, torch.Tensor]:
    """(a JSON header, every tensor's bytes end to end in one uint8 tensor)."""
    names = list(copy.tensors)
    flat = [copy.tensors[name].contiguous().reshape(-1).view(torch.uint8) for name in names]
    header = {"step": copy.step, "layout": copy.layout, "world_size": copy.world_size, "values": copy.values,
              "tensors": [[name, list(copy.tensors[name].shape), str(copy.tensors[name].dtype).removeprefix("torch.")]
                          for name in names]}
    payload = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    return json.dumps(header).encode(), payload


def from_bytes(header: bytes, payload: torch.Tensor) -> RankCopy:
    """The copy `to_bytes` wrote."""
    meta = json.loads(header.decode())
    tensors, offset = {}, 0
    for name, shape, dtype_name in meta["tensors"]:
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        tensors[name] = payload[offset:offset + size].clone().view(dtype).reshape(shape)  # aligned
        offset += size
    return RankCopy(meta["step"], meta["layout"], meta["world_size"], tensors, meta["values"])
