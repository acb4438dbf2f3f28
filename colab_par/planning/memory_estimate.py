"""Bytes per device of a `Layout`: model state, the build's peak, activations, and which
parameters the fullest rank holds.

Pure arithmetic, below `layout_estimate`. Sources (docs/planner.md): model state from the ZeRO
paper (Rajbhandari et al. 2020, Table 1), activations from Korthikanti et al. 2022.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from colab_par.layout import Layout, splits_backward
from colab_par.layout.tier_options import bf16_working_shards
from colab_par.parallel.data_parallel import GRADIENT_BUCKET_BYTES
from colab_par.planning.devices import DeviceSpec
from colab_par.planning.expert_costs import local_expert_params
from colab_par.planning.flops import ModelSpec, recompute_work
from colab_par.planning.tensor_costs import (GridShape, autocast, feed_forward_kept_bytes, grid_local_params,
                                             holds_ends, kept_activation_bytes, ring_attention_bytes)

__all__ = ["MemoryBreakdown", "STATE_BYTES", "FROZEN_BYTES", "INIT_MODES", "INIT_BYTES", "state_precision",
           "model_state_bytes", "check_init", "init_peak_bytes", "activation_bytes_per_layer",
           "microbatches_in_flight", "kept_activations", "RankParams", "rank_params", "decoder_memory",
           "step_instants"]


# ---- model state (ZeRO paper) --------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device; ``host_*`` is what CPU offload keeps in host memory instead.

    `total` is the training peak: what is alive at the step's fullest instant, `phase`
    (`step_instants`; "" where the step is not split into instants): parameters as held then,
    gradients, optimizer state, activations, the temporaries and communication `buffers`, and the
    frozen copies of the trainable parameters a run keeps beside them (`reference`: GRPO's
    reference policy with full weights, `ModelSpec.frozen_copies`); `init` the peak while
    the model is built or loaded and sharded, before training; `baseline` what the process holds
    before any model (a CPU engine's torch and gloo). `peak`, what must fit, is the baseline plus
    the larger of the two phases.
    """

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0
    host_params: float = 0.0
    host_grads: float = 0.0
    host_optimizer: float = 0.0
    buffers: float = 0.0
    init: float = 0.0
    baseline: float = 0.0
    reference: float = 0.0
    phase: str = ""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.reference

    @property
    def peak(self) -> float:
        return self.baseline + max(self.total, self.init)

    @property
    def host_total(self) -> float:
        return self.host_params + self.host_grads + self.host_optimizer


# bytes per parameter: (parameters, gradients, optimizer states). "mixed" is the ZeRO paper's
# 2 + 2 + K with K = 12 for Adam (fp32 master weights, momentum, variance).
STATE_BYTES = {
    ("mixed", "adam"): (2, 2, 12), ("fp32", "adam"): (4, 4, 8),
    ("mixed", "sgd"): (2, 2, 8), ("fp32", "sgd"): (4, 4, 4),
}


def state_precision(layout: Layout) -> str:
    """The state accounting of `STATE_BYTES` the kit's bf16 really holds: float32 parameters and
    gradients with bf16 compute (autocast; FSDP's MixedPrecisionPolicy keeps float32 shards and
    reduces in float32), so "fp32"; only bf16 working shards with the master beside the optimizer
    state (memory tiers, `bf16_working_shards`) are the ZeRO paper's "mixed" 2 + 2 + 12."""
    return "mixed" if bf16_working_shards(layout.tiers, layout.precision, layout.zero) else "fp32"


FROZEN_BYTES = 4  # a frozen weight holds its stored copy only: fp32, the kit's (and from_pretrained's) dtype


def model_state_bytes(n_params: float, *, zero: int, dp: int, precision: str = "mixed",
                      optimizer: str = "adam", offload: bool = False, trainable: float = 1.0) -> MemoryBreakdown:
    """Per-device bytes of parameters, gradients and optimizer states under ZeRO stage `zero`.

    Stage 1 shards the optimizer states over `dp`, 2 the gradients too, 3 the parameters too.
    `offload` moves every sharded part (and the optimizer states) to host memory; what stays
    replicated stays on the device, as in ZeRO-Offload and FSDP's CPUOffloadPolicy.
    Only the `trainable` share of the parameters (a PEFT model's adapters) has gradients and
    optimizer state; the frozen rest holds its weights (`FROZEN_BYTES` each), sharded like them.
    """
    if (precision, optimizer) not in STATE_BYTES:
        raise ValueError(f"precision={precision!r}, optimizer={optimizer!r} is not modelled; use "
                         "precision 'mixed' or 'fp32' and optimizer 'adam' or 'sgd'")
    if zero not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"zero={zero}, dp={dp}: zero is 0..3 and dp a positive integer")
    if not 0.0 <= trainable <= 1.0:
        raise ValueError(f"trainable={trainable!r} is the share of parameters that train, between 0 and 1")
    params, grads, states = STATE_BYTES[precision, optimizer]
    per_param = (trainable * params + (1 - trainable) * FROZEN_BYTES, trainable * grads, trainable * states)
    sharded = (zero >= 3, zero >= 2, zero >= 1)
    device, host = [], []
    for bytes_, is_sharded, is_optimizer in zip(per_param, sharded, (False, False, True)):
        amount = n_params * bytes_ / (dp if is_sharded else 1)
        moved = offload and (is_sharded or is_optimizer)
        device.append(0.0 if moved else amount)
        host.append(amount if moved else 0.0)
    return MemoryBreakdown(*device, host_params=host[0], host_grads=host[1], host_optimizer=host[2])


