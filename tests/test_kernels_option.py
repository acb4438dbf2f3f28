"""parallelize's `kernels=` is honoured or refused before any work: "triton" on a model the kit's
kernels cannot reach fails as apply_kernels does (naming the families and kernels='torch'), what a
model is being read from its config and transformers' classes, never its class name; the kit's GPT
follows its own GPTConfig.kernels, so another explicit mode is refused. A one-rank gloo world."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colab_par import parallelize
from colab_par.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

GPT_SIZES = dict(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16)
REFUSED = (r"has nothing colab_par's kernels can patch: apply_kernels knows the Hugging Face families "
           r"\['llama', 'mistral', 'phi3', 'qwen2', 'qwen3'\]; use kernels='torch'")


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)


class LlamaForCausalLM(torch.nn.Module):
    """Named like transformers' Llama and carrying a Llama config, but not a transformers model."""

    def __init__(self):
        super().__init__()
        self.config = tiny_llama_config()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Renamed(transformers.LlamaForCausalLM):
    """A transformers Llama under another class name."""


def test_triton_kernels_on_a_model_they_cannot_reach_are_refused():
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    for model in (torch.nn.Sequential(torch.nn.Linear(4, 4)), bert, LlamaForCausalLM()):
        with pytest.raises(ValueError, match=REFUSED):
            parallelize(model, "dp1", kernels="triton")
    pm = parallelize(Renamed(tiny_llama_config()), "dp1", kernels="triton")  # a Llama by what it is
    patched = pm.model._colab_par_kernels[1]
    assert {entry.split(": ")[1] for entry in patched} == {"rms_norm", "swiglu", "apply_rope"}


def test_the_gpt_follows_its_config_and_refuses_another_explicit_mode():
    with pytest.raises(ValueError, match=r"kernels='triton' but this GPT was built with GPTConfig\(kernels="
                                         r"'torch'\).*GPTConfig\(kernels='triton'\), or leave parallelize's"):
        parallelize(GPT(GPTConfig(**GPT_SIZES, kernels="torch")), "dp1", kernels="triton")
    with pytest.raises(ValueError, match=r"kernels='torch' but this GPT was built with GPTConfig\(kernels='auto'"):
        parallelize(GPT(GPTConfig(**GPT_SIZES)), "dp1", kernels="torch")
    assert parallelize(GPT(GPTConfig(**GPT_SIZES, kernels="triton")), "dp1", kernels="triton").layout.dp == 1
