"""The reference decoder: a nanoGPT-sized Llama-style GPT (RMSNorm, RoPE, SwiGLU, optional GQA).

Written so every parallelism can reach into it without patches:
- heads are inferred from tensor shapes (``view(b, s, -1, head_dim)``), so tensor parallel can
  shard the projections and the module still works on its local heads;
- ``Attention.attention`` is a plain attribute holding the core attention function, which context
  parallel swaps for ring or Ulysses attention;
- ``forward(tokens, positions)`` takes explicit positions, so a rank holding sequence chunks of a
  load-balanced context-parallel split still applies the right rotary angles;
- ``layers`` is a ModuleDict keyed by layer index and the embedding / head may be ``None``, so a
  pipeline stage is the same class with the other stages' modules deleted;
- ``forward(..., cache=KVCache(...))`` is generation's path: keys and values of past tokens are kept,
  so a new token costs one position's forward, and left padding is masked out;
- ``n_experts > 0`` makes every feed-forward a mixture of ``n_experts`` SwiGLU experts of width
  ``ffn_hidden``, ``top_k`` of them per token (`moe.py`); ``aux_loss_coef`` adds their
  load-balancing loss to `loss_fn`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from colab_par.models.moe import MoE

__all__ = ["GPTConfig", "GPT", "KVCache", "causal_attention", "rope_cos_sin"]


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    kernels: str = "auto"  # "torch" | "triton" | "auto" (triton on CUDA, torch elsewhere)
    n_experts: int = 0  # 0: dense feed-forward; else a mixture of experts (moe.py)
    top_k: int = 2
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.0
    dropout: float = 0.0  # on the embeddings and each residual branch, as GPT-2's resid/embd dropout

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.d_model * 2 // 3 // 8 * 8 or 8
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                             f"try d_model={self.n_head * max(1, self.d_model // self.n_head)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}; "
                             "use n_kv_head dividing n_head (e.g. 1 or n_head)")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("head_dim = d_model/n_head must be even for rotary embeddings")
        if self.kernels not in ("torch", "triton", "auto"):
            raise ValueError(f"kernels={self.kernels!r}; choose 'torch', 'triton' or 'auto'")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1), e.g. 0.1")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} experts per token out of n_experts={self.n_experts}; "
                             f"use 1 <= top_k <= {self.n_experts}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        """Parameter count from the sizes alone (embedding and head untied)."""
        d, h, kv = self.d_model, self.n_head, self.n_kv_head
        attn = d * d + 2 * d * (d // h) * kv + d * d
        ffn = 3 * d * self.ffn_hidden * max(self.n_experts, 1) + d * self.n_experts
        return 2 * self.vocab_size * d + self.n_layer * (attn + ffn + 2 * d) + d


def _use_triton(config: GPTConfig, tensor: torch.Tensor) -> bool:
    if config.kernels == "auto":
        return tensor.is_cuda
    return config.kernels == "triton"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention on (batch, seq, heads, head_dim); k/v may have fewer (GQA) heads."""
    if k.shape[2] != q.shape[2]:
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True)
    return out.transpose(1, 2)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (*positions.shape, head_dim) in the rotate-half (Llama) convention:
    (seq, head_dim) for positions shared by the batch, (batch, seq, head_dim) for per-row ones."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if triton and cos.dim() == 2:
        from colab_par.kernels import apply_rope
        return apply_rope(q, k, cos, sin)
    if cos.dim() == 2:  # positions shared by the batch
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:  # per row: (batch, seq, head_dim)
        cos, sin = cos[:, :, None], sin[:, :, None]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class KVCache:
    """Keys and values of past tokens, per attention module, at fixed slots (batch, slots, kv heads,
    head_dim), and `keep` (batch, slots): which slots hold real tokens (left padding does not).

    Before each forward the caller sets `start`, the slot of the forward's first token; its tokens'
    keys and values are written at slots [start, start + seq) and each attends causally over the
    slots up to its own. Writing a slot again overwrites it, so a forward may re-feed recent tokens
    (sequence parallel needs a multiple of tp tokens per forward).
    """

    def __init__(self, keep: torch.Tensor):
        self.keep, self.start = keep.bool(), 0
        self._slots: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, keep: torch.Tensor) -> "KVCache":
        """This cache for a piece of the batch, `keep` being its rows (a tensor grid's attention
        holds its batch piece): the same slots per module (allocated at the piece's size) and the
        current `start`."""
        piece = KVCache(keep)
        piece.start, piece._slots = self.start, self._slots
        return piece

    def attend(self, owner: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of (batch, seq, heads, head_dim) queries over `owner`'s cached slots."""
        b, s = q.shape[:2]
        end = self.start + s
        if owner not in self._slots:
            shape = (b, self.keep.shape[1], *k.shape[2:])
            self._slots[owner] = (k.new_zeros(shape), v.new_zeros(shape))
        keys, values = self._slots[owner]
        keys[:, self.start:end], values[:, self.start:end] = k, v
        keys, values = keys[:, :end], values[:, :end]
        if keys.shape[2] != q.shape[2]:
            keys = keys.repeat_interleave(q.shape[2] // keys.shape[2], dim=2)
            values = values.repeat_interleave(q.shape[2] // values.shape[2], dim=2)
        slot = torch.arange(end, device=q.device)
        query_slot = slot[self.start:, None]
        # A padding query attends to itself only, so no row is fully masked (NaN).
        allowed = (slot <= query_slot) & self.keep[:, None, :end] | (slot == query_slot)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=allowed[:, None])
        return out.transpose(1, 2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, config: GPTConfig):
        super().__init__()
        self.eps, self.config = eps, config
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(self.config, x):
            from colab_par.kernels import rms_norm
            return rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.config, self.head_dim = config, hd
        self.wq = nn.Linear(d, config.n_head * hd, bias=False)
        self.wk = nn.Linear(d, config.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(d, config.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(config.n_head * hd, d, bias=False)
        self.attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = _apply_rope(q, k, cos, sin, _use_triton(self.config, x))
        out = self.attention(q, k, v) if cache is None else cache.attend(self, q, k, v)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.w1 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if _use_triton(self.config, x):
            from colab_par.kernels import swiglu
            return self.w2(swiglu(gate, up))
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps, config)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, config)
        self.feed_forward = MoE(config) if config.n_experts else FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        p, training = self.attention.config.dropout, self.training
        x = x + F.dropout(self.attention(self.attention_norm(x), cos, sin, cache=cache), p, training)
        return x + F.dropout(self.feed_forward(self.ffn_norm(x)), p, training)


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); a pipeline stage maps hidden -> hidden."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.norm: RMSNorm | None = RMSNorm(config.d_model, config.norm_eps, config)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                nn.init.normal_(param, 0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(param, 0.0, std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """`positions`: (seq,) shared by the batch or (batch, seq) per row (left-padded prompts)."""
        h = (F.dropout(self.tok_embeddings(tokens), self.config.dropout, self.training)
             if self.tok_embeddings is not None else tokens)
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, cache=cache)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (the fused Triton kernel when kernels are on), plus the
        experts' load-balancing losses of the last forward (taken: a model holds no graph after)
        where gradients are on: a training term, so evaluation (no_grad) scores the data alone."""
        flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        if _use_triton(self.config, logits):
            from colab_par.kernels import cross_entropy
            loss = cross_entropy(flat_logits, flat_targets)
        else:
            loss = F.cross_entropy(flat_logits.float(), flat_targets)
        balance = [m.take_aux_loss() for m in self.modules() if isinstance(m, MoE)]
        balance = [term for term in balance if term is not None]
        return loss + sum(balance) if balance and torch.is_grad_enabled() else loss
