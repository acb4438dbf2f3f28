"""Mixture of experts: the MoE GPT under expert parallel trains like one process (real engines).

10 AdamW steps of a 2-layer GPT with 4 experts (2 per token) on learnable data: losses and gradient
norms within 1e-5 relative of the one-process reference, every parameter within Adam's tolerance
(`parity.assert_parity`), with and without the load-balancing loss (computed from global-batch
counts). Plus: each rank holds n_experts/ep experts, the Trainer's per-expert token counts equal a
one-process count of the router's choices, and impossible ep layouts are refused before any work.
"""
from __future__ import annotations

import re
import sys

import cloudpickle
import pytest
import torch

from colab_par.layout import Layout, LayoutError, valid_layouts
from colab_par.models import GPTConfig
from colab_par.training.telemetry import expert_row_key
from parity import (GPT_SIZES, LR, MOE_SIZES, SEED, assert_parity, batches, build_model, engine_model,
                    _parallelized, _plain_loss, engine_run, hf_moe_model, reference_run, training_batches)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

STEPS = 10


@pytest.mark.parametrize("kind", ["gpt-moe", "gpt-moe-aux"])
@pytest.mark.parametrize("layout", ["dp2 ep2", "dp2 ep2 zero3", "dp2"])
def test_two_engine_moe_trains_like_single_process(cluster2, layout: str, kind: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


@pytest.mark.parametrize("layout, kind", [("dp4 ep2", "gpt-moe"), ("dp4 ep2", "gpt-moe-aux"),
                                          ("dp4 ep2 zero3", "gpt-moe-aux")])
def test_four_engine_moe_trains_like_single_process(cluster4, layout: str, kind: str) -> None:
    """Two ep groups: each expert's gradient is summed over its two replicas and divided by dp
    (zero3: FSDP shards the experts over those replicas, on top of their ep split)."""
    assert_parity(cluster4.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


@pytest.mark.parametrize("kind", ["gpt-moe", "gpt-moe-aux"])
def test_moe_gpt_under_tensor_parallel_trains_like_single_process(cluster2, kind: str) -> None:
    """Every tp rank holds a slice of every expert (w1/w3 by output, w2 by input features); the
    partial expert outputs are summed, the router and balance loss computed whole."""
    assert_parity(cluster2.run(engine_run, "tp2", kind, STEPS), reference_run(kind, STEPS))


@pytest.mark.parametrize("layout, kind", [("dp2 ep2 tp2", "gpt-moe"), ("dp2 ep2 tp2", "gpt-moe-aux"),
                                          ("dp2 ep2 tp2 zero3", "gpt-moe-aux"), ("dp2 ep2 tp2 zero2", "gpt-moe")])
def test_moe_gpt_under_ep_and_tp_trains_like_single_process(cluster4, layout: str, kind: str) -> None:
    """dp2 ep2 tp2: each expert weight one DTensor over (ep, tp), sharded by expert and inside;
    zero 2/3 shard the other parameters over dp and the experts over their own replicas (edp),
    fully_shard taking the (ep, tp) DTensors as they are."""
    assert_parity(cluster4.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


def test_experts_sharded_over_ep_tp_and_their_replicas_train_like_single_process(cluster8) -> None:
    """dp4 ep2 tp2 zero3: each expert weight a DTensor over (ep, tp), fully_shard'ed over its two
    replicas (edp): FSDP over three mesh dims, the other parameters over dp and tp."""
    kind = "gpt-moe-aux"
    assert_parity(cluster8.run(engine_run, "dp4 ep2 tp2 zero3", kind, STEPS), reference_run(kind, STEPS))


@pytest.mark.parametrize("layout, kind", [("dp2 ep2 zero3 offload", "gpt-moe-aux"),
                                          ("dp2 ep2 zero2 offload", "qwen3-moe-aux")])
def test_ep_with_fsdp_cpu_offload_trains_like_single_process(cluster2, layout: str, kind: str) -> None:
    """FSDP's CPU offload of the shards, the experts' (sharded over their own replicas) included."""
    assert_parity(cluster2.run(engine_run, layout, kind, 6), reference_run(kind, 6))


@pytest.mark.parametrize("layout, kind", [("pp2 dp2 ep2", "gpt-moe"), ("pp2 dp2 ep2 gpipe mb1", "gpt-moe-aux"),
                                          ("pp2 dp2 ep2 zero3", "gpt-moe"),
                                          ("pp2 dp2 ep2 zero2 gpipe mb1", "gpt-moe-aux")])
def test_moe_gpt_under_pipeline_and_ep_trains_like_single_process(cluster4, layout: str, kind: str) -> None:
    """Each stage's MoE layers split over ep; the balance losses of BOTH stages reach the loss and
    the gradients (a loss computed in stage 0 rides on its output into its backward). One
    microbatch with the balance loss: it is computed per global microbatch, as one process
    accumulating over the same microbatches would, and the reference takes the batch whole."""
    assert_parity(cluster4.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


PP_EP = (("pp2 dp2 ep2", ""), ("pp2 dp2 ep2 gpipe mb1", "-aux"))  # the balance loss per microbatch: one


@pytest.mark.parametrize("layout, kind", [*[(layout, family + aux) for family in ("qwen3-moe", "mixtral", "olmoe")
                                            for layout, aux in PP_EP],
                                          ("pp2 dp2 ep2 zero2", "qwen3-moe"),
                                          ("pp2 dp2 ep2 zero3 gpipe mb1", "qwen3-moe-aux")])
def test_hf_moe_under_pipeline_and_ep_trains_like_transformers(cluster4, layout: str, kind: str) -> None:
    """A Hugging Face family's stages split over ep the same way. Its own balance loss (Qwen3-MoE's
    mixes all layers' routing, so no stage can compute a part alone) reaches the loss and the
    gradients of both stages: each differentiates the family's loss over every stage's logits
    with respect to its own (`stage_balance.py`); transformers alone computes it whole."""
    assert_parity(cluster4.run(engine_run, layout, kind, 6), reference_run(kind, 6))


@pytest.mark.parametrize("layout, kind", [("pp2 dp2 ep2 tp2", "gpt-moe"),
                                          ("pp2 dp2 ep2 tp2 zero3 gpipe mb1", "gpt-moe-aux"),
                                          ("pp2 dp2 ep2 tp2 gpipe mb1", "qwen3-moe-aux")])
def test_moe_under_pipeline_ep_and_tp_trains_like_single_process(cluster8, layout: str, kind: str) -> None:
    """All four at once on 8 engines: each stage's experts split over ep and inside over tp, the
    balance losses (the kit's, the family's across stages) computed as without tp."""
    assert_parity(cluster8.run(engine_run, layout, kind, 6), reference_run(kind, 6))


# ---- each rank holds its n_experts/ep experts -----------------------------------------------------
def _accumulated_reference(kind: str, steps: int, dp: int, microbatches: int) -> dict[str, list[float]]:
    """One process, no kit code, accumulating over the global microbatches a pipeline runs: the
    j-th microbatch of every dp rank's slice together, each with its own balance loss."""
    model = build_model(kind, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grad_norms = [], []
    for x, y in training_batches(kind, steps):
        per = x.shape[0] // dp // microbatches
        total = 0.0
        for j in range(microbatches):
            rows = torch.cat([torch.arange(per) + (r * microbatches + j) * per for r in range(dp)])
            loss = _plain_loss(kind, model, (x[rows], y[rows])) / microbatches
            loss.backward()
            total += loss.item()
        losses.append(total)
        grad_norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None])).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grad_norms": grad_norms}


def test_hf_balance_loss_under_1f1b_is_each_global_microbatchs(cluster4) -> None:
    """Two microbatches under 1F1B (the stages' logits of both in flight, received in order): the
    family's loss of each global microbatch, as one process accumulating over them computes it,
    which is not the whole batch's (so the microbatches are told apart)."""
    kind, steps = "qwen3-moe-aux", 4
    runs = cluster4.run(engine_run, "pp2 dp2 ep2 1f1b mb2", kind, steps)
    reference = _accumulated_reference(kind, steps, dp=2, microbatches=2)
    for key in ("losses", "grad_norms"):
        for run in runs:
            torch.testing.assert_close(torch.tensor(run[key], dtype=torch.float64),
                                       torch.tensor(reference[key], dtype=torch.float64), rtol=1e-5, atol=0)
    assert abs(reference["losses"][0] - reference_run(kind, steps)["losses"][0]) > 1e-4


def _dense_first_stage_refusal(layout: str) -> str:
    import transformers

    from colab_par import parallelize

    config = hf_moe_model("qwen3-moe-aux").config
    config.mlp_only_layers = [0]  # stage 0 of pp2 holds a dense layer only
    try:
        parallelize(transformers.Qwen3MoeForCausalLM(config), layout)
    except ValueError as error:
        return str(error)
    return ""


def test_hf_balance_loss_refuses_a_stage_without_moe_layers(cluster4) -> None:
    """Every stage takes part in the family's loss; one without routers would leave the others
    waiting, so every rank refuses before training."""
    for error in cluster4.run(_dense_first_stage_refusal, "pp2 dp2 ep2 gpipe mb1"):
        assert "holds no MoE layer" in error and "output_router_logits=False" in error, error


def _expert_pieces(layout: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Engine side: this rank and its local pieces of every expert weight, after parallelize."""
    import torch.distributed as dist

    from colab_par import parallelize

    pm = parallelize(engine_model("gpt-moe", "module"), layout)
    return dist.get_rank(), {name: param.to_local().detach().clone()
                             for name, param in pm.model.named_parameters() if ".experts." in name}


@pytest.mark.parametrize("cluster, layout", [("cluster2", "dp2 ep2"), ("cluster4", "dp4 ep2"),
                                             ("cluster2", "tp2"), ("cluster4", "dp2 ep2 tp2")])
def test_each_rank_holds_its_share_of_the_experts(request, cluster: str, layout: str) -> None:
    """Neighbouring dp ranks form an ep group: rank r holds experts [dp_rank % ep · E/ep, ...) of
    rank 0's model, and of those, under tp, its tp rank's piece of w1/w3's output and w2's input
    features; nothing else."""
    parsed = Layout.parse(layout)
    ep, tp, experts = parsed.ep, parsed.tp, MOE_SIZES["n_experts"]
    whole = build_model("gpt-moe", SEED).state_dict()
    for rank, pieces in request.getfixturevalue(cluster).run(_expert_pieces, layout):
        assert len(pieces) == 3 * MOE_SIZES["n_layer"]
        tp_rank, dp_rank = rank % tp, rank // tp
        for name, piece in pieces.items():
            mine = experts // ep
            first = dp_rank % ep * mine
            expected = whole[name][first:first + mine].chunk(tp, 1 if name.endswith("w2") else 2)[tp_rank]
            assert piece.shape == expected.shape, f"rank {rank} holds {tuple(piece.shape)} of {name}"
            torch.testing.assert_close(piece, expected, rtol=0, atol=0)


# ---- the Trainer's per-expert token counts ------------------------------------------------------
COUNT_STEPS, GRAD_ACCUM = 3, 2
DATA = dict(vocab_size=MOE_SIZES["vocab_size"], seq_len=MOE_SIZES["seq_len"], batch_size=4, seed=5)


def _trainer_rows(layout: str, kind: str) -> list[dict]:
    from colab_par import parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.training.trainer import Trainer

    pm = parallelize(engine_model(kind, "module"), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR))
    trainer = Trainer(pm, SyntheticDataset(**DATA), steps=COUNT_STEPS, grad_accum=GRAD_ACCUM)
    trainer.fit()
    return trainer.history


def _one_process_counts(kind: str) -> list[torch.Tensor]:
    """Per step, (layer, expert) counts of the routers' choices training in one process."""
    from colab_par.data import SyntheticDataset
    from colab_par.parallel.experts import moe_layers

    model, data = build_model(kind, SEED), SyntheticDataset(**DATA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per_step = []
    for step in range(COUNT_STEPS):
        counts = 0
        for micro in range(GRAD_ACCUM):
            inputs, targets = data.batch(step * GRAD_ACCUM + micro)
            (model.loss_fn(model(inputs), targets) / GRAD_ACCUM).backward()
            counts = counts + torch.stack([layer.last_counts for layer in moe_layers(model)])
        optimizer.step()
        optimizer.zero_grad()
        per_step.append(counts)
    return per_step


@pytest.mark.parametrize("cluster, layout, kind", [("cluster2", "dp2 ep2", "gpt-moe-aux"),
                                                   ("cluster4", "pp2 dp2 ep2", "gpt-moe")])
def test_trainer_rows_count_the_tokens_each_expert_got(request, cluster: str, layout: str, kind: str) -> None:
    """pp: each stage counts its own layers, summed over the step's two microbatches; the rows
    number the whole model's layers (no balance loss there: per microbatch it trains otherwise)."""
    expected = _one_process_counts(kind)
    tokens = GRAD_ACCUM * DATA["batch_size"] * DATA["seq_len"] * MOE_SIZES["top_k"]
    for history in request.getfixturevalue(cluster).run(_trainer_rows, layout, kind):
        assert [row["step"] for row in history] == list(range(1, COUNT_STEPS + 1))
        for row, counts in zip(history, expected):
            assert counts.sum(1).tolist() == [tokens] * MOE_SIZES["n_layer"]
            got = [[row[expert_row_key(layer, e)] for e in range(MOE_SIZES["n_experts"])]
                   for layer in range(MOE_SIZES["n_layer"])]
            assert got == counts.tolist(), f"step {row['step']}"


# ---- evaluation scores the data alone ------------------------------------------------------------
EVAL_BATCHES = 3


def _evaluated(layout: str, kind: str) -> float:
    pm = _parallelized(engine_model(kind, "module"), layout)
    return pm.evaluate(training_batches(kind, EVAL_BATCHES))["loss"]


def _held_out_losses(kind: str) -> tuple[float, float]:
    """One process, no kit code, on the same batches (every row and token scored, so a mean of
    the batches' means is the mean): the cross-entropy alone, and the training loss (with the
    routers' balance loss)."""
    import torch.nn.functional as F

    model, data = build_model(kind, SEED), training_batches(kind, EVAL_BATCHES)
    data_loss = 0.0
    with torch.no_grad():
        for x, y in data:
            logits = model(x) if kind.startswith("gpt") else model(input_ids=x, use_cache=False).logits
            data_loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).item()
    training_loss = sum(_plain_loss(kind, model, batch).item() for batch in data)
    return data_loss / len(data), training_loss / len(data)


@pytest.mark.parametrize("kind", ["gpt-moe-aux", "qwen3-moe-aux"])
@pytest.mark.parametrize("cluster, layout", [("cluster2", "dp2 ep2"), ("cluster2", "tp2"),
                                             ("cluster4", "pp2 dp2 ep2 1f1b mb2")])
def test_evaluation_leaves_the_balance_loss_out_under_every_layout(request, cluster: str, layout: str,
                                                                    kind: str) -> None:
    """The held-out loss is the data's (the balance loss depends on how a batch is split, per
    microbatch under pp): the same number without pp and with it, that of one process."""
    data_loss, training_loss = _held_out_losses(kind)
    assert training_loss - data_loss > 1e-3 * data_loss  # the balance loss is on and would show
    for loss in request.getfixturevalue(cluster).run(_evaluated, layout, kind):
        assert loss == pytest.approx(data_loss, rel=1e-6)


# ---- refused before any work --------------------------------------------------------------------
@pytest.mark.parametrize("layout, config, message", [
    ("dp3 ep2", MOE_SIZES, "must divide dp=3"),
    ("dp8 ep8", MOE_SIZES, "does not divide the 4 experts"),
    ("dp2 ep2", GPT_SIZES, "this model has none"),
    ("dp2 ep2 cp2", MOE_SIZES, "not with cp=2"),
    ("tp2 sp", MOE_SIZES, "drop 'sp'"),
    ("tp4 2d", MOE_SIZES, "has no split of the experts inside"),
    ("dp2 ep2 zero1", MOE_SIZES, "ranks of an ep group hold different experts"),
    ("dp2 cp2", MOE_SIZES, "not cp=2"),
])
def test_impossible_expert_layouts_are_refused(layout: str, config: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        Layout.parse(layout).validate(None, GPTConfig(**config))


def test_ep_is_a_layout_token_and_enumerated_only_when_asked() -> None:
    layout = Layout.parse("dp4 ep2 zero3")
    assert (layout.ep, layout.world_size, str(layout)) == (2, 4, "dp4 ep2 zero3")
    moe = GPTConfig(**MOE_SIZES)
    assert {l.ep for l in valid_layouts(4, moe)} == {1}
    asked = set(valid_layouts(4, moe, ep=(1, 2, 4), zero=(0, 1, 3), checkpointing=("none", "full")))
    assert {l.ep for l in asked} == {1, 2, 4}
    for layout in asked:  # exactly what validate accepts (ep's rules run inside the enumeration)
        layout.validate(4, moe)
        assert layout.ep == 1 or (layout.zero != 1 and layout.dp * layout.tp * layout.pp == 4 and layout.cp == 1)
    assert {Layout.parse("dp2 ep2 tp2"), Layout.parse("dp2 ep2 tp2 zero3"), Layout.parse("pp2 dp2 ep2 zero3")} <= asked


def _refusal(layout: str, kind: str, source: str) -> str | None:
    from colab_par import parallelize

    try:
        parallelize(engine_model(kind, source), layout)
    except ValueError as error:  # LayoutError is one
        return str(error)
    return None


@pytest.mark.parametrize("kind, source, message", [("gpt", "module", "this model has none")])
def test_parallelize_refuses_ep_before_building(cluster2, kind: str, source: str, message: str) -> None:
    assert all(message in (error or "") for error in cluster2.run(_refusal, "dp2 ep2", kind, source))


def test_flops_per_token_count_the_experts_a_token_runs() -> None:
    """MFU's formula for the MoE GPT (top_k experts and the router per token) equals torch's FLOP
    counter on its matmuls (float64: the matmul loop the counter sees; torch's counter has no
    formula for _grouped_mm), attention's 12·layers·d·seq aside (SDPA, which it does not count here)."""
    from torch.utils.flop_counter import FlopCounterMode

    from colab_par.training.telemetry import model_flops_per_token

    model = build_model("gpt-moe", SEED).double()
    inputs, targets = batches(MOE_SIZES["vocab_size"], MOE_SIZES["seq_len"], 1)[0]
    with FlopCounterMode(display=False) as counter:
        model.loss_fn(model(inputs), targets).backward()
    seq = MOE_SIZES["seq_len"]
    attention = 12 * MOE_SIZES["n_layer"] * MOE_SIZES["d_model"] * seq
    assert model_flops_per_token(model, 0, seq) - attention == counter.get_total_flops() / inputs.numel()
