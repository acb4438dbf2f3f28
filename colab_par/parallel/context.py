"""Context parallel: causal attention over a sequence split across the ranks of a ``cp`` group.

Ours rather than torch's because torch's context parallel has no causal CPU (gloo) path. Two
algorithms, both exact (not approximations) and both with a hand-written backward:

- **ring** (load balanced): rank r holds global chunks r and 2·cp−1−r of 2·cp equal chunks, so
  under the causal mask every rank does the same work. Keys/values travel around the ring; each
  step merges one block of attention into a running output with the online-softmax
  (log-sum-exp) rule. The backward sends the key/value gradient partial sums around the ring with
  the keys/values and returns them to their owner at the end.
- **ulysses**: rank r holds contiguous chunk r. An all-to-all turns "my tokens, all heads" into
  "all tokens, my heads", ordinary causal attention runs on the local heads, and a second
  all-to-all turns it back.

The math is written down in docs/context_parallel.md.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from colab_par.layout import CP_MODES
from colab_par.models.gpt import Attention, causal_attention

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "ring_chunks",
    "shard_sequence",
    "unshard_sequence",
    "sequence_positions",
    "apply_context_parallel",
]

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]


# ---- sharding helpers --------------------------------------------------------------------------
def _check_mode(mode: str) -> None:
    if mode not in CP_MODES:
        raise ValueError(f"context parallel mode {mode!r} is unknown; choose one of {CP_MODES}")


def _chunk_count(cp_size: int, mode: str) -> int:
    _check_mode(mode)
    return 2 * cp_size if mode == "ring" else cp_size


def ring_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Global chunk indices (of 2·cp) held by `cp_rank` under head–tail load balancing."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(x: Tensor, cp_rank: int, cp_size: int, mode: str, dim: int = 1) -> Tensor:
    """This rank's part of a full sequence: chunks r and 2·cp−1−r (ring) or chunk r (ulysses)."""
    chunks = _chunk_count(cp_size, mode)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside 0..{cp_size - 1}")
    if x.shape[dim] % chunks:
        raise ValueError(f"sequence length {x.shape[dim]} (dim {dim}) is not divisible by {chunks} "
                         f"chunks needed by cp={cp_size} {mode}; pad the sequence to a multiple of "
                         f"{chunks}")
    pieces = x.chunk(chunks, dim=dim)
    if mode == "ulysses":
        return pieces[cp_rank]
    head, tail = ring_chunks(cp_rank, cp_size)
    return torch.cat([pieces[head], pieces[tail]], dim=dim)


def unshard_sequence(parts: Sequence[Tensor], cp_size: int, mode: str, dim: int = 1) -> Tensor:
    """The full sequence from every rank's part (in cp-rank order); inverse of shard_sequence."""
    _check_mode(mode)
    if len(parts) != cp_size:
        raise ValueError(f"got {len(parts)} parts for cp={cp_size}; pass one part per cp rank")
    if mode == "ulysses":
        return torch.cat(list(parts), dim=dim)
    halves = [part.chunk(2, dim=dim) for part in parts]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


def sequence_positions(seq_len: int, cp_rank: int, cp_size: int, mode: str,
                       device: torch.device | str | None = None) -> Tensor:
    """Global positions of this rank's tokens (what RoPE needs when chunks are not contiguous)."""
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, mode, dim=0)


# ---- ring attention ----------------------------------------------------------------------------
class _RingHop:
    """One exchange in flight: `sent` goes to the next ring rank, the previous rank's arrives.

    Holding `sent` keeps the buffer alive until the send has completed.
    """

    def __init__(self, sent: Tensor, group: dist.ProcessGroup, tag: int):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.sent, self.received = sent, torch.empty_like(sent)
        # One batch, so NCCL posts send and receive together instead of deadlocking on the ring.
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, sent, dist.get_global_rank(group, (rank + 1) % size), group, tag),
            dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % size),
                       group, tag),
        ])

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _block_scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    """Scaled q·kᵀ for q (b, kv, group, m, d) and k (b, kv, n, d); diagonal blocks masked causally."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if causal:
        m, n = scores.shape[-2:]
        future = torch.ones(m, n, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor]:
    """Softmax attention of one (q-chunk, kv-chunk) block: its output and row log-sum-exp."""
    scores = _block_scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def _block_backward(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor,
                    scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of dq, dk, dv, with probabilities rebuilt from the final log-sum-exp."""
    probs = torch.exp(_block_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, dout)
    dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dout, v)
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q) * scale
    return dq, dk, dv


def _block_pairs(rank: int, source: int, size: int, chunk: int):
    """(q slice, kv slice, causal) for every block of local q against `source`'s kv that is visible.

    Pairs are classified from global chunk indices: an earlier kv chunk is fully visible, the same
    chunk is visible below the diagonal, a later one is skipped.
    """
    for qi, q_chunk in enumerate(ring_chunks(rank, size)):
        for ki, k_chunk in enumerate(ring_chunks(source, size)):
            if k_chunk <= q_chunk:
                yield (slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk),
                       k_chunk == q_chunk)


