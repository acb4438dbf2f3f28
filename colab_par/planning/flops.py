"""What a training step of a decoder computes: its sizes (`ModelSpec`) and the FLOPs per token.

Below the planner (step-time estimates) and telemetry (MFU on the engines), which both count with
these formulas, so that the two agree and neither imports the other. Pure arithmetic: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from colab_par.layout import PACKED_ATTENTION, Layout, has_expert_plan, model_sizes

__all__ = ["ModelSpec", "flops_per_token", "recompute_work", "trainable_share", "PACKED_ATTENTION"]

"""Hugging Face families (by ``model_type``) whose attention projects q, k and v in one weight,
side by side, that the kit's tensor plan splits by columns and regroups over tp every forward
(`parallel.hf_plans.Conv1DColwise`): how many blocks it packs."""


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of a Llama-style decoder (the reference GPT, or a Hugging Face config).

    With `n_experts`, every feed-forward is a mixture of that many SwiGLU experts of width
    `expert_hidden` (default `ffn_hidden`) behind a bias-free router, `top_k` of them per token
    (the kit's MoE GPT, Mixtral, OLMoE; shared experts and dense-first layers are not modelled)."""

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
    n_experts: int = 0  # 0: dense feed-forward
    top_k: int = 0
    expert_hidden: int = 0
    packed_gate_up: bool = False  # experts' gate|up stored side by side (transformers' packed_colwise)
    expert_plan: bool = False  # a Hugging Face family whose experts ep can split (`layout.has_expert_plan`)
    packed_attention: int = 0  # blocks of d_model in a packed q|k|v projection (`PACKED_ATTENTION`), else 0
    # frozen copies of the trainable parameters held beside them, sharded as they are (GRPO's
    # reference policy with full weights: 1; with LoRA the base without adapters needs none)
    frozen_copies: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.frozen_copies, int) or isinstance(self.frozen_copies, bool) or self.frozen_copies < 0:
            raise ValueError(f"frozen_copies={self.frozen_copies!r} must be a whole number >= 0 (1 for GRPO's "
                             "reference policy with full weights)")
        if not self.n_kv_head:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if not self.ffn_hidden:  # the reference GPT's SwiGLU width
            object.__setattr__(self, "ffn_hidden", 4 * self.d_model * 2 // 3 // 8 * 8 or 8)
        if self.n_experts and not self.expert_hidden:
            object.__setattr__(self, "expert_hidden", self.ffn_hidden)
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} experts per token of n_experts={self.n_experts}: "
                             f"choose 1 <= top_k <= {self.n_experts}")

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
                   hugging_face=bool(getattr(model, "model_type", None)), trainable=share,
                   n_experts=sizes.get("n_experts", 0),
                   top_k=sizes.get("top_k", 0) if sizes.get("n_experts") else 0,
                   expert_hidden=sizes.get("expert_hidden", 0) if sizes.get("n_experts") else 0,
                   packed_gate_up=bool(sizes.get("n_experts")) and _packs_gate_up(model),
                   expert_plan=has_expert_plan(model), packed_attention=PACKED_ATTENTION.get(get("model_type"), 0))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def attention_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        return 2 * d * self.n_head * hd + 2 * d * self.n_kv_head * hd

    @property
    def layer_expert_params(self) -> int:
        """One layer's experts (0 for a dense model): what expert parallel splits."""
        return self.n_experts * 3 * self.d_model * self.expert_hidden

    @property
    def expert_params(self) -> int:
        return self.n_layer * self.layer_expert_params

    def _feed_forward_params(self, experts: int) -> int:
        if not self.n_experts:
            return 3 * self.d_model * self.ffn_hidden
        return experts * 3 * self.d_model * self.expert_hidden + self.d_model * self.n_experts  # + router

    @property
    def layer_matrix_params(self) -> int:
        """One layer's matrices as held: every expert of a MoE layer."""
        return self.attention_params + self._feed_forward_params(self.n_experts)

    @property
    def n_params(self) -> int:
        embeddings = self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)
        return embeddings + self.n_layer * (self.layer_matrix_params + 2 * self.d_model) + self.d_model

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single parameter, whole (embedding/head, or a layer matrix)."""
        d, hd = self.d_model, self.head_dim
        experts = self.n_experts * d * self.expert_hidden  # stacked per layer: (experts, in, out)
        return max(self.vocab_size * d, d * self.ffn_hidden, d * self.n_head * hd, d * self.n_kv_head * hd,
                   experts)

    @property
    def matmul_params(self) -> int:
        """Parameters a token's matmuls use (all but the embedding lookup and the norms; of a MoE
        layer the router and the top_k experts the token runs)."""
        layer = self.attention_params + self._feed_forward_params(self.top_k)
        return self.n_layer * layer + self.vocab_size * self.d_model

    def config(self, seq_len: int) -> dict[str, int]:
        sizes = {"n_layer": self.n_layer, "n_head": self.n_head, "n_kv_head": self.n_kv_head,
                 "ffn_hidden": self.ffn_hidden, "seq_len": seq_len}
        if self.n_experts:
            sizes.update(n_experts=self.n_experts, top_k=self.top_k)
        if self.expert_plan:
            sizes["expert_plan"] = 1
        return {**sizes, "hugging_face": 1} if self.hugging_face else sizes


def _packs_gate_up(config: Any) -> bool:
    """Whether a Hugging Face config's own tensor plan packs its experts' gate and up projections
    (a ``packed_colwise`` entry on an experts weight)."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return any(style == "packed_colwise" and "experts" in key for key, style in plan.items())


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


def recompute_work(layout: Layout) -> str:
    """What a step recomputes: its `checkpointing` ("none", "selective", "full"), except selective
    on a tensor grid, "matmuls": the grid's matmuls run inside `_GridLinear`, an autograd Function
    the selective policy rebuilds rather than caches (`parallel/checkpointing.py`), so backward
    rebuilds each layer but SDPA, whose outputs are kept."""
    if layout.checkpointing == "selective" and layout.tp_mode != "1d":
        return "matmuls"
    return layout.checkpointing


def flops_per_token(spec: ModelSpec, seq_len: int, recompute: str) -> float:
    """6Ψ (forward, input and weight gradients: 2Ψ each; frozen weights skip theirs) + 12·L·h·s
    attention; recompute (`recompute_work`) repeats (part of) forward."""
    dense = (4 + 2 * spec.trainable) * spec.matmul_params
    attention = 12 * spec.n_layer * spec.d_model * seq_len
    if recompute == "full":
        return (dense + attention) * 4 / 3
    if recompute == "matmuls":
        return dense * 4 / 3 + attention
    if recompute == "selective":
        return dense + attention * 4 / 3
    return dense + attention
