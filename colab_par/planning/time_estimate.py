"""Seconds per training step of a `Layout`: compute, the pipeline bubble and the communication
each kind of parallelism leaves exposed.

Pure arithmetic, below `layout_estimate`. Sources (docs/planner.md): compute from 6Ψ FLOPs per
token plus attention, collective volumes from the ring algorithms, the pipeline bubble from
Narayanan et al. 2021.
"""
from __future__ import annotations

from typing import Callable

from colab_par.layout import Layout
from colab_par.planning.devices import DeviceSpec
from colab_par.planning.expert_costs import all_to_all_bytes, expert_flops_share, packed_regroup_bytes
from colab_par.planning.flops import ModelSpec, flops_per_token, recompute_work
from colab_par.planning.memory_estimate import MemoryBreakdown, state_precision
from colab_par.planning.tensor_costs import GridShape, tensor_comm_bytes

__all__ = ["pipeline_bubble", "packed_attention_bytes", "spans_nodes", "data_parallel_seconds", "step_times"]


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


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether a group of `size` ranks `stride` apart reaches beyond one node."""
    return size > 1 and stride * size > gpus_per_node


def _compute_seconds(spec: ModelSpec, layout: Layout, dev: DeviceSpec, precision: str, global_batch: int,
                     seq_len: int, micro_tokens: int) -> dict[str, float]:
    """{"compute", "bubble"}: the FLOPs at the rate a micro-batch of `micro_tokens` reaches, or the
    launches of the layers and their wrappers where those take longer (or add, without async
    launch); the pipeline bubble on top."""
    t, p, c, m = layout.tp, layout.pp, layout.cp, layout.microbatches
    recompute = recompute_work(layout)
    flops = global_batch * seq_len * flops_per_token(spec, seq_len, recompute)
    rate = dev.peak_flops[precision] * dev.efficiency * micro_tokens / (micro_tokens + dev.half_tokens)
    compute = flops / layout.world_size / rate
    passes = {"none": 1.0, "selective": 1.1, "matmuls": 1.5, "full": 1.5}[recompute]
    wrappers = {"tp": t > 1, "fsdp": layout.zero >= 2, "cp": c > 1}
    per_pass = dev.layer_overhead + sum(dev.wrapper_overhead.get(k, 0.0) for k, on in wrappers.items() if on)
    launches = m * spec.n_layer / p * per_pass * passes
    compute = max(compute, launches) if dev.async_launch else compute + launches
    bubble = pipeline_bubble(p, m, layout.pp_schedule, layout.virtual_stages)
    # a rank waiting in the bubble lends its core to the others: with core_share < 1 the critical
    # path runs at full core speed and only its excess over the shared time shows
    critical = compute * dev.core_share / (1 - bubble)
    return {"compute": compute, "bubble": max(0.0, critical - compute)}


def _tensor_seconds(spec: ModelSpec, layout: Layout, dev: DeviceSpec, micro: int, s_local: int,
                    act_bytes: int, bandwidth: float) -> float:
    """Exposed tensor-parallel traffic over a group at `bandwidth`.

    1d: 2 all-reduces forward + 2 backward per layer (an all-gather/reduce-scatter pair each with
    SP, same volume), 1 more forward pair under full recompute; embedding all-reduce and logits
    all-gather. A grid: `_grid_seconds`. Weights packed side by side and split by columns (a
    Hugging Face MoE's gate|up, `expert_costs.packed_regroup_bytes`; GPT-2's q|k|v weight and
    bias, `packed_attention_bytes`): each forward regroups this rank's tp piece of them and
    backward their gradients, one all-to-all per tensor each time.
    """
    t, m = layout.tp, layout.microbatches
    layers = spec.n_layer / layout.pp
    micro_tokens = micro * s_local
    if layout.tp_mode != "1d":
        seconds = _grid_seconds(spec, layout, micro, s_local, act_bytes, dev, bandwidth)
    else:
        activation = micro_tokens * spec.d_model * act_bytes
        per_layer = 6 if layout.checkpointing == "full" else 4
        volume = m * (layers * per_layer * 2 * activation + 2 * activation
                      + micro_tokens * spec.vocab_size * act_bytes) * (t - 1) / t
        hops = m * (layers * per_layer + 2) * 2 * (t - 1)  # a ring all-reduce takes 2(t−1) hops
        seconds = volume / bandwidth + hops * dev.latency
    regrouped_tensors = bool(spec.packed_gate_up) + 2 * bool(spec.packed_attention)
    if t > 1 and regrouped_tensors:
        forwards = 2 if layout.checkpointing == "full" else 1
        weight_bytes = 2 if state_precision(layout) == "mixed" else 4
        regrouped = m * (packed_regroup_bytes(spec, layout.ep, t, weight_bytes, layers, forwards)
                         + packed_attention_bytes(spec, t, weight_bytes, layers, forwards)) * (t - 1) / t
        hops = m * layers * (forwards + 1) * regrouped_tensors * (t - 1)
        seconds += regrouped / bandwidth + hops * dev.latency
    return seconds


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


def _context_seconds(spec: ModelSpec, layout: Layout, dev: DeviceSpec, micro_tokens: int, seq_len: int,
                     compute: float, act_bytes: int, bandwidth: float) -> float:
    """Exposed context-parallel traffic: ring passes K,V around (backward passes K,V and dK,dV: 3x
    forward), hidden behind the attention compute; Ulysses: 4 all-to-alls forward, 4 backward,
    exposed."""
    t, c, m = layout.tp, layout.cp, layout.microbatches
    layers = spec.n_layer / layout.pp
    if layout.cp_mode == "ring":
        kv = micro_tokens * 2 * spec.n_kv_head * spec.head_dim / t * act_bytes
        volume, hops = 3 * m * layers * (c - 1) * kv, 3 * m * layers * (c - 1)
        attention_time = compute * 12 * spec.d_model * seq_len / (6 * spec.matmul_params / spec.n_layer
                                                                   + 12 * spec.d_model * seq_len)
        comm = volume / bandwidth + hops * dev.latency
        return max(0.0, comm - attention_time)
    qkvo = micro_tokens * 2 * (spec.n_head + spec.n_kv_head) * spec.head_dim / t * act_bytes
    volume, hops = 2 * m * layers * qkvo * (c - 1) / c, 8 * m * layers * (c - 1)
    return volume / bandwidth + hops * dev.latency


def data_parallel_seconds(layout: Layout, local_params: float, units: float, act_bytes: int,
                          compute: float, dev: DeviceSpec, bandwidth: float, trainable: float = 1.0) -> float:
    """Exposed gradient/parameter traffic over the dp·cp group.

    DDP all-reduce 2Ψ(N−1)/N; ZeRO-1 (ZeroRedundancyOptimizer) adds the all-gather of updated
    parameters, 3Ψ; FSDP zero2 gathers once and reduce-scatters, 2Ψ; zero3 gathers again for
    backward, 3Ψ, with one collective per FSDP unit (`units`). Hidden behind compute as far as the
    device allows: DDP's bucketed all-reduce behind backward only, FSDP's prefetched gathers behind
    forward too. Zero 0 with tensor or pipeline parallel cannot use DDP: an all-reduce per 25 MiB
    bucket after backward (data_parallel.GradientAverager), which nothing hides. Only the `trainable` share has
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
        buckets = 1 + local_params * trainable * grad_bytes / 25e6  # DDP's and the averager's 25 MB buckets
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


