"""Analytic memory / communication / time model of a `Layout`, and the `plan()` search over layouts.

Pure Python and arithmetic (torch is imported only to measure the CPU): the picker and the planner
work in a notebook kernel with no cluster. The formulas, with their sources, are in docs/planner.md:
model state from the ZeRO paper (Rajbhandari et al. 2020, Table 1), activations from Korthikanti et
al. 2022, collective volumes from the ring algorithms, the pipeline bubble from Narayanan et al.
2021 and compute from 6Ψ FLOPs per token plus attention.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from colab_par.planning.devices import (CPU_PROCESS_BYTES, CPU_WRAPPER_COST, DEVICES, GiB, DeviceSpec,
                               cpu_compute_costs, cpu_device, get_device, measure_cpu_device)
from colab_par.planning.expert_costs import all_to_all_bytes, expert_flops_share, local_expert_params, packed_regroup_bytes
from colab_par.planning.flops import ModelSpec, flops_per_token
from colab_par.layout import CP_MODES, TP_MODES, Choices, Layout, LayoutError, valid_layouts
from colab_par.planning.module_spec import ModuleSpec
from colab_par.planning.tensor_costs import GridShape, grid_local_params, kept_activation_bytes, tensor_comm_bytes
from colab_par.planning.tier_costs import HEAP_COSTS, TierPlan, tier_plan
from colab_par.layout.tier_options import MemoryTiers, bf16_working_shards

__all__ = ["MemoryBreakdown", "ModelSpec", "DeviceSpec", "Plan", "DEVICES", "GiB", "INIT_MODES",
           "FROZEN_BYTES", "model_state_bytes", "init_peak_bytes",
           "activation_bytes_per_layer", "pipeline_bubble", "get_device", "measure_cpu_device",
           "cpu_device", "cpu_compute_costs", "estimate", "search_space", "preferred",
           "candidate_layouts", "plan", "flops_per_token", "packed_attention_bytes", "CPU_PROCESS_BYTES",
           "CPU_WRAPPER_COST"]


# ---- model state (ZeRO paper) --------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device; ``host_*`` is what CPU offload keeps in host memory instead.

    `total` is the training peak (model state, activations and the step's communication
    `buffers`); `init` the peak while the model is built or loaded and sharded, before training;
    `baseline` what the process holds before any model (a CPU engine's torch and gloo). `peak`,
    what must fit, is the baseline plus the larger of the two phases.
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

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def peak(self) -> float:
        return self.baseline + max(self.total, self.init)

    @property
    def host_total(self) -> float:
        return self.host_params + self.host_grads + self.host_optimizer


# bytes per parameter: (parameters, gradients, optimizer states). "mixed" is the ZeRO paper's
# 2 + 2 + K with K = 12 for Adam (fp32 master weights, momentum, variance).
_STATE_BYTES = {
    ("mixed", "adam"): (2, 2, 12), ("fp32", "adam"): (4, 4, 8),
    ("mixed", "sgd"): (2, 2, 8), ("fp32", "sgd"): (4, 4, 4),
}


def _state_precision(layout: Layout) -> str:
    """The state accounting of `_STATE_BYTES` the kit's bf16 really holds: float32 parameters and
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
    if (precision, optimizer) not in _STATE_BYTES:
        raise ValueError(f"precision={precision!r}, optimizer={optimizer!r} is not modelled; use "
                         "precision 'mixed' or 'fp32' and optimizer 'adam' or 'sgd'")
    if zero not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"zero={zero}, dp={dp}: zero is 0..3 and dp a positive integer")
    if not 0.0 <= trainable <= 1.0:
        raise ValueError(f"trainable={trainable!r} is the share of parameters that train, between 0 and 1")
    params, grads, states = _STATE_BYTES[precision, optimizer]
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


def _check_init(init: str) -> None:
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
    _check_init(init)
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


