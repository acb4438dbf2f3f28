"""A tied tensor saved under one of its names, loaded where a layout wants it under another.

A head tied to the word embeddings is one tensor of the whole model, saved (with its optimizer
state) under the first of its names; pipeline stages hold a copy of it on the first stage and on
the last, each under its own name (`ParallelModel.tied_names`). An entry a layout wants but the
checkpoint lacks is read from the same tensor's entry under another name, so a checkpoint of a
whole tied model loads into pipeline stages (and stages' checkpoints, which hold every name, load
anywhere).
"""
from __future__ import annotations

from typing import Any, Container, Iterable

import torch

__all__ = ["tied_sources", "read_through_aliases"]

# How DCP names an entry of a parameter: its model value, its optimizer state and settings.
_PREFIXES = ("model.", "optim.state.", "optim.param_groups.")


def tied_sources(aliases: dict[str, list[str]], wanted: Iterable[str], saved: Container[str]) -> dict[str, str]:
    """{entry in `wanted` missing from `saved`: the entry `saved` has for the same tensor under a
    tied name}. `aliases`: parameter name -> every name of its tensor."""
    found = {}
    for key in wanted:
        if key in saved:
            continue
        for prefix in _PREFIXES:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            for name, names in aliases.items():
                if rest == name or rest.startswith(name + "."):
                    source = next((prefix + other + rest[len(name):] for other in names
                                   if prefix + other + rest[len(name):] in saved), None)
                    if source is not None:
                        found[key] = source
    return found


def read_through_aliases(tensors: dict[str, dict], sources: dict[str, str]) -> tuple[dict[str, dict], list]:
    """`tensors` ({part: {key: tensor}}) as DCP should read them, each borrowing entry under its
    source's name, and the (destination, source) tensor pairs to copy after the read where this
    rank holds the source entry itself (both stages of a tie on one rank)."""
    reads = {part: dict(values) for part, values in tensors.items()}
    copies: list[tuple[torch.Tensor, Any]] = []
    for key, source in sources.items():
        part, name = key.split(".", 1)
        source_part, source_name = source.split(".", 1)
        if part not in reads or name not in reads[part]:
            continue  # a non-tensor value: the caller reads it from the JSON
        tensor = reads[part].pop(name)
        if source_name in reads[source_part]:
            copies.append((tensor, reads[source_part][source_name]))
        else:
            reads[source_part][source_name] = tensor
    return reads, copies
