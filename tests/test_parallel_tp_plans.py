"""Tensor-parallel plans for any module: every Hugging Face style string, user plans, BERT.

Each style is proven on a tiny module under tp2 against the same module unsharded on one process:
the outputs and every parameter's gradient (gathered) must match, and the parameters the style
splits must hold half their rows or columns on each rank. Bad plans are refused before anything
is sharded. A user plan (strings or DTensor styles) and BertForMaskedLM then train like one process.
"""
from __future__ import annotations

import copy
import functools
import math
import sys
from typing import Any

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from colab_par.parallel.tensor_parallel import HF_STYLES, bert_tp_plan, resolve_tp_plan, tp_plan_for
from parity import assert_parity, engine_run, reference_run

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

HEAD = 4  # head size of the attention-like test modules


class Block(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, hidden), nn.Linear(hidden, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """Linear-GELU-Linear-Linear, the block in a submodule so a style can sit on the block."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.block, self.out = Block(hidden), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


class Embed(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


class HeadNorm(nn.Module):
    """Qwen3's q_norm pattern: a norm over each head of a colwise projection's local output."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.norm, self.o = nn.Linear(8, 16), nn.RMSNorm(HEAD), nn.Linear(16, 8)
        nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.norm(self.q(x).view(*x.shape[:-1], -1, HEAD))
        return self.o(heads.flatten(-2))


class Sinks(nn.Module):
    """A bare per-head parameter used directly in forward (attention sinks)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 16), nn.Linear(16, 8)
        self.sinks = nn.Parameter(torch.linspace(0.5, 2.0, 16 // HEAD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.q(x).view(*x.shape[:-1], -1, HEAD) * self.sinks[:, None]
        return self.o(heads.flatten(-2))


class WithSinks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Sinks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


# name -> (model builder, plan, parameters the plan must split); the input is float (batch 2,
# sequence 4, features 8) except for Embed, which takes token ids.
CASES: dict[str, tuple[Any, dict[str, Any], set[str]]] = {
    "colwise+rowwise": (Net, {"block.up": "colwise", "block.down": "rowwise"},
                        {"block.up.weight", "block.up.bias", "block.down.weight"}),
    "colwise_gather_output+rowwise_split_input": (
        Net, {"block.up": "colwise_gather_output", "block.down": "rowwise_split_input"},
        {"block.up.weight", "block.up.bias", "block.down.weight"}),
    "colwise_rep+rowwise_rep": (Net, {"block.up": "colwise_rep", "block.down": "rowwise_rep"},
                                {"block.up.weight", "block.up.bias", "block.down.weight"}),
    "local_colwise+local_rowwise+all_reduce": (
        Net, {"block.up": "local_colwise", "block.down": "local_rowwise", "block": "all_reduce"},
        {"block.up.weight", "block.up.bias", "block.down.weight"}),
    "gather": (Net, {"block.up": "colwise", "block.down": "local_rowwise", "block": "gather"},
               {"block.up.weight", "block.up.bias", "block.down.weight"}),
    "replicate": (Net, {"block.up": "colwise", "block.down": "rowwise", "out": "replicate"},
                  {"block.up.weight", "block.up.bias", "block.down.weight"}),
    "embedding_rowwise": (Embed, {"emb": "embedding_rowwise"}, {"emb.weight"}),
    "embedding_colwise": (Embed, {"emb": "embedding_colwise"}, {"emb.weight"}),
    "replicated_with_grad_allreduce": (
        HeadNorm, {"q": "colwise", "norm": "replicated_with_grad_allreduce", "o": "rowwise"},
        {"q.weight", "q.bias", "o.weight"}),
    "local_params": (WithSinks, {"attn.q": "colwise", "attn.sinks": "colwise", "attn": "local_params",
                                 "attn.o": "rowwise"}, {"attn.q.weight", "attn.q.bias", "attn.o.weight",
                                                        "attn.sinks"}),
    "sequence_parallel": (Norm, {"norm": "sequence_parallel"}, set()),
    "torch styles": (Net, {"block.up": ColwiseParallel(), "block.down": RowwiseParallel()},
                     {"block.up.weight", "block.up.bias", "block.down.weight"}),
    # sizes tp=2 does not divide, split unevenly where the split stays inside the module
    "uneven embedding_rowwise": (functools.partial(Embed, vocab=15), {"emb": "embedding_rowwise"}, {"emb.weight"}),
    "uneven embedding_colwise": (functools.partial(Embed, dim=7), {"emb": "embedding_colwise", "out": "rowwise_split_input"},
                                 {"emb.weight", "out.weight"}),
    "uneven colwise_gather_output+rowwise_split_input": (
        functools.partial(Net, hidden=15), {"block.up": "colwise_gather_output", "block.down": "rowwise_split_input"},
        {"block.up.weight", "block.up.bias", "block.down.weight"}),
}


def test_every_training_style_of_transformers_is_covered() -> None:
    """The cases above exercise every style this kit accepts, and this kit accepts every style of
    transformers' registry except the refused (packed/MLA/ep) ones and the experts' split inside
    ('moe_tp_experts', the experts step's: tests/test_hf_experts.py)."""
    exercised = {s for _, plan, _ in CASES.values() for s in plan.values() if isinstance(s, str)}
    assert exercised == set(HF_STYLES)
    registry = pytest.importorskip("transformers.integrations.tensor_parallel").ALL_PARALLEL_STYLES
    untrainable = {"packed_colwise", "packed_rowwise", "moe_identity_expert",
                   "grouped_gemm", "ep_dispatch_experts", "mla_kv_a_proj"}
    assert set(registry) - untrainable - {"moe_tp_experts"} <= set(HF_STYLES)
    for name in untrainable & set(registry):
        with pytest.raises(ValueError, match=rf"style '{name}' for 'up' cannot train here.*tp=1"):
            resolve_tp_plan(Block(), {"up": name})


def _style_case(case: str) -> dict[str, Any]:
    """Engine side: the case's model under tp2 vs the same model whole, one forward and backward."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize

    make, plan, _ = CASES[case]
    torch.manual_seed(0)
    reference = make()
    model = copy.deepcopy(reference)
    pm = parallelize(model, "tp2", tp_plan=plan)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randint(0, reference.emb.num_embeddings, (2, 4), generator=gen) if isinstance(reference, Embed)
         else torch.randn(2, 4, 8, generator=gen))
    weights = torch.randn(*x.shape[:2], 6 if isinstance(reference, (Net, Embed)) else 8, generator=gen)
    expected = reference(x)
    (expected * weights).sum().backward()
    if case == "sequence_parallel":  # each rank holds its own half of the sequence
        half = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
        x, weights, expected = x[:, half], weights[:, half], expected[:, half]
    out = pm.model(x)
    (out * weights).sum().backward()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in pm.model.named_parameters()}
    return {"out_error": (out - expected).abs().max().item(),
            "grad_errors": {name: (grads[name] - p.grad).abs().max().item()
                            for name, p in reference.named_parameters()},
            "pieces": {name: (p.to_local().numel(), p.numel()) for name, p in pm.model.named_parameters()
                       if isinstance(p, DTensor) and p.to_local().numel() < p.numel()}}


@pytest.mark.parametrize("case", list(CASES))
def test_style_shards_and_computes_like_one_process(cluster2, case: str) -> None:
    results = cluster2.run(_style_case, case)
    for result in results:
        assert result["out_error"] < 1e-5
        assert max(result["grad_errors"].values()) < 1e-5, result["grad_errors"]
        assert set(result["pieces"]) == CASES[case][2]
    for name in CASES[case][2]:  # the two ranks' pieces make the whole, nothing doubled or lost
        local, whole = zip(*(result["pieces"][name] for result in results))
        assert sum(local) == whole[0], (name, local, whole)


# ---- bad plans ------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan, message", [
    ({"up": "colwize"}, r"unknown tensor-parallel style 'colwize' for 'up'; supported: colwise, rowwise"),
    ({"up": "packed_colwise"}, r"'packed_colwise' for 'up' cannot train here \(fused weights.*tp=1.*tp_plan"),
    ({"up": "moe_tp_experts"}, r"'moe_tp_experts' for 'up' names Linear, which is not an experts module"),
    ({"upp": "colwise"}, r"pattern 'upp' matches no module of Block; its top-level modules are up, down"),
    ({"layers.*.up": "colwise"}, r"pattern 'layers.\*.up' matches no module"),
    ({"up": "embedding_rowwise"}, r"'embedding_rowwise' for 'up' shards nn.Embedding, but it matches Linear"),
    ({"up.weight": "colwise"}, r"'up.weight' shards a bare parameter.*add 'up': 'local_params'"),
    ({"up": 3}, r"tp_plan\['up'\] is int"),
])
def test_bad_plans_are_refused_before_sharding(plan: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        resolve_tp_plan(Block(), plan)


def test_a_model_without_plan_and_a_plan_without_sequence_sharding_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Block has no tensor-parallel plan; pass parallelize\(\.\.\., tp_plan="):
        tp_plan_for(Block(), None, hf=False, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"asks for sequence parallel.*drop 'sp'.*'sequence_parallel'"):
        tp_plan_for(Block(), {"up": "colwise", "down": "rowwise"}, hf=False, sequence_parallel=True)
    assert set(tp_plan_for(Norm(), {"norm": "sequence_parallel"}, hf=False, sequence_parallel=True)) == {"norm"}


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 15), nn.Linear(15, 8)
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied


def _refusal(plan: dict[str, str]) -> tuple[str, bool]:
    """Engine side: parallelize's error for `plan`, and whether any parameter got sharded first."""
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize

    model = Odd()
    try:
        parallelize(model, "tp2", tp_plan=plan)
    except ValueError as error:
        return str(error), any(isinstance(p, DTensor) for p in model.parameters())
    return "", True


@pytest.mark.parametrize("plan, message", [
    ({"emb": "embedding_rowwise", "up": "colwise"},
     r"ColwiseParallel on 'up' splits weight dim 0 of size 15 over tp=2, which does not divide it"),
    ({"down": "rowwise"}, r"RowwiseParallel on 'down' splits weight dim 1 of size 15 over tp=2"),
    ({"head": "colwise_gather_output"},
     r"emb.weight and head.weight are one tied parameter.*'embedding_rowwise'.*tie_word_embeddings=False"),
    ({"up": "colwise", "*": "replicate"}, r"module 'up' is matched by tp_plan patterns '(up|\*)' and '(up|\*)'"),
])
def test_unshardable_plans_are_refused_on_the_engines(cluster2, plan: dict, message: str) -> None:
    import re
    for error, sharded in cluster2.run(_refusal, plan):
        assert re.search(message, error), error
        assert not sharded


# ---- a user's plan trains like one process ------------------------------------------------------
@pytest.mark.parametrize("plan", [
    {"inp": "colwise", "out": "rowwise"},
    {"inp": "colwise_gather_output", "out": "rowwise_split_input"},
    {"inp": ColwiseParallel(), "out": RowwiseParallel()},
], ids=["strings", "gathered strings", "DTensor styles"])
def test_user_plan_trains_like_single_process(cluster2, plan: dict) -> None:
    assert_parity(cluster2.run(engine_run, "tp2", "mlp", tp_plan=plan), reference_run("mlp"))


# ---- BERT -----------------------------------------------------------------------------------------
BERT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _bert(seed: int) -> nn.Module:
    import transformers
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(transformers.BertConfig(**BERT))


def _bert_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    """Masked-LM batches with padding: 15% of the real tokens are masked and predicted."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        ids = (torch.randint(0, 8, (4, 1), generator=gen) + 5 * torch.arange(12)) % 60 + 4
        mask = (torch.arange(12) < torch.randint(8, 13, (4, 1), generator=gen)).long()
        chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & mask.bool()
        out.append({"input_ids": torch.where(chosen, 3, ids) * mask, "attention_mask": mask,
                    "labels": torch.where(chosen, ids, -100)})
    return out


def test_bert_plan_is_megatron() -> None:
    pytest.importorskip("transformers")
    plan = bert_tp_plan(_bert(0))
    layer = "bert.encoder.layer.*"
    assert plan == {"bert.embeddings.word_embeddings": "embedding_rowwise",
                    f"{layer}.attention.self.query": "colwise", f"{layer}.attention.self.key": "colwise",
                    f"{layer}.attention.self.value": "colwise", f"{layer}.attention.output.dense": "rowwise",
                    f"{layer}.intermediate.dense": "colwise", f"{layer}.output.dense": "rowwise",
                    "cls.predictions.decoder": "colwise_gather_output"}
    assert set(resolve_tp_plan(_bert(0), plan)) == set(plan)  # every pattern names real modules


def _bert_sharding() -> dict[str, Any]:
    """Engine side: local shapes under tp2 and whether the decoder is still tied to the embeddings."""
    from colab_par import parallelize

    pm = parallelize(_bert(0), "tp2")
    model = pm.model
    layer = model.bert.encoder.layer[0]
    local = {name: tuple(p.to_local().shape) for name, p in [
        ("query", layer.attention.self.query.weight), ("out", layer.attention.output.dense.weight),
        ("intermediate", layer.intermediate.dense.weight), ("output", layer.output.dense.weight),
        ("words", model.bert.embeddings.word_embeddings.weight)]}
    predictions = model.cls.predictions
    return {"local": local, "tied": predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
            and predictions.decoder.bias is predictions.bias}


def test_bert_tensor_parallel_shards_what_the_plan_says(cluster2) -> None:
    pytest.importorskip("transformers")
    for result in cluster2.run(_bert_sharding):
        assert result["local"] == {"query": (16, 32), "out": (32, 16), "intermediate": (32, 32),
                                   "output": (32, 32), "words": (32, 32)}
        assert result["tied"]


def _bert_training(layout: str | None, steps: int) -> dict[str, Any]:
    """Masked-LM training on the batch API under `layout`, or plainly on one process (None)."""
    if layout is None:
        model = _bert(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, norms = [], []
        for batch in _bert_batches(steps):
            loss = model(**batch).loss
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "grad_norms": norms, "state": model.state_dict()}
    import torch.distributed as dist

    from colab_par import parallelize

    pm = parallelize(_bert(dist.get_rank()), layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))
    losses, norms = [], []
    for batch in _bert_batches(steps):
        losses.append(pm.forward_backward(batch))
        norms.append(pm.clip_grad_norm_(math.inf))
        pm.optimizer_step()
    return {"losses": losses, "grad_norms": norms, "state": pm.full_state_dict()}


@pytest.mark.slow
def test_bert_trains_like_single_process_under_tp2(cluster2) -> None:
    pytest.importorskip("transformers")
    results = cluster2.run(_bert_training, "tp2", 10)
    reference = _bert_training(None, 10)
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(results[0][key], dtype=torch.float64),
                                   torch.tensor(reference[key], dtype=torch.float64), rtol=1e-5, atol=0.0)
    assert results[0]["losses"] == results[1]["losses"]
    state = results[0]["state"]
    for name, expected in reference["state"].items():
        if name in state:
            torch.testing.assert_close(state[name], expected, rtol=1e-4, atol=1e-5, msg=name)
    assert set(reference["state"]) - set(state) <= {"cls.predictions.decoder.weight",
                                                    "cls.predictions.decoder.bias"}  # tied copies


# ---- pipeline stages --------------------------------------------------------------------------------
def test_stage_plans_skip_what_other_stages_hold() -> None:
    """A pipeline stage keeps the full model's plan: patterns naming another stage's modules (its
    embeddings, head or layers) are skipped, the rest must still match."""
    from colab_par.parallel.pipeline import split_model
    from colab_par.parallel.tensor_parallel import hf_tp_plan
    from parity import build_model

    pytest.importorskip("transformers")
    model = build_model("qwen3", 0)
    first, last = split_model(model, "pp2", 0)[0], split_model(model, "pp2", 1)[0]
    assert "lm_head" not in resolve_tp_plan(first, hf_tp_plan(first))
    assert "model.embed_tokens" not in resolve_tp_plan(last, hf_tp_plan(last))
    assert "model.layers.*.self_attn.q_norm" in resolve_tp_plan(last, hf_tp_plan(last))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up' matches no module"):
        resolve_tp_plan(first, {"model.layers.1.mlp.up": "colwise"})  # layer 1 is here, up is not
    assert resolve_tp_plan(first, {"model.layers.3.mlp.up_proj": "colwise"}) == {}  # layer 3 is stage 1's
