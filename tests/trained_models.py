"""Tiny language models trained in the test process, for generation and evaluation parity tests.

A model with random weights gives near-uniform logits (greedy ties, every token's loss near ln V,
so a wrong weighting hides); trained for 60 steps on a learnable pattern (each token is the one
before plus 3, mod the vocabulary, with 10 % noise) its continuations are confident and its
per-token losses spread. The same weights then go to the engines.
"""
from __future__ import annotations

import sys
from functools import lru_cache

import cloudpickle
import torch
import torch.nn.functional as F

import any_models

cloudpickle.register_pickle_by_value(sys.modules[__name__])

VOCAB, SEQ = any_models.LM_VOCAB, any_models.LM_SEQ  # 67 tokens (tp splits it unevenly), 16 positions
GPT_SIZES = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=4, n_head=4, n_kv_head=2, d_model=32, kernels="torch")


def pattern(starts: list[int], length: int) -> torch.Tensor:
    """Rows counting by 3 from each start, mod the vocabulary."""
    return (torch.tensor(starts)[:, None] + 3 * torch.arange(length)) % VOCAB


def noisy_pattern(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    seq = pattern(torch.randint(0, VOCAB, (rows,), generator=generator).tolist(), length)
    noise = torch.randint(0, VOCAB, seq.shape, generator=generator)
    return torch.where(torch.rand(seq.shape, generator=generator) < 0.1, noise, seq)


def build(kind: str) -> torch.nn.Module:
    """colab_par's GPT ("gpt"), the notebook's own LM ("tinylm") or a tiny transformers causal LM."""
    if kind == "gpt":
        from colab_par.models import GPT, GPTConfig
        return GPT(GPTConfig(**GPT_SIZES))
    if kind == "tinylm":
        return any_models.TinyLM(vocab_size=VOCAB, seq_len=SEQ)
    return any_models.causal_lm(kind)


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """One process, no cache: (batch, seq, vocab) logits of whole sequences."""
    import transformers

    if isinstance(model, transformers.PreTrainedModel):
        return model(input_ids=tokens, use_cache=False).logits
    return model(tokens)


@lru_cache(maxsize=None)
def trained_state(kind: str) -> dict[str, torch.Tensor]:
    """`kind` trained for 60 AdamW steps on the noisy pattern (see the module docstring)."""
    torch.manual_seed(0)
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(60):
        seq = noisy_pattern(8, SEQ + 1, generator)
        F.cross_entropy(logits_of(model, seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trained(kind: str) -> torch.nn.Module:
    """A fresh `kind` holding the trained weights (whatever the generator stood at)."""
    model = build(kind)
    model.load_state_dict(trained_state(kind))
    return model
