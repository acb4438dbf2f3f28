"""Hugging Face models (tiny configs, no weights) through parallelize, each learning its own objective.

Every decoder family, GPT-2 included (its model is not named *ForCausalLM; its Conv1D layers and
fused q|k|v get the kit's plan), trains on {"input_ids", "labels"} batches with padding labelled
-100 under tensor parallel (its own plan, an odd vocabulary split unevenly), ZeRO-3 and pipeline
stages cut by its layers, against transformers' own loss of the same model in one process (losses
1e-5 relative, parameters within Adam's float32 tolerance). What a model is comes from what it is:
its own loss says whether labels are shifted (GPT-2's are, BERT's are not).
"""
from __future__ import annotations

import dataclasses
import sys

import cloudpickle
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from any_models import CAUSAL_LMS, bert, causal_lm  # noqa: E402
from parity import (HF_DECODERS, LLAMA_SIZES, LR, SEED, _parallelized, _vocab_seq, assert_parity, batches,  # noqa: E402
                    build_model, engine_model, engine_run, reference_run, training_batches)
from test_expert_costs import AllToAllBytes  # noqa: E402

from colab_par.models.hf import is_hf_decoder, is_hf_model, shifts_labels  # noqa: E402
from colab_par.parallel.hf_plans import Conv1DColwise, gpt2_tp_plan  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

FAMILIES = sorted(HF_DECODERS)
LANGUAGE_MODELS = [f"{family}-lm" for family in sorted(CAUSAL_LMS)]


def test_what_a_model_is_comes_from_its_own_loss() -> None:
    gpt2, llama, masked = causal_lm("gpt2"), causal_lm("llama"), bert()
    assert type(gpt2).__name__ == "GPT2LMHeadModel"  # not *ForCausalLM, still a causal LM
    assert shifts_labels(gpt2) and shifts_labels(llama) and not shifts_labels(masked)
    assert is_hf_decoder(gpt2) and is_hf_decoder(llama) and not is_hf_decoder(masked)
    assert not is_hf_model(torch.nn.Linear(2, 2)) and not shifts_labels(torch.nn.Linear(2, 2))


