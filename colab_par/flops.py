"""What a training step of a decoder computes: its sizes (`ModelSpec`) and the FLOPs per token.

Below the planner (step-time estimates) and telemetry (MFU on the engines), which both count with
these formulas, so that the two agree and neither imports the other. Pure arithmetic: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from colab_par.layout import model_sizes

__all__ = ["ModelSpec", "flops_per_token", "trainable_share"]


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of a Llama-style decoder (the reference GPT, or a Hugging Face config)."""

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    n_kv_head: int = 0
    ffn_hidden: int = 0
    seq_len: int = 0
    tied_embeddings: bool = False
    hugging_face: bool = False  # no context parallel / sequence parallel plan for those
    trainable: float = 1.0  # share of the parameters that train (a PEFT model's adapters); the rest are frozen

    def __post_init__(self) -> None:
        if not self.n_kv_head:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if not self.ffn_hidden:  # the reference GPT's SwiGLU width
            object.__setattr__(self, "ffn_hidden", 4 * self.d_model * 2 // 3 // 8 * 8 or 8)

    @classmethod
    def of(cls, model: Any) -> "ModelSpec":
        """From a ModelSpec, GPTConfig, GPT module, Hugging Face config/model (a PEFT model too: its
        trainable share is read off its parameters) or a mapping."""
        if isinstance(model, ModelSpec):
            return model
        share = trainable_share(model)
        if not isinstance(model, Mapping) and hasattr(model, "config") and not hasattr(model, "d_model"):
            model = model.config
        sizes = model_sizes(model)
        missing = [k for k in ("n_layer", "d_model", "n_head", "vocab_size") if k not in sizes]
        if missing:
            raise ValueError(f"model sizes {', '.join(missing)} are missing; pass a GPTConfig, a "
                             "Hugging Face config, a dict like {'n_layer': 12, 'd_model': 768, "
                             "'n_head': 12, 'vocab_size': 50257}, or for any other nn.Module "
                             "ModuleSpec.probe(model, example_batch) (the picker takes "
                             "example_batch=... and probes it)")
        get = model.get if isinstance(model, Mapping) else lambda k, d=None: getattr(model, k, d)
        return cls(n_layer=sizes["n_layer"], d_model=sizes["d_model"], n_head=sizes["n_head"],
                   vocab_size=sizes["vocab_size"], n_kv_head=sizes.get("n_kv_head", 0),
                   ffn_hidden=sizes.get("ffn_hidden", 0), seq_len=sizes.get("seq_len", 0),
                   tied_embeddings=bool(get("tie_word_embeddings", False)),
                   hugging_face=bool(getattr(model, "model_type", None)), trainable=share)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def layer_matrix_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        return 2 * d * self.n_head * hd + 2 * d * self.n_kv_head * hd + 3 * d * self.ffn_hidden

    @property
    def n_params(self) -> int:
        embeddings = self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)
        return embeddings + self.n_layer * (self.layer_matrix_params + 2 * self.d_model) + self.d_model

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single parameter, whole (embedding/head, or a layer matrix)."""
        d, hd = self.d_model, self.head_dim
        return max(self.vocab_size * d, d * self.ffn_hidden, d * self.n_head * hd, d * self.n_kv_head * hd)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matmuls (all but the embedding lookup and the norms)."""
        return self.n_layer * self.layer_matrix_params + self.vocab_size * self.d_model

    def config(self, seq_len: int) -> dict[str, int]:
        sizes = {"n_layer": self.n_layer, "n_head": self.n_head, "n_kv_head": self.n_kv_head,
                 "ffn_hidden": self.ffn_hidden, "seq_len": seq_len}
        return {**sizes, "hugging_face": 1} if self.hugging_face else sizes


def trainable_share(model: Any) -> float:
    """The share of a module's parameter elements that require gradients (1.0 for anything that is
    not a module with parameters)."""
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return 1.0
    total = trainable = 0
    for param in parameters():
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return trainable / total if total else 1.0


def flops_per_token(spec: ModelSpec, seq_len: int, recompute: str) -> float:
    """6Ψ (forward, input and weight gradients: 2Ψ each; frozen weights skip theirs) + 12·L·h·s
    attention; recompute repeats (part of) forward."""
    dense = (4 + 2 * spec.trainable) * spec.matmul_params
    attention = 12 * spec.n_layer * spec.d_model * seq_len
    if recompute == "full":
        return (dense + attention) * 4 / 3
    if recompute == "selective":
        return dense + attention * 4 / 3
    return dense + attention
