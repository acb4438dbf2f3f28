"""Generation brings the weights in once per call, not once per token and layer, and returns each
sampled token's log-probability, which the training forward agrees with.

Under dp2 zero3 the all-gathers of a whole generate call are counted with torch's profiler (the
`c10d::_allgather_base_` collectives FSDP issues): one per FSDP unit whether the call makes 1 or 8
tokens (before, 8 tokens gathered every unit at each of the 8 forwards: 40 on this model), every
unit is sharded again after, and the tokens equal a one-process loop's (`test_generation`'s
reference). The sampling log-probabilities equal a one-process reference written here (the
kept tokens' renormalized softmax, in float64 Python), and the training forward's
(`forward_logps`) agree with them to float32 rounding, measured by `mismatch.py`, also combined
over the two ranks' rows. Under `params@disk` a generate call pages each parameter in once.
"""
from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch

from test_generation import NEW, SAMPLED, prompts, reference_generate
from trained_models import build, logits_of, trained, trained_state

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TEMPERATURE_ONLY = dict(do_sample=True, temperature=1.5, seed=5)
CALLS = [(1, {}), (NEW, {}), (NEW, SAMPLED), (NEW, TEMPERATURE_ONLY)]
TOLERANCE = 1e-4  # float32 logits (|x| < ~20) through 4 layers in other orders: rounding ~1e-6, /T


def engine_zero3(state: dict) -> dict:
    """Each call of CALLS with its all-gathers counted; then the training forward's log-probs of
    the temperature-only call's completions and their mismatch (whole batch, and combined from
    each rank's rows: rank 0 rows 0-1, rank 1 row 2)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    from colab_par import parallelize
    from colab_par.parallel.inference.generation import generate_with_logps
    from colab_par.parallel.inference.sampling import Sampling
    from colab_par.training.grpo.logprobs import forward_logps
    from colab_par.training.grpo.mismatch import logp_mismatch, mismatch_over_ranks
    from colab_par.training.grpo.rollout import Rollout

    torch.manual_seed(dist.get_rank())
    model = build("gpt")
    model.load_state_dict(state)
    pm = parallelize(model, "dp2 zero3")
    units = [m for m in pm.model.modules() if isinstance(m, FSDPModule)]
    ids, mask, _ = prompts()
    runs = []
    for new, call in CALLS:
        settings = {k: v for k, v in call.items() if k != "seed"}
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            generated = generate_with_logps(pm, ids, new, Sampling(**settings), attention_mask=mask,
                                            seed=call.get("seed", 0))
        gathers = sum(1 for event in profiled.events() if event.name == "c10d::_allgather_base_")
        runs.append({"tokens": generated.tokens, "logps": generated.logps, "gathers": gathers})
    sharded = all(isinstance(p, DTensor) for unit in units for p in unit.parameters(recurse=False))
    completions = runs[-1]["tokens"][:, ids.shape[1]:]
    rollout = Rollout(prompt_ids=ids, prompt_mask=mask.bool(), completion_ids=completions,
                      mask=torch.ones_like(completions, dtype=torch.bool), advantages=torch.zeros(3))
    train = forward_logps(pm, rollout, TEMPERATURE_ONLY["temperature"])
    sampling = runs[-1]["logps"]
    mine = slice(0, 2) if dist.get_rank() == 0 else slice(2, 3)
    combined = mismatch_over_ranks(logp_mismatch(train[mine], sampling[mine], rollout.mask[mine]), dist.group.WORLD)
    return {"units": len(units), "runs": runs, "sharded": sharded, "train": train,
            "whole": logp_mismatch(train, sampling, rollout.mask).row(), "combined": combined.row()}


def reference_logp(logits: torch.Tensor, token: int, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> float:
    """log p(token) under the distribution sampling draws from, in float64 Python: softmax of
    logits / T over the top_k (ties with the k-th kept), then the most likely until top_p."""
    scores = [x / temperature for x in logits.double().tolist()]
    order = sorted(range(len(scores)), key=lambda t: -scores[t])
    kept = [t for t in order if top_k is None or scores[t] >= scores[order[top_k - 1]]]
    total = sum(math.exp(scores[t]) for t in kept)
    if top_p is not None:
        mass, nucleus = 0.0, []
        for t in kept:
            if mass >= top_p:
                break
            nucleus.append(t)
            mass += math.exp(scores[t]) / total
        kept = nucleus
    assert token in kept, "the draw chose a token outside the kept ones"
    return scores[token] - math.log(sum(math.exp(scores[t]) for t in kept))


def reference_logps(new_tokens: torch.Tensor, **settings) -> torch.Tensor:
    """One process, whole rows re-forwarded: each new token's `reference_logp` given the row so far."""
    model = trained("gpt").eval()
    rows = prompts()[2]
    out = torch.zeros(new_tokens.shape, dtype=torch.float64)
    with torch.no_grad():
        for i, (row, new) in enumerate(zip(rows, new_tokens)):
            logits = logits_of(model, torch.cat([row, new])[None])[0]
            for j, token in enumerate(new.tolist()):
                out[i, j] = reference_logp(logits[len(row) - 1 + j], token, **settings)
    return out