def _sharded_shapes(kind: str) -> dict[str, tuple]:
    """Engine side: local shapes of the tensor-parallel parameters (parity alone could pass unsharded)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize

    pm = parallelize(build_model(kind, SEED + dist.get_rank()), "tp2")
    return {name: (tuple(p.to_local().shape), tuple(p.shape)) if isinstance(p, DTensor) else None
            for name, p in pm.model.named_parameters() if ".layers.0." in name or ".h.0." in name
            or "layers" not in name and ".h." not in name}


@pytest.mark.parametrize("kind", FAMILIES)
def test_tensor_parallel_uses_the_models_own_plan(cluster2, kind: str) -> None:
    for shapes in cluster2.run(_sharded_shapes, kind):
        attention = ("model.layers.0.self_attn.qkv_proj.weight" if kind == "phi3"
                     else "model.layers.0.self_attn.q_proj.weight")
        for name in (attention, "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                     "model.embed_tokens.weight", "lm_head.weight"):
            local, full = shapes[name]
            assert sum(l * 2 == f for l, f in zip(local, full)) == 1, (name, local, full)
        norms = {name: shape for name, shape in shapes.items() if "norm" in name}
        if kind == "qwen3":  # per-head norms: replicated DTensors, their gradient summed over tp
            assert norms["model.layers.0.self_attn.q_norm.weight"] == ((8,), (8,))
        assert all(shape is None for name, shape in norms.items() if "self_attn" not in name)


def test_gpt2_plan_splits_its_conv1d_layers_heads_and_odd_vocabulary(cluster2) -> None:
    """Conv1D weights are (in, out): column-split layers split dim 1, row-split ones dim 0; the
    67-token vocabulary goes 34 + 33 in the embedding and the head tied to it."""
    first, second = cluster2.run(_sharded_shapes, "gpt2-lm")
    expected = {"transformer.h.0.attn.c_attn.weight": ((32, 48), (32, 96)),
                "transformer.h.0.attn.c_attn.bias": ((48,), (96,)),
                "transformer.h.0.attn.c_proj.weight": ((16, 32), (32, 32)),
                "transformer.h.0.mlp.c_fc.weight": ((32, 64), (32, 128)),
                "transformer.h.0.mlp.c_proj.weight": ((64, 32), (128, 32)),
                "transformer.wte.weight": ((34, 32), (67, 32))}
    for name, shape in expected.items():
        assert first[name] == shape, name
    assert second["transformer.wte.weight"] == ((33, 32), (67, 32))
    assert "lm_head.weight" not in first  # tied: one parameter, listed once
    assert first["transformer.wpe.weight"] is None and first["transformer.h.0.ln_1.weight"] is None


def test_gpt2_fused_qkv_split_as_plain_columns_is_caught(cluster2) -> None:
    """Negative control: split c_attn's q|k|v columns plainly (rank 0 would get all of q) and the
    parity check fails."""
    plain = {**gpt2_tp_plan(causal_lm("gpt2")), "transformer.h.*.attn.c_attn": Conv1DColwise()}
    results = cluster2.run(engine_run, "tp2", "gpt2-lm", steps=3, tp_plan=plain)
    with pytest.raises(AssertionError):
        assert_parity(results, reference_run("gpt2-lm", steps=3))


def _all_to_all_bytes(layout: str) -> int:
    """Engine side: a GPT-2 step under `layout` after a warm-up one: the bytes its all-to-alls send."""
    pm = _parallelized(engine_model("gpt2-lm", "module"), layout)
    warm, counted = training_batches("gpt2-lm", 2)
    pm.train_step(warm)
    with AllToAllBytes() as bytes_:
        pm.train_step(counted)
    return bytes_.sent


@pytest.mark.parametrize("layout, forwards", [("tp2", 1), ("tp2 ac-full", 2)])
def test_the_planner_counts_the_regroup_of_gpt2s_packed_qkv(cluster2, layout: str, forwards: int) -> None:
    """GPT-2's q|k|v weight and bias are regrouped over tp by an all-to-all each forward (twice with
    full recompute) and their gradients once: exactly the bytes the planner now counts."""
    from colab_par.planning.planner import ModelSpec, estimate, packed_attention_bytes

    spec = ModelSpec.of(causal_lm("gpt2").config)
    assert spec.packed_attention == 3 and ModelSpec.of(causal_lm("llama").config).packed_attention == 0
    predicted = packed_attention_bytes(spec, 2, 4, spec.n_layer, forwards)
    assert predicted > 0
    assert cluster2.run(_all_to_all_bytes, layout) == [predicted, predicted]
    unpacked = dataclasses.replace(spec, packed_attention=0)
    options = dict(device="cpu", global_batch=4, seq_len=16)
    assert estimate(spec, layout, **options).times["tp"] > estimate(unpacked, layout, **options).times["tp"]


def test_clipping_scales_a_head_tied_across_pipeline_stages_on_both(cluster2) -> None:
    """GPT-2's head is tied to its embeddings, so under pp each stage steps its own synchronised
    copy: clipping (1.0, below every step's norm of 1.7-2.8) must scale both copies, or the stages'
    weights part and the run leaves the clipped one-process run."""
    assert_parity(cluster2.run(engine_run, "pp2 1f1b mb2", "gpt2-lm", steps=3, max_norm=1.0),
                  reference_run("gpt2-lm", steps=3, max_norm=1.0))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp2 zero3", "pp2 1f1b mb2"])
@pytest.mark.parametrize("kind", LANGUAGE_MODELS)
def test_family_learns_its_own_objective_like_single_process(cluster2, kind: str, layout: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, kind), reference_run(kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout", [("qwen3-lm", "pp2 tp2 1f1b mb2"), ("phi3-lm", "pp2 tp2 1f1b mb2"),
                                         ("qwen3-lm", "dp2 tp2 zero3"), ("phi3-lm", "dp2 tp2 zero3"),
                                         ("gpt2-lm", "dp2 tp2")])
def test_tensor_parallel_composes_with_stages_and_data_parallel(cluster4, kind: str, layout: str) -> None:
    """The plan applies to each pipeline stage (patterns of other stages skipped) and under FSDP
    (Qwen3's norm-gradient sum lives in the autograd graph, so FSDP's parameters keep it);
    GPT-2's Conv1D pieces are averaged over data-parallel ranks."""
    assert_parity(cluster4.run(engine_run, layout, kind), reference_run(kind))


def _fused_loss_run(layout: str) -> dict:
    """Engine side: llama with kernels="triton" (the torch references of the kernels on CPU
    engines); counts how often lm_head runs, i.e. how often full logits are built."""
    import torch.distributed as dist

    from colab_par import parallelize

    from colab_par.kernels import _dispatch

    model = build_model("llama", SEED + dist.get_rank())
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    pm = parallelize(model, layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR), kernels="triton")
    losses, before = [], _dispatch.launches.copy()
    for x, y in batches(*_vocab_seq("llama"), 5):
        losses.append(pm.forward_backward(x, y))
        pm.optimizer_step()
    launched = {name: count for (name, _), count in (_dispatch.launches - before).items()}
    return {"losses": losses, "lm_head_calls": len(calls), "launches": launched}


