"""A family's own on-disk tensor names, from transformers' conversion mapping.

transformers keeps most MoE families' experts packed in memory (``mlp.experts.gate_up_proj``
[experts, 2*ffn, hidden], ``mlp.experts.down_proj``) but reads and writes them one tensor per expert
(``mlp.experts.3.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.3.w1.weight``), as its
conversion mapping for the model says. `DiskNames` takes that mapping (transformers' own transforms,
reversed as its ``save_pretrained`` reverses them) and tells, per in-memory name, which tensors on
disk hold it. `FamilyWeights` reads a directory through it, a rank's block from the experts of its
slice only; the writer (`save.py`) writes the names transformers writes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colab_par.models.hf_weights import SafetensorsWeights

__all__ = ["DiskNames", "FamilyWeights", "Packed"]


@dataclass(frozen=True)
class Packed:
    """One packed tensor [experts, ...] stored one tensor per expert: per expert, the disk names
    concatenated along the packed tensor's dim `dim` (transformers' Concatenate order, gate before
    up); a single name per expert when nothing is concatenated."""
    parts: tuple[tuple[str, ...], ...]
    dim: int = 1


class DiskNames:
    """In-memory name -> its on-disk form (a name, or `Packed`) for a transformers model."""

    def __init__(self, model: nn.Module):
        from transformers.core_model_loading import PrefixChange, WeightConverter

        # As transformers' revert_weight_conversion: the model's mapping without legacy renames and
        # prefix changes, reversed (last transform first), each transform turned around.
        transforms = [t for t in _model_transforms(model) if not isinstance(t, PrefixChange)][::-1]
        self._renamings = [t.reverse_transform() for t in transforms if not isinstance(t, WeightConverter)]
        self._converters = [(t.reverse_transform(), _packing(t)) for t in transforms if isinstance(t, WeightConverter)]

    def on_disk(self, name: str, shape: tuple[int, ...]) -> str | Packed | None:
        """Where `name` (of `shape`) lies on disk; None for a packing the kit cannot slice."""
        from transformers.core_model_loading import apply_renamings

        for reverse, dim in self._converters:
            renamed, pattern = reverse.rename_source_key(name)
            if pattern is None:
                continue
            if dim is None or not shape:
                return None
            first = reverse.target_patterns[0]
            parts = tuple(tuple(apply_renamings(renamed.replace(first, part, 1).replace("*", str(expert)),
                                                self._renamings) for part in reverse.target_patterns)
                          for expert in range(shape[0]))
            return Packed(parts, dim)
        return apply_renamings(name, self._renamings)


def _model_transforms(model: nn.Module) -> list[Any]:
    """transformers' mapping for the first transformers model in `model` (itself, or the base of a
    peft wrapper, whose names are the ones written); none for any other model."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return [] if base is None else get_model_conversion_mapping(base, add_legacy=False)


def _packing(converter: Any) -> int | None:
    """The packed dim the per-expert tensors concatenate along (1: none concatenated), for the
    conversions the kit slices: stack the experts (MergeModulelist on dim 0), then optionally
    concatenate the parts (Concatenate); None for any other operation chain."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(converter, "operations", []))
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return None
    if len(ops) == 1:
        return 1
    if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
        return ops[1].dim
    return None


class FamilyWeights(SafetensorsWeights):
    """A directory's tensors under `model`'s in-memory names: a name the files hold as it is reads
    directly; otherwise it reads from the family's own layout (renamed, or per expert)."""

    def __init__(self, path: str | os.PathLike, model: nn.Module):
        super().__init__(path)
        names = DiskNames(model)
        self._disk: dict[str, str | Packed] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            where = None if super().__contains__(name) else names.on_disk(name, tuple(tensor.shape))
            if where is not None and where != name:
                self._disk[name] = where

    def _keys(self, name: str) -> list[str]:
        where = self._disk[name]
        return [where] if isinstance(where, str) else [key for keys in where.parts for key in keys]

    def __contains__(self, name: object) -> bool:
        if name in self._disk:
            return all(super(FamilyWeights, self).__contains__(key) for key in self._keys(name))
        return super().__contains__(name)

    def names(self) -> list[str]:
        consumed = {key for name in self._disk if name in self for key in self._keys(name)}
        return [name for name in self._disk if name in self] + \
               [name for name in super().names() if name not in consumed]

    def where(self, name: str) -> Path:
        return super().where(self._keys(name)[0] if name in self._disk else name)

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        where = self._disk.get(name)
        if where is None:
            return super().header(name)
        if isinstance(where, str):
            return super().header(where)
        part_shapes = [super(FamilyWeights, self).header(key) for key in where.parts[0]]
        shape = list(part_shapes[0][0])
        shape[where.dim - 1] = sum(s[where.dim - 1] for s, _ in part_shapes)
        return (len(where.parts), *shape), part_shapes[0][1]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        where = self._disk.get(name)
        if where is None:
            return super().read(name, index)
        if isinstance(where, str):
            return super().read(where, index)
        return self._read_packed(name, where, index)

    def _read_packed(self, name: str, packed: Packed, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The block `index` of a packed tensor, read from the experts (and rows) it covers only."""
        shape = self.header(name)[0]
        index = tuple(index) if index else tuple(slice(None) for _ in shape)
        if len(index) != len(shape):
            raise ValueError(f"read({name!r}) got {len(index)} slices for a tensor of {len(shape)} dims; "
                             "give one slice per dim")
        rows = range(shape[packed.dim])[index[packed.dim]]
        if rows.step != 1:
            raise ValueError(f"read({name!r}): a strided block along dim {packed.dim} is not supported; "
                             "give contiguous slices")
        first = packed.parts[0][0]
        sizes = [len(range(n)[s]) for n, s in zip(shape, index)]
        if 0 in sizes:
            return super().read(first, tuple(slice(0, 0) for _ in shape[1:])).new_empty(sizes)
        blocks = []
        for expert in range(shape[0])[index[0]]:
            pieces, offset = [], 0
            for key in packed.parts[expert]:
                size = super().header(key)[0][packed.dim - 1]
                low, high = max(rows.start, offset), min(rows.stop, offset + size)
                if low < high:
                    inner = list(index[1:])
                    inner[packed.dim - 1] = slice(low - offset, high - offset)
                    pieces.append(super().read(key, tuple(inner)))
                offset += size
            blocks.append(torch.cat(pieces, dim=packed.dim - 1))
        return torch.stack(blocks)
