"""`ParallelModel.generate` on real engines against one process.

Every model is trained briefly in the test process (`trained_models.py`), so its continuations
are confident, and the same weights go to the engines. Greedy output equals transformers' own
`generate` (Hugging Face families) or a one-process loop that re-forwards the whole sequence and
takes the argmax (colab_par's GPT, a notebook's own LM), token for token, for left-padded prompts
of different lengths. Sampling with a seed gives the same tokens on every rank and equals
`reference_sample`, a one-process draw written here (temperature -> top-k -> top-p -> multinomial
with a seeded generator) on logits of the same one-process re-forward. Generation leaves training state untouched: the next training
steps give bit for bit the losses they give without it.
"""
from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch

import any_models
from trained_models import GPT_SIZES, SEQ, VOCAB, build, logits_of, pattern, trained, trained_state

cloudpickle.register_pickle_by_value(sys.modules[__name__])

NEW = 8
SAMPLED = dict(do_sample=True, temperature=3.0, top_k=12, top_p=0.95, seed=3)


def prompts() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Three prompts of 5, 3 and 4 tokens, left-padded with token 0: (ids, mask, unpadded rows)."""
    rows = [pattern([s], n)[0] for s, n in ((4, 5), (30, 3), (50, 4))]
    ids = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 5 - len(row):], mask[i, 5 - len(row):] = row, 1
    return ids, mask, rows


def reference_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     generator: torch.Generator) -> torch.Tensor:
    """The sampling procedure written out row by row: keep the top_k scores (ties with the k-th),
    then the most likely tokens until their probability reaches top_p, draw from the softmax."""
    scores = logits.float() / temperature
    kept = torch.full_like(scores, -math.inf)
    for row in range(scores.shape[0]):
        kth = sorted(scores[row].tolist(), reverse=True)[top_k - 1]
        cut = torch.where(scores[row] >= kth, scores[row], -math.inf)
        probs, mass = cut.softmax(-1), 0.0
        for token in sorted(range(len(probs)), key=lambda t: -probs[t].item()):
            if mass >= top_p:
                break
            kept[row, token] = cut[token]
            mass += probs[token].item()
    return torch.multinomial(kept.softmax(-1), 1, generator=generator).squeeze(-1)


def reference_generate(kind: str, sampled: bool, rows: list[torch.Tensor], eos: int | None = None,
                       pad: int = 0) -> torch.Tensor:
    """One process, no cache: every step re-forwards each unpadded prompt and its tokens so far."""
    model = trained(kind).eval()
    generator = torch.Generator().manual_seed(SAMPLED["seed"])
    seqs, done = [row.clone() for row in rows], [False] * len(rows)
    with torch.no_grad():
        for _ in range(NEW):
            logits = torch.stack([logits_of(model, seq[None])[0, -1] for seq in seqs])
            chosen = (reference_sample(logits, *(SAMPLED[k] for k in ("temperature", "top_k", "top_p")),
                                       generator) if sampled else logits.argmax(-1))
            for i, token in enumerate(chosen.tolist()):
                seqs[i] = torch.cat([seqs[i], torch.tensor([pad if done[i] else token])])
                done[i] = done[i] or token == eos
            if eos is not None and all(done):
                break
    return torch.stack([seq[len(row):] for seq, row in zip(seqs, rows)])


# ---- engine side --------------------------------------------------------------------------------
def engine_generate(kind: str, layout: str, state: dict, calls: list[dict]) -> list[torch.Tensor]:
    import torch.distributed as dist

    from colab_par import parallelize

    torch.manual_seed(dist.get_rank())
    model = build(kind)
    model.load_state_dict(state)
    pm = parallelize(model, layout)
    ids, mask, _ = prompts()
    return [pm.generate(ids, NEW, attention_mask=None if kind == "tinylm" else mask, **call) for call in calls]


def new_tokens(results: list[torch.Tensor]) -> torch.Tensor:
    """The tokens after the prompts, after checking every rank returned the same."""
    assert all(torch.equal(r, results[0]) for r in results), "ranks returned different tokens"
    return results[0][:, 5:]


GPT_CALLS = [{}, SAMPLED, {"use_cache": False}]


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero1", "dp2 zero2 ac-selective", "dp2 zero3",
                                    "dp2 zero3 offload", "dp2 ac-full", "tp2", "tp2 sp",
                                    "pp2 1f1b mb2", "pp2 interleaved v2 mb2", "pp2 zbv v2 mb2", "cp2",
                                    "cp2 ulysses"])
def test_gpt_generates_like_one_process(cluster2, layout: str) -> None:
    calls = GPT_CALLS if "sp" not in layout else GPT_CALLS[:2]  # sequence parallel: cached only
    check_gpt_generation(cluster2.run(engine_generate, "gpt", layout, trained_state("gpt"), calls), calls)


def test_gpt_generates_under_tensor_and_data_parallel_together(cluster4) -> None:
    calls = GPT_CALLS[:2]
    check_gpt_generation(cluster4.run(engine_generate, "gpt", "dp2 tp2", trained_state("gpt"), calls), calls)


def test_gpt_generates_on_a_tensor_grid(cluster4) -> None:
    """The 2d grid splits the batch in two: the three prompts get a copy of the last, dropped after."""
    check_gpt_generation(cluster4.run(engine_generate, "gpt", "tp4 2d", trained_state("gpt"), GPT_CALLS), GPT_CALLS)


def fed_lengths(layout: str, state: dict) -> dict[str, list[int]]:
    """Engine side: how many tokens each forward fed the token embedding, cached and not."""
    import torch.distributed as dist

    from colab_par import parallelize

    torch.manual_seed(dist.get_rank())
    model = build("gpt")
    model.load_state_dict(state)
    pm = parallelize(model, layout)
    ids, mask, _ = prompts()
    lengths: list[int] = []
    embeddings = [m for m in pm.model.modules() if isinstance(m, torch.nn.Embedding)]
    handles = [m.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[-1])) for m in embeddings]
    fed = {}
    for use_cache in (True, False):
        lengths.clear()
        pm.generate(ids, NEW, attention_mask=mask, use_cache=use_cache)
        fed[str(use_cache)] = list(lengths)
    for handle in handles:
        handle.remove()
    return fed


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2 1f1b mb2", "cp2"])
def test_the_cache_feeds_only_the_new_tokens(cluster2, layout: str) -> None:
    """The cached path is the one taken: after the prompt, each forward feeds one token, where the
    re-forwarding path feeds the whole sequence so far (one more each step)."""
    ranks = [fed for fed in cluster2.run(fed_lengths, layout, trained_state("gpt")) if fed["True"]]
    assert ranks, "no rank's embedding saw a forward"
    for fed in ranks:
        cached, uncached = fed["True"], fed["False"]
        assert len(cached) == len(uncached) >= NEW - 1, fed
        assert cached[1:] == [1] * (len(cached) - 1) and cached[0] == uncached[0] > 1, fed
        assert uncached == list(range(uncached[0], uncached[0] + len(uncached))), fed


def check_gpt_generation(results: list[list[torch.Tensor]], calls: list[dict]) -> None:
    """Greedy (cached and, where called, re-forwarded) equals the one-process loop; sampling too."""
    greedy, sampled, *uncached = (new_tokens(r) for r in zip(*results))
    rows = prompts()[2]
    expected = reference_generate("gpt", False, rows)
    assert torch.equal(greedy, expected)
    assert len(uncached) == len(calls) - 2 and all(torch.equal(tokens, expected) for tokens in uncached)
    assert torch.equal(sampled, reference_generate("gpt", True, rows))
    assert not torch.equal(sampled, expected)  # the draw did something


def test_trained_continuation_is_the_pattern() -> None:
    """The parity above is meaningful: the trained GPT continues each prompt's +3 pattern."""
    ids, _, rows = prompts()
    expected = torch.stack([pattern([int(row[-1]) + 3], NEW)[0] for row in rows])
    assert (reference_generate("gpt", False, rows) == expected).float().mean() > 0.9


