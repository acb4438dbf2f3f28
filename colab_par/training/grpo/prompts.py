"""The prompts a GRPO loop draws from, read the same way on every rank: a list of token-id lists
(or 1-D tensors), or a torch Dataset / Hugging Face `datasets.Dataset` whose rows hold
`input_ids` and other columns (an expected answer, ...) that reward functions get as keywords.

Each step takes the next `count` prompts of a shuffled order, reshuffled every pass over the data
(TRL's sampler shuffles too): pass e is ``torch.randperm(len(prompts))`` drawn from a generator
seeded with ``seed + e``, so every rank picks the same prompts without talking to the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["PromptRows", "PromptDraw", "left_padded"]


class PromptRows:
    """`prompts` checked once (not empty, the first row readable), then read by index."""

    def __init__(self, prompts: Any):
        if isinstance(prompts, (str, bytes, Mapping)) or not (hasattr(prompts, "__len__")
                                                              and hasattr(prompts, "__getitem__")):
            raise TypeError(f"prompts must be a list of token-id lists, or a Dataset of rows with 'input_ids', "
                            f"not {type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: give at least one prompt (a list of token ids, or a Dataset "
                             "row with 'input_ids')")
        self.data = prompts
        self.columns = tuple(self.row(0)[1])

    def __len__(self) -> int:
        return len(self.data)

    def row(self, index: int) -> tuple[list[int], dict[str, Any]]:
        """Row `index`'s token ids and its other columns."""
        item = self.data[index]
        columns: dict[str, Any] = {}
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ValueError(f"prompt row {index} has columns {sorted(item)}, none named 'input_ids': give "
                                 "each row its prompt's token ids as 'input_ids'")
            columns = {key: value for key, value in item.items() if key != "input_ids"}
            item = item["input_ids"]
        ids = item.tolist() if isinstance(item, torch.Tensor) else item
        if (not isinstance(ids, (list, tuple)) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"prompt row {index} is {_short(ids)}: a prompt is a non-empty list (or 1-D "
                             "tensor) of token ids")
        return list(ids), columns

    def take(self, step: int, count: int, seed: int) -> tuple[list[list[int]], dict[str, list[Any]]]:
        """The `count` prompts of `step` (module docstring) and their columns, one list per column."""
        size, ids, columns = len(self.data), [], {key: [] for key in self.columns}
        orders: dict[int, list[int]] = {}
        for position in range(step * count, (step + 1) * count):
            lap = position // size
            if lap not in orders:
                orders[lap] = torch.randperm(size, generator=torch.Generator().manual_seed(seed + lap)).tolist()
            index = orders[lap][position % size]
            row_ids, row_columns = self.row(index)
            if set(row_columns) != set(self.columns):
                raise ValueError(f"prompt row {index} has columns {sorted(row_columns)}, row 0 has "
                                 f"{sorted(self.columns)}: give every row the same columns")
            ids.append(row_ids)
            for key, value in row_columns.items():
                columns[key].append(value)
        return ids, columns


@dataclass(frozen=True)
class PromptDraw:
    """The prompts and how many each step takes: what a checkpoint records as the loop's data, so
    that `checkpoint.load` refuses, before any tensor, a resume that would draw other prompts."""

    rows: PromptRows
    per_step: int

    def describe(self) -> dict[str, Any]:
        return {"kind": "grpo prompts", "rows": len(self.rows), "columns": list(self.rows.columns),
                "prompts_per_step": self.per_step}


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows as one (rows, longest) tensor padded on the left with `pad_id`, and the mask
    (True on real tokens) that `generate` takes."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = True
    return ids, mask


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
