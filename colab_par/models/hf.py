"""Hugging Face causal LMs as they are (no patches): how to recognise one and get its logits.

transformers stays optional: nothing here imports it. A ``*ForCausalLM`` returns an output object
and takes keyword inputs; `causal_lm_logits` gives the kit the same ``logits = f(tokens,
positions)`` it uses for the reference GPT.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["is_hf_model", "causal_lm_logits"]


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (duck-typed, so transformers need not be installed)."""
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


def causal_lm_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) token ids and (seq,) positions -> (batch, seq, vocab) logits, no KV cache."""
    out = model(input_ids=tokens, position_ids=positions.expand(tokens.shape[0], -1), use_cache=False)
    return out.logits
