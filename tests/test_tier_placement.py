"""The runtime's placement (`memory_tiers.placement.place`) on byte counts: where nothing can leave
the fast tier (no disk on a CPU), the unmeasured first step never refuses and nothing is reserved
for streaming; the smallest budget a refusal names is one that works."""
from __future__ import annotations

import pytest

from colab_par.memory_tiers.placement import FAST, Measured, TierBudgetError, place
from colab_par.layout.tier_options import SLACK, MemoryTiers

MiB = 2 ** 20
CHUNKS = [{"exp_avg": 10 * MiB, "exp_avg_sq": 10 * MiB} for _ in range(4)]  # 80 MiB of AdamW state
MEASURED = Measured(fixed=100 * MiB, working=50 * MiB, grads=40 * MiB)  # 270 MiB in all


def _place(budget: int, measured: Measured = MEASURED, disk: bool = False, pessimistic: bool = False):
    tiers = MemoryTiers(budget=budget, disk="tmp" if disk else None)
    return place(tiers, CHUNKS, measured, cuda=False, grads_movable=True, has_disk=disk, rank=0,
                 pessimistic=pessimistic)


def test_without_a_disk_the_unmeasured_step_keeps_everything_and_does_not_refuse() -> None:
    # the warm-up's working memory (first-call growth, glibc's default heap) over the budget
    inflated = Measured(fixed=100 * MiB, working=500 * MiB, grads=40 * MiB)
    grads, plan = _place(300 * MiB, inflated, pessimistic=True)
    assert grads == {"grads": FAST} and all(tier == FAST for chunk in plan for tier in chunk.values())
    with pytest.raises(TierBudgetError):  # the measured step decides
        _place(300 * MiB, inflated)


def test_without_a_disk_nothing_is_reserved_for_streaming() -> None:
    fits = int(270 * MiB / (1 - SLACK)) + 1  # everything, exactly, and the slack
    grads, plan = _place(fits)
    assert grads == {"grads": FAST} and all(tier == FAST for chunk in plan for tier in chunk.values())


def test_the_smallest_budget_a_refusal_names_works() -> None:
    for disk in (False, True):
        with pytest.raises(TierBudgetError) as refused:
            _place(150 * MiB, disk=disk)
        smallest = refused.value.args[0].split("smallest budget that works is about ")[1].split(".")[0]
        assert ("add a disk tier" in str(refused.value)) is not disk
        _, plan = _place(MemoryTiers(budget=smallest).budget, disk=disk)  # no error
        if not disk:
            assert all(tier == FAST for chunk in plan for tier in chunk.values())


def test_with_a_disk_two_chunks_are_reserved_and_the_rest_spills_in_order() -> None:
    # fixed 100 + working 50 + 2 streamed chunks 40 + grads 40 = 230; room for 2 of the 4 chunks
    budget = int((230 + 40) * MiB / (1 - SLACK)) + 1
    _, plan = _place(budget, disk=True)
    assert [set(chunk.values()) for chunk in plan] == [{FAST}, {FAST}, {"disk"}, {"disk"}]
