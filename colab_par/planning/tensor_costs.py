"""Per-rank weights, activations and communication of the tensor-parallel modes for the kit's GPT.

The papers' analyses (Optimus for 2D, Tesseract for 2.5D, Bian et al. for 3D) written out for the
kit's GPT as `parallel/tensor_grid.py` partitions it, so the planner predicts what a run measures.
1d (Megatron, with or without sequence parallel) is counted the same way, so the modes compare on
one basis (`benchmarks/tensor_modes.py`); the planner's own 1d figures follow Korthikanti et al.
- **weights**: every matrix in q² pieces (2D, 2.5D: replicated over the depth) or q³ (3D); norm
  weights in q pieces (2D, 2.5D) or q² (3D).
- **activations** a layer keeps for backward, with T = tokens per rank (a (micro)batch split in
  q, q·d or q² pieces) and the hidden / head / FFN widths split in q: two RMSNorms (the fp32 input,
  its normalised copy, the output: 3·T·H/q, plus the fp32 scale; in bf16 the copy is fp32 under
  torch's rms_norm, the kit's 1d layers, and bf16 in Hugging Face's and the grid's norms), attention (rotated q, k, v and the
  attention output, whose [b, s, h, d] layout the output projection reads without a copy, plus
  the log-sum-exp; k and v at the query heads' width in the kit's GPT, which repeats them before
  SDPA, at their own width in a Hugging Face decoder, whose SDPA call takes grouped heads:
  2·T·(H + H_kv)/q),
  SwiGLU (gate, silu(gate), up, their product: 4·T·F/q).
- **communication** per linear y = x·Wᵀ (W: out × in): forward gathers x (T·in) and W (out·in/q in
  2D, out·in/q² in 3D); backward gathers both again and reduce-scatters their gradients, so 3·T·in
  + 3·out·in/q(²). 3D also reduce-scatters the output's partial sums forward and gathers its
  gradient backward: 2·T·out. 2.5D sums weight gradients over the depth (all-reduce of out·in/q²).
  Norms all-reduce their sums of squares (T fp32, forward and backward); the head's logits are
  gathered whole. Bytes are the full buffers, as `CollectiveBytes` counts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colab_par.layout import Layout, grid_batch_chunks, tensor_grid

__all__ = ["GridShape", "autocast", "grid_local_params", "holds_ends", "kept_activation_bytes", "feed_forward_kept_bytes",
           "ring_attention_bytes", "tensor_comm_bytes"]

FP32 = 4
# Under autocast each projection casts the fp32 norm output it reads on its own (nothing caches an
# activation's cast): q, k and v read the attention norm's, gate and up the FFN norm's, so a layer
# keeps three bf16 copies more than one per norm (measured by dry runs, tp4 bf16).
AUTOCAST_EXTRA_NORM_COPIES = 3


def autocast(layout: Layout) -> bool:
    """Whether the step runs under torch.autocast (`ParallelModel._autocast`): bf16 without FSDP,
    which casts its parameters itself instead."""
    return layout.precision == "bf16" and layout.zero < 2


@dataclass(frozen=True)
class GridShape:
    mode: str
    q: int
    depth: int
    batch_pieces: int

    @classmethod
    def of(cls, layout: Layout) -> "GridShape":
        grid = tensor_grid(layout.tp, layout.tp_mode, layout.tp_depth)
        if grid is None:
            raise ValueError(f"layout {layout} has no tensor grid; use tp_mode '2d', '2.5d' or '3d'")
        return cls(layout.tp_mode, grid[0], grid[1], grid_batch_chunks(layout))

    @property
    def cube(self) -> bool:
        return self.mode == "3d"

    @property
    def matrix_pieces(self) -> int:
        return self.q ** 3 if self.cube else self.q ** 2

    @property
    def gathered_pieces(self) -> int:
        """Pieces a linear's weight is still in after its gather: the output split (and 3D's)."""
        return self.q ** 2 if self.cube else self.q

    @property
    def norm_pieces(self) -> int:
        return self.q ** 2 if self.cube else self.q


def _linears(spec: Any) -> list[tuple[int, int]]:
    """(out, in) of one layer's linears: q, k, v, o, gate, up, down."""
    d, hd, f = spec.d_model, spec.head_dim, spec.ffn_hidden
    q_width, kv_width = spec.n_head * hd, spec.n_kv_head * hd
    return [(q_width, d), (kv_width, d), (kv_width, d), (d, q_width), (f, d), (f, d), (d, f)]


