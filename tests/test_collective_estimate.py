"""The planner's collectives (`planning.collective_estimate.collective_bytes`) against the dry run's.

The reference is the kit's own step, traced: `dry_run` runs rank 0's real `parallelize` and
training step in a fake world of the layout's size and counts every collective it issues per mesh
dimension (`CollectivesByDim`, the kit's payload rule). The planner, from the config's sizes and
the layout alone, must give the same rows: the same (dimension, op) keys, calls and bytes,
exactly. Models: the kit's GPT (one with grouped kv heads) and a Llama config whose vocabulary (66) and FFN width (50) do not
split evenly over 4 ranks, so FSDP's padding of dim 0 counts; a wider GPT whose gradients fill two
DDP buckets. Llama-3 8B and the other rows of tests/data/dry_run_traces.json (recorded by
benchmarks/dry_run_scale.py, fake tensors, worlds 8 and 64) are held to the same equality.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import LlamaConfig

from colab_par.models import GPTConfig
from colab_par.planning.collective_estimate import collective_bytes
from colab_par.planning.dry_run import dry_run
from colab_par.planning.dry_run.compare import compare

TINY_GPT = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
GQA_GPT = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, kernels="torch")
WIDE_GPT = GPTConfig(vocab_size=4096, seq_len=16, n_layer=2, n_head=4, d_model=128, kernels="torch")
TINY_LLAMA = LlamaConfig(vocab_size=66, hidden_size=24, intermediate_size=50, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
MODELS = {"gpt": TINY_GPT, "gqa-gpt": GQA_GPT, "wide-gpt": WIDE_GPT, "llama": TINY_LLAMA}
BATCH = (8, 16)
TRACES = Path(__file__).parent / "data" / "dry_run_traces.json"

# (model, layout, world, tensors): DDP reads tensor data, so its layouts trace real (small)
# tensors, as does the pipeline (on fake tensors its stages failed to build when this was written)
CASES = [
    ("gpt", "dp2 zero3", 2, "fake"),
    ("gpt", "dp2 tp2", 4, "fake"),  # tp with the gradient averager's all-reduce over dp (one bucket)
    ("gpt", "tp2", 2, "fake"),
    ("gpt", "tp2 sp", 2, "fake"),  # the norms' partial gradients reduced by Adam
    ("gpt", "dp4 zero2", 4, "fake"),
    ("gpt", "dp2 tp2 sp zero2 bf16 ac-selective", 4, "fake"),  # ... by FSDP, in bf16; recompute
    ("gpt", "dp2 cp2 zero3", 4, "fake"),  # ring hops; FSDP over the flattened dp·cp group
    ("gqa-gpt", "cp2 ulysses tp2 sp", 4, "fake"),  # all-to-alls, kv heads repeated (1 per tp rank)
    ("gpt", "dp2 pp2 mb2", 4, "real"),  # stage boundaries, the loss broadcast, the stage's gradients
    ("wide-gpt", "dp2 zero1", 2, "real"),  # DDP's two buckets, its rebuild, ZeRO-1's broadcasts
    ("llama", "dp2 zero3", 2, "fake"),
    ("llama", "dp2 tp2", 4, "fake"),
    ("llama", "tp2 bf16 ac-full", 2, "fake"),  # autocast: bf16 forward all-reduces, fp32 backward
    ("llama", "dp4 zero2", 4, "fake"),  # padding: vocabulary 66 -> 68, FFN 50 -> 52 rows
    ("llama", "dp2", 2, "real"),  # DDP broadcasts the rotary buffers
]


def planned(model, layout: str, batch: tuple[int, int]) -> dict:
    return collective_bytes(model, layout, global_batch=batch[0], seq_len=batch[1])


def traced_rows(collectives) -> dict:
    return {(row.dim, row.op): (row.calls, row.bytes) for row in collectives}


@pytest.mark.parametrize("name,layout,world,tensors", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_planner_moves_the_bytes_the_traced_step_moves(name: str, layout: str, world: int, tensors: str) -> None:
    start = time.perf_counter()
    report = dry_run(MODELS[name], layout, world, batch=BATCH, tensors=tensors)
    print(f"{name} {layout} at world {world}: traced in {time.perf_counter() - start:.1f} s\n{report}")
    traced = traced_rows(report.collectives)
    assert planned(MODELS[name], layout, BATCH) == traced
    comparison = compare(report, MODELS[name])  # what verify shows: the same bytes, call for call
    assert comparison.collectives_equal is True and "equal the trace's on all" in str(comparison)
    if name == "wide-gpt":  # the case is there for DDP's buckets: its gradients need two
        assert traced[("dp", "c10d.allreduce_")][0] == 2 + 1  # + the loss


def recorded_config(model: dict):
    sizes = {key: value for key, value in model.items() if key != "model_type"}
    return GPTConfig(**sizes) if model["model_type"] == "gpt" else LlamaConfig(**sizes)


def test_planner_agrees_with_the_recorded_traces_at_scale() -> None:
    """Llama-3 8B at worlds 8 and 64, 70B at 64 and 512 (dp, zero3, tp, bf16 rows): every recorded
    row the planner models, exactly; rows of families it does not model (it refuses them) are
    listed."""
    compared, unmodelled = [], []
    for row in json.loads(TRACES.read_text()):
        if row.get("rank", 0) != 0:  # the planner counts global rank 0's step
            continue
        model = recorded_config(row["model"])
        try:
            plan = planned(model, row["layout"], tuple(row["batch"]))
        except ValueError:
            unmodelled.append(row["name"])
            continue
        want = {(c["dim"], c["op"]): (c["calls"], c["bytes"]) for c in row["collectives"]}
        assert plan == want, row["name"]
        compared.append(row["name"])
    print("compared:", compared, "\nnot modelled:", unmodelled)
    assert "llama3-8b w64 dp8 tp8 zero3" in compared


def test_it_refuses_what_it_does_not_model_naming_it() -> None:
    with pytest.raises(ValueError, match="pipeline parallel beyond.*trace such a layout with dry_run"):
        planned(TINY_GPT, "pp2 interleaved v2", BATCH)
    with pytest.raises(ValueError, match="global_batch=7"):
        planned(TINY_GPT, "dp2", (7, 16))
