"""The collectives one training step of a rank issues, per mesh dimension and op, with their calls
and payload bytes: the planner's side of the dry run's traced rows (`DryRunReport.collectives`),
which it must equal exactly.

Counted from the model's sizes (`flops.ModelSpec`: the kit's GPT or a Llama-shaped Hugging Face
decoder, told apart by its config, never by a class name) and the layout, as the kit's step
issues them. The payload is `parallel.collective_bytes.CollectiveBytes`'s: an all-reduce's tensor,
an all-gather's output, a reduce-scatter's input, a broadcast's tensor.
- **loss**: one float64 all-reduce over the world (`ParallelModel.forward_backward_tensor`).
- **FSDP2** (zero2/3): one unit per transformer block and the root (embeddings, final norm, head);
  each parameter's local (tensor-parallel) piece padded on dim 0 to a multiple of the dp·cp size.
  Per unit one all-gather forward and, under zero3 (the kit sets `reshard_after_forward` itself,
  so the root reshards too), one more for backward, in the parameters' compute dtype; one fp32
  reduce-scatter of the gradients.
- **DDP** (zero0/1 without tp): the gradients in buckets (1 MiB first, then 25 MiB, in reverse
  parameter order), one all-reduce each; the buffers broadcast every forward; on the second step
  the bucket rebuild broadcasts the new assignment (two int32 tensors). ZeRO-1 broadcasts every
  parameter from its owner after the update.
- **bucketed gradient all-reduce** (zero0 with tp or pp): `GradientAverager`, the local gradients in
  order, in buckets of up to 25 MiB (`gradient_buckets`).
- **recompute** (full or selective, per block): FSDP gathers nothing more; tensor parallel's
  forward collectives of each block run again in backward, but for the block's closing one.
- **tensor parallel** (1d, DTensor): per block, the Megatron all-reduces (the kit's GPT plan shares
  one replicated input among q/k/v and among gate/up: two forward, two backward; a Hugging Face
  plan reduces each column-split projection's input gradient: its colwise count backward, its
  rowwise count forward); the embedding's output forward, the head's input gradient, the logits
  gathered whole. Sequence parallel turns each all-reduce into an all-gather / reduce-scatter pair
  and leaves the norms' weight gradients partial: reduced by FSDP once (in the compute dtype), else
  by Adam at each read of the gradient: once for the first moment, twice for the second (Adam's
  per-tensor path, which it takes on the CPU; its foreach path on GPUs may read them otherwise).
- **context parallel** (the kit's GPT): ring hops or Ulysses all-to-alls (`_context_parallel`).
- **pipeline** (gpipe/1f1b, rank 0 = the first stage): its boundary sends and receives, the loss
  broadcast from the last stage; its gradients are those of its own stage.

Not modelled (a ValueError says so): pipeline schedules with virtual stages, pipeline with tp, cp
or ZeRO, expert parallel, tensor grids, context parallel with recompute or of a Hugging Face
model, mixture-of-experts or packed-attention models, sequence parallel under autocast bf16,
ZeRO-1 with tensor parallel, memory tiers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colab_par.layout import Layout
from colab_par.parallel.data_parallel import gradient_buckets
from colab_par.parallel.mesh import MESH_DIMS
from colab_par.planning.flops import ModelSpec

__all__ = ["collective_bytes", "CollectiveKey"]

CollectiveKey = tuple[str, str]  # (mesh dimension, op as `dry_run.collectives.CollectivesByDim` names it)

ALL_REDUCE = "c10d.allreduce_"  # loss, DDP buckets, the gradient averager's buckets
BROADCAST = "c10d.broadcast_"  # DDP buffers and bucket rebuild, ZeRO-1's updated parameters
FSDP_ALL_GATHER = "c10d._allgather_base_"
FSDP_REDUCE_SCATTER = "c10d._reduce_scatter_base_"
TP_ALL_REDUCE = "_c10d_functional.all_reduce"
TP_ALL_GATHER = "_c10d_functional.all_gather_into_tensor"
TP_REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor"
RING_SEND, RING_RECV = "c10d.send", "c10d.recv_"  # context parallel's ring hops, pipeline stages
ALL_TO_ALL = "c10d.alltoall_base_"  # context parallel's Ulysses exchanges

FP32, FP64, INT32 = 4, 8, 4
DDP_BUCKET_CAPS = (2 ** 20, 25 * 2 ** 20)  # DDP's first bucket, then bucket_cap_mb=25
ADAM_PARTIAL_READS = 3  # per-tensor Adam reduces a partial gradient at each of its three reads


@dataclass(frozen=True)
class ParamShape:
    """One parameter as the model registers it: (rows, cols) (cols 1 for a vector), the FSDP unit
    it belongs to (a block index, or -1 for the root) and how tensor parallel splits it: "rows"
    (Shard(0): column-parallel linears, the vocabulary of embedding and head), "cols" (Shard(1):
    row-parallel linears) or "" (replicated: norms)."""

    rows: int
    cols: int
    unit: int
    tp_split: str = ""

    def local(self, tp: int) -> tuple[int, int]:
        """Rank 0's piece under `tp` (torch.chunk: the first pieces take the ceiling)."""
        if self.tp_split == "rows":
            return -(-self.rows // tp), self.cols
        if self.tp_split == "cols":
            return self.rows, -(-self.cols // tp)
        return self.rows, self.cols


def model_parameters(spec: ModelSpec) -> list[ParamShape]:
    """The decoder's parameters in registration order (the kit's GPT: norm, q, k, v, o, norm,
    gate, up, down per block; Hugging Face Llama: q, k, v, o, gate, up, down, norm, norm)."""
    d, f, v = spec.d_model, spec.ffn_hidden, spec.vocab_size
    q_width, kv_width = spec.n_head * spec.head_dim, spec.n_kv_head * spec.head_dim
    attention = [(q_width, d, "rows"), (kv_width, d, "rows"), (kv_width, d, "rows"), (d, q_width, "cols")]
    ffn = [(f, d, "rows"), (f, d, "rows"), (d, f, "cols")]
    norm = [(d, 1, "")]
    block = attention + ffn + norm + norm if spec.hugging_face else norm + attention + norm + ffn
    params = [ParamShape(v, d, -1, "rows")]
    params += [ParamShape(rows, cols, layer, split) for layer in range(spec.n_layer) for rows, cols, split in block]
    params.append(ParamShape(d, 1, -1))
    if not spec.tied_embeddings:
        params.append(ParamShape(v, d, -1, "rows"))
    return params


class _Tally:
    def __init__(self) -> None:
        self.rows: dict[CollectiveKey, tuple[int, int]] = {}

    def add(self, dim: str, op: str, size: float, calls: int = 1) -> None:
        """`calls` collectives of `size` payload bytes each."""
        if calls:
            before = self.rows.get((dim, op), (0, 0))
            self.rows[(dim, op)] = (before[0] + calls, before[1] + int(size) * calls)


def _dim_names(layout: Layout) -> dict[str, str]:
    """The row name of each group the step uses, as `dry_run.collectives.mesh_group_names` names
    it: a mesh dimension spanning the whole world shares the world's group (and its name, the
    first such in (pp, dp, cp, tp) order); the flattened dp·cp group is its own but for that, and
    is the world's group (named "dp_cp") where dp and cp together span it."""
    world = layout.world_size
    spanning = next((dim for dim in MESH_DIMS if getattr(layout, dim) == world), None)
    flat_is_world = layout.dp * layout.cp == world
    names = {dim: spanning if getattr(layout, dim) == world else dim for dim in MESH_DIMS}
    names["dp_cp"] = spanning if flat_is_world and spanning in ("dp", "cp") else "dp_cp"
    names["world"] = spanning or (names["dp_cp"] if flat_is_world else "world")
    return names


def _refuse_unmodelled(spec: Any, layout: Layout) -> None:
    unmodelled = [name for name, on in (
        ("pipeline parallel beyond gpipe/1f1b stages without tp, cp or zero", layout.pp > 1 and (
            layout.pp_schedule not in ("gpipe", "1f1b") or layout.tp * layout.cp > 1 or layout.zero > 0)),
        ("context parallel with recompute", layout.cp > 1 and layout.checkpointing != "none"),
        ("expert parallel", layout.ep > 1), (f"tp_mode {layout.tp_mode!r}", layout.tp_mode != "1d"),
        ("memory tiers", layout.tiers != type(layout.tiers)()),
        ("sequence parallel under autocast bf16", layout.sequence_parallel and _autocast(layout)),
        ("zero1 with tensor parallel", layout.zero == 1 and layout.tp > 1)) if on]
    if not isinstance(spec, ModelSpec):
        unmodelled.append("a probed module (ModuleSpec)")
    elif spec.n_experts or spec.packed_attention:
        unmodelled.append("mixture-of-experts or packed q|k|v attention")
    elif spec.hugging_face and layout.cp * layout.pp > 1:
        unmodelled.append("context or pipeline parallel of a Hugging Face model")
    if unmodelled:
        raise ValueError(f"collective_bytes does not model {', '.join(unmodelled)} (layout {layout}); it counts "
                         "dp, zero0-3, offload, recompute, 1d tp with or without sp, cp (ring, ulysses), gpipe/1f1b "
                         "pp, fp32 and bf16, for the kit's GPT and Llama-shaped Hugging Face decoders: trace such "
                         "a layout with dry_run instead")


def _autocast(layout: Layout) -> bool:
    """bf16 by autocast (FSDP casts the parameters itself instead, zero2/3)."""
    return layout.precision == "bf16" and layout.zero < 2


def collective_bytes(model: Any, layout: "Layout | str", *, global_batch: int, seq_len: int,
                     steps: int = 2) -> dict[CollectiveKey, tuple[int, int]]:
    """{(mesh dimension, op): (calls, payload bytes)} of the `steps`-th training step of global
    rank 0 (the step `dry_run(..., steps=steps)` traces) of `model` (a GPTConfig, Hugging Face
    config or `ModelSpec`) under `layout`, on a global batch of `global_batch` sequences of
    `seq_len` tokens. Raises ValueError for what it does not model (see the module docstring)."""
    layout = Layout.parse(layout)
    spec = model if isinstance(model, ModelSpec) else ModelSpec.of(model)
    _refuse_unmodelled(spec, layout)
    if global_batch % layout.dp or steps < 1:
        raise ValueError(f"global_batch={global_batch}, steps={steps}: give a global batch that dp={layout.dp} "
                         "divides and steps >= 1")
    tally, names = _Tally(), _dim_names(layout)
    tally.add(names["world"], ALL_REDUCE, FP64)  # the loss, summed over every rank
    params = model_parameters(spec)
    if layout.pp > 1:
        _pipeline(tally, spec, layout, global_batch // layout.dp * seq_len, names["pp"])
        params = _first_stage(params, spec, layout)
    if layout.dp * layout.cp > 1:  # gradients averaged over the dp·cp ranks
        if layout.zero >= 2:
            _fully_sharded(tally, params, layout, names["dp_cp"])
        elif layout.tp > 1 or layout.pp > 1:  # GradientAverager: an all-reduce per bucket
            sizes = _averaged_gradient_bytes(params, layout.tp)
            for bucket in gradient_buckets(sizes):
                tally.add(names["dp_cp"], ALL_REDUCE, sum(sizes[i] for i in bucket))
        else:
            _distributed_data_parallel(tally, spec, params, layout, names, steps)
    rows, local_seq = global_batch // layout.dp, seq_len // layout.cp
    if layout.tp > 1:
        _tensor_parallel(tally, spec, model, layout, rows * local_seq, names["tp"])
    if layout.cp > 1:
        _context_parallel(tally, spec, layout, rows * local_seq, names["cp"])
    return tally.rows


def _fully_sharded(tally: _Tally, params: list[ParamShape], layout: Layout, dim: str) -> None:
    """FSDP2's gathers and reduce-scatters, unit by unit (blocks, then the root)."""
    shards = layout.dp * layout.cp
    gathers = 2 if layout.zero == 3 else 1
    param_bytes = 2 if layout.precision == "bf16" else FP32
    units: dict[int, int] = {}
    for param in params:
        rows, cols = param.local(layout.tp)
        units[param.unit] = units.get(param.unit, 0) + -(-rows // shards) * shards * cols
    for padded in units.values():
        tally.add(dim, FSDP_ALL_GATHER, padded * param_bytes, gathers)
        tally.add(dim, FSDP_REDUCE_SCATTER, padded * FP32)


def _averaged_gradient_bytes(params: list[ParamShape], tp: int) -> list[int]:
    """Bytes of each of this rank's local gradients, in order: tensor-parallel pieces, but the
    embedding's whole: DTensor's embedding backward returns it replicated, and the hook meant to
    chunk it back to the weight's vocabulary split (`tensor_parallel._keep_gradient_sharded_like`)
    leaves it so."""
    local = [param.local(tp) for param in params]
    sizes = [rows * cols * FP32 for rows, cols in local]
    if tp > 1:
        sizes[0] = params[0].rows * params[0].cols * FP32
    return sizes


def _distributed_data_parallel(tally: _Tally, spec: ModelSpec, params: list[ParamShape], layout: Layout,
                               names: dict[str, str], steps: int) -> None:
    """DDP's bucketed all-reduce over dp·cp (its buffers and bucket rebuild broadcast on the same
    group), ZeRO-1's broadcast of the updated parameters over dp."""
    dim = names["dp_cp"]
    buckets = _ddp_buckets([p.rows * p.cols * FP32 for p in reversed(params)])
    for size in buckets:
        tally.add(dim, ALL_REDUCE, size)
    if spec.hugging_face:  # the rotary inv_freq and original_inv_freq buffers, coalesced
        tally.add(dim, BROADCAST, 2 * (spec.head_dim // 2) * FP32)
    if steps == 2:  # the rebuild: bucket indices with their count, then the bucket sizes
        tally.add(dim, BROADCAST, (len(params) + 1) * INT32)
        tally.add(dim, BROADCAST, len(buckets) * INT32)
    if layout.zero == 1:
        for param in params:
            tally.add(names["dp"], BROADCAST, param.rows * param.cols * FP32)


def _ddp_buckets(sizes: list[int]) -> list[int]:
    """Bytes of each DDP bucket: gradients in the order given fill a bucket until it reaches its
    cap (`DDP_BUCKET_CAPS`: the first, then every later one)."""
    buckets, current = [], 0
    for size in sizes:
        current += size
        if current >= DDP_BUCKET_CAPS[min(len(buckets), 1)]:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def _hf_layer_styles(model: Any) -> tuple[int, int]:
    """(row-parallel, column-parallel) projections per block in a Hugging Face config's own plan
    (`base_model_tp_plan`); Llama's (2, 5) where the config carries none."""
    plan = getattr(model, "base_model_tp_plan", None) or {}
    styles = [style for key, style in plan.items() if key.startswith("layers.") and "expert" not in key]
    return (styles.count("rowwise"), styles.count("colwise")) if styles else (2, 5)


def _tensor_parallel(tally: _Tally, spec: ModelSpec, model: Any, layout: Layout, tokens: int, dim: str) -> None:
    """The DTensor collectives of the block's linears, the embedding, the head and (sequence
    parallel) the norms, for `tokens` tokens of this rank's dp share."""
    hidden, logits = tokens * spec.d_model, tokens * spec.vocab_size
    act = 2 if layout.precision == "bf16" else FP32
    # autocast: linears' outputs in bf16; the embedding's output and the inputs' gradients in fp32
    forward, backward, embedding = (act, FP32, FP32) if _autocast(layout) else (act, act, act)
    if spec.hugging_face:
        row_parallel, col_parallel = _hf_layer_styles(model)
    else:
        row_parallel = col_parallel = 2  # one shared replicated input for q/k/v, one for gate/up
    # recompute (full or selective) repeats a block's forward collectives up to the last one its
    # backward needs: all but the closing row-parallel output (torch stops recomputing early)
    again = spec.n_layer if layout.checkpointing != "none" else 0
    if layout.sequence_parallel:  # all-reduce -> all-gather + reduce-scatter, both ways
        pairs = spec.n_layer * (row_parallel + col_parallel) + 2  # + embedding and head input
        tally.add(dim, TP_ALL_GATHER, hidden * act, pairs + again * 2)  # the attention's and FFN's inputs
        tally.add(dim, TP_REDUCE_SCATTER, hidden * act, pairs + again * (row_parallel - 1))
        norms = 2 * spec.n_layer + 1
        tally.add(dim, TP_ALL_REDUCE, spec.d_model * act, norms * (1 if layout.zero >= 2 else ADAM_PARTIAL_READS))
    else:
        tally.add(dim, TP_ALL_REDUCE, hidden * forward, (spec.n_layer + again) * row_parallel - again)
        tally.add(dim, TP_ALL_REDUCE, hidden * backward, spec.n_layer * col_parallel + 1)  # + the head's input
        tally.add(dim, TP_ALL_REDUCE, hidden * embedding)
    tally.add(dim, TP_ALL_GATHER, logits * act)


def _pipeline(tally: _Tally, spec: ModelSpec, layout: Layout, tokens: int, dim: str) -> None:
    """Rank 0 holds the first stage: per microbatch it sends its output on and receives that
    output's gradient back; the last stage broadcasts the mean loss to every stage."""
    boundary = tokens * spec.d_model * FP32
    tally.add(dim, RING_SEND, boundary // layout.microbatches, layout.microbatches)
    tally.add(dim, RING_RECV, boundary // layout.microbatches, layout.microbatches)
    tally.add(dim, BROADCAST, FP64)


def _first_stage(params: list[ParamShape], spec: ModelSpec, layout: Layout) -> list[ParamShape]:
    """The first pipeline stage's parameters: the embedding and the first n_layer/pp blocks
    (`pipeline.stages.stage_layers`)."""
    blocks = spec.n_layer // layout.pp
    return [params[0]] + [param for param in params if 0 <= param.unit < blocks]


def _context_parallel(tally: _Tally, spec: ModelSpec, layout: Layout, tokens: int, dim: str) -> None:
    """The kit's GPT attention over a sequence split in cp (`parallel.context`), per block:
    ring: keys and values stacked in fp32 hop cp-1 times forward and again backward, and their
    gradients' partial sums cp times (each hop a send and a receive); Ulysses: q, k, v and the
    output exchanged all-to-all forward, their gradients backward (k, v repeated to every query
    head where cp does not divide the kv heads), for `tokens` tokens of this rank."""
    cp, heads, kv_heads = layout.cp, spec.n_head // layout.tp, spec.n_kv_head // layout.tp
    if layout.cp_mode == "ring":
        hop = 2 * tokens * kv_heads * spec.head_dim * FP32
        hops = spec.n_layer * (3 * cp - 2)
        tally.add(dim, RING_SEND, hop, hops)
        tally.add(dim, RING_RECV, hop, hops)
        return
    act = 2 if layout.precision == "bf16" else FP32
    kv_width = kv_heads if kv_heads % cp == 0 else heads
    for width in (heads, kv_width, kv_width, heads):  # q, k, v, the output
        tally.add(dim, ALL_TO_ALL, tokens * width * spec.head_dim * act, 2 * spec.n_layer)
