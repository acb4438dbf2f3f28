"""Rank lists as users write them (`--targets 0,2`, `1-3`, `all`), for the magic and for scripts."""
from __future__ import annotations

__all__ = ["parse_ranks"]


def parse_ranks(text: str, world: int) -> list[int]:
    """``"0,2"``, ``"1-3"``, ``"all"`` -> rank list, each checked against the world size."""
    if text == "all":
        return list(range(world))
    ranks: list[int] = []
    for part in text.split(","):
        try:
            low, _, high = part.partition("-")
            ranks.extend(range(int(low), int(high or low) + 1))
        except ValueError:
            raise ValueError(f"--targets {text!r} is not a rank list; use e.g. 0 or 0,1 or 0-3 or all") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"--targets names rank(s) {bad} but ranks are 0..{world - 1}")
    return ranks