def pipeline_bubble(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p−1)/(m·v + p − 1) (v = 1 for GPipe and 1F1B).

    ZB-V splits the weight-gradient pass off the backward pass and fills the bubble with it; we
    model a third of the interleaved bubble, the saving the zero-bubble paper reports for ZB-H1.
    """
    if pp == 1:
        return 0.0
    v = virtual_stages if schedule in ("interleaved", "zbv") else 1
    bubble = (pp - 1) / (microbatches * v + pp - 1)
    return bubble / 3 if schedule == "zbv" else bubble


# ---- one layout ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The estimate for one layout: per-device peak memory, step time (s), MFU and whether it fits.

    `resting` is the model state between steps (what `memory_report` measures); `times` splits the
    step into compute, bubble and exposed communication seconds; `init` is how the model is built
    (`INIT_MODES`), and `fits` holds only if that build's peak fits too. With memory tiers
    (`layout.tiers`), `tiers` is the state's placement and traffic (`tier_costs.TierPlan`), `memory`
    holds the device's share only (streaming buffers among the `buffers`), and `fits` also needs
    the placement to fit its budget and tiers.
    """

    layout: Layout
    memory: MemoryBreakdown
    step_time: float
    mfu: float
    fits: bool
    tokens_per_s: float = 0.0
    capacity: float = 0.0
    resting: MemoryBreakdown | None = None
    times: Mapping[str, float] = field(default_factory=dict)
    samples_per_s: float = 0.0
    init: str = "meta"
    tiers: TierPlan | None = None

    @property
    def limit(self) -> str:
        """The phase that sets the peak: "init" (building or loading the model) or "training"."""
        return "init" if self.memory.init > self.memory.total else "training"

    @property
    def throughput(self) -> str:
        """tokens/s for language models, samples/s for models without tokens."""
        return (f"{self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s
                else f"{self.samples_per_s:,.1f} samples/s")

    def __str__(self) -> str:
        return (f"{str(self.layout):<32} {self.memory.peak / GiB:8.2f} GiB  "
                f"{self.step_time * 1e3:9.1f} ms  {self.throughput:>18}  "
                f"MFU {self.mfu:6.1%}  {'fits' if self.fits else 'OOM'}" + self._tier_text())

    def _tier_text(self) -> str:
        if self.tiers is None:
            return ""
        resident = self.tiers.resident()
        return ("  tiers " + ", ".join(f"{tier} {resident[tier] / GiB:.2f} GiB" for tier in resident if resident[tier])
                + f", {self.tiers.moved / GiB:.2f} GiB moved/step" + ("" if self.tiers.fits else f" ({self.tiers.reason})"))


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


def _grid_activations(spec: ModelSpec, layout: Layout, micro: int, seq: int,
                      act_bytes: int) -> tuple[float, float]:
    """(bytes a layer keeps, bytes outside the layers) under a 2d / 2.5d / 3d grid: what the kit's
    grid layers keep (`tensor_costs`), a layer's input only under full recompute (selective is
    counted as none), plus the gathered logits alive next to the loss."""
    per_layer, outside = kept_activation_bytes(spec, layout, micro, seq, act_bytes)
    if layout.checkpointing == "full":
        per_layer = micro * seq * spec.d_model / layout.tp * act_bytes
    return per_layer, outside + micro * seq * spec.vocab_size * act_bytes


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
                              for part in fields(MemoryBreakdown)})


def _spec_of(model: Any) -> "ModelSpec | ModuleSpec":
    """A probed model as it is, anything else as a decoder's sizes (`ModelSpec.of`)."""
    return model if isinstance(model, ModuleSpec) else ModelSpec.of(model)


def _spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    return size > 1 and stride * size > gpus_per_node