def _to_groups(q: Tensor, kv_heads: int) -> Tensor:
    """(b, s, heads, d) -> (b, kv_heads, heads/kv_heads, s, d): q heads grouped by their kv head."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _from_groups(x: Tensor) -> Tensor:
    b, kv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, kv * g, d)


class _RingAttention(torch.autograd.Function):
    """Causal attention over the head–tail sharded sequence; q (b,kv,g,s,d), k/v (b,kv,s,d)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        scale, chunk = 1.0 / math.sqrt(q.shape[-1]), q.shape[-2] // 2
        out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        q_acc, kv = q.to(acc_dtype), torch.stack([k, v]).to(acc_dtype)
        for step in range(size):
            # Send these keys/values on while computing with them.
            kv_hop = _RingHop(kv, group, tag=0) if step < size - 1 else None
            source = (rank - step) % size
            for q_part, kv_part, causal in _block_pairs(rank, source, size, chunk):
                block_out, block_lse = _block_forward(q_acc[..., q_part, :], kv[0][:, :, kv_part],
                                                      kv[1][:, :, kv_part], scale, causal)
                _merge(out[..., q_part, :], lse[..., q_part], block_out, block_lse)
            if kv_hop is not None:
                kv = kv_hop.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        acc_dtype = lse.dtype
        scale, chunk = 1.0 / math.sqrt(q.shape[-1]), q.shape[-2] // 2
        q_acc, dout = q.to(acc_dtype), dout.to(acc_dtype)
        delta = (dout * out.to(acc_dtype)).sum(-1)
        dq = torch.zeros_like(q_acc)
        kv = torch.stack([k, v]).to(acc_dtype)
        grad_hop = None  # the visiting kv's gradient partial sums, arriving from the previous rank
        for step in range(size):
            kv_hop = _RingHop(kv, group, tag=0) if step < size - 1 else None
            source = (rank - step) % size
            dkv = torch.zeros_like(kv)
            for q_part, kv_part, causal in _block_pairs(rank, source, size, chunk):
                block_dq, block_dk, block_dv = _block_backward(
                    q_acc[..., q_part, :], kv[0][:, :, kv_part], kv[1][:, :, kv_part],
                    dout[..., q_part, :], lse[..., q_part], delta[..., q_part], scale, causal)
                dq[..., q_part, :] += block_dq
                dkv[0][:, :, kv_part] += block_dk
                dkv[1][:, :, kv_part] += block_dv
            if grad_hop is not None:
                dkv += grad_hop.wait()
            if size > 1:
                # The partial sums follow their kv block; after the last step they reach its owner.
                grad_hop = _RingHop(dkv, group, tag=1)
            if kv_hop is not None:
                kv = kv_hop.wait()
        if grad_hop is not None:
            dkv = grad_hop.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Online softmax: fold one block's (output, log-sum-exp) into the running pair, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(
        block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Causal attention of (batch, local_seq, heads, head_dim) tensors sharded head–tail over `group`.

    k/v may have fewer heads than q (GQA); they are never repeated, q heads are grouped instead.
    """
    _check_heads(q, k, v)
    if q.shape[1] % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {q.shape[1]}; "
                         f"shard a sequence divisible by 2·cp with shard_sequence(..., mode='ring')")
    if not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised; start a Cluster first")
    kv_heads = k.shape[2]
    out = _RingAttention.apply(_to_groups(q, kv_heads), k.transpose(1, 2).contiguous(),
                               v.transpose(1, 2).contiguous(),
                               dist.group.WORLD if group is None else group)
    return _from_groups(out)


def _check_heads(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (batch, seq, heads, head_dim) and k, v of equal shape "
                         f"(batch, seq, kv_heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")


# ---- Ulysses -----------------------------------------------------------------------------------
def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(b, s/cp, h, d) on every rank -> (b, s, h/cp, d): all tokens of this rank's head group."""
    size = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * s, h // size, d)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(b, s, h/cp, d) -> (b, s/cp, h, d): this rank's tokens with every head; inverse of above."""
    size = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, size, s // size, h, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


class _Reshard(torch.autograd.Function):
    """The Ulysses exchange (sequence -> heads, or back); its gradient is the opposite exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad.contiguous(), ctx.group), None, None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None,
                      attention: AttentionFn = causal_attention) -> Tensor:
    """Causal attention of (batch, local_seq, heads, head_dim) tensors sharded contiguously.

    `attention` is the single-device causal attention run on the local heads of the full sequence
    (so a fused kernel keeps working). kv heads are repeated only when cp does not divide them.
    """
    _check_heads(q, k, v)
    if not dist.is_initialized():
        raise RuntimeError("ulysses_attention needs torch.distributed initialised; start a Cluster first")
    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % size:
        raise ValueError(f"Ulysses splits heads over cp={size} ranks but there are {heads} (local) "
                         f"heads; use cp_mode='ring' or a cp that divides the heads")
    if kv_heads % size:
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    q, k, v = (_Reshard.apply(t.contiguous(), group, True) for t in (q, k, v))
    return _Reshard.apply(attention(q, k, v).contiguous(), group, False)


# ---- wiring into the reference GPT -------------------------------------------------------------
_CP_FUNCTIONS = (ring_attention, ulysses_attention)


def apply_context_parallel(module: torch.nn.Module, cp_group: dist.ProcessGroup | None,
                           mode: str) -> torch.nn.Module:
    """Swap the core attention of every reference-GPT Attention in `module` for its cp version.

    Inputs, targets and positions must then be sharded with shard_sequence / sequence_positions
    in the same `mode`.
    """
    _check_mode(mode)
    attentions = [m for m in module.modules() if isinstance(m, Attention)]
    if not attentions:
        raise ValueError(f"{type(module).__name__} has no colab_par.models.gpt.Attention module; "
                         "context parallel supports the reference GPT only")
    for attn in attentions:
        current = attn.attention
        if isinstance(current, functools.partial) and current.func in _CP_FUNCTIONS:
            raise ValueError("context parallel is already applied to this module; apply it once")
        if mode == "ring":
            attn.attention = functools.partial(ring_attention, group=cp_group)
        else:
            attn.attention = functools.partial(ulysses_attention, group=cp_group, attention=current)
    return module
