"""Data-parallel rollouts (2 CPU engines, gloo): under dp2 and dp2 zero3 each rank decodes only its
share of the rows and the shares are gathered, and the result equals both the whole batch decoded
on every rank (pp2: every rank runs every row) and one process drawing row by row from its own
seeded generator (`grpo_reference.reference_rollout`, written from the definition).

Three `generate_rollout` calls per layout, in order: rows of two prompt lengths sampled at a
temperature; greedy rows built so that rank 0's rows all end at the first step while rank 1's
run to the end (rank 0 must stop alone without leaving rank 1 in a collective); and a sampled
call after it, which would hang or mix up tokens had the ranks fallen out of step. A forward hook
on each rank's model records the batch of every forward: the proof that a dp rank decoded its own
rows only (and that rank 0 stopped after one forward).
"""
from __future__ import annotations

import functools
import sys

import cloudpickle
import pytest
import torch
from grpo_reference import EOS, LENGTH, PAD, PROMPTS, SEED, TEMPERATURE, gpt, reference_rollout

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS = 8
WHOLE_BATCH = "pp2"  # not pure data parallel: every rank decodes every row
LAYOUTS = ["dp2", "dp2 zero3", WHOLE_BATCH]
# float32 logits of a 2-layer, width-32 GPT (|logit| < ~5), cached batch forward against one row
# re-forwarded alone: rounding of ~1e-7 per operation, divided by the temperature 0.7
LOGP_TOLERANCE = 1e-6


def early_ending_rows() -> tuple[list[list[int]], int]:
    """Prompts A x 4 then B x 4 and an end id: A's greedy first token is the end id, which B's
    greedy continuation never produces (found on the one-process model)."""
    candidates = PROMPTS + [[t, t + 1, t + 2] for t in range(3, 29)]
    continued, _ = reference_rollout(gpt(), candidates, 0, 1.0, greedy=True, eos=-1)
    for a, first in zip(candidates, continued[:, 0].tolist()):
        for b, row in zip(candidates, continued.tolist()):
            if first not in (PAD, EOS) and first not in row:
                return [a] * 4 + [b] * 4, first
    raise AssertionError("no prompt pair ends on one rank only")


@functools.cache
def calls() -> list[tuple[list[list[int]], int, bool, int]]:
    """(prompts, seed, greedy, end id) of each call (the search for early-ending rows done once)."""
    sampled = [PROMPTS[1]] * 4 + [PROMPTS[2]] * 4
    early, end = early_ending_rows()
    return [(sampled, SEED, False, EOS), (early, 0, True, end), (sampled, SEED + 1, False, EOS)]


def engine_rollouts(layout: str, state: dict, work: list) -> list[dict]:
    """Each call's completions, log-probabilities and the batch of every forward on this rank."""
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.parallel.inference.generation import generate_rollout
    from colab_par.parallel.inference.sampling import Sampling
    from colab_par.parallel.inference.state import bare_module
    from colab_par.training.grpo.prompts import left_padded

    torch.manual_seed(dist.get_rank())  # nothing may depend on a rank's own generator
    model = gpt()
    model.load_state_dict(state)
    pm = parallelize(model, layout)
    batches: list[int] = []
    bare_module(pm.model_parts[0]).register_forward_hook(  # what decodes (DDP's module under dp2)
        lambda module, args, out: batches.append(args[0].shape[0]))
    results = []
    for prompts, seed, greedy, end in work:
        ids, mask = left_padded(prompts, PAD)
        sampling = Sampling() if greedy else Sampling(do_sample=True, temperature=TEMPERATURE)
        batches.clear()
        out = generate_rollout(pm, ids, LENGTH, sampling, eos_token_id=end, pad_token_id=PAD,
                               attention_mask=mask.long(), seed=seed)
        results.append({"completions": out.tokens[:, ids.shape[1]:], "logps": out.logps, "batches": list(batches)})
    return results


@pytest.fixture(scope="module")
def runs(cluster2) -> dict[str, list[list[dict]]]:
    state, work = gpt().state_dict(), calls()
    return {layout: cluster2.run(engine_rollouts, layout, state, work) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def expected() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [reference_rollout(gpt(), prompts, seed, 1.0 if greedy else TEMPERATURE, greedy=greedy, eos=end)
            for prompts, seed, greedy, end in calls()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rollouts_equal_the_whole_batch_and_one_process(runs, expected, layout: str) -> None:
    ranks = runs[layout]
    for call, (completions, logps) in enumerate(expected):
        for rank in ranks:
            got = rank[call]
            assert torch.equal(got["completions"], completions), (layout, call, got["completions"], completions)
            assert torch.allclose(got["logps"], logps, atol=LOGP_TOLERANCE, rtol=0), (layout, call)
            whole = runs[WHOLE_BATCH][0][call]
            assert torch.equal(got["completions"], whole["completions"])
            assert torch.allclose(got["logps"], whole["logps"], atol=LOGP_TOLERANCE, rtol=0)
    assert (expected[0][0] != expected[2][0]).any()  # the seed matters
    assert len({tuple(row) for row in expected[0][0].tolist()}) == ROWS  # each row its own draws


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3"])
def test_each_data_parallel_rank_decodes_only_its_rows(runs, layout: str) -> None:
    for rank in runs[layout]:
        for call in rank:
            assert call["batches"] and set(call["batches"]) == {ROWS // 2}, call["batches"]
    for rank in runs[WHOLE_BATCH]:
        assert all(set(call["batches"]) == {ROWS} for call in rank)


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3"])
def test_a_rank_whose_rows_end_first_stops_alone(runs, expected, layout: str) -> None:
    completions, end = expected[1][0], calls()[1][3]
    assert (completions[:4, 0] == end).all() and (completions[:4, 1:] == PAD).all()  # ended at step 1
    assert completions.shape[1] == LENGTH and not (completions[4:] == end).any()  # ran to the end
    first, second = (rank[1]["batches"] for rank in runs[layout])
    assert len(first) == 1 and len(second) == LENGTH, (first, second)  # the prefill only, then alone
