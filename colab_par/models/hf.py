"""Hugging Face models as they are (no patches): what a model is, from what it is, and its logits.

Nothing here reads a class name. A model is a transformers model if it is a `PreTrainedModel`; what
it learns is its own loss (`model.loss_function`, the function its forward scores labels with):
a causal LM's loss shifts the labels (position t predicts label t+1), a masked LM's does not. A
decoder is a causal LM that can start from hidden states (``inputs_embeds``), so pipeline stages
can be cut between its repeated blocks whatever its modules are called (``model.layers``,
``transformer.h``, ...). transformers stays optional: it is only looked at once it is imported,
as any of its models has imported it.
"""
from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch
from torch import nn

from colab_par import compat

__all__ = ["is_hf_model", "hf_token_loss", "shifts_labels", "is_hf_decoder", "causal_lm_logits",
           "decode_keywords"]


def is_hf_model(model: nn.Module) -> bool:
    """A transformers `PreTrainedModel` (a model of it has imported transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def hf_token_loss(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The model's own per-token loss, ``loss(logits, labels, vocab_size, num_items_in_batch)``, when
    it is one of transformers' language-model losses (causal or masked); None otherwise."""
    if not is_hf_model(model):
        return None
    loss = model.loss_function
    return loss if loss in compat.hf_token_losses().values() else None


def shifts_labels(model: nn.Module) -> bool:
    """Whether the model's own loss scores position t against label t+1 (a causal LM's loss; an
    encoder-decoder feeds its decoder shifted inputs instead and scores every label)."""
    loss = hf_token_loss(model)  # None without importing transformers for a model not of it
    return (loss is not None and loss is compat.hf_token_losses()["causal"]
            and not getattr(model.config, "is_encoder_decoder", False))


def is_hf_decoder(model: nn.Module) -> bool:
    """A transformers causal LM whose forward can start from hidden states (``inputs_embeds``)."""
    return shifts_labels(model) and "inputs_embeds" in inspect.signature(model.forward).parameters


def causal_lm_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) token ids and (seq,) positions -> (batch, seq, vocab) logits, no KV cache."""
    out = model(input_ids=tokens, position_ids=positions.expand(tokens.shape[0], -1), use_cache=False)
    return out.logits


def decode_keywords(model: nn.Module, attention_mask: torch.Tensor | None, positions: torch.Tensor,
                    cache: object) -> dict[str, object]:
    """What a causal LM's own forward takes for one generation step: its KV cache (by the name its
    forward gives it: ``cache``, or ``past_key_values`` in earlier transformers; None: no cache),
    positions, the 2D padding mask (None: no padding) and, where it can, only the last position's
    logits, as transformers' own `generate` asks."""
    accepted = inspect.signature(type(model).forward).parameters
    keywords: dict[str, object] = {"position_ids": positions, "use_cache": cache is not None}
    if cache is not None:
        keywords["cache" if "cache" in accepted else "past_key_values"] = cache
    if attention_mask is not None:
        keywords["attention_mask"] = attention_mask
    if "logits_to_keep" in accepted:
        keywords["logits_to_keep"] = 1
    return keywords
