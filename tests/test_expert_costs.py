"""The planner's expert-parallel terms against real dp·ep steps (real engines, gloo):

- the bytes every rank's all-to-alls send and receive in a training step (counted as the c10d ops
  run, forward and backward) equal `expert_costs.all_to_all_bytes` at the rank's own load (the
  rows the routers sent its experts), and its mean over the ranks equals the balanced formula,
  under dp·ep, zero3, pp (the stage's layers, every microbatch) and tp (whole tokens per tp rank);
- the parameters and optimizer state a rank holds equal `estimate(...).resting`, its expert
  weights n_experts/ep per layer (further sharded by zero over the dp/ep replicas);
- `plan()` searches ep for a MoE model (and only for one), the picker offers it, `ep_load` reads
  the busiest rank off a heat map's counts, and uneven routing costs time.
"""
from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import pytest
import torch
from parity import LR, MOE_SIZES, _vocab_seq, batches, build_model, engine_model

from colab_par import compat
from colab_par.planning.expert_costs import all_to_all_bytes, ep_load, local_expert_params, packed_regroup_bytes
from colab_par.planning.flops import ModelSpec
from colab_par.layout import Layout
from colab_par.models import GPTConfig
from colab_par.planning.planner import estimate, plan

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

GLOBAL_BATCH, FP32 = 8, 4
CONFIG = GPTConfig(**MOE_SIZES)