def hf_reference(kind: str, eos: int) -> torch.Tensor:
    """transformers' own greedy `generate` of the same weights and left-padded prompts."""
    model = trained(kind).eval()
    ids, mask, _ = prompts()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[:, 5:]


@pytest.fixture(scope="module")
def hf_cases() -> dict[str, dict]:
    """Per family: transformers' greedy output stopping at eos 2 (the model's own, which generate
    takes by default as transformers does), and at an eos that one row reaches after three tokens,
    so rows finish at different steps; the seeded draw stopping at eos 2."""
    cases = {}
    for kind in ("llama", "gpt2"):
        plain = hf_reference(kind, eos=2)
        stop = int(plain[0, 2])
        cases[kind] = {"calls": [{"pad_token_id": 0}, {"eos_token_id": stop, "pad_token_id": 0},
                                 {**SAMPLED, "pad_token_id": 0}],
                       "expected": [plain, hf_reference(kind, eos=stop),
                                    reference_generate(kind, True, prompts()[2], eos=2)]}
    return cases


def check_hf(results: list[list[torch.Tensor]], case: dict) -> None:
    for got, expected in zip(zip(*results), case["expected"]):
        got = new_tokens(got)
        assert torch.equal(got[:, :expected.shape[1]], expected), (got, expected)
        assert got.shape[1] == expected.shape[1]  # stopped at the same step


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3", "tp2", "pp2 1f1b mb2"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_greedy_equals_transformers_generate(cluster2, hf_cases, kind: str, layout: str) -> None:
    case = hf_cases[kind]
    check_hf(cluster2.run(engine_generate, kind, layout, trained_state(kind), case["calls"]), case)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_generates_under_tensor_and_data_parallel(cluster4, hf_cases, kind: str) -> None:
    case = hf_cases[kind]
    check_hf(cluster4.run(engine_generate, kind, "dp2 tp2", trained_state(kind), case["calls"]), case)