# ---- building the model (before training) -------------------------------------------------------
INIT_MODES = ("meta", "full", "pretrained")
INIT_BYTES = 4  # parameters materialise in fp32 (bf16 layouts keep fp32 master weights)


def check_init(init: str) -> None:
    """Refuse an `init` that is not one of `INIT_MODES`, saying what each means."""
    if init not in INIT_MODES:
        raise ValueError(f"init={init!r}; choose 'meta' (parallelize a factory or a meta-device model), "
                         "'full' (a model built whole on every rank) or 'pretrained' (from_pretrained)")


def init_peak_bytes(init: str, *, model_params: float, local_params: float, largest_tensor: float,
                    block_params: float, param_bytes: int = INIT_BYTES, shard_bytes: int | None = None) -> float:
    """Bytes one rank holds at the peak of building (or loading) and sharding its model.

    `local_params` is what the rank keeps once sharded, `largest_tensor` the largest parameter
    whole, `block_params` one repeated block as a rank reads it.
    - "meta" (`parallelize(factory)` or a meta model): the rank's own shards plus two full
      tensors: recording the init runs each random op once on a full-size temporary, and
      materialising computes one full tensor on the CPU before copying its shard out.
    - "full" (a model built normally): the whole model on every rank plus one tensor in flight
      of the per-tensor broadcast from rank 0; sharding happens after this peak.
    - "pretrained" (`from_pretrained`): the rank's own shards plus one block read from the
      safetensors files.
    `shard_bytes`: bytes per kept parameter where the shards are kept narrower than they are
    computed (memory tiers' bf16 working shards); default `param_bytes`.
    """
    check_init(init)
    kept = (param_bytes if shard_bytes is None else shard_bytes) * local_params
    extra = {"meta": kept + 2 * largest_tensor * param_bytes,
             "full": (model_params + largest_tensor) * param_bytes,
             "pretrained": kept + block_params * param_bytes}
    return extra[init]


# ---- activations (Korthikanti et al. 2022) -------------------------------------------------------
def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sp: bool = False, recompute: str = "none",
                               dtype_bytes: int = 2) -> float:
    """Activation bytes one transformer layer keeps for backward, 16-bit activations.

    none: sbh(34 + 5as/h); tensor parallel: sbh(10 + 24/t + 5as/(ht)); with sequence parallel:
    (sbh/t)(34 + 5as/h); selective recompute drops the 5as/h attention term; full recompute keeps
    only the layer input, 2sbh (÷t with SP). `dtype_bytes=4` (fp32 CPU runs) scales every term by 2,
    1-byte dropout masks included (an upper bound: the reference GPT has no dropout).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}; choose 'none', 'selective' or 'full'")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    scale = dtype_bytes / 2
    if recompute == "full":
        return scale * 2 * s * b * h / (t if sp else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return scale * s * b * h / t * (34 + attention)
    return scale * s * b * h * (10 + 24 / t + attention / t)


def microbatches_in_flight(layout: Layout) -> float:
    """Microbatches whose activations the first pipeline stage holds at once under the schedule."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    if layout.pp_schedule == "interleaved":
        return min(m, p * (1 + (p - 1) / (p * v)))
    return float(min(m, p))


def kept_activations(spec: ModelSpec, layout: Layout, micro: int, seq: int, act_bytes: int) -> tuple[float, float]:
    """(bytes the fullest rank keeps for backward at the end of its forward, of which the loss's
    fp32 log-probabilities): what the kit's layers save (`tensor_costs.kept_activation_bytes`:
    RMSNorm, SwiGLU, grouped heads, SDPA's output and log-sum-exp, no s² scores) times the layers
    and microbatches in flight, the final norm, rotary tables and log-probabilities beside them.
    Full recompute keeps a layer's input only, selective its matmul and SDPA outputs (a grid its input
    and SDPA's: `_layer_kept`); backward rebuilds one layer whole (`rebuilt_layer_bytes`), not counted here."""
    _, outside = kept_activation_bytes(spec, layout, micro, seq, act_bytes)
    log_probs = micro * seq * spec.vocab_size * 4 if holds_ends(layout)[1] else 0.0
    layers = _stage_layers_kept(spec, layout, micro, seq, act_bytes) * microbatches_in_flight(layout)
    return layers + outside - micro * seq * spec.vocab_size * 4 + log_probs, log_probs


