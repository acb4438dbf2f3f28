"""Successive halving worked out from solo runs' losses: the reference the sweep's pruning must match."""
from __future__ import annotations

import math


def halving_lifetimes(losses: dict[str, list[float]], first: int, steps: int, factor: int = 2) -> dict[str, int]:
    """How many steps each trial lives: rungs at first, first·factor, … below `steps`; at each, the
    ⌈n/factor⌉ trials with the lowest mean loss since the previous rung go on (ties: listed first)."""
    race, lived, previous, rung = list(losses), {}, 0, first
    while rung < steps:
        order = {name: i for i, name in enumerate(losses)}
        ranked = sorted(race, key=lambda name: (sum(losses[name][previous:rung]) / (rung - previous), order[name]))
        keep = max(1, math.ceil(len(ranked) / factor))
        lived.update({name: rung for name in ranked[keep:]})
        race, previous, rung = ranked[:keep], rung, rung * factor
    lived.update({name: steps for name in race})
    return lived
