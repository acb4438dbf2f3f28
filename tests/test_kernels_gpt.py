"""A tiny GPT trained with kernels="triton" (Triton interpreter) matches kernels="torch" step for step.

Runs in a spawned worker that imported triton with TRITON_INTERPRET=1 (see test_kernels.py for why).
"""
from __future__ import annotations

import pytest
import torch

from colab_par.kernels import InterpreterProcess

STEPS = 5


def train_losses(kernels: str) -> list[float]:
    """Five AdamW steps of a tiny GQA GPT on fixed random tokens; returns the losses."""
    from colab_par.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, kernels=kernels)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def compare_triton_and_torch_training() -> None:
    from colab_par.kernels import _dispatch
    before = _dispatch.launches.copy()
    torch_losses = train_losses("torch")
    assert _dispatch.launches == before, "the kernels='torch' run launched Triton"
    triton_losses = train_losses("triton")
    for kernel in ("rms_norm_forward", "rms_norm_backward", "rope_forward", "rope_backward", "swiglu_forward",
                   "swiglu_backward", "cross_entropy"):
        launched = _dispatch.launches[(kernel, "triton-interpreter")] - before[(kernel, "triton-interpreter")]
        assert launched >= STEPS, f"{kernel} did not run in Triton"
    assert torch_losses[-1] < torch_losses[0], "the reference run did not learn; the comparison would be vacuous"
    torch.testing.assert_close(torch.tensor(triton_losses), torch.tensor(torch_losses), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tiny_gpt_triton_kernels_match_torch_over_five_steps():
    with InterpreterProcess(timeout=300) as worker:
        worker.run(compare_triton_and_torch_training)