def _stage_layers_kept(spec: ModelSpec, layout: Layout, micro: int, seq: int, act_bytes: int) -> float:
    """What one microbatch leaves kept in a stage's layers (the whole model's without a pipeline)."""
    return spec.n_layer / layout.pp * _layer_kept(spec, layout, micro, seq, act_bytes)


def _rebuilds_layers(layout: Layout) -> bool:
    """Whether backward rebuilds each layer (almost) whole (`recompute_work`)."""
    return recompute_work(layout) in ("full", "matmuls")


def _layer_kept(spec: ModelSpec, layout: Layout, micro: int, seq: int, act_bytes: int) -> float:
    """One layer's kept tensors for one microbatch: under full recompute its input; selective on a
    grid its input and SDPA's output with its fp32 log-sum-exp (traced, tp4 2d and tp8 3d: within
    2 KiB a layer); otherwise `kept_activation_bytes`' layer."""
    tokens = micro * seq
    if layout.checkpointing == "full":
        return _layer_input_bytes(spec, layout, tokens, act_bytes)
    if recompute_work(layout) == "matmuls":
        grid = GridShape.of(layout)
        sdpa = tokens / grid.batch_pieces * spec.n_head / grid.q * (spec.head_dim * act_bytes + 4)
        return _layer_input_bytes(spec, layout, tokens, act_bytes) + sdpa
    return kept_activation_bytes(spec, layout, micro, seq, act_bytes)[0]


def rebuilt_layer_bytes(spec: ModelSpec, layout: Layout, micro: int, seq: int, act_bytes: int) -> float:
    """What backward adds while it rebuilds a layer (`_rebuilds_layers`): the layer's whole kept
    activations less what it kept (0 where nothing is rebuilt whole). Present in backward only:
    the trace's peak under full recompute is a layer's backward, not the loss."""
    if not _rebuilds_layers(layout):
        return 0.0
    whole = kept_activation_bytes(spec, layout.replace(checkpointing="none"), micro, seq, act_bytes)[0]
    return whole - _layer_kept(spec, layout, micro, seq, act_bytes)


@dataclass(frozen=True)
class RebuiltMLP:
    """Under full recompute a step peaks inside a rebuilt layer's MLP backward, after the down
    projection's and before the gate's and up projection's (traced, 70B at 2 to 128 sequences per
    rank, to the byte): the down projection's saved input is `freed`; its weight gradient is the
    only one of the layer's in `grads` (compute dtype); three gradients of the hidden width and
    the residual stream's are the `temporaries`."""

    freed: float
    grads: float
    temporaries: float

    @classmethod
    def of(cls, spec: ModelSpec, layout: Layout, tokens: int, act_bytes: int, split: int) -> "RebuiltMLP":
        hidden = tokens * spec.ffn_hidden / split * act_bytes
        return cls(freed=hidden, grads=spec.d_model * spec.ffn_hidden / split * act_bytes,
                   temporaries=3 * hidden + _layer_input_bytes(spec, layout, tokens, act_bytes))


def _layer_input_bytes(spec: ModelSpec, layout: Layout, tokens: int, act_bytes: int) -> float:
    """A layer's input, what full recompute keeps: the residual stream, float32 under autocast."""
    split = layout.tp if layout.tp_mode == "1d" else GridShape.of(layout).matrix_pieces
    return tokens * spec.d_model / split * (4 if autocast(layout) else act_bytes)


# ---- what the fullest rank holds ----------------------------------------------------------------
@dataclass(frozen=True)
class RankParams:
    """The fullest rank's parameters after the tp / pp / ep / grid splits: `local` in all, `layer`
    one transformer layer's share, `trainable` the share of `local` that trains, `experts` the
    expert weights among `local` (0 without ep)."""

    local: float
    layer: float
    trainable: float
    experts: float


