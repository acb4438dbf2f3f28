"""Which trial a free engine runs next: Sharded-LRTF (Hydra), FIFO and random.

A trial is runnable when none of its tasks is in flight (its shards run one after another). The
policies see only what a scheduler knows: each trial's estimated remaining time and its order.
"""
from __future__ import annotations

import random
from typing import Protocol, Sequence

__all__ = ["POLICIES", "Candidate", "pick"]

POLICIES = ("lrtf", "fifo", "random")


class Candidate(Protocol):
    index: int  # the trial's position in the sweep (FIFO order)

    def remaining_seconds(self) -> float: ...

    def step_seconds(self) -> float: ...


def pick(policy: str, runnable: Sequence[Candidate], rng: random.Random,
         stay: Candidate | None = None) -> Candidate:
    """Sharded-LRTF: the longest estimated remaining time (ties: earlier trial), except that the
    engine keeps `stay` (the trial it ran last, its weights resident) unless another's remaining
    time is longer by more than one of `stay`'s steps: estimates are no finer than that, and a
    switch reloads both trials. FIFO: the earliest trial; random: uniformly (from `rng`, so a
    seeded sweep repeats)."""
    if not runnable:
        raise ValueError("no runnable trial to pick from")
    if policy == "lrtf":
        longest = max(runnable, key=lambda c: (c.remaining_seconds(), -c.index))
        if stay is not None and longest.remaining_seconds() - stay.remaining_seconds() <= stay.step_seconds():
            return stay
        return longest
    if policy == "fifo":
        return min(runnable, key=lambda c: c.index)
    if policy == "random":
        return rng.choice(list(runnable))
    raise ValueError(f"scheduler={policy!r} is not one of {', '.join(POLICIES)}")