def estimate(model: Any, layout: "Layout | str", *, device: "str | DeviceSpec", global_batch: int,
             seq_len: int, gpus_per_node: int = 8, optimizer: str = "adam",
             validate: bool = True, init: str = "meta", expert_load: float = 1.0,
             grad_clip: bool = False) -> Plan:
    """Predict memory and step time of `layout` for `model` (raises LayoutError if impossible).

    `init` says how the model reaches the ranks (`INIT_MODES`, see `init_peak_bytes`): the plan
    fits only if both that peak and the training peak do. `expert_load` (MoE models under ep):
    the busiest rank's routed tokens over the mean, 1.0 for balanced routing; a run's own is
    `expert_costs.ep_load` of its heat map's counts. `grad_clip`: the run clips its gradients
    (`Trainer(grad_clip=...)`), whose norm reads the gradients memory tiers keep on disk once more."""
    if expert_load < 1.0:
        raise ValueError(f"expert_load={expert_load!r} is the busiest rank's tokens over the mean, "
                         "at least 1.0 (1.0: balanced routing)")
    _check_init(init)
    layout = Layout.parse(layout)
    spec = _spec_of(model)
    dev = get_device(device, layout.world_size)
    if isinstance(spec, ModuleSpec):
        return _estimate_module(spec, layout, dev, global_batch=global_batch, gpus_per_node=gpus_per_node,
                                optimizer=optimizer, validate=validate, init=init, grad_clip=grad_clip)
    if validate:
        layout.validate(layout.world_size, spec.config(seq_len), device=dev, global_batch=global_batch)
    # bytes follow what the kit holds (bf16 layouts run in bf16 on any device, a CPU included);
    # speed follows the device's peaks (fp32's where it has no bf16 figure)
    precision = layout.precision if layout.precision in dev.peak_flops else "fp32"
    act_bytes = 2 if layout.precision == "bf16" else 4
    shard = layout.dp * layout.cp if layout.zero >= 2 else layout.dp
    grid = layout.tp_mode != "1d"
    local, layer_params = grid_local_params(spec, layout) if grid else _local_params(spec, layout)
    local, trainable = _with_whole_adapters(spec, local) if grid else (local, spec.trainable)
    # expert parallel: a rank keeps n_experts/ep of each layer's experts, of those its tp slice
    # (tp splits every expert inside) and its pp stage's layers
    inside = layout.tp * layout.pp
    experts = local_expert_params(spec, layout.ep) / inside if layout.ep > 1 else 0.0
    if experts:
        local -= spec.expert_params / inside - experts
    layer_params -= spec.layer_expert_params / layout.tp * (1 - 1 / layout.ep)

    # model state: the ZeRO accounting; zero=2 is FSDP with reshard_after_forward=False, which keeps
    # the gathered parameters from forward to backward (peak = ZeRO-2) and reshards after backward
    # (at rest = ZeRO-3).
    state_precision = _state_precision(layout)
    # CPU offload moves state to host memory; where the host is the device (a CPU: host bandwidth
    # infinite) it moves nothing and the state stays in the peak
    offloaded = layout.offload and not math.isinf(dev.host_bandwidth)
    state_options = dict(precision=state_precision, optimizer=optimizer, offload=offloaded,
                         trainable=trainable)
    state = _state(local, experts, layout, shard, layout.zero, **state_options)
    resting = _state(local, experts, layout, shard, 3 if layout.zero == 2 else layout.zero, **state_options)
    # FSDP (zero 2/3): the root unit (embedding, head, final norm) stays gathered from forward to
    # the end of backward, with the current and the prefetched layer; a unit's reduce-scatter
    # holds its unsharded gradients and the flat fp32 input they are copied into (on gloo: the
    # input and a staging copy of the same size), the largest unit's at the peak.
    root = local - spec.n_layer / layout.pp * layer_params
    gathered = (root + 2 * layer_params) * act_bytes if layout.zero == 3 else 0.0
    buffers = 2 * max(root, layer_params) * 4 if layout.zero >= 2 else 0.0

    # activations of the fullest rank: the first stage holds the most microbatches in flight
    local_batch = global_batch // layout.dp
    micro = local_batch // layout.microbatches
    s_local = seq_len // layout.cp
    if grid:
        per_layer, logits = _grid_activations(spec, layout, micro, s_local, act_bytes)
    else:
        per_layer = activation_bytes_per_layer(s_local, micro, spec.d_model, spec.n_head, tp=layout.tp,
                                               sp=layout.sequence_parallel,
                                               recompute=layout.checkpointing, dtype_bytes=act_bytes)
        logits = micro * s_local * spec.vocab_size * (act_bytes + 4)  # gathered logits + fp32 loss
    in_flight = _microbatches_in_flight(layout)
    activations = spec.n_layer / layout.pp * per_layer * in_flight + logits
    if layout.checkpointing != "none":  # backward recomputes one layer at a time, whole
        whole = (_grid_activations(spec, layout.replace(checkpointing="none"), micro, s_local, act_bytes)[0]
                 if grid else activation_bytes_per_layer(s_local, micro, spec.d_model, spec.n_head,
                                                         tp=layout.tp, sp=layout.sequence_parallel,
                                                         dtype_bytes=act_bytes))
        activations += whole - per_layer
    init_bytes = init_peak_bytes(init, model_params=spec.n_params,
                                 local_params=local / shard if layout.zero >= 2 else local,
                                 largest_tensor=spec.largest_tensor,
                                 block_params=layer_params if grid else
                                 (spec.layer_matrix_params + 2 * spec.d_model) / layout.tp,
                                 shard_bytes=2 if bf16_working_shards(layout.tiers, layout.precision,
                                                                      layout.zero) else None)
    memory = MemoryBreakdown(state.params + gathered, state.grads, state.optimizer, activations,
                             state.host_params, state.host_grads, state.host_optimizer, buffers,
                             init_bytes, dev.process_memory)

    times = _step_times(spec, layout, dev, precision, global_batch, seq_len, gpus_per_node,
                        local, act_bytes, resting, trainable, experts, expert_load)
    memory, tiers = _place_in_tiers(layout, memory, resting, times, dev, gpus_per_node,
                                    _STATE_BYTES[state_precision, optimizer][2], grad_clip)
    step = sum(times.values())
    tokens = global_batch * seq_len
    model_flops = tokens * flops_per_token(spec, seq_len, "none")
    mfu = model_flops / (step * layout.world_size * dev.peak_flops[precision])
    capacity = 0.9 * dev.memory  # allocator fragmentation, CUDA context, NCCL buffers
    # a budget holds the build too: the tiers place the training state, not the shards being built
    built = layout.tiers.budget is None or memory.init <= layout.tiers.budget
    return Plan(layout, memory, step, mfu, memory.peak <= capacity and (tiers is None or tiers.fits) and built,
                tokens / step, capacity, resting, times, init=init, tiers=tiers)