def _local_params(spec: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(parameters on the fullest rank, one transformer layer's share) after TP and PP splits.

    Matrices are split over tp (vocabulary too); norm weights and MoE routers are replicated. With pp > 1 the
    fullest rank holds the first stage (embedding) or the last (final norm and output head).
    """
    t, d = layout.tp, spec.d_model
    router = d * spec.n_experts  # a MoE layer's router stays whole on every tp rank
    layer = (spec.layer_matrix_params - router) / t + router + 2 * d
    layers = spec.n_layer / layout.pp * layer
    embedding = spec.vocab_size * d / t
    head = 0 if spec.tied_embeddings and layout.pp == 1 else embedding
    if layout.pp == 1 or layout.pp_schedule == "zbv":  # ZB-V: rank 0 holds the first and last stage
        return layers + embedding + head + d, layer
    return layers + max(embedding, head + d), layer


def _with_whole_adapters(spec: ModelSpec, local: float) -> tuple[float, float]:
    """(parameters on a grid rank, the share of them that train): a tensor grid splits the base
    model but keeps LoRA's adapters, `spec.trainable` of all parameters, whole on every rank
    (`parallel/adapters/grid.py`)."""
    if spec.trainable >= 1.0:
        return local, 1.0
    adapters = spec.n_params * spec.trainable / (1.0 - spec.trainable)  # n_params: the base's sizes
    return local + adapters, adapters / (local + adapters)


def rank_params(spec: ModelSpec, layout: Layout) -> RankParams:
    """What the fullest rank holds of a decoder's parameters under `layout`.

    Expert parallel: a rank keeps n_experts/ep of each layer's experts, of those its tp slice
    (tp splits every expert inside) and its pp stage's layers."""
    grid = layout.tp_mode != "1d"
    local, layer_params = grid_local_params(spec, layout) if grid else _local_params(spec, layout)
    local, trainable = _with_whole_adapters(spec, local) if grid else (local, spec.trainable)
    inside = layout.tp * layout.pp
    experts = local_expert_params(spec, layout.ep) / inside if layout.ep > 1 else 0.0
    if experts:
        local -= spec.expert_params / inside - experts
    layer_params -= spec.layer_expert_params / layout.tp * (1 - 1 / layout.ep)
    return RankParams(local, layer_params, trainable, experts)


def _state(local: float, experts: float, layout: Layout, shard: int, zero: int,
           **options: Any) -> MemoryBreakdown:
    """Model state of a rank holding `local` parameters of which `experts` are its expert weights
    (0 without ep): those are sharded over the dp/ep ranks holding the same experts, the rest
    over `shard` ranks."""
    dense = model_state_bytes(local - experts, zero=zero, dp=shard, **options)
    if not experts:
        return dense
    own = model_state_bytes(experts, zero=zero, dp=shard // layout.ep, **options)
    return MemoryBreakdown(**{part.name: getattr(dense, part.name) + getattr(own, part.name)
                              for part in fields(MemoryBreakdown) if part.name != "phase"})


def decoder_memory(spec: ModelSpec, layout: Layout, rank: RankParams, dev: DeviceSpec, *, global_batch: int,
                   seq_len: int, optimizer: str, init: str) -> tuple[dict[str, MemoryBreakdown], MemoryBreakdown]:
    """({instant: the memory then} over the step's fullest instants, `step_instants`; the model
    state at rest between steps) of a decoder's fullest rank holding `rank`. Every instant carries
    the build's peak (`init`), the process baseline and the host's share.

    Model state: the ZeRO accounting; zero=2 is FSDP with reshard_after_forward=False, which keeps
    the gathered parameters from forward to backward and reshards after backward (at rest =
    ZeRO-3). CPU offload moves state to host memory; where the host is the device (a CPU: host
    bandwidth infinite) it moves nothing and the state stays on the device.
    """
    act_bytes = 2 if layout.precision == "bf16" else 4
    shard = layout.dp * layout.cp if layout.zero >= 2 else layout.dp
    local, layer_params, experts = rank.local, rank.layer, rank.experts
    offloaded = layout.offload and not math.isinf(dev.host_bandwidth)
    state_options = dict(precision=state_precision(layout), optimizer=optimizer, offload=offloaded,
                         trainable=rank.trainable)
    state = _state(local, experts, layout, shard, layout.zero, **state_options)
    resting = _state(local, experts, layout, shard, 3 if layout.zero == 2 else layout.zero, **state_options)
    init_bytes = init_peak_bytes(init, model_params=spec.n_params,
                                 local_params=local / shard if layout.zero >= 2 else local,
                                 largest_tensor=spec.largest_tensor,
                                 block_params=layer_params if layout.tp_mode != "1d" else
                                 (spec.layer_matrix_params + 2 * spec.d_model) / layout.tp,
                                 shard_bytes=2 if bf16_working_shards(layout.tiers, layout.precision,
                                                                      layout.zero) else None)
    copies = _frozen_copies(spec, rank, layout, shard, state_options)
    micro = global_batch // layout.dp // layout.microbatches
    instants = step_instants(spec, layout, rank, state, resting, micro=micro, seq=seq_len // layout.cp,
                             act_bytes=act_bytes, shard=shard, adam=optimizer == "adam")
    extra = dict(host_params=state.host_params + copies.host_params, host_grads=state.host_grads,
                 host_optimizer=state.host_optimizer, init=init_bytes, baseline=dev.process_memory,
                 reference=copies.params)
    return {name: replace(instant, **extra) for name, instant in instants.items()}, resting


def step_instants(spec: ModelSpec, layout: Layout, rank: RankParams, state: MemoryBreakdown,
                  resting: MemoryBreakdown, *, micro: int, seq: int, act_bytes: int, shard: int,
                  adam: bool = True) -> dict[str, MemoryBreakdown]:
    """The device memory of the fullest rank at the instants a traced step peaks (docs/planner.md,
    "The step's fullest instants"; checked by `dry_run` at 8-512 ranks):

    - "loss": forward done, the loss computed. Every layer's kept activations; no gradients (the
      last step's were set to None; earlier microbatches' where a step accumulates); FSDP has
      resharded every zero3 unit after its forward (zero2 keeps them gathered); the loss's fp32
      log-probabilities (among the activations) and two more token x vocabulary fp32 tensors beside
      them (the float logits and log-softmax's result before it is kept).
    - "head": backward through the output head. The log-probabilities are freed; the gradient of
      the logits (compute dtype) and the head's weight gradient twice (computed, then accumulated);
      zero3 has gathered the root unit (embedding, head, final norm) again.
    - "layer" (zero 2/3): the last layer's backward done, its reduce-scatter running while the next
      layer is gathered: the head's and that layer's unsharded gradients (compute dtype) among the
      gradients with the layer's first shard, the layer's gradients again in compute dtype and
      as the fp32 reduce-scatter input among the temporaries; its activations freed.
    - "optimizer": activations gone, every gradient present (tp alone keeps the embedding's whole,
      vocabulary-parallel gradient), Adam's update holding two fp32 temporaries of the largest tensor.
    - "backward end" (zero 2/3): the root unit's reduce-scatter, its unsharded gradients and the
      flat fp32 input they are copied into (on gloo a staging copy too; measured on the engines).
    """
    split = layout.tp if layout.tp_mode == "1d" else GridShape.of(layout).matrix_pieces
    root = rank.local - spec.n_layer / layout.pp * rank.layer
    sharded = resting.params if layout.zero >= 2 else state.params
    kept_gathered = rank.local * act_bytes if layout.zero == 2 or _stages_stay_gathered(layout) else 0.0
    root_gathered = root * act_bytes if layout.zero == 3 and not kept_gathered else 0.0
    # gradients exist once a microbatch's backward is done: a pipeline's first stage holds its
    # most microbatches before its first backward ends unless more are queued than it holds
    accumulated = 0.0
    if layout.microbatches > microbatches_in_flight(layout):
        accumulated = pipeline_unsharded_grads(layout, rank, act_bytes) or state.grads
    # zbv's weight passes, which make the unsharded gradients, trail its losses: when a rank holds
    # the most microbatches in flight only its later chunk's have run (half its layers)
    at_loss = accumulated / 2 if splits_backward(layout) else accumulated
    activations, log_probs = kept_activations(spec, layout, micro, seq, act_bytes)
    head = spec.vocab_size * spec.d_model / split if log_probs else 0.0
    logits = micro * seq * spec.vocab_size if log_probs else 0.0
    instants = {
        "loss": MemoryBreakdown(sharded + kept_gathered, at_loss, state.optimizer,
                                activations + _autocast_weight_cache(spec, layout, rank, split),
                                buffers=2 * logits * 4, phase="loss"),
        "head": MemoryBreakdown(sharded + kept_gathered + root_gathered, at_loss, state.optimizer,
                                activations - log_probs, buffers=(logits + 2 * head) * act_bytes, phase="head"),
    }
    rebuilt = rebuilt_layer_bytes(spec, layout, micro, seq, act_bytes)
    rebuilt_mlp = RebuiltMLP.of(spec, layout, micro * seq, act_bytes, split) if rebuilt else RebuiltMLP(0.0, 0.0, 0.0)
    layer_gathered = rank.layer * act_bytes if layout.zero == 3 and not kept_gathered else 0.0
    if layout.zero >= 2:
        last_layer, outside = kept_activation_bytes(spec, layout, micro, seq, act_bytes)
        final_norm = _final_norm_bytes(spec, outside, micro, seq, act_bytes)
        # their backward is done: the last layer's (a rebuilt one's is added back), and under full
        # recompute the final norm's too (traced: the rebuilt layer's peak comes after them)
        freed = final_norm if rebuilt else last_layer
        instants["layer"] = MemoryBreakdown(
            sharded + kept_gathered + root_gathered + layer_gathered,
            accumulated + head * act_bytes + (rebuilt_mlp.grads if rebuilt else rank.layer * act_bytes)
            + rank.layer * 4 / shard, state.optimizer, activations - log_probs - freed + rebuilt - rebuilt_mlp.freed,
            buffers=_layer_buffers(layout, rank, act_bytes, layer_gathered) + rebuilt_mlp.temporaries,
            phase="layer")
    elif rebuilt:
        instants["rebuilt layer"] = MemoryBreakdown(
            sharded + kept_gathered, accumulated + head * 4 + rebuilt_mlp.grads * 4 / act_bytes, state.optimizer,
            activations - log_probs + rebuilt - rebuilt_mlp.freed, buffers=rebuilt_mlp.temporaries,
            phase="rebuilt layer")
    ring = ring_attention_bytes(spec, layout, micro, seq, act_bytes)
    if ring:
        fsdp = layout.zero >= 2
        before = MemoryBreakdown(instants.get("layer", instants["head"]).params,
                                 accumulated + head * (act_bytes if fsdp else 4), state.optimizer,
                                 activations - log_probs, buffers=ring)
        # FSDP: under full recompute the last layer's reduce-scatter runs; without it the layer's own
        # gradients wait, unreduced
        reducing = 0.0 if not fsdp else (_layer_buffers(layout, rank, act_bytes, layer_gathered) if rebuilt
                                         else rank.layer * act_bytes)
        instants["ring attention"] = _ring_attention(spec, layout, rank, before, micro=micro, seq=seq,
                                                     act_bytes=act_bytes, shard=shard, rebuilt=rebuilt,
                                                     reducing=reducing)
    whole_embedding = spec.vocab_size * spec.d_model * 4 * (1 - 1 / split) if layout.zero < 2 and split > 1 else 0.0
    largest = spec.largest_tensor / split / (shard if layout.zero >= 2 else 1)
    instants["optimizer"] = MemoryBreakdown(sharded, state.grads + whole_embedding, state.optimizer,
                                            buffers=(2 if adam else 1) * largest * 4, phase="optimizer")
    if layout.pp > 1 and layout.pp_schedule != "zbv":
        instants["last stage"] = _last_stage(spec, layout, state, sharded + kept_gathered, micro=micro, seq=seq,
                                             act_bytes=act_bytes)
    if _averages_itself(layout) and layout.dp * layout.cp > 1 and layout.ep == 1:  # `GradientAverager`
        grads = state.grads + whole_embedding
        instants["gradient average"] = MemoryBreakdown(sharded, grads, state.optimizer,
                                                       buffers=min(grads, GRADIENT_BUCKET_BYTES),
                                                       phase="gradient average")
    if layout.zero >= 2:
        instants["backward end"] = MemoryBreakdown(sharded + root_gathered, state.grads, state.optimizer,
                                                   buffers=2 * max(root, rank.layer) * 4, phase="backward end")
    buckets = ddp_bucket_bytes(layout, rank)
    held = pipeline_held_bytes(spec, layout, micro=micro, seq=seq, act_bytes=act_bytes)
    middle = middle_stage_surplus(spec, layout, micro=micro, seq=seq, act_bytes=act_bytes)
    return {name: replace(instant, activations=instant.activations + buckets + (
                0.0 if name == "optimizer" else held if name == "last stage" else held + middle))
            for name, instant in instants.items()}


def _ring_attention(spec: ModelSpec, layout: Layout, rank: RankParams, before: MemoryBreakdown, *, micro: int,
                    seq: int, act_bytes: int, shard: int, rebuilt: float, reducing: float) -> MemoryBreakdown:
    """A layer's ring attention backward (`ring_attention_bytes`, among `before`'s buffers), its
    feed-forward's done: the layer's gradients unsharded beside `before`'s (the head's, earlier
    microbatches'). Without full recompute the last layer's, whose other kept tensors are freed;
    under it the next layer's, rebuilt less its feed-forward, while FSDP reduces the last one's
    gradients (`reducing`). `before`: the backward's start, the log-probabilities freed."""
    last_layer, outside = kept_activation_bytes(spec, layout, micro, seq, act_bytes)
    fsdp = layout.zero >= 2
    kept = before.activations - last_layer
    if rebuilt:
        kept = (before.activations - _final_norm_bytes(spec, outside, micro, seq, act_bytes) + rebuilt
                - feed_forward_kept_bytes(spec, layout, micro, seq, act_bytes))
    return replace(before, grads=before.grads + rank.layer * (act_bytes + 4 / shard if fsdp else 4),
                   activations=kept, buffers=before.buffers + reducing, phase="ring attention")


def _final_norm_bytes(spec: ModelSpec, outside: float, micro: int, seq: int, act_bytes: int) -> float:
    """The final norm's share of what is kept outside the layers (`kept_activation_bytes`): less the
    log-probabilities and the rotary tables."""
    return outside - micro * seq * spec.vocab_size * 4 - 2 * seq * spec.head_dim * act_bytes


def _stages_stay_gathered(layout: Layout) -> bool:
    """zbv under zero 3 keeps each of the rank's stages gathered from its first action to its last
    (torch's pipelining runtime unshards up to three stages ahead, and the split backward's weight
    pass leaves them so): all the rank's parameters are gathered for the whole step (traced)."""
    return splits_backward(layout) and layout.zero == 3


def _layer_buffers(layout: Layout, rank: RankParams, act_bytes: int, layer_gathered: float) -> float:
    """Temporaries of the "layer" instant: the layer's gradients in compute dtype, and the fp32
    reduce-scatter input they are copied into; a pipeline stage under FSDP reduces nothing until its
    last microbatch, so there the next layer gathered ahead (zero 3) stands in place of that input
    (traced: 1f1b, interleaved and zbv at two depths)."""
    if layout.pp > 1 and layout.zero >= 2:
        return rank.layer * act_bytes + layer_gathered
    return rank.layer * (act_bytes + 4)


def pipeline_unsharded_grads(layout: Layout, rank: RankParams, act_bytes: int) -> float:
    """Under FSDP (zero 2/3) a pipeline stage turns gradient sync off until its last microbatch, so
    every local parameter's gradient stays unsharded from its first backward to the step's end, in
    the fp32 reduce dtype FSDP's post-backward upcasts it to. Under zbv the weight-gradient pass
    runs after that hook: zero 3 keeps them in the parameters' dtype only, zero 2 in both (traced at
    two depths, bf16: 4, 2 and 6 bytes per parameter). 0 where there is no such stage."""
    if layout.pp == 1 or layout.zero < 2:
        return 0.0
    per_param = 4 if not splits_backward(layout) else act_bytes if layout.zero == 3 else 4 + act_bytes
    return rank.local * rank.trainable * per_param


def stage_boundaries_held(layout: Layout) -> int:
    """Stage-boundary tensors the fullest pipeline rank keeps per microbatch until the step's end:
    each of its stages' output unless it is the last stage, and its input gradient unless it is the
    first, one more under zbv (measured at pp2 for 1f1b 1 and 1, interleaved v2 3 and 3, zbv 3 and 5;
    a real gloo world keeps them too). Under interleaving and zbv a middle rank is the fullest once
    there is one (pp > 2); under 1F1B a middle rank holds one microbatch fewer in flight, and is
    counted apart (`middle_stage_surplus`)."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return 0
    if layout.pp_schedule == "zbv":
        return 5  # rank r holds stages r and 2p-1-r; any middle rank: 2 + 2, and zbv's one more
    if layout.pp_schedule == "interleaved":
        return 2 * v if p > 2 else 2 * v - 1
    return 1  # 1F1B, GPipe: the first stage's outputs, the last's input gradients (a middle rank's: below)


def middle_stage_surplus(spec: ModelSpec, layout: Layout, *, micro: int, seq: int, act_bytes: int) -> float:
    """What a middle 1F1B rank (pp > 2) holds beyond the first stage: each microbatch's input
    gradient beside its output, with one microbatch fewer in flight (traced at pp8 with 32
    one-sequence microbatches: the first stage, a middle one and the last); 0 where the first
    stage is the fuller."""
    if layout.pp <= 2 or layout.pp_schedule != "1f1b":
        return 0.0
    boundaries = layout.microbatches * _boundary_bytes(spec, layout, micro * seq, act_bytes)
    return max(0.0, boundaries - _stage_layers_kept(spec, layout, micro, seq, act_bytes))


def pipeline_held_bytes(spec: ModelSpec, layout: Layout, *, micro: int, seq: int, act_bytes: int) -> float:
    """What a pipeline rank's step keeps per microbatch until the step ends, for every microbatch
    (`stage_boundaries_held` tensors of tokens x width: the dtype a boundary carries, as in
    `_last_stage`); grows with the microbatch count (dry runs: exactly linear from the warm-up on,
    docs/planner.md "Many microbatches"). The tracker files them as activations and temporaries."""
    return layout.microbatches * stage_boundaries_held(layout) * _boundary_bytes(spec, layout, micro * seq, act_bytes)


def _boundary_bytes(spec: ModelSpec, layout: Layout, tokens: int, act_bytes: int) -> float:
    """One stage-boundary tensor of `tokens` x width: compute dtype where FSDP casts the
    parameters, float32 under autocast (its residual stream stays float32)."""
    return tokens * spec.d_model * (act_bytes if layout.zero >= 2 else 4)


def ddp_bucket_bytes(layout: Layout, rank: RankParams) -> float:
    """DDP (zero 0/1 data parallel where it can wrap the model: no tp, tensor grid, experts or
    pipeline under zero 0, whose DTensors or stages `GradientAverager` reduces instead) keeps its
    gradient buckets beside the gradients from the first backward on: a float32 copy of every
    trainable local parameter (`gradient_as_bucket_view` is off). Allocated in the first step's
    forward, the memory tracker files them as activations, so they are counted there, at every
    instant."""
    uses_ddp = layout.zero < 2 and layout.dp * layout.cp > 1 and not _averages_itself(layout)
    return 4 * rank.local * rank.trainable if uses_ddp else 0.0


def _averages_itself(layout: Layout) -> bool:
    """Whether zero 0 data parallel averages the gradients with `GradientAverager` (DTensors, stages
    or experts, which DDP cannot wrap): after backward it copies a bucket of local gradients at a
    time into one flat tensor for its all-reduce (before buckets, one copy of them all: 70B tp2 cp2
    traced 37.75 GiB, 7.84 of it that copy)."""
    return layout.zero == 0 and (layout.tp > 1 or layout.tp_mode != "1d" or layout.pp > 1 or layout.ep > 1)


def _last_stage(spec: ModelSpec, layout: Layout, state: MemoryBreakdown, params: float, *, micro: int, seq: int,
                act_bytes: int) -> MemoryBreakdown:
    """A pipeline's last stage at its last microbatch's loss (dry runs: pp2 at two sizes; 2, 4 and 8
    microbatches of one size; pp4): the layers, final norm and log-probabilities of the microbatches
    in flight there and each one's output logits, which the schedule holds for its backward (token x
    vocabulary in the compute dtype), the stage's received input, every gradient of the earlier
    microbatches, and the loss's two token x vocabulary fp32 temporaries. 1F1B and interleaved run each backward
    right after its forward: one microbatch in flight (what each earlier one leaves is its stage
    boundary, `pipeline_held_bytes`). GPipe runs every forward before any backward: all of them,
    and no gradient yet."""
    per_layer, outside = kept_activation_bytes(spec, layout, micro, seq, act_bytes)
    tokens = micro * seq
    boundary = _boundary_bytes(spec, layout, tokens, act_bytes)
    gpipe = layout.pp_schedule == "gpipe"
    in_flight = layout.microbatches if gpipe else 1
    kept = in_flight * (spec.n_layer / layout.pp * per_layer + outside + tokens * spec.vocab_size * act_bytes)
    grads = state.grads if layout.microbatches > 1 and not gpipe else 0.0
    return MemoryBreakdown(params, grads, state.optimizer, kept + boundary,
                           buffers=2 * tokens * spec.vocab_size * 4 + boundary, phase="last stage")


def _autocast_weight_cache(spec: ModelSpec, layout: Layout, rank: RankParams, split: int) -> float:
    """The bf16 copies autocast caches of every linear's weight (not the embedding's, nor the
    norms') from the forward until the loss leaves autocast: among the activations at the loss.
    1d only: a tensor grid casts the weights it gathers itself (`parallel/tensor_grid.py`)."""
    if not autocast(layout) or layout.tp_mode != "1d":
        return 0.0
    embedding = 0.0 if spec.tied_embeddings else spec.vocab_size * spec.d_model / split
    norms = (2 * spec.n_layer / layout.pp + 1) * spec.d_model
    return (rank.local - embedding - norms) * 2


def _frozen_copies(spec: ModelSpec, rank: RankParams, layout: Layout, shard: int,
                   state_options: dict[str, Any]) -> MemoryBreakdown:
    """The `params` (on the device) and `host_params` (offloaded) of `spec.frozen_copies` copies of
    the rank's trainable parameters: each a clone of the local tensors as they rest between steps
    (zero 2 and 3 sharded, offloaded ones on the host) in the parameters' own dtype."""
    if not spec.frozen_copies:
        return MemoryBreakdown(0.0, 0.0, 0.0)
    options = {**state_options, "trainable": 1.0}
    one = _state(rank.local, rank.experts, layout, shard, 3 if layout.zero == 2 else layout.zero, **options)
    scale = spec.frozen_copies * rank.trainable
    return MemoryBreakdown(one.params * scale, 0.0, 0.0, host_params=one.host_params * scale)