def halved_logits_llama() -> torch.nn.Module:
    """A Llama whose own forward halves its logits (a temperature baked into a subclass): the
    fused loss, which scores lm_head(hidden), would not be its loss."""
    import transformers

    class HalvedLogits(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits / 2
            return out

    base = build_model("llama", SEED)
    model = HalvedLogits(base.config)
    model.load_state_dict(base.state_dict())
    return model


def _own_forward_run() -> dict:
    from colab_par import parallelize

    pm = parallelize(halved_logits_llama(), "dp2", optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR),
                     kernels="triton")
    return {"fused": pm._fused_loss, "losses": [pm.train_step(x, y) for x, y in batches(*_vocab_seq("llama"), 2)]}


def test_a_model_with_its_own_forward_keeps_its_own_loss(cluster2) -> None:
    """kernels="triton" fuses the loss only where it is the model's own (`fused_loss_mismatch`)."""
    from colab_par.models.hf_kernels import fuse_loss_into_forward

    model = halved_logits_llama()
    with pytest.raises(ValueError, match="HalvedLogits runs its own forward, not LlamaForCausalLM's"):
        fuse_loss_into_forward(model)
    expected = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in batches(*_vocab_seq("llama"), 2):
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    for result in cluster2.run(_own_forward_run):
        assert result["fused"] is False
        assert result["losses"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3"])
def test_kernels_reach_llama_and_its_loss_never_builds_logits(cluster2, layout: str) -> None:
    """With kernels="triton" the decoder's norms, SwiGLU and RoPE are the kit's, and the loss is
    the fused linear cross-entropy through DDP / FSDP: lm_head never runs, losses match."""
    layers, steps = LLAMA_SIZES["num_hidden_layers"], 5
    per_step = {"rms_norm": 2 * layers + 1, "swiglu": layers, "rope": layers}  # calls of each kernel a step
    for result in cluster2.run(_fused_loss_run, layout):
        assert result["lm_head_calls"] == 0
        for kernel, modules in per_step.items():  # the torch path counts forward calls only
            assert result["launches"].get(f"{kernel}_forward") == modules * steps, (kernel, result["launches"])
        torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                                   torch.tensor(reference_run("llama")["losses"][:5], dtype=torch.float64),
                                   rtol=1e-5, atol=0.0)
