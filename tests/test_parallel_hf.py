"""Hugging Face LlamaForCausalLM (tiny config, no weights) through parallelize, unpatched.

TP comes from the model's own `_tp_plan`, FSDP wraps each decoder layer, PP cuts by layers; each
trains like the same model on one process (losses 1e-5 relative, parameters 1e-5).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from parity import SEED, assert_parity, build_model, engine_run, reference_run  # noqa: E402


def _tp_is_real() -> bool:
    """Engine side: the plan really shards the projections (the parity alone could pass unsharded)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize

    pm = parallelize(build_model("llama", SEED + dist.get_rank()), "tp2")
    q_proj = pm.model.model.layers[0].self_attn.q_proj.weight
    embed = pm.model.model.embed_tokens.weight
    return (isinstance(q_proj, DTensor) and q_proj.to_local().shape[0] * 2 == q_proj.shape[0]
            and isinstance(embed, DTensor) and isinstance(pm.model.lm_head.weight, DTensor))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2 zero3", "tp2", "pp2 1f1b mb2"])
def test_llama_trains_like_single_process(cluster2, layout: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, "llama"), reference_run("llama"))


def test_llama_tensor_parallel_uses_the_model_plan(cluster2) -> None:
    assert cluster2.run(_tp_is_real) == [True, True]