def _estimate_module(spec: ModuleSpec, layout: Layout, dev: DeviceSpec, *, global_batch: int,
                     gpus_per_node: int, optimizer: str, validate: bool, init: str, grad_clip: bool) -> Plan:
    """`estimate` for a model the kit did not write, from its probe (`module_spec.py`).

    Parameters split evenly over tp and pp (the pipeline is cut to balance parameters); under
    zero3 the largest FSDP unit is gathered whole (with the next one prefetched), so a model
    without repeated blocks holds all its parameters unsharded during forward and backward.
    Activations and FLOPs scale the measured single sample. Tensor-parallel traffic and pipeline
    activations crossing stages are not modelled for such models (only their latency). The probe
    does not record the largest single tensor; the init peak takes the largest unit for it.
    """
    if validate:
        layout.validate(layout.world_size, spec.config(), device=dev, global_batch=global_batch)
    precision = layout.precision if layout.precision in dev.peak_flops else "fp32"  # speed, as above
    act_bytes = 2 if layout.precision == "bf16" else 4
    state_precision = _state_precision(layout)
    offloaded = layout.offload and not math.isinf(dev.host_bandwidth)  # a CPU's host is its device
    local = spec.n_params / (layout.tp * layout.pp)
    state = model_state_bytes(local, zero=layout.zero, dp=layout.dp, precision=state_precision,
                              optimizer=optimizer, offload=offloaded, trainable=spec.trainable)
    resting = model_state_bytes(local, zero=3 if layout.zero == 2 else layout.zero, dp=layout.dp,
                                precision=state_precision, optimizer=optimizer, offload=offloaded,
                                trainable=spec.trainable)
    units_in_memory = 2 if spec.n_blocks else 1
    gathered = units_in_memory * spec.unit_params / layout.tp * act_bytes if layout.zero == 3 else 0.0
    buffers = 2 * spec.unit_params / layout.tp * 4 if layout.zero >= 2 else 0.0
    init_bytes = init_peak_bytes(init, model_params=spec.n_params,
                                 local_params=local / layout.dp if layout.zero >= 2 else local,
                                 largest_tensor=spec.unit_params, block_params=spec.unit_params / layout.tp)
    micro = global_batch // layout.dp // layout.microbatches
    recompute = {"none": 1.0, "selective": 0.5, "full": 0.1}[layout.checkpointing]  # share kept
    activations = (spec.activation_bytes * act_bytes / 4 * recompute * micro
                   * _microbatches_in_flight(layout) / layout.pp / layout.tp)
    memory = MemoryBreakdown(state.params + gathered, state.grads, state.optimizer, activations,
                             state.host_params, state.host_grads, state.host_optimizer, buffers,
                             init_bytes, dev.process_memory)

    passes = {"none": 1.0, "selective": 1.1, "full": 4 / 3}[layout.checkpointing]
    flops = spec.flops_per_sample * global_batch
    compute = flops * passes / layout.world_size / (dev.peak_flops[precision] * dev.efficiency)
    bubble = pipeline_bubble(layout.pp, layout.microbatches, layout.pp_schedule, layout.virtual_stages)
    times = {"compute": compute, "bubble": max(0.0, compute * dev.core_share / (1 - bubble) - compute)}
    if layout.dp > 1:
        inter = _spans_nodes(layout.tp, layout.dp, gpus_per_node)
        units = max(spec.n_blocks, 1) / layout.pp + 1
        times["dp"] = _data_parallel_seconds(layout, local, units, act_bytes, compute, dev,
                                             dev.inter_bandwidth if inter else dev.intra_bandwidth,
                                             spec.trainable)
    if layout.pp > 1:
        times["pp"] = 2 * layout.microbatches * layout.virtual_stages * dev.latency
    times["optimizer"] = 2 * (resting.total + resting.host_total) / dev.hbm_bandwidth
    if layout.offload:
        times["offload"] = 2 * local / layout.dp * act_bytes / dev.host_bandwidth
    memory, tiers = _place_in_tiers(layout, memory, resting, times, dev, gpus_per_node,
                                    _STATE_BYTES[state_precision, optimizer][2], grad_clip)
    step = sum(times.values())
    mfu = flops / (step * layout.world_size * dev.peak_flops[precision])
    return Plan(layout, memory, step, mfu, memory.peak <= 0.9 * dev.memory and (tiers is None or tiers.fits),
                0.0, 0.9 * dev.memory, resting, times, samples_per_s=global_batch / step, init=init, tiers=tiers)


def _place_in_tiers(layout: Layout, memory: MemoryBreakdown, resting: MemoryBreakdown, times: dict[str, float],
                    dev: DeviceSpec, gpus_per_node: int, optimizer_bytes_per_param: float,
                    grad_clip: bool) -> tuple[MemoryBreakdown, TierPlan | None]:
    """The training memory with the rank's local state (`resting`) placed by `layout.tiers`
    (`tier_costs.tier_plan`), adding the exposed seconds to `times["tiers"]`; as is without tiers.
    Working memory is the peak less that state: activations, gathered parameters, buffers. A CPU
    (host bandwidth infinite: the host is the device) is one memory shared by all its ranks."""
    if not layout.tiers.enabled:
        return memory, None
    state = {"params": resting.params, "grads": resting.grads, "optimizer": resting.optimizer}
    one_memory = math.isinf(dev.host_bandwidth)
    ranks = layout.world_size if one_memory else min(layout.world_size, gpus_per_node)
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tiers = tier_plan(state, layout.tiers, memory.total - sum(state.values()), one_memory=one_memory,
                      compute=times["compute"], optimizer_time=times["optimizer"],
                      optimizer_bytes_per_param=optimizer_bytes_per_param, ranks_per_host=ranks,
                      core_share=dev.core_share, host_capacity=host_memory / ranks,
                      link_bandwidth=dev.host_bandwidth, clip=grad_clip)
    if tiers.tight_heap:  # every part of the step pays the mapped blocks' page faults
        times["heap"] = (HEAP_COSTS.tight_step_ratio - 1) * sum(times.values())
    times["tiers"] = tiers.seconds
    placed = MemoryBreakdown(
        *(getattr(memory, kind) - state[kind] + tiers.device[kind] for kind in ("params", "grads", "optimizer")),
        memory.activations, tiers.host["params"], tiers.host["grads"], tiers.host["optimizer"],
        memory.buffers + tiers.streaming, memory.init, memory.baseline)
    return placed, tiers