class AllToAllBytes(compat.torch_dispatch_mode()):
    """Bytes the c10d all-to-alls this rank issues send (their input) and receive (their output),
    seen as they dispatch; every other op passes through untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = self.received = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "namespace", "") == "c10d" and "alltoall" in func.__name__:
            output, payload = args[0], args[1]
            self.sent += sum(t.numel() * t.element_size() for t in _tensors(payload))
            self.received += sum(t.numel() * t.element_size() for t in _tensors(output))
        return func(*args, **(kwargs or {}))


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for t in value if isinstance(t, torch.Tensor)]


def _measure(layout: str, kind: str) -> dict[str, Any]:
    """Engine side: train one step, then count one more: its all-to-all bytes, the routers' counts
    per layer of this rank's stage (summed over the step's microbatches), its ep group and what the
    rank holds afterwards."""
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.parallel import memory_report
    from colab_par.parallel.experts import moe_layers

    pm = parallelize(engine_model(kind, "module"), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR))
    warm, counted = batches(*_vocab_seq(kind), 2, GLOBAL_BATCH)
    pm.train_step(*warm)
    with AllToAllBytes() as bytes_:
        pm.train_step(*counted)
    layers = moe_layers(pm.model)
    experts = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                  for name, p in pm.model.named_parameters() if ".experts." in name)
    return {"rank": dist.get_rank(), "sent": bytes_.sent, "received": bytes_.received,
            "ep_group": dist.get_process_group_ranks(layers[0].dispatch.group),
            "counts": [layer.last_counts.tolist() for layer in layers],
            "memory": memory_report(pm), "expert_elements": experts}


@pytest.mark.parametrize("cluster, layout, kind", [
    ("cluster2", "dp2 ep2", "gpt-moe"), ("cluster2", "dp2 ep2 zero3", "gpt-moe"),
    ("cluster4", "dp4 ep2 zero3", "gpt-moe"), ("cluster4", "pp2 dp2 ep2", "gpt-moe"),
    ("cluster4", "dp2 ep2 tp2", "gpt-moe"),
    ("cluster4", "dp2 ep2 tp2 zero3", "gpt-moe"), ("cluster4", "dp2 ep2 tp2", "qwen3-moe")])
def test_a_real_step_costs_what_the_planner_says(request, cluster: str, layout: str, kind: str) -> None:
    """Under pp a rank's all-to-alls serve its stage's MoE layers, once per microbatch; under tp
    every tp rank dispatches whole tokens over its own ep group (the split is inside the experts),
    and a Hugging Face family's packed gate|up weights are regrouped over tp besides."""
    model = CONFIG if kind == "gpt-moe" else build_model(kind, 0).config
    parsed, spec = Layout.parse(layout), ModelSpec.of(model)
    ep, experts, m = parsed.ep, spec.n_experts, parsed.microbatches
    ranks = {r["rank"]: r for r in request.getfixturevalue(cluster).run(_measure, layout, kind)}
    seq_len = _vocab_seq(kind)[1]
    tokens = GLOBAL_BATCH // parsed.dp // m * seq_len  # one micro-step of one rank
    routed = tokens * spec.top_k
    stage_layers = spec.n_layer // parsed.pp

    # all-to-all bytes: a rank receives, in each of its MoE layers, the rows its ep group routed to
    # its experts (the ranks of a group run the same stage: they exchange tokens)
    regrouped = packed_regroup_bytes(spec, ep, parsed.tp, FP32, stage_layers)  # 0 but for packed experts
    assert (regrouped > 0) == (kind != "gpt-moe")
    loads = []
    for rank, measured in ranks.items():
        group = measured["ep_group"]
        assert len(group) == ep and rank in group and all(ranks[q]["ep_group"] == group for q in group)
        place = group.index(rank)
        mine = range(place * experts // ep, (place + 1) * experts // ep)
        assert len(measured["counts"]) == stage_layers
        received_rows = sum(ranks[q]["counts"][layer][e] for q in group for layer in range(stage_layers)
                            for e in mine)
        assert sum(map(sum, measured["counts"])) == m * routed * stage_layers  # top_k rows per token
        load = received_rows / (m * routed * stage_layers)
        predicted = m * (all_to_all_bytes(spec, ep, tokens, FP32, load, layers=stage_layers) + regrouped)
        assert (measured["sent"], measured["received"]) == (predicted, predicted), f"rank {rank}"
        loads.append(load)
    assert sum(r["sent"] for r in ranks.values()) / len(ranks) == \
        m * (all_to_all_bytes(spec, ep, tokens, FP32, layers=stage_layers) + regrouped)
    assert len(set(loads)) > 1  # uneven routing: the loads differ, so the test tells them apart

    # parameters and optimizer state per rank: the planner's resting state, exactly (under pp the
    # fullest stage's); expert weights n_experts/ep per layer of the stage, sliced by tp and
    # further sharded by zero over the dp/ep replicas. Qwen3's per-head q/k norms (2·head_dim
    # elements a layer, 0.3 % here) are the one thing ModelSpec leaves out.
    plan_ = estimate(model, parsed, device="cpu", global_batch=GLOBAL_BATCH, seq_len=seq_len)
    unmodelled = 0.0 if kind == "gpt-moe" else 0.01
    replicas = parsed.dp // ep if parsed.zero >= 2 else 1
    for rank, measured in ranks.items():
        assert measured["expert_elements"] == local_expert_params(spec, ep) / (parsed.tp * parsed.pp * replicas)
        assert measured["memory"]["params"] <= plan_.resting.params * (1 + unmodelled), f"rank {rank}"
    fullest = max(ranks.values(), key=lambda r: r["memory"]["params"])
    for key in ("params", "optimizer"):
        assert fullest["memory"][key] == pytest.approx(getattr(plan_.resting, key), rel=unmodelled, abs=0)
        if parsed.pp == 1:  # every rank holds the same
            assert len({r["memory"][key] for r in ranks.values()}) == 1


# ---- the search and the picker -------------------------------------------------------------------
def test_plan_searches_ep_only_for_moe_models() -> None:
    moe = GPTConfig(**{**MOE_SIZES, "n_experts": 8})
    layouts = [p.layout for p in plan(moe, 4, device="cpu", global_batch=8, seq_len=16, top=None)]
    assert {l.ep for l in layouts} == {1, 2, 4}
    assert all(l.dp % l.ep == 0 and 8 % l.ep == 0 for l in layouts)
    dense = GPTConfig(**{**MOE_SIZES, "n_experts": 0})
    assert {p.layout.ep for p in plan(dense, 4, device="cpu", global_batch=8, seq_len=16, top=None)} == {1}
    family = build_model("qwen3-moe", 0).config  # its own expert plan, read off the config
    assert {p.layout.ep for p in plan(family, 4, device="cpu", global_batch=8, seq_len=16, top=None)} == {1, 2, 4}


def test_experts_per_rank_shrink_with_ep_and_uneven_routing_costs_time() -> None:
    big = GPTConfig(vocab_size=32000, seq_len=2048, n_layer=8, n_head=16, d_model=2048, n_experts=16,
                    top_k=2, ffn_hidden=1024)
    spec = ModelSpec.of(big)
    options = dict(device="H100-80GB", global_batch=32, seq_len=2048)
    dense_part = spec.n_params - spec.expert_params
    for ep in (1, 2, 4, 8):
        option = estimate(big, f"dp8 ep{ep}" if ep > 1 else "dp8", **options)
        assert option.resting.params == 4 * (dense_part + spec.expert_params / ep)  # fp32 weights
        assert ("ep" in option.times) == (ep > 1)
    balanced, skewed = (estimate(big, "dp8 ep4", expert_load=load, **options) for load in (1.0, 2.0))
    assert skewed.times["imbalance"] > 0 == balanced.times["imbalance"]
    assert skewed.times["ep"] > balanced.times["ep"] and skewed.step_time > balanced.step_time
    with pytest.raises(ValueError, match="at least 1.0"):
        estimate(big, "dp8 ep4", expert_load=0.5, **options)


def test_ep_load_is_the_busiest_ranks_share_of_a_layers_tokens() -> None:
    counts = [[4, 4, 4, 4], [10, 2, 1, 3]]  # layer 1: ranks of ep2 get 12 and 4 of 16 rows
    assert ep_load(counts, 1) == 1.0
    assert ep_load(counts, 2) == 12 / 8
    assert ep_load(counts, 4) == 10 / 4
    with pytest.raises(ValueError, match="does not divide the 4 experts"):
        ep_load(counts, 3)


def test_the_picker_offers_ep_for_a_moe_model_only() -> None:
    from colab_par.notebook.picker import LayoutPicker

    moe = LayoutPicker(4, model=GPTConfig(**{**MOE_SIZES, "n_experts": 8}), device="cpu",
                       global_batch=8, seq_len=16)
    assert tuple(moe.controls["ep"].options) == (1, 2, 4)
    assert moe.controls["ep"] in moe.widget.children[1].children
    moe.apply("dp4 ep2 zero3")
    assert moe.layout == Layout.parse("dp4 ep2 zero3") and moe.message.startswith("✓")
    dense = LayoutPicker(4, model=GPTConfig(**{**MOE_SIZES, "n_experts": 0}), device="cpu",
                         global_batch=8, seq_len=16)
    assert tuple(dense.controls["ep"].options) == (1,)
    assert dense.controls["ep"] not in dense.widget.children[1].children
