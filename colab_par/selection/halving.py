"""Successive halving: stop the worst trials at checkpoints, so the sweep's time goes to the best.

Synchronous successive halving (Jamieson & Talwalkar 2016; Li et al.'s Hyperband rungs): rungs
at steps `first`, `first·factor`, `first·factor²`, … below the longest trial's steps. A trial
that reaches a rung waits there until every other trial still in the race has reached it too;
then they are ranked by their mean loss over the steps since the previous rung (one step's loss
is noisy) and only the best ⌈n / factor⌉ go on; the others end "pruned", with the losses they had.
A trial that fails or ends before a rung is not in that rung's race.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Halving"]


@dataclass(frozen=True)
class Halving:
    """`first`: the step of the first rung; `factor`: keep 1/factor of the trials at each rung,
    and space the rungs by that factor."""

    first: int
    factor: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.first, int) or self.first < 1:
            raise ValueError(f"Halving(first={self.first!r}): the first rung is a step count >= 1, "
                             "e.g. Halving(first=4)")
        if not isinstance(self.factor, int) or self.factor < 2:
            raise ValueError(f"Halving(factor={self.factor!r}) must be an integer >= 2 (2 keeps the "
                             "better half at each rung)")

    def rungs(self, steps: int) -> list[int]:
        """The rung steps before `steps`, the longest trial's step count."""
        rungs, rung = [], self.first
        while rung < steps:
            rungs.append(rung)
            rung *= self.factor
        return rungs

    def survivors(self, contenders: int) -> int:
        """How many of `contenders` trials go on past a rung (at least one)."""
        return max(1, math.ceil(contenders / self.factor))
