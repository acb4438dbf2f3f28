"""The rows engines publish and the dashboard draws: the datapub keys, the chunk size, and the
columns of a MoE model's routed tokens. Owned here, below both, so training never imports a view."""
from __future__ import annotations

from typing import Any

__all__ = ["METRICS_KEY", "ROWS_KEY", "CHUNK", "SAMPLES_COLUMN", "expert_row_key", "expert_counts"]

METRICS_KEY = "colab_par.metrics"
ROWS_KEY = METRICS_KEY + ".rows."
CHUNK = 64  # rows per published chunk: a publish re-sends at most ~2 chunks (a few KiB)
# A row's column of what the model wrote (a GRPO step's rollout): a short list of
# {"prompt": str, "completion": str, "reward": float}, drawn as a table under the plots.
SAMPLES_COLUMN = "samples"


def expert_row_key(layer: int, expert: int) -> str:
    """The row column of the tokens routed to `expert` of the `layer`-th MoE layer in a step."""
    return f"expert_tokens.{layer}.{expert}"


def expert_counts(row: dict[str, Any]) -> list[list[float]]:
    """The layer × expert matrix of a row's `expert_row_key` columns ([] when it has none); a
    layer or expert the row lacks counts 0."""
    prefix = "expert_tokens."
    cells = {}
    for key, value in row.items():
        if key.startswith(prefix):
            layer, expert = key[len(prefix):].split(".")
            cells[int(layer), int(expert)] = float(value)
    if not cells:
        return []
    layers, experts = (1 + max(index[axis] for index in cells) for axis in (0, 1))
    return [[cells.get((layer, expert), 0.0) for expert in range(experts)] for layer in range(layers)]