def _with_whole_adapters(spec: ModelSpec, local: float) -> tuple[float, float]:
    """(parameters on a grid rank, the share of them that train): a tensor grid splits the base
    model but keeps LoRA's adapters, `spec.trainable` of all parameters, whole on every rank
    (`parallel/adapters/grid.py`)."""
    if spec.trainable >= 1.0:
        return local, 1.0
    adapters = spec.n_params * spec.trainable / (1.0 - spec.trainable)  # n_params: the base's sizes
    return local + adapters, adapters / (local + adapters)


def _microbatches_in_flight(layout: Layout) -> float:
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    if layout.pp_schedule == "interleaved":
        return min(m, p * (1 + (p - 1) / (p * v)))
    return float(min(m, p))


def _step_times(spec: ModelSpec, layout: Layout, dev: DeviceSpec, precision: str, global_batch: int,
                seq_len: int, gpus_per_node: int, local_params: float, act_bytes: int,
                resting: MemoryBreakdown, trainable: float, experts: float = 0.0,
                expert_load: float = 1.0) -> dict[str, float]:
    """Seconds per step: compute, pipeline bubble, exposed communication, optimizer, offload
    (`trainable`: the share of `local_params` that train; `experts` of the `local_params` are expert
    weights under ep, 0 without)."""
    t, p, c, dp, m = layout.tp, layout.pp, layout.cp, layout.dp, layout.microbatches
    micro = global_batch // dp // m
    s_local = seq_len // c
    micro_tokens = micro * s_local
    flops = global_batch * seq_len * flops_per_token(spec, seq_len, layout.checkpointing)
    rate = dev.peak_flops[precision] * dev.efficiency * micro_tokens / (micro_tokens + dev.half_tokens)
    compute = flops / layout.world_size / rate
    passes = {"none": 1.0, "selective": 1.1, "full": 1.5}[layout.checkpointing]
    wrappers = {"tp": t > 1, "fsdp": layout.zero >= 2, "cp": c > 1}
    per_pass = dev.layer_overhead + sum(dev.wrapper_overhead.get(k, 0.0) for k, on in wrappers.items() if on)
    launches = m * spec.n_layer / p * per_pass * passes
    compute = max(compute, launches) if dev.async_launch else compute + launches
    bubble = pipeline_bubble(p, m, layout.pp_schedule, layout.virtual_stages)
    # a rank waiting in the bubble lends its core to the others: with core_share < 1 the critical
    # path runs at full core speed and only its excess over the shared time shows
    critical = compute * dev.core_share / (1 - bubble)
    times = {"compute": compute, "bubble": max(0.0, critical - compute)}

    def bandwidth(stride: int, size: int) -> float:
        return dev.inter_bandwidth if _spans_nodes(stride, size, gpus_per_node) else dev.intra_bandwidth

    layers = spec.n_layer / p
    activation = micro_tokens * spec.d_model * act_bytes
    # tensor parallel: 2 all-reduces forward + 2 backward per layer (an all-gather/reduce-scatter
    # pair each with SP, same volume), 1 more forward pair under full recompute; embedding all-reduce
    # and logits all-gather.
    if layout.tp_mode != "1d":
        times["tp"] = _grid_seconds(spec, layout, micro, s_local, act_bytes, dev, bandwidth(1, t))
    elif t > 1:
        per_layer = 6 if layout.checkpointing == "full" else 4
        volume = m * (layers * per_layer * 2 * activation + 2 * activation
                      + micro_tokens * spec.vocab_size * act_bytes) * (t - 1) / t
        hops = m * (layers * per_layer + 2) * 2 * (t - 1)  # a ring all-reduce takes 2(t−1) hops
        times["tp"] = volume / bandwidth(1, t) + hops * dev.latency
    # weights packed side by side and split by columns (a Hugging Face MoE's gate|up,
    # `expert_costs.packed_regroup_bytes`; GPT-2's q|k|v weight and bias, `packed_attention_bytes`):
    # each forward regroups this rank's tp piece of them and backward their gradients, one
    # all-to-all per tensor each time
    regrouped_tensors = bool(spec.packed_gate_up) + 2 * bool(spec.packed_attention)
    if t > 1 and regrouped_tensors:
        forwards = 2 if layout.checkpointing == "full" else 1
        weight_bytes = 2 if _state_precision(layout) == "mixed" else 4
        regrouped = m * (packed_regroup_bytes(spec, layout.ep, t, weight_bytes, layers, forwards)
                         + packed_attention_bytes(spec, t, weight_bytes, layers, forwards)) * (t - 1) / t
        hops = m * layers * (forwards + 1) * regrouped_tensors * (t - 1)
        times["tp"] += regrouped / bandwidth(1, t) + hops * dev.latency
    # context parallel: ring passes K,V around (backward passes K,V and dK,dV: 3x forward), hidden
    # behind the attention compute; Ulysses: 4 all-to-alls forward, 4 backward, exposed.
    if c > 1:
        kv = micro_tokens * 2 * spec.n_kv_head * spec.head_dim / t * act_bytes
        if layout.cp_mode == "ring":
            volume, hops = 3 * m * layers * (c - 1) * kv, 3 * m * layers * (c - 1)
            attention_time = compute * 12 * spec.d_model * seq_len / (6 * spec.matmul_params / spec.n_layer
                                                                       + 12 * spec.d_model * seq_len)
            comm = volume / bandwidth(t, c) + hops * dev.latency
            times["cp"] = max(0.0, comm - attention_time)
        else:
            qkvo = micro_tokens * 2 * (spec.n_head + spec.n_kv_head) * spec.head_dim / t * act_bytes
            volume, hops = 2 * m * layers * qkvo * (c - 1) / c, 8 * m * layers * (c - 1)
            times["cp"] = volume / bandwidth(t, c) + hops * dev.latency
    # data parallel over dp·cp: DDP all-reduce 2Ψ(N−1)/N; ZeRO-1 (ZeroRedundancyOptimizer) adds
    # the all-gather of updated parameters, 3Ψ; FSDP zero2 gathers once and reduce-scatters, 2Ψ;
    # zero3 gathers again for backward, 3Ψ. Hidden behind compute as far as the device allows:
    # DDP's bucketed all-reduce behind backward only, FSDP's prefetched gathers behind forward too.
    # Zero 0 with tensor or pipeline parallel cannot use DDP: one flat all-reduce after backward
    # (data_parallel.GradientAverager), which nothing hides.
    if dp * c > 1:
        times["dp"] = _data_parallel_seconds(layout, local_params - experts, layers + 1, act_bytes, compute,
                                             dev, bandwidth(t, dp * c), trainable)
    # expert parallel: the experts' gradients reduce over the dp/ep ranks holding the same experts;
    # the all-to-alls of the stage's MoE layers (`expert_costs.all_to_all_bytes`: whole tokens on
    # every tp rank, (ep-1)/ep of them leave the rank; 5 per layer and micro-step, each ep-1 hops)
    # sit on the critical path, as does the busiest rank's extra expert work when routing is uneven
    # (`expert_load` above 1)
    ep = layout.ep
    if ep > 1:
        if dp // ep > 1:
            times["dp"] += _data_parallel_seconds(layout.replace(dp=dp // ep, ep=1), experts, layers + 1,
                                                  act_bytes, compute, dev, bandwidth(t * ep, dp // ep),
                                                  trainable)
        moved = m * all_to_all_bytes(spec, ep, micro_tokens, act_bytes, expert_load, layers) * (ep - 1) / ep
        times["ep"] = moved / bandwidth(t, ep) + m * layers * 5 * (ep - 1) * dev.latency
        share = expert_flops_share(spec, flops_per_token(spec, seq_len, "none"))
        times["imbalance"] = (expert_load - 1) * compute * share
    # pipeline: each microbatch crosses each of this rank's stage boundaries forward and backward
    if p > 1:
        # the boundary activation is split over tp with SP, and in every grid mode (batch × hidden)
        hidden = activation / (t if layout.sequence_parallel or layout.tp_mode != "1d" else 1)
        sends = 2 * m * layout.virtual_stages
        times["pp"] = sends * (hidden / bandwidth(t * c * dp, p) + dev.latency)
    # optimizer: read and write the (sharded) states once, memory bound; offload adds the PCIe trip
    state_bytes = resting.total + resting.host_total
    times["optimizer"] = 2 * state_bytes / dev.hbm_bandwidth
    if layout.offload:
        times["offload"] = 2 * local_params / (dp * c) * act_bytes / dev.host_bandwidth
    return times


def packed_attention_bytes(spec: ModelSpec, tp: int, weight_bytes: int, layers: float,
                           forwards: int = 1) -> float:
    """Bytes one rank's regrouping all-to-alls send in one micro-step for a packed q|k|v projection
    (`ModelSpec.packed_attention` blocks of d_model; GPT-2's Conv1D): over `layers`, its tp piece
    of the weight (d × blocks·d) and of the bias, `forwards` times and their gradients once.
    0 without tp or packing. Of this, (tp-1)/tp leaves the rank."""
    if tp == 1 or not spec.packed_attention:
        return 0.0
    width = spec.packed_attention * spec.d_model
    return layers * (forwards + 1) * (spec.d_model + 1) * width / tp * weight_bytes


def _grid_seconds(spec: ModelSpec, layout: Layout, micro: int, seq: int, act_bytes: int,
                  dev: DeviceSpec, bandwidth: float) -> float:
    """The grid's collectives, exposed: each moves (q−1)/q of its buffer over a ring of q ranks
    (`tensor_costs.tensor_comm_bytes`); per layer 7 linears of 6 collectives (8 in 3D) and 2 norms
    of 3, each (q−1) latency hops."""
    q = GridShape.of(layout).q
    volume = layout.microbatches * tensor_comm_bytes(spec, layout, micro, seq, act_bytes) * (q - 1) / q
    per_layer = 7 * (8 if layout.tp_mode == "3d" else 6) + 2 * 3
    recompute = 1.5 if layout.checkpointing == "full" else 1.0
    hops = layout.microbatches * spec.n_layer / layout.pp * per_layer * recompute * (q - 1)
    return volume / bandwidth + hops * dev.latency


def _data_parallel_seconds(layout: Layout, local_params: float, units: float, act_bytes: int,
                           compute: float, dev: DeviceSpec, bandwidth: float, trainable: float = 1.0) -> float:
    """Exposed gradient/parameter traffic over the dp·cp group.

    DDP all-reduce 2Ψ(N−1)/N; ZeRO-1 (ZeroRedundancyOptimizer) adds the all-gather of updated
    parameters, 3Ψ; FSDP zero2 gathers once and reduce-scatters, 2Ψ; zero3 gathers again for
    backward, 3Ψ, with one collective per FSDP unit (`units`). Hidden behind compute as far as the
    device allows: DDP's bucketed all-reduce behind backward only, FSDP's prefetched gathers behind
    forward too. Zero 0 with tensor or pipeline parallel cannot use DDP: one flat all-reduce after
    backward (data_parallel.GradientAverager), which nothing hides. Only the `trainable` share has
    gradients to reduce and (ZeRO-1) updates to gather.
    """
    n = layout.dp * layout.cp
    grad_bytes = 4  # fp32 gradient reduction (MixedPrecisionPolicy reduce_dtype) and fp32 runs
    flat = layout.zero == 0 and (layout.tp > 1 or layout.pp > 1)
    leaves = (n - 1) / n  # of the full tensor, what each rank sends
    if layout.zero >= 2:
        gathers = 2 if layout.zero == 3 else 1
        volume = {"all_gather": local_params * gathers * act_bytes * leaves,
                  "reduce_scatter": local_params * trainable * grad_bytes * leaves}
        hops = (gathers + 1) * units * (n - 1)
    else:
        buckets = 1 if flat else 1 + local_params * trainable * grad_bytes / 25e6  # DDP's 25 MB buckets
        volume = {"all_reduce": local_params * trainable * 2 * grad_bytes * leaves,
                  "all_gather": local_params * trainable * (4 if layout.zero == 1 else 0) * leaves}
        hops = buckets * 2 * (n - 1) + (n - 1 if layout.zero == 1 else 0)
    comm = sum(v / _bus_bandwidth(dev, kind, bandwidth) for kind, v in volume.items()) + hops * dev.latency
    window = 0.0 if flat else compute if layout.zero >= 2 else compute * 2 / 3
    return max(0.0, comm - dev.overlap * window)


def _bus_bandwidth(dev: DeviceSpec, collective: str, link: float) -> float:
    """The rate `collective` moves its bus bytes over `link`: the device's measured rate for it
    within a node (scaled as `link` is to the node's), else the link's own."""
    measured = dev.collective_bandwidth.get(collective)
    return link if measured is None else measured * link / dev.intra_bandwidth


# ---- the search ----------------------------------------------------------------------------------
def search_space(global_batch: int, *, bf16: bool, gpus_per_node: int = 8,
                 n_experts: int = 0) -> dict[str, Choices]:
    """What the planner tries, as `valid_layouts` choices; the rules themselves live in layout.py.
    A MoE model (`n_experts`) also tries every ep that divides dp (layout.py keeps those that
    divide the experts and compose with the rest).

    Left out because a candidate kept is never worse in this model: tp across nodes, interleaved
    1F1B (ZB-V has the smaller bubble and no more memory), a cp mode without cp, recompute and
    offload (`plan` adds them where the layout does not fit without), and compile (no estimate
    tells its speed-up; the user adds it). Microbatch counts: pp, 2pp,
    4pp, 8pp and the whole local batch.
    """
    def microbatches(chosen: Any) -> tuple:
        return (None,) if chosen.pp == 1 else (*(k * chosen.pp for k in (1, 2, 4, 8)),
                                                max(global_batch // chosen.dp, 1))

    def expert_degrees(chosen: Any) -> tuple:
        return tuple(e for e in range(1, chosen.dp + 1) if chosen.dp % e == 0) if n_experts else (1,)

    return {"tp": range(1, gpus_per_node + 1), "ep": expert_degrees,
            "tp_mode": lambda chosen: TP_MODES if chosen.tp > 1 else ("1d",),
            # 2.5d with depth 1 is 2d
            "tp_depth": lambda chosen: (2, 4, 8) if chosen.tp_mode == "2.5d" else (1,),
            "cp_mode": lambda chosen: CP_MODES if chosen.cp > 1 else ("ring",),
            "pp_schedule": lambda chosen: ("zbv", "1f1b", "gpipe") if chosen.pp > 1 else ("1f1b",),
            "virtual_stages": lambda chosen: (1, 2) if chosen.pp > 1 else (1,),
            "microbatches": microbatches,
            "offload": (False,), "checkpointing": ("none",), "precision": ("bf16" if bf16 else "fp32",),
            "compile": (False,)}


def preferred(layouts: Iterable[Layout]) -> list[Layout]:
    """Drop layouts another valid one dominates: tp without sequence parallel where SP is valid
    (same traffic, more memory), and of the schedules valid for the same degrees and microbatch
    count only the first of ZB-V, 1F1B, GPipe (smallest bubble, no more memory)."""
    valid = list(layouts)
    present = set(valid)
    best: dict[Layout, Layout] = {}
    for layout in valid:
        if not layout.sequence_parallel and layout.replace(sequence_parallel=True) in present:
            continue
        group = layout.replace(pp_schedule="1f1b", virtual_stages=1, microbatches=layout.microbatches)
        if group not in best or _SCHEDULE_ORDER.index(layout.pp_schedule) < \
                _SCHEDULE_ORDER.index(best[group].pp_schedule):
            best[group] = layout
    return list(best.values())


_SCHEDULE_ORDER = ("zbv", "1f1b", "interleaved", "gpipe")


def candidate_layouts(spec: ModelSpec, world_size: int, *, global_batch: int, seq_len: int,
                      bf16: bool, gpus_per_node: int = 8,
                      device: "str | DeviceSpec | None" = None) -> list[Layout]:
    """Layouts worth estimating, without activation checkpointing (`plan` adds it when needed):
    the layouts layout.py accepts over `search_space`, less the `preferred` ones' dominated twins."""
    return preferred(valid_layouts(world_size, spec.config(seq_len), device=device,
                                   global_batch=global_batch,
                                   **search_space(global_batch, bf16=bf16, gpus_per_node=gpus_per_node,
                                                  n_experts=getattr(spec, "n_experts", 0))))


def plan(model: Any, world_size: int, *, device: "str | DeviceSpec", global_batch: int, seq_len: int,
         gpus_per_node: int = 8, top: int | None = 10, optimizer: str = "adam",
         init: str = "meta", expert_load: float = 1.0, tiers: MemoryTiers | None = None,
         grad_clip: bool = False) -> list[Plan]:
    """Valid layouts for `model` on `world_size` devices, best first: fitting before not fitting,
    then by predicted step time, then fewer parallel dimensions, then less memory.
    `model` is a GPTConfig, a Hugging Face config, a dict of sizes, or a `ModuleSpec` (any
    nn.Module, probed; `seq_len` is then unused). A plan fits only if building the model the
    `init` way fits too (see `estimate`). A MoE model's layouts include ep, costed at
    `expert_load` (see `estimate`). `tiers` (e.g. ``MemoryTiers(budget="8GiB", disk="tmp")``)
    puts every candidate under that budget and those tiers instead of trying FSDP's offload;
    `grad_clip` as in `estimate`."""
    _check_init(init)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer, e.g. 8")
    spec = _spec_of(model)
    if global_batch < 1 or (seq_len < 1 and not isinstance(spec, ModuleSpec)):
        raise ValueError(f"global_batch={global_batch} and seq_len={seq_len} must be positive")
    dev = get_device(device, world_size)
    options = dict(device=dev, global_batch=global_batch, seq_len=seq_len,
                   gpus_per_node=gpus_per_node, optimizer=optimizer, validate=False, init=init,
                   expert_load=expert_load, grad_clip=grad_clip)
    plans = [_cheapest_fitting(spec, layout.replace(tiers=tiers or MemoryTiers()), options)
             for layout in candidate_layouts(spec, world_size, global_batch=global_batch, seq_len=seq_len,
                                             bf16=dev.bf16, gpus_per_node=gpus_per_node, device=dev)]
    if not plans:
        raise LayoutError(f"no valid layout for this model on {world_size} devices with "
                          f"global_batch={global_batch}, seq_len={seq_len}; try a global batch "
                          f"that is a multiple of {world_size}")
    plans.sort(key=lambda option: (not option.fits, round(option.step_time, 9),
                                   sum(getattr(option.layout, d) > 1 for d in ("tp", "pp", "cp", "ep")),
                                   option.memory.peak))
    return plans[:top] if top else plans


def _cheapest_fitting(spec: ModelSpec, layout: Layout, options: dict[str, Any]) -> Plan:
    """The first of: as is, selective then full recompute, each also offloaded (zero >= 2, no
    memory tiers), that fits; the last tried if none does."""
    for checkpointing in ("none", "selective", "full"):
        for offload in ((False, True) if layout.zero >= 2 and not layout.tiers.enabled else (False,)):
            option = estimate(spec, layout.replace(checkpointing=checkpointing, offload=offload), **options)
            if option.fits:
                return option
    return option
