"""The largest model of a family that a layout trains: how far a memory budget, with or without a
disk tier, stretches (issue 26's question "how big can I go?").

Above the planner: every member is `planner.estimate`d under the layout, and the largest one that
fits (its build included, `init`) is the answer. The default family is the reference GPT grown in
width and depth as `benchmarks/scale.py` grows it (heads of 128, about 85 channels per layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from colab_par.layout import Layout
from colab_par.planning.planner import ModelSpec, Plan, estimate
from colab_par.layout.tier_options import DEFAULT_DISK, MemoryTiers

__all__ = ["ModelFit", "gpt_ladder", "largest_model", "largest_under_budget"]


@dataclass(frozen=True)
class ModelFit:
    """A family member (`sizes`, a dict `ModelSpec.of` reads), its parameter count and its plan."""

    sizes: dict[str, Any]
    n_params: int
    plan: Plan


def gpt_ladder(vocab_size: int = 8192, *, widths: Iterable[int] = range(256, 16385, 256),
               channels_per_layer: int = 85) -> list[dict[str, Any]]:
    """Reference GPT sizes, smallest first: each width (heads of 128 channels) with
    width / `channels_per_layer` layers (at least 2)."""
    return [dict(vocab_size=vocab_size, d_model=d, n_head=max(1, d // 128),
                 n_layer=max(2, round(d / channels_per_layer))) for d in widths]


def largest_model(layout: "Layout | str", *, device: Any, global_batch: int, seq_len: int,
                  family: Iterable[Any] | None = None, init: str = "meta",
                  gpus_per_node: int = 8) -> ModelFit | None:
    """The member of `family` (default `gpt_ladder()`) with the most parameters whose plan under
    `layout` (memory tiers included) fits; None when none does."""
    layout = Layout.parse(layout)
    best: ModelFit | None = None
    for sizes in gpt_ladder() if family is None else family:
        spec = ModelSpec.of(sizes)
        if best is not None and spec.n_params <= best.n_params:
            continue
        option = estimate(spec, layout, device=device, global_batch=global_batch, seq_len=seq_len,
                          gpus_per_node=gpus_per_node, validate=False, init=init)
        if option.fits:
            best = ModelFit(dict(sizes), spec.n_params, option)
    return best


def largest_under_budget(layout: "Layout | str", budget: "int | str", *, device: Any, global_batch: int,
                         seq_len: int, disk: str = DEFAULT_DISK, family: Iterable[Any] | None = None,
                         init: str = "meta", gpus_per_node: int = 8) -> dict[str, ModelFit | None]:
    """The largest member that trains under `budget` bytes per rank: {"memory": kept in memory
    (device and, on CUDA, host), "disk": with a disk tier in `disk` (its free space the limit)}.
    `layout`'s own tiers are replaced."""
    layout = Layout.parse(layout)
    members = list(gpt_ladder() if family is None else family)
    options = dict(device=device, global_batch=global_batch, seq_len=seq_len, family=members, init=init,
                   gpus_per_node=gpus_per_node)
    return {"memory": largest_model(layout.replace(tiers=MemoryTiers(budget=budget)), **options),
            "disk": largest_model(layout.replace(tiers=MemoryTiers(budget=budget, disk=disk)), **options)}
