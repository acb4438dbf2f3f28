"""Which pipeline stages live on which rank, and the tensors several stages hold.

Stage placement follows torch's schedules: one stage per rank for gpipe/1f1b; "loop" placement for
interleaved (rank r holds r, r+pp, r+2pp, ...); "V" placement for zbv (rank r holds r and 2pp-1-r,
so the first and the last stage share rank 0).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from colab_par.compat import non_persistent_buffers
from colab_par.layout import Layout

__all__ = ["stage_ids", "stage_owner", "stage_layers", "TiedTensor", "tensors_across_stages", "stages_as_one"]


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Stage indices held by `pp_rank`, in the order torch's schedule for the layout expects."""
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{layout.pp - 1} for pp={layout.pp}")
    pp, v = layout.pp, layout.virtual_stages
    if layout.pp_schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if layout.pp_schedule == "interleaved":
        return [pp_rank + k * pp for k in range(v)]
    return [pp_rank]


def stage_owner(layout: Layout, stage: int) -> int:
    """The pp rank that holds `stage` (the inverse of `stage_ids`)."""
    for rank in range(layout.pp):
        if stage in stage_ids(layout, rank):
            return rank
    raise ValueError(f"stage {stage} does not exist; the layout has "
                     f"{layout.pp * layout.virtual_stages} stages")


def stage_layers(stage: int, n_stages: int, n_layers: int) -> range:
    """The layers stage `stage` of `n_stages` holds (equal shares, in order)."""
    per_stage = n_layers // n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


class TiedTensor(NamedTuple):
    """One tensor whose names live on several pipeline stages (see `tensors_across_stages`)."""

    names: tuple[str, ...]  # the names stages hold it under
    first_stage: int  # the copy a norm counts
    shape: tuple[int, ...]
    dtype: torch.dtype


def tensors_across_stages(model: nn.Module, holders: dict[str, set[int]], layout: Layout) -> list[TiedTensor]:
    """Refuse a split that would lose a tensor from checkpoints; return the tensors several stages
    use (a head tied to the word embeddings). `holders`: state-dict name -> the stages holding it.
    Each of those stages trains a copy, and `PipelineRunner.sync_tied_gradients` sums their
    gradients so the copies stay one tensor, as Megatron does for embeddings shared by the first
    and last stage."""
    aliases: dict[int, list[str]] = {}  # a tied tensor has several names
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    ties = []
    for key, names in aliases.items():
        held = set().union(*(holders.get(name, set()) for name in names))
        if not held:
            what = f"{names} are one tied tensor" if len(names) > 1 else f"{names[0]} is"
            raise ValueError(f"{what} not used by forward, so no pipeline stage would hold it and "
                             "checkpoints would lose it; delete the unused module, or use pp=1")
        if len(held) == 1:
            continue
        if layout.zero >= 2:
            raise ValueError(f"{names} are one tied tensor used by stages {sorted(held)}; its copies "
                             "are kept equal by summing their gradients, which FSDP's sharded "
                             "gradients (zero 2/3) do not support yet; use zero=0 or 1, or untie them "
                             "(e.g. tie_word_embeddings=False)")
        ties.append(TiedTensor(tuple(name for name in names if name in holders), min(held),
                               tuple(tensors[key].shape), tensors[key].dtype))
    return ties


def stages_as_one(parts: list[nn.Module]) -> nn.Module:
    """One module holding every stage of `parts` (one rank's) under the model's own names.

    A rank with several stages (interleaved, zbv) trains them under one optimizer; torch's
    optimizer state dicts name each parameter through one module, so this one lends them all:
    the stages' trees are laid over each other (the same parameter and module objects, nothing
    copied), a stage's stand-ins for other stages' modules give way to the real ones, and DDP's
    wrapper is looked through (its module's names are the model's). One part comes back as is.
    """
    if len(parts) == 1:
        return parts[0]
    merged = nn.Module()
    for part in parts:
        _lay_over(merged, part.module if isinstance(part, DistributedDataParallel) else part, "")
    return merged


def _holds_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _lay_over(into: nn.Module, source: nn.Module, prefix: str) -> None:
    """Add `source`'s tensors and children to `into`; two stages meeting at one name share a fresh
    container below it, and one parameter name held by two stages as two tensors is refused."""
    held_tensors = {**dict(into.named_parameters(recurse=False)), **dict(into.named_buffers(recurse=False))}
    transient = non_persistent_buffers(source)
    for kind, own in (("parameter", source.named_parameters(recurse=False)),
                      ("buffer", source.named_buffers(recurse=False))):
        for name, tensor in own:
            held = held_tensors.get(name)
            if held is tensor:
                continue
            if held is not None and kind == "buffer":
                continue  # each stage's copy of a fixed table (rotary frequencies): no optimizer state
            if held is not None:
                raise ValueError(f"two pipeline stages on this rank hold {prefix}{name} as two tensors (a "
                                 "tied tensor of a traced model), which one optimizer state dict cannot "
                                 "name twice; untie it, or use one stage per rank (e.g. 'pp2 1f1b')")
            if kind == "parameter":
                into.register_parameter(name, tensor)
            else:
                into.register_buffer(name, tensor, persistent=name not in transient)
    children = dict(into.named_children())
    for name, child in source.named_children():
        held = children.get(name)
        if held is child or not _holds_state(child):
            continue
        if held is None or not _holds_state(held):
            into.add_module(name, child)
            continue
        if not isinstance(held, _SharedContainer):  # a stage's own module: share a container
            shared = _SharedContainer()
            _lay_over(shared, held, f"{prefix}{name}.")
            into.add_module(name, shared)
        _lay_over(getattr(into, name), child, f"{prefix}{name}.")


class _SharedContainer(nn.Module):
    """A module name two stages on one rank both hold (each a part of it): their parts laid over."""
