"""Hugging Face decoder families (tiny configs, no weights) through parallelize.

Every family that ships a tensor-parallel plan trains under its own plan (Qwen3's per-head norms
are `replicated_with_grad_allreduce`, Phi-3's fused projections `colwise_gather_output` +
`rowwise_split_input`), under ZeRO-3 with each decoder layer an FSDP unit, and cut into pipeline
stages by layers; each like the same model on one process (losses 1e-5 relative, parameters within
Adam's float32 tolerance).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from parity import (HF_DECODERS, LR, SEED, _vocab_seq, assert_parity, batches, build_model,  # noqa: E402
                    engine_run, reference_run)

FAMILIES = sorted(HF_DECODERS)


def _sharded_shapes(kind: str) -> dict[str, tuple]:
    """Engine side: local shapes of the tensor-parallel parameters (parity alone could pass unsharded)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize

    pm = parallelize(build_model(kind, SEED + dist.get_rank()), "tp2")
    return {name: (tuple(p.to_local().shape), tuple(p.shape)) if isinstance(p, DTensor) else None
            for name, p in pm.model.named_parameters() if ".layers.0." in name or "layers" not in name}


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


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp2 zero3", "pp2 1f1b mb2"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_family_trains_like_single_process(cluster2, kind: str, layout: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, kind), reference_run(kind))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2 tp2 1f1b mb2", "dp2 tp2 zero3"])
@pytest.mark.parametrize("kind", ["qwen3", "phi3"])
def test_tensor_parallel_composes_with_stages_and_fsdp(cluster4, kind: str, layout: str) -> None:
    """The plan applies to each pipeline stage (patterns of other stages skipped) and under FSDP
    (Qwen3's norm-gradient sum lives in the autograd graph, so FSDP's parameters keep it)."""
    assert_parity(cluster4.run(engine_run, layout, kind), reference_run(kind))


def _fused_loss_run(layout: str) -> dict:
    """Engine side: llama with kernels="triton" (the torch references of the kernels on CPU
    engines); counts how often lm_head runs, i.e. how often full logits are built."""
    import torch.distributed as dist

    from colab_par import parallelize

    model = build_model("llama", SEED + dist.get_rank())
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    pm = parallelize(model, layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR), kernels="triton")
    losses = []
    for x, y in batches(*_vocab_seq("llama"), 5):
        losses.append(pm.forward_backward(x, y))
        pm.optimizer_step()
    return {"losses": losses, "lm_head_calls": len(calls)}


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3"])
def test_kernels_reach_llama_and_its_loss_never_builds_logits(cluster2, layout: str) -> None:
    """With kernels="triton" the decoder's norms, SwiGLU and RoPE are the kit's, and the loss is
    the fused linear cross-entropy through DDP / FSDP: lm_head never runs, losses match."""
    for result in cluster2.run(_fused_loss_run, layout):
        assert result["lm_head_calls"] == 0
        torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                                   torch.tensor(reference_run("llama")["losses"][:5], dtype=torch.float64),
                                   rtol=1e-5, atol=0.0)