def grid_local_params(spec: Any, layout: Layout) -> tuple[float, float]:
    """(parameters on the fullest rank, one layer's share), like the planner's 1d accounting."""
    grid = GridShape.of(layout)
    d = spec.d_model
    layer = spec.layer_matrix_params / grid.matrix_pieces + 2 * d / grid.norm_pieces
    layers = spec.n_layer / layout.pp * layer
    embedding = head = spec.vocab_size * d / grid.matrix_pieces
    norm = d / grid.norm_pieces
    if layout.pp == 1 or layout.pp_schedule == "zbv":
        return layers + embedding + head + norm, layer
    return layers + max(embedding, head + norm), layer


def kept_activation_bytes(spec: Any, layout: Layout, micro: int, seq: int,
                          act_bytes: int = FP32) -> tuple[float, float]:
    """(bytes one layer keeps for backward, bytes kept outside the layers) per microbatch on one
    rank; outside: the final norm, the rotary tables and the loss's fp32 log-probabilities (of the
    whole microbatch: the logits are gathered). Without recompute.

    1d keeps the norms' tensors whole (sequence parallel: split, plus the gathered output the
    projections keep) and splits the heads and FFN columns over tp."""
    if layout.tp_mode == "1d":
        tokens, split, hidden = micro * seq, layout.tp, spec.d_model
    else:
        grid = GridShape.of(layout)
        tokens, split, hidden = micro * seq / grid.batch_pieces, grid.q, spec.d_model / grid.q
    hugging_face = getattr(spec, "hugging_face", False)
    norm = _norm_kept(layout, tokens, hidden, split, act_bytes, hugging_face)
    q_width = spec.n_head * spec.head_dim / split
    kv_width = spec.n_kv_head * spec.head_dim / split if hugging_face else q_width
    attention = 2 * tokens * (q_width + kv_width) * act_bytes + tokens * spec.n_head / split * FP32
    ffn = _feed_forward_kept(spec, tokens, hidden, split, act_bytes)
    one_d_autocast = autocast(layout) and layout.tp_mode == "1d"
    casts = AUTOCAST_EXTRA_NORM_COPIES * tokens * hidden * act_bytes if one_d_autocast else 0
    outside = norm + 2 * seq * spec.head_dim * act_bytes + micro * seq * spec.vocab_size * FP32
    if layout.checkpointing == "selective" and layout.tp_mode == "1d":
        return _matmul_outputs(spec, tokens, split, act_bytes, layout.sequence_parallel), outside
    return 2 * norm + attention + ffn + casts, outside


def _norm_kept(layout: Layout, tokens: float, hidden: float, split: int, act_bytes: int,
               hugging_face: bool) -> float:
    """One RMSNorm's kept tensors: the fp32 input and the normalised copy (Hugging Face's RMSNorm
    casts that copy back to the compute dtype before the weight, torch's rms_norm, the kit's,
    multiplies it in fp32; under autocast the residual stream stays fp32, so Hugging Face's copy
    is fp32 too), the output and the fp32 row statistics."""
    cast_back = layout.tp_mode != "1d" or (hugging_face and not autocast(layout))
    kept = FP32 + (act_bytes if cast_back else FP32)
    if layout.sequence_parallel:  # input and normalised copy split; the output gathered whole
        norm = (tokens * hidden * kept + tokens * FP32) / split + tokens * hidden * act_bytes
    else:
        norm = tokens * hidden * (kept + act_bytes) + tokens * FP32
    if layout.tp_mode == "3d":
        norm += hidden * FP32  # the norm weight, gathered over x
    return norm


