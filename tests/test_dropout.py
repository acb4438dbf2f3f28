"""Dropout trains right under every layout (issue 38): recompute replays the forward's masks, and
the ranks of one tensor-parallel group draw the same masks for the activations they all hold
(`colab_par/parallel/rng.py`).

GPT-2 from transformers keeps its shipped dropout (0.1 on embeddings, attention and residuals);
the kit's GPT gets the same 0.1 on its embeddings and residual branches.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from colab_par.data import BatchList, SyntheticDataset
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.parallel.rng import stream_seed
from colab_par.training.options import Checkpoints, Logs

cloudpickle.register_pickle_by_value(sys.modules[__name__])

VOCAB, SEQ, MODEL_SEED, TRAIN_SEED, LR = 101, 16, 7, 3, 3e-3
DATA = dict(vocab_size=VOCAB, seq_len=SEQ, batch_size=4, seed=5)


def build(kind: str, **overrides) -> torch.nn.Module:
    """GPT-2 with transformers' default dropout (0.1), or the kit's GPT with dropout 0.1."""
    torch.manual_seed(MODEL_SEED)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, kernels="torch",
                             dropout=0.1))
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=1, eos_token_id=2, attn_implementation="sdpa", **overrides)
    return transformers.GPT2LMHeadModel(config)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def dict_batches(steps: int) -> BatchList:
    """The token batches as Hugging Face dicts with labels: the model's own forward then builds its
    KV cache (use_cache is GPT-2's default), which checkpointing must keep out of the recompute."""
    data = SyntheticDataset(**DATA)
    return BatchList([{"input_ids": data.batch(i)[0], "labels": data.batch(i)[0]} for i in range(steps)])


def replicated_over_tp(pm) -> dict[str, torch.Tensor]:
    """This rank's copy of every parameter that each tp rank holds whole (plain or Replicate)."""
    from torch.distributed.tensor import DTensor, Replicate

    held = {}
    for name, p in pm.model.named_parameters():
        if not isinstance(p, DTensor):
            held[name] = p.detach().clone()
        elif all(isinstance(placement, Replicate) for placement in p.placements):
            held[name] = p.to_local().detach().clone()
    return held


def train(layout: str, kind: str, steps: int, data: str = "tokens", **overrides) -> dict:
    """On an engine: `kind` parallelized as `layout`, trained by the Trainer (seed TRAIN_SEED)."""
    from colab_par import Trainer, parallelize

    pm = parallelize(build(kind, **overrides), layout, optimizer_fn=adamw)
    source = SyntheticDataset(**DATA) if data == "tokens" else dict_batches(steps)
    trainer = Trainer(pm, source, steps=steps, seed=TRAIN_SEED, logs=Logs(telemetry=False))
    trainer.fit()
    return {"losses": [row["loss"] for row in trainer.history], "replicated": replicated_over_tp(pm),
            "rng": pm.rng.state()["cpu"]}


def one_process(kind: str, steps: int, stream: int, **overrides) -> list[float]:
    """The same training in this process, no parallel wrapper, with the masks of `stream`."""
    model = build(kind, **overrides)
    optimizer, data = adamw(model.parameters()), SyntheticDataset(**DATA)
    torch.manual_seed(stream_seed(TRAIN_SEED, stream))
    losses = []
    for step in range(steps):
        inputs, targets = data.batch(step)
        if kind == "gpt":
            loss = model.loss_fn(model(inputs), targets)
        else:
            logits = model(input_ids=inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_over_tp(results: list[dict], tp: int) -> None:
    """Every tp group's ranks hold bit-identical replicated parameters and the same RNG state."""
    for first in range(0, len(results), tp):
        group = results[first:first + tp]
        names = group[0]["replicated"]
        assert any("ln" in name or "norm" in name for name in names), sorted(names)
        for other in group[1:]:
            for name, value in names.items():
                assert torch.equal(other["replicated"][name], value), f"{name} differs within a tp group"
            assert torch.equal(other["rng"], group[0]["rng"])


@pytest.mark.parametrize("plain,recomputed,data", [("dp2", "dp2 ac-full", "tokens"),
                                                   ("dp2 zero3", "dp2 zero3 ac-selective", "dicts")])
def test_recompute_replays_the_forwards_dropout_masks(cluster2, plain: str, recomputed: str, data: str) -> None:
    expected = cluster2.run(train, plain, "gpt2", 4, data)[0]["losses"]
    assert cluster2.run(train, recomputed, "gpt2", 4, data)[0]["losses"] == expected


@pytest.mark.parametrize("kind,layout", [("gpt2", "tp2"), ("gpt", "tp2"), ("gpt", "tp2 sp")])  # no sp plan for HF
def test_tp_ranks_keep_replicated_parameters_identical(cluster2, kind: str, layout: str) -> None:
    assert_same_over_tp(cluster2.run(train, layout, kind, 20), tp=2)


def test_dp_ranks_draw_other_masks_and_tp_ranks_the_same(cluster4) -> None:
    results = cluster4.run(train, "dp2 tp2", "gpt2", 20)
    assert_same_over_tp(results, tp=2)
    assert not torch.equal(results[0]["rng"], results[2]["rng"])  # dp replicas: other streams


def hand_loop(layout: str, steps: int) -> dict:
    """On an engine: a hand-written loop over `pm.train_step` whose cell reseeds torch's generator
    per rank before every step (as a careless cell might); the model's stream must not care."""
    import torch.distributed as dist

    from colab_par import parallelize

    pm = parallelize(build("gpt2"), layout, optimizer_fn=adamw)
    data = SyntheticDataset(**DATA)
    for step in range(steps):
        torch.manual_seed(100 + dist.get_rank())
        before = torch.get_rng_state()
        pm.train_step(*data.batch(step))
        assert torch.equal(torch.get_rng_state(), before), "training drew from the cell's generator"
    return {"replicated": replicated_over_tp(pm), "rng": pm.rng.state()["cpu"]}


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_a_hand_written_loop_gets_the_streams_of_its_layout(cluster2, layout: str) -> None:
    results = cluster2.run(hand_loop, layout, 6)
    if layout == "tp2":
        assert_same_over_tp(results, tp=2)
    else:
        assert not torch.equal(results[0]["rng"], results[1]["rng"])  # dp replicas: other masks


@pytest.mark.parametrize("kind,overrides", [("gpt", {}), ("gpt2", {"attn_pdrop": 0.0})])
def test_one_process_with_the_same_masks_matches_tp2(cluster2, kind: str, overrides: dict) -> None:
    """Every dropout here acts on an activation tp2 holds whole, so one process seeded with tp2's
    stream draws the same masks. (GPT-2's attention dropout acts on each rank's half of the heads:
    a mask half the size moves the stream differently from one process's whole mask.)"""
    losses = cluster2.run(train, "tp2", kind, 4, **overrides)[0]["losses"]
    same, other = one_process(kind, 4, 0, **overrides), one_process(kind, 4, 1, **overrides)
    # float32 sums in another order (the row-parallel all-reduce): measured 4.8e-7, one ulp at 4.6.
    assert losses == pytest.approx(same, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(losses, other)) > 1e-3  # other masks: visibly other losses


def resumed(saved_as: str, resumed_as: str, kind: str, folder: str, steps: int) -> dict:
    """On an engine: train `steps` steps saving a checkpoint halfway under `saved_as`, then resume
    that checkpoint under `resumed_as` (a new model and Trainer) and train to the end."""
    from colab_par import Trainer, parallelize

    pm = parallelize(build(kind), saved_as, optimizer_fn=adamw)
    Trainer(pm, SyntheticDataset(**DATA), steps=steps, seed=TRAIN_SEED, logs=Logs(telemetry=False), checkpoints=Checkpoints(folder)).fit(stop_at=steps // 2)
    pm = parallelize(build(kind), resumed_as, optimizer_fn=adamw)
    trainer = Trainer(pm, SyntheticDataset(**DATA), steps=steps, seed=TRAIN_SEED, logs=Logs(telemetry=False), checkpoints=Checkpoints(folder))
    trainer.resume()
    trainer.fit()
    return {"losses": [row["loss"] for row in trainer.history], "replicated": replicated_over_tp(pm),
            "rng": pm.rng.state()["cpu"]}


def test_resume_replays_the_saved_streams_bit_for_bit(cluster2, tmp_path) -> None:
    uninterrupted = cluster2.run(train, "tp2", "gpt2", 6)[0]["losses"]
    assert cluster2.run(resumed, "tp2", "tp2", "gpt2", str(tmp_path), 6)[0]["losses"] == uninterrupted


def test_a_relayout_keeps_tp_ranks_on_one_stream(cluster2, tmp_path) -> None:
    """Saved under dp2 (two streams), resumed under tp2: the ranks must not take their dp streams."""
    assert_same_over_tp(cluster2.run(resumed, "dp2", "tp2", "gpt2", str(tmp_path), 8), tp=2)


def test_a_dropout_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        GPTConfig(dropout=1.0)
