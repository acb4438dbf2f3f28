"""The words of a layout: its fields, the values its named fields take, its error, and the few sizes
derived from fields alone (the default microbatch count, the shape of a tensor-parallel grid).

Everything else in `colab_par.layout` reads these; this module reads nothing of the package.
"""
from __future__ import annotations

from typing import Any

DEGREES = ("dp", "tp", "pp", "cp")
ZERO_LEVELS = (0, 1, 2, 3)
CP_MODES = ("ring", "ulysses")
TP_MODES = ("1d", "2d", "2.5d", "3d")  # Megatron, Optimus (q×q), Tesseract (q×q×d), 3D (q×q×q)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
PRECISIONS = ("fp32", "bf16")
CHECKPOINTING = ("none", "selective", "full")
# Field order of the enumeration: a field comes after those its choices or its default depend on.
FIELDS = ("tp", "tp_mode", "tp_depth", "cp", "pp", "dp", "ep", "pp_schedule", "virtual_stages",
          "microbatches", "zero", "sequence_parallel", "cp_mode", "offload", "precision", "checkpointing",
          "compile", "tiers")
# The fields that take one of a few named values, and those values.
NAMED_VALUES = {"zero": ZERO_LEVELS, "tp_mode": TP_MODES, "cp_mode": CP_MODES, "pp_schedule": PP_SCHEDULES,
                "precision": PRECISIONS, "checkpointing": CHECKPOINTING}


class LayoutError(ValueError):
    """An impossible layout; the message names the broken rule and a valid alternative."""


def divisors(n: int) -> list[int]:
    """Every divisor of `n`, smallest first (the candidates of a degree, the hints of a rule)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def default_microbatches(pp: int) -> int:
    """The count a Layout gets when none is given: the smallest that fills the pipeline (pp: every
    stage busy in steady state) for every schedule, and 1 (the whole batch) without pipeline."""
    return pp


def tensor_grid(tp: int, tp_mode: str, tp_depth: int = 1) -> "tuple[int, int] | None":
    """(q, depth) of a multi-dimensional tensor-parallel grid: q×q for "2d", q×q×depth for "2.5d",
    q×q×q for "3d" (depth q); None when `tp` does not form that grid (or for "1d")."""
    if tp_mode == "1d":
        return None
    depth = tp_depth if tp_mode == "2.5d" else 1
    power = 3 if tp_mode == "3d" else 2
    if tp % depth:
        return None
    q = round((tp // depth) ** (1 / power))
    if q < 2 or q ** power * depth != tp:
        return None
    return q, (q if tp_mode == "3d" else depth)


def grid_batch_chunks(layout: Any) -> int:
    """Into how many pieces a multi-dimensional tensor-parallel grid splits each (micro)batch: q in
    2d, q·depth in 2.5d, q² in 3d; 1 otherwise."""
    grid = tensor_grid(layout.tp, layout.tp_mode, layout.tp_depth)
    if grid is None:
        return 1
    q, depth = grid
    return q * depth if layout.tp_mode != "2d" else q