def feed_forward_kept_bytes(spec: Any, layout: Layout, micro: int, seq: int, act_bytes: int) -> float:
    """The feed-forward's half of `kept_activation_bytes`' layer, its norm included (1d tensor
    parallel): what a layer no longer keeps once its feed-forward's backward is done."""
    tokens, hugging_face = micro * seq, getattr(spec, "hugging_face", False)
    return (_norm_kept(layout, tokens, spec.d_model, layout.tp, act_bytes, hugging_face)
            + _feed_forward_kept(spec, tokens, spec.d_model, layout.tp, act_bytes))


def ring_attention_bytes(spec: Any, layout: Layout, micro: int, seq: int, act_bytes: int) -> float:
    """What ring attention's backward (`parallel/context.py`, cp ring) holds at its fullest beyond
    the layer's gradients, for `seq` tokens a rank: four fp32 score blocks of its two
    chunks' size per local head (the probabilities, their gradient, its difference from the row
    sums, the scores' gradient), and per token 18 bytes a local query element (14 in fp32: no
    copies of q and the output's gradient), 38 a key/value element (the fp32 key/value stack,
    its gradient and the hops of both). Fitted on fake-tensor traces of the 70B shape (tp2, tp4;
    grouped and full key/value heads; 1-8 sequences of 2,048-8,192 tokens; bf16 and fp32): within
    3 MiB of every one. 0 without cp ring."""
    if layout.cp == 1 or layout.cp_mode != "ring":
        return 0.0
    heads, kv_heads, chunk = spec.n_head / layout.tp, spec.n_kv_head / layout.tp, seq / 2
    blocks = 4 * micro * heads * chunk * chunk * FP32
    per_token = (18 if act_bytes == 2 else 14) * heads * spec.head_dim + 38 * kv_heads * spec.head_dim
    return blocks + micro * seq * per_token


def _feed_forward_kept(spec: Any, tokens: float, hidden: float, split: int, act_bytes: int) -> float:
    """SwiGLU's kept tensors (gate, silu(gate), up, their product); a mixture of experts keeps
    them for each of a token's `top_k` experts, with the grouped tokens it sent them and the
    outputs it got back (`models/moe.py`; measured by a dry run, dp4 ep2)."""
    width = (spec.expert_hidden or spec.ffn_hidden) if spec.n_experts else spec.ffn_hidden
    swiglu = 4 * tokens * width / split * act_bytes
    if not spec.n_experts:
        return swiglu
    return spec.top_k * (swiglu + 2 * tokens * hidden * act_bytes) + tokens * spec.n_experts * FP32


def _matmul_outputs(spec: Any, tokens: float, split: int, act_bytes: int, sequence_parallel: bool) -> float:
    """What a 1d layer keeps under selective checkpointing (`parallel/checkpointing.py` saves the
    matmul and SDPA outputs and recomputes the rest): its input (split over tp under sequence
    parallel), the q/k/v, output, gate, up and down projections' outputs (the row-parallel ones
    whole, before their all-reduce or reduce-scatter) and SDPA's output with its fp32 log-sum-exp."""
    d, hd = spec.d_model, spec.head_dim
    q_width, kv_width = spec.n_head * hd / split, spec.n_kv_head * hd / split
    layer_input = d / split if sequence_parallel else d
    widths = layer_input + (q_width + 2 * kv_width) + d + 2 * spec.ffn_hidden / split + d + q_width
    return tokens * (widths * act_bytes + spec.n_head / split * FP32)


