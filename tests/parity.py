"""Shared helpers for parity tests: one engine-side training run and its single-process reference.

The reference trains the same initial model on the same global batches with the same optimizer,
with no parallel wrapper at all, so a layout passes only if its distributed arithmetic reproduces
plain training. Engines build their model from a rank-dependent seed on purpose: parity then also
proves that `parallelize` starts every rank from rank 0's parameters.
"""
from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

import cloudpickle
import torch

# Engines cannot import this test module by name: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 20
BATCH = 4
SEED = 1234
LR = 1e-3
GPT_SIZES = dict(vocab_size=64, seq_len=16, n_layer=4, n_head=4, n_kv_head=2, d_model=32,
                 kernels="torch")
LLAMA_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)


def batches(vocab_size: int, seq_len: int, steps: int = STEPS, batch: int = BATCH) -> list[tuple]:
    """Fixed (inputs, targets) global batches: a learnable next-token pattern plus noise."""
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab_size, (batch, 1), generator=gen)
        seq = (start + 3 * torch.arange(seq_len + 1)) % vocab_size
        noise = torch.rand(seq.shape, generator=gen) < 0.2
        seq = torch.where(noise, torch.randint(0, vocab_size, seq.shape, generator=gen), seq)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def build_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        from colab_par.models import GPT, GPTConfig
        return GPT(GPTConfig(**GPT_SIZES))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(**LLAMA_SIZES, attn_implementation="sdpa")
        return LlamaForCausalLM(config)
    raise ValueError(kind)


def _vocab_seq(kind: str) -> tuple[int, int]:
    if kind == "gpt":
        return GPT_SIZES["vocab_size"], GPT_SIZES["seq_len"]
    return LLAMA_SIZES["vocab_size"], LLAMA_SIZES["max_position_embeddings"]


def engine_run(layout: str, kind: str = "gpt", steps: int = STEPS) -> dict[str, Any]:
    """Runs on every engine: parallelize, train `steps` steps, return losses and the full state."""
    import torch.distributed as dist

    from colab_par import parallelize

    model = build_model(kind, SEED + dist.get_rank())  # only rank 0's init must survive
    pm = parallelize(model, layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR))
    losses = [pm.train_step(x, y) for x, y in batches(*_vocab_seq(kind), steps)]
    return {"losses": losses, "state": pm.full_state_dict()}


@lru_cache(maxsize=None)
def reference_run(kind: str = "gpt", steps: int = STEPS) -> dict[str, Any]:
    """Single-process training of the same model and data, computed once per model kind."""
    import torch.nn.functional as F

    model = build_model(kind, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in batches(*_vocab_seq(kind), steps):
        if kind == "gpt":
            loss = model.loss_fn(model(x), y)
        else:
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_parity(results: list[dict[str, Any]], reference: dict[str, Any], rtol: float = 1e-5,
                  atol: float = 1e-5) -> None:
    """Every rank reports the same losses; they and rank 0's final parameters match the reference.

    Losses must agree to `rtol` relative. Parameters to `rtol` relative or `atol` absolute: Adam
    divides by sqrt(v), so an element whose gradient is nearly zero turns summation-order noise
    into an update of up to lr; 1e-5 absolute (parameters are ~2e-2) still catches any real error.
    """
    losses = [r["losses"] for r in results]
    assert all(l == losses[0] for l in losses), f"ranks disagree on the loss: {losses}"
    torch.testing.assert_close(torch.tensor(losses[0], dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64),
                               rtol=rtol, atol=0.0)
    state = results[0]["state"]
    assert set(state) == set(reference["state"]), (
        f"keys differ: {sorted(set(state) ^ set(reference['state']))}")
    for key, expected in reference["state"].items():
        torch.testing.assert_close(state[key].float(), expected.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert all(r["state"] == {} for r in results[1:]), "full_state_dict must be {} off rank 0"
