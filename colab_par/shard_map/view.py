"""`ShardMap`: which rank holds which slice of each parameter, and the bytes each rank holds.

Built from every rank's `describe.describe_rank` (on the engines, or in the notebook from what they
sent); prints as a table and draws itself (`picture.py`). Pure Python. With many parameters the rows
are the model's blocks (``layers.3``), each cell the share of the block's elements the rank holds.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from colab_par.views import remote_view
from colab_par.shard_map.picture import draw, size_text

__all__ = ["ShardMap", "Row", "MAX_PARAMETER_ROWS"]

MAX_PARAMETER_ROWS = 24  # above this many parameters, one row per block
_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # "layers.3.attn.wq.weight" -> "layers.3"


@dataclass(frozen=True)
class Row:
    """One row of the map: a parameter (or a block of them) and what each rank holds of it."""

    name: str
    shape: tuple[int, ...]  # () for a block
    numel: int
    held: dict[int, int]  # rank -> elements held
    slices: dict[int, tuple[tuple[int, int], ...]]  # rank -> per dim (start, stop); parameters only
    placement: dict[int, str]  # rank -> placements

    def fraction(self, rank: int) -> float:
        return self.held.get(rank, 0) / self.numel if self.numel else 0.0

    def cell(self, rank: int) -> str:
        """What rank `rank` holds, in words: "all", "-", "[0:32, :]" or a share of a block."""
        if rank not in self.held:
            return "-"
        if self.fraction(rank) == 1.0:
            return "all"
        if not self.shape or rank not in self.slices:
            return f"{self.fraction(rank):.0%}"
        dims = [":" if (start, stop) == (0, size) else f"{start}:{stop}"
                for (start, stop), size in zip(self.slices[rank], self.shape)]
        return "[" + ", ".join(dims) + "]"


class ShardMap(remote_view.View):
    """Which rank holds which slice of each parameter of a ParallelModel (see `colab_par.show`)."""

    kind = "shard_map"

    def __init__(self, ranks: list[dict[str, Any]]):
        if not ranks:
            raise ValueError("a ShardMap needs the description of at least one rank")
        self.descriptions = sorted(ranks, key=lambda d: d["rank"])
        self.layout = self.descriptions[0].get("layout", "")

    @property
    def ranks(self) -> list[int]:
        return [d["rank"] for d in self.descriptions]

    # ---- the parameters --------------------------------------------------------------------------
    def parameters(self) -> list[Row]:
        """One row per parameter, in the model's order (the first rank holding it decides)."""
        rows: dict[str, dict[str, Any]] = {}
        for description in self.descriptions:
            for param in description["params"]:
                row = rows.setdefault(param["name"], {"shape": tuple(param["shape"]), "held": {},
                                                      "slices": {}, "placement": {}})
                rank = description["rank"]
                row["held"][rank] = math.prod(param["sizes"])
                row["slices"][rank] = tuple((o, o + s) for o, s in zip(param["offsets"], param["sizes"]))
                row["placement"][rank] = param["placement"]
        return [Row(name, row["shape"], math.prod(row["shape"]), row["held"], row["slices"], row["placement"])
                for name, row in rows.items()]

    def rows(self) -> list[Row]:
        """The rows shown: the parameters, or their blocks when there are more than
        `MAX_PARAMETER_ROWS` of them."""
        params = self.parameters()
        if len(params) <= MAX_PARAMETER_ROWS:
            return params
        blocks: dict[str, list[Row]] = {}
        for row in params:
            match = _BLOCK.match(row.name)
            blocks.setdefault(match[1] if match else row.name.split(".")[0], []).append(row)
        return [Row(name, (), sum(r.numel for r in members),
                    {rank: sum(r.held.get(rank, 0) for r in members)
                     for rank in {rank for r in members for rank in r.held}},
                    {}, {}) for name, members in blocks.items()]

    # ---- bytes -------------------------------------------------------------------------------
    def bytes_per_rank(self) -> dict[int, int]:
        """Bytes of parameters each rank holds: its slices' elements × element size."""
        return {d["rank"]: sum(math.prod(p["sizes"]) * p["itemsize"] for p in d["params"])
                for d in self.descriptions}

    def storage_per_rank(self) -> dict[int, int]:
        """Bytes the parameters' storages take on each rank (padded shards included)."""
        return {d["rank"]: d["storage_bytes"] for d in self.descriptions}

    def state_per_rank(self) -> dict[int, dict[str, int]]:
        """Per rank: parameter, gradient and optimizer-state bytes (what the bar chart stacks)."""
        held = self.bytes_per_rank()
        return {d["rank"]: {"parameters": held[d["rank"]], "gradients": d["grad_bytes"],
                            "optimizer state": d["optimizer_bytes"]} for d in self.descriptions}

    # ---- showing it ------------------------------------------------------------------------------
    def __str__(self) -> str:
        rows, ranks = self.rows(), self.ranks
        cells = [[row.cell(rank) for rank in ranks] for row in rows]
        shapes = ["×".join(map(str, row.shape)) if row.shape else f"{row.numel:,} el." for row in rows]
        name_w = max(len("parameter"), *(len(row.name) for row in rows))
        shape_w = max(len("shape"), *(len(s) for s in shapes))
        col_w = [max(len(f"rank {rank}"), *(len(c[i]) for c in cells)) for i, rank in enumerate(ranks)]
        lines = [f"colab_par shard map: {self.layout}, {len(ranks)} ranks",
                 f"{'parameter':<{name_w}}  {'shape':>{shape_w}}  "
                 + "  ".join(f"{f'rank {r}':>{w}}" for r, w in zip(ranks, col_w))]
        for row, shape, cell in zip(rows, shapes, cells):
            lines.append(f"{row.name:<{name_w}}  {shape:>{shape_w}}  "
                         + "  ".join(f"{c:>{w}}" for c, w in zip(cell, col_w)))
        held, storage = self.bytes_per_rank(), self.storage_per_rank()
        lines.append(f"{'bytes held':<{name_w}}  {'':>{shape_w}}  "
                     + "  ".join(f"{size_text(held[r]):>{w}}" for r, w in zip(ranks, col_w)))
        padded = {r: storage[r] - held[r] for r in ranks if storage[r] != held[r]}
        if padded:
            lines.append("storage beyond the slices (padded shards): "
                         + ", ".join(f"rank {r} {size_text(b)}" for r, b in padded.items()))
        states = self.state_per_rank()
        optimizer = [states[r]["optimizer state"] for r in ranks]
        if any(optimizer):
            lines.append(f"{'optimizer state':<{name_w}}  {'':>{shape_w}}  "
                         + "  ".join(f"{size_text(b):>{w}}" for b, w in zip(optimizer, col_w)))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<ShardMap {self.layout}: {len(self.parameters())} parameters on {len(self.ranks)} ranks>"

    def png(self, **options: Any) -> bytes:
        """The picture (`picture.draw`)."""
        return draw(self, **options)

    def to_json(self) -> dict[str, Any]:
        return {"ranks": self.descriptions}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShardMap":
        return cls(data["ranks"])