def tensor_comm_bytes(spec: Any, layout: Layout, micro: int, seq: int, act_bytes: int = FP32) -> float:
    """Bytes of the tensor-parallel collectives one rank issues for one microbatch, forward and
    backward, of its pipeline stage's layers (+ embedding or head where the stage holds them).
    Exact for fp32 without recompute or with full recompute (the layers' forward collectives
    twice)."""
    if layout.tp_mode == "1d":
        return _megatron_comm_bytes(spec, layout, micro, seq, act_bytes)
    grid = GridShape.of(layout)
    q, a = grid.q, act_bytes
    tokens = micro * seq / grid.batch_pieces
    d, v = spec.d_model, spec.vocab_size

    def linear(out: int, inp: int) -> tuple[float, float]:
        weight = out * inp / grid.gathered_pieces
        partial = tokens * out if grid.cube else 0.0  # 3D's partial sums, reduce-scattered
        depth_sum = out * inp / q ** 2 * FP32 if grid.depth > 1 and not grid.cube else 0.0
        return ((tokens * inp + weight + partial) * a,
                (2 * tokens * inp + 2 * weight + partial) * a + depth_sum)

    def norm() -> tuple[float, float]:
        stats = tokens * FP32  # the sums of squares, all-reduced forward and backward
        if grid.cube:  # gather the weight over x, reduce-scatter its gradient, sum it over y
            return stats + d / q * FP32, stats + d / q * FP32 + d / q ** 2 * FP32
        replicas = d / q * FP32 * (1 + (grid.depth > 1))  # gradient summed over rows (and depth)
        return stats, stats + replicas

    layer_forward, layer_backward = 0.0, 0.0
    for forward, backward in [linear(out, inp) for out, inp in _linears(spec)] + [norm(), norm()]:
        layer_forward, layer_backward = layer_forward + forward, layer_backward + backward
    recompute = layout.checkpointing == "full"
    total = spec.n_layer / layout.pp * (layer_forward * (2 if recompute else 1) + layer_backward)

    first, last = holds_ends(layout)
    if first:  # embedding: gather the fp32 table ([V/q.., H/q..] -> [V, H/q]); reduce-scatter its grad
        table = v * d / q + (v * d / q ** 2 if grid.cube else 0.0)
        depth_sum = v * d / q ** 2 * FP32 if grid.depth > 1 and not grid.cube else 0.0
        total += 2 * table * FP32 + depth_sum
    if last:  # final norm, head, and the logits gathered whole (vocab, then the batch pieces)
        forward, backward = norm()
        head_forward, head_backward = linear(v, d)
        pieces = [grid.q, grid.depth] if grid.mode == "2.5d" else [grid.q] * (2 if grid.cube else 1)
        logits, rows = tokens * v, tokens * v
        for size in pieces:
            rows *= size
            logits += rows if size > 1 else 0.0
        total += forward + backward + head_forward + head_backward + logits * a
    return total


def _megatron_comm_bytes(spec: Any, layout: Layout, micro: int, seq: int, act_bytes: int) -> float:
    """1d: per layer two all-reduces of the activation forward (attention and FFN outputs) and two
    backward (their inputs' gradients), each an all-gather + reduce-scatter pair with sequence
    parallel (same buffers, twice as many); the embedding's output and the head's input (their
    adjoints too with sequence parallel), and the head's logits gathered whole."""
    if layout.tp == 1:
        return 0.0
    activation = micro * seq * spec.d_model * act_bytes
    logits = micro * seq * spec.vocab_size * act_bytes
    sp = 2 if layout.sequence_parallel else 1
    forward = 2 * sp * activation
    per_layer = forward * (2 if layout.checkpointing == "full" else 1) + 2 * sp * activation
    first, last = holds_ends(layout)
    ends = (sp * activation if first else 0.0) + (sp * activation + logits if last else 0.0)
    return spec.n_layer / layout.pp * per_layer + ends


def holds_ends(layout: Layout) -> tuple[bool, bool]:
    """Whether the fullest rank (pipeline rank 0) holds the embedding and the head."""
    if layout.pp == 1:
        return True, True
    return True, layout.pp_schedule == "zbv"
