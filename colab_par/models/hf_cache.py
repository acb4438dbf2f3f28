"""The KV cache of a Hugging Face decoder during generation: the model's own `DynamicCache`, and
for a pipeline stage one that answers size questions with the stage's own layers.

A stage holds only some layers, so only their cache entries fill; the model's forward still sizes
its masks and positions by the first (full-attention) layer (``get_mask_sizes(q, 0)``,
``get_seq_length()``), which may belong to another stage. `StageCache` sends those questions to
the stage's first layer of the same kind. Imported only for transformers models.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from transformers import DynamicCache

__all__ = ["decoder_cache", "StageCache"]


def decoder_cache(model: nn.Module, layers: range | None = None) -> DynamicCache:
    """A fresh cache for `model`, or for a pipeline stage of it holding `layers`."""
    if layers is None:
        return DynamicCache(config=model.config)
    return StageCache(model.config, layers)


class StageCache(DynamicCache):
    """A pipeline stage's `DynamicCache` (see the module docstring)."""

    def __init__(self, config: Any, layers: range):
        super().__init__(config=config)
        self.held = layers

    def _answering(self, layer_idx: int) -> int:
        if layer_idx in self.held or layer_idx >= len(self.layers):
            return layer_idx
        sliding = getattr(self.layers[layer_idx], "is_sliding", False)
        same = [i for i in self.held if getattr(self.layers[i], "is_sliding", False) == sliding]
        return same[0] if same else self.held.start

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._answering(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._answering(layer_idx))