def test_notebook_lm_generates_by_reforwarding(cluster2) -> None:
    """A notebook's own LM (no cache, no padding mask): equal-length prompts, re-forwarded."""
    results = cluster2.run(engine_generate_equal_length, trained_state("tinylm"))
    assert all(torch.equal(r, results[0]) for r in results)
    rows = [pattern([s], 5)[0] for s in (4, 30)]
    assert torch.equal(results[0][:, 5:], reference_generate("tinylm", False, rows))


def engine_generate_equal_length(state: dict) -> torch.Tensor:
    from colab_par import parallelize

    model = build("tinylm")
    model.load_state_dict(state)
    return parallelize(model, "dp2").generate(pattern([4, 30], 5), NEW)


# ---- training state ------------------------------------------------------------------------------
def engine_train_around(layout: str, interrupt: bool) -> dict:
    """Two training steps, then (when `interrupt`) generate + evaluate, then two more steps; with
    checks that nothing of training moved during the interruption."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(11)
    pm = parallelize(GPT(GPTConfig(**GPT_SIZES)), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=3e-3))
    gen = torch.Generator().manual_seed(2)
    batches = [(seq[:, :-1], seq[:, 1:]) for seq in
               (pattern(torch.randint(0, VOCAB, (4,), generator=gen).tolist(), SEQ + 1) for _ in range(4))]
    losses = [pm.train_step(*batch) for batch in batches[:2]]
    pm.model_parts[0].train()
    first_block = next(m for m in pm.model_parts[0].modules() if m.__class__.__name__.endswith("Block"))
    first_block.eval()  # a mixed state must come back as it was
    torch.manual_seed(5 + dist.get_rank())  # per-rank training RNG, as the Trainer seeds it

    def snapshot() -> dict:
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t
        return {"rng": torch.get_rng_state(),
                "params": [local(p).detach().clone() for part in pm.model_parts for p in part.parameters()],
                "grads": [p.grad for part in pm.model_parts for p in part.parameters()],
                "optimizer": [local(v).clone() for s in pm.optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor)],
                "modes": [m.training for part in pm.model_parts for m in part.modules()],
                "sharded": [all(isinstance(p, DTensor) for p in m.parameters(recurse=False))
                            for part in pm.model_parts for m in part.modules() if isinstance(m, FSDPModule)]}

    before = snapshot()
    if interrupt:
        ids, mask, _ = prompts()
        pm.generate(ids, 4, attention_mask=mask, **SAMPLED)
        pm.evaluate(batches[2:])
    after = snapshot()
    same = {key: all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                     for a, b in zip(before[key], after[key])) and len(before[key]) == len(after[key])
            for key in before}
    same["rng"] = torch.equal(before["rng"], after["rng"])
    pm.model_parts[0].train()
    losses += [pm.train_step(*batch) for batch in batches[2:]]
    return {"losses": losses, "same": same, "fsdp": bool(before["sharded"])}


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero2", "dp2 zero3", "pp2 1f1b mb2", "tp2"])
def test_generate_and_evaluate_leave_training_untouched(cluster2, layout: str) -> None:
    plain = cluster2.run(engine_train_around, layout, False)
    interrupted = cluster2.run(engine_train_around, layout, True)
    for rank, (a, b) in enumerate(zip(plain, interrupted)):
        assert b["same"] == {key: True for key in b["same"]}, (rank, b["same"])
        assert a["losses"] == b["losses"], rank  # bit for bit
    assert interrupted[0]["fsdp"] == ("zero" in layout and "zero1" not in layout)


# ---- refusals ---------------------------------------------------------------------------------------
def test_bad_sampling_arguments_are_refused() -> None:
    from colab_par.parallel.inference.sampling import Sampling

    for kwargs, message in [({"temperature": 0.7}, "do_sample=True"), ({"do_sample": True, "temperature": 0},
                            "temperature"), ({"do_sample": True, "top_k": 0}, "top_k"),
                            ({"do_sample": True, "top_p": 1.5}, "top_p"), ({"do_sample": 1}, "do_sample")]:
        with pytest.raises((ValueError, TypeError), match=message):
            Sampling(**kwargs)


def test_sampling_procedure_matches_its_written_out_reference() -> None:
    from colab_par.parallel.inference.sampling import Sampling

    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    sampling = Sampling(do_sample=True, temperature=0.8, top_k=12, top_p=0.9)
    draws = [sampling.choose(logits, torch.Generator().manual_seed(s)) for s in range(20)]
    expected = [reference_sample(logits, 0.8, 12, 0.9, torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(draws, expected))
    assert len({tuple(d.tolist()) for d in draws}) > 1


def engine_refusals() -> dict[str, str]:
    """Each bad call's error (before any work: the last call must still work)."""
    import torch.distributed as dist
    import transformers

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = parallelize(GPT(GPTConfig(**GPT_SIZES)), "dp2")
    classifier = parallelize(transformers.BertForSequenceClassification(
        transformers.BertConfig(**any_models.BERT, num_labels=3)), "dp2")
    ids, mask, _ = prompts()
    calls = {"classifier": lambda: classifier.generate(ids, 2),
             "mlp": lambda: parallelize(any_models.NoBlocksMLP(), "dp2").generate(ids, 2),
             "too long": lambda: gpt.generate(torch.zeros(1, SEQ + 1, dtype=torch.long), 1),
             "too many": lambda: gpt.generate(ids, SEQ, attention_mask=mask),
             "right padding": lambda: gpt.generate(ids, 2, attention_mask=mask.flip(1)),
             "vocabulary": lambda: gpt.generate(ids + VOCAB, 2),
             "temperature": lambda: gpt.generate(ids, 2, temperature=0.5),
             "max_new_tokens": lambda: gpt.generate(ids, 0),
             "eos": lambda: gpt.generate(ids, 2, eos_token_id=-1),
             "different prompts": lambda: gpt.generate(ids + dist.get_rank(), 2)}
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = "no error"
        except (ValueError, TypeError) as error:
            errors[name] = str(error)
    errors["works after"] = str(tuple(gpt.generate(ids, 2, attention_mask=mask).shape))
    return errors


def test_refused_before_any_work(cluster2) -> None:
    errors = cluster2.run(engine_refusals)[0]
    expected = {"classifier": "causal language model", "mlp": "vocabulary logits", "too long": "positions",
                "too many": "max_new_tokens <=", "right padding": "left padding", "vocabulary": "vocabulary",
                "temperature": "do_sample=True", "max_new_tokens": "max_new_tokens", "eos": "eos_token_id",
                "different prompts": "different prompts", "works after": "(3, 7)"}
    for name, fragment in expected.items():
        assert fragment in errors[name], (name, errors[name])