@pytest.fixture(scope="module")
def zero3_ranks(cluster2) -> list[dict]:
    return cluster2.run(engine_zero3, trained_state("gpt"))


def test_zero3_generation_gathers_each_unit_once_and_scores_its_tokens(zero3_ranks) -> None:
    ranks = zero3_ranks
    units = ranks[0]["units"]
    assert units == 5  # four blocks and the root
    for rank in ranks:
        assert [run["gathers"] for run in rank["runs"]] == [units] * len(CALLS), rank["runs"]
        assert rank["sharded"]  # the gathered weights are freed after the call
        for run, first in zip(rank["runs"], ranks[0]["runs"]):
            assert torch.equal(run["tokens"], first["tokens"]) and torch.equal(run["logps"], first["logps"])
    greedy, sampled, temperature_only = (run["tokens"][:, 5:] for run in ranks[0]["runs"][1:])
    assert torch.equal(greedy, reference_generate("gpt", False, prompts()[2]))
    assert torch.equal(sampled, reference_generate("gpt", True, prompts()[2]))
    cuts = {key: SAMPLED[key] for key in ("temperature", "top_k", "top_p")}
    for run, tokens, settings in [(ranks[0]["runs"][1], greedy, {}), (ranks[0]["runs"][2], sampled, cuts),
                                  (ranks[0]["runs"][3], temperature_only, {"temperature": 1.5})]:
        expected = reference_logps(tokens, **settings)
        assert run["logps"].shape == tokens.shape and run["logps"].dtype == torch.float32
        assert torch.allclose(run["logps"].double(), expected, atol=TOLERANCE, rtol=0), (run["logps"], expected)
    assert torch.allclose(ranks[0]["train"].double(), reference_logps(temperature_only, temperature=1.5),
                          atol=TOLERANCE, rtol=0)


def test_training_forward_agrees_with_generation(zero3_ranks) -> None:
    """The trainer–generator mismatch of the temperature-only draw: float32 rounding only, and the
    two ranks' rows combined give the whole batch's measures."""
    ranks = zero3_ranks
    whole = ranks[0]["whole"]
    assert whole["mismatch/logp_difference_max"] < TOLERANCE
    assert abs(whole["mismatch/importance_ratio_mean"] - 1) < TOLERANCE
    for rank in ranks:
        for name, value in whole.items():
            assert math.isclose(rank["combined"][name], value, rel_tol=1e-6, abs_tol=1e-9), (name, rank["combined"])


def engine_paged(state: dict) -> dict:
    """params@disk: the bytes paged in from the disk tier by one generate call."""
    from colab_par import parallelize

    model = build("gpt")
    model.load_state_dict(state)
    pm = parallelize(model, "dp2 params@disk")
    ids, mask, _ = prompts()
    before = pm.optimizer.parameters_read()
    tokens = pm.generate(ids, NEW, attention_mask=mask)
    return {"read": pm.optimizer.parameters_read() - before, "tokens": tokens,
            "bytes": sum(p.numel() * p.element_size() for p in pm.model.parameters())}


def test_parameters_on_disk_are_paged_in_once_per_call(cluster2) -> None:
    """Without holding the pages, every one of the 8 forwards would read the whole model again."""
    for rank in cluster2.run(engine_paged, trained_state("gpt")):
        assert rank["read"] == rank["bytes"], rank
        assert torch.equal(rank["tokens"][:, 5:], reference_generate("gpt", False, prompts()[2]))