def _expert_seconds(spec: ModelSpec, layout: Layout, dev: DeviceSpec, micro_tokens: int, seq_len: int,
                    act_bytes: int, compute: float, expert_load: float,
                    bandwidth: Callable[[int, int], float]) -> dict[str, float]:
    """{"ep", "imbalance"}: the all-to-alls of the stage's MoE layers (`expert_costs.all_to_all_bytes`:
    whole tokens on every tp rank, (ep-1)/ep of them leave the rank; 5 per layer and micro-step,
    each ep-1 hops) sit on the critical path, as does the busiest rank's extra expert work when
    routing is uneven (`expert_load` above 1)."""
    t, ep, m = layout.tp, layout.ep, layout.microbatches
    layers = spec.n_layer / layout.pp
    moved = m * all_to_all_bytes(spec, ep, micro_tokens, act_bytes, expert_load, layers) * (ep - 1) / ep
    share = expert_flops_share(spec, flops_per_token(spec, seq_len, "none"))
    return {"ep": moved / bandwidth(t, ep) + m * layers * 5 * (ep - 1) * dev.latency,
            "imbalance": (expert_load - 1) * compute * share}


def step_times(spec: ModelSpec, layout: Layout, dev: DeviceSpec, precision: str, global_batch: int,
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
    times = _compute_seconds(spec, layout, dev, precision, global_batch, seq_len, micro_tokens)
    compute = times["compute"]

    def bandwidth(stride: int, size: int) -> float:
        return dev.inter_bandwidth if spans_nodes(stride, size, gpus_per_node) else dev.intra_bandwidth

    layers = spec.n_layer / p
    if layout.tp_mode != "1d" or t > 1:
        times["tp"] = _tensor_seconds(spec, layout, dev, micro, s_local, act_bytes, bandwidth(1, t))
    if c > 1:
        times["cp"] = _context_seconds(spec, layout, dev, micro_tokens, seq_len, compute, act_bytes,
                                       bandwidth(t, c))
    if dp * c > 1:
        times["dp"] = data_parallel_seconds(layout, local_params - experts, layers + 1, act_bytes, compute,
                                            dev, bandwidth(t, dp * c), trainable)
    # expert parallel: the experts' gradients reduce over the dp/ep ranks holding the same experts
    ep = layout.ep
    if ep > 1:
        if dp // ep > 1:
            times["dp"] += data_parallel_seconds(layout.replace(dp=dp // ep, ep=1), experts, layers + 1,
                                                 act_bytes, compute, dev, bandwidth(t * ep, dp // ep),
                                                 trainable)
        times.update(_expert_seconds(spec, layout, dev, micro_tokens, seq_len, act_bytes, compute,
                                     expert_load, bandwidth))
    # pipeline: each microbatch crosses each of this rank's stage boundaries forward and backward
    if p > 1:
        # the boundary activation is split over tp with SP, and in every grid mode (batch × hidden)
        activation = micro_tokens * spec.d_model * act_bytes
        hidden = activation / (t if layout.sequence_parallel or layout.tp_mode != "1d" else 1)
        sends = 2 * m * layout.virtual_stages
        times["pp"] = sends * (hidden / bandwidth(t * c * dp, p) + dev.latency)
    # optimizer: read and write the (sharded) states once, memory bound; offload adds the PCIe trip
    state_bytes = resting.total + resting.host_total
    times["optimizer"] = 2 * state_bytes / dev.hbm_bandwidth
    if layout.offload:
        times["offload"] = 2 * local_params / (dp * c) * act_bytes / dev.host_bandwidth
    return times
