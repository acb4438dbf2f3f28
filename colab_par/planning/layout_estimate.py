"""The estimate of one `Layout`: its memory and step time brought together, placed in memory
tiers where the layout asks for them, and judged against the device (`Plan`).

Pure arithmetic, below the search (`planner.plan`): `memory_estimate` says the bytes,
`time_estimate` the seconds, `tier_costs` what memory tiers change of both.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from colab_par.layout import Layout
from colab_par.planning.devices import GiB, DeviceSpec, get_device
from colab_par.planning.flops import ModelSpec, flops_per_token
from colab_par.planning.memory_estimate import (STATE_BYTES, MemoryBreakdown, check_init, decoder_memory,
                                                init_peak_bytes, microbatches_in_flight, model_state_bytes,
                                                rank_params, state_precision)
from colab_par.planning.module_spec import ModuleSpec
from colab_par.planning.tier_costs import HEAP_COSTS, HostShare, TierPlan, tier_plan
from colab_par.planning.time_estimate import data_parallel_seconds, pipeline_bubble, spans_nodes, step_times

__all__ = ["Plan", "estimate", "spec_of"]


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


def spec_of(model: Any) -> "ModelSpec | ModuleSpec":
    """A probed model as it is, anything else as a decoder's sizes (`ModelSpec.of`)."""
    return model if isinstance(model, ModuleSpec) else ModelSpec.of(model)


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
    check_init(init)
    layout = Layout.parse(layout)
    spec = spec_of(model)
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
    rank = rank_params(spec, layout)
    instants, resting = decoder_memory(spec, layout, rank, dev, global_batch=global_batch, seq_len=seq_len,
                                       optimizer=optimizer, init=init)
    times = step_times(spec, layout, dev, precision, global_batch, seq_len, gpus_per_node,
                       rank.local, act_bytes, resting, rank.trainable, rank.experts, expert_load)
    memory, tiers = _place_in_tiers(layout, instants, resting, times, dev, gpus_per_node,
                                    STATE_BYTES[state_precision(layout), optimizer][2], grad_clip)
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
    precision_of_state = state_precision(layout)
    offloaded = layout.offload and not math.isinf(dev.host_bandwidth)  # a CPU's host is its device
    local = spec.n_params / (layout.tp * layout.pp)
    state = model_state_bytes(local, zero=layout.zero, dp=layout.dp, precision=precision_of_state,
                              optimizer=optimizer, offload=offloaded, trainable=spec.trainable)
    resting = model_state_bytes(local, zero=3 if layout.zero == 2 else layout.zero, dp=layout.dp,
                                precision=precision_of_state, optimizer=optimizer, offload=offloaded,
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
                   * microbatches_in_flight(layout) / layout.pp / layout.tp)
    memory = MemoryBreakdown(state.params + gathered, state.grads, state.optimizer, activations,
                             state.host_params, state.host_grads, state.host_optimizer, buffers,
                             init_bytes, dev.process_memory)

    passes = {"none": 1.0, "selective": 1.1, "full": 4 / 3}[layout.checkpointing]
    flops = spec.flops_per_sample * global_batch
    compute = flops * passes / layout.world_size / (dev.peak_flops[precision] * dev.efficiency)
    bubble = pipeline_bubble(layout.pp, layout.microbatches, layout.pp_schedule, layout.virtual_stages)
    times = {"compute": compute, "bubble": max(0.0, compute * dev.core_share / (1 - bubble) - compute)}
    if layout.dp > 1:
        inter = spans_nodes(layout.tp, layout.dp, gpus_per_node)
        units = max(spec.n_blocks, 1) / layout.pp + 1
        times["dp"] = data_parallel_seconds(layout, local, units, act_bytes, compute, dev,
                                            dev.inter_bandwidth if inter else dev.intra_bandwidth,
                                            spec.trainable)
    if layout.pp > 1:
        times["pp"] = 2 * layout.microbatches * layout.virtual_stages * dev.latency
    times["optimizer"] = 2 * (resting.total + resting.host_total) / dev.hbm_bandwidth
    if layout.offload:
        times["offload"] = 2 * local / layout.dp * act_bytes / dev.host_bandwidth
    memory, tiers = _place_in_tiers(layout, {"step": memory}, resting, times, dev, gpus_per_node,
                                    STATE_BYTES[precision_of_state, optimizer][2], grad_clip)
    step = sum(times.values())
    mfu = flops / (step * layout.world_size * dev.peak_flops[precision])
    return Plan(layout, memory, step, mfu, memory.peak <= 0.9 * dev.memory and (tiers is None or tiers.fits),
                0.0, 0.9 * dev.memory, resting, times, samples_per_s=global_batch / step, init=init, tiers=tiers)


def _place_in_tiers(layout: Layout, instants: dict[str, MemoryBreakdown], resting: MemoryBreakdown,
                    times: dict[str, float], dev: DeviceSpec, gpus_per_node: int, optimizer_bytes_per_param: float,
                    grad_clip: bool) -> tuple[MemoryBreakdown, TierPlan | None]:
    """The fullest of the step's `instants` (`memory_estimate.step_instants`), with the rank's
    local state (`resting`) placed by `layout.tiers` (`tier_costs.tier_plan`) and the exposed
    seconds added to `times["tiers"]`; without tiers the fullest instant as it is. The placement
    is sized for the largest working memory of any instant (what it holds beside the state:
    activations, gathered parameters, buffers); at each instant the device keeps its share of
    each kind of state present then. A CPU (host bandwidth infinite: the host is the device) is
    one memory shared by all its ranks."""
    if not layout.tiers.enabled:
        return max(instants.values(), key=lambda instant: instant.total), None
    state = {"params": resting.params, "grads": resting.grads, "optimizer": resting.optimizer}
    present = {name: {kind: min(getattr(instant, kind), state[kind]) for kind in state}
               for name, instant in instants.items()}
    working = max(instant.total - sum(present[name].values()) for name, instant in instants.items())
    one_memory = math.isinf(dev.host_bandwidth)
    ranks = layout.world_size if one_memory else min(layout.world_size, gpus_per_node)
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = HostShare(one_memory, ranks=ranks, core_share=dev.core_share, capacity=host_memory / ranks,
                     link_bandwidth=dev.host_bandwidth)
    tiers = tier_plan(state, layout.tiers, working, host=host,
                      compute=times["compute"], optimizer_time=times["optimizer"],
                      optimizer_bytes_per_param=optimizer_bytes_per_param, clip=grad_clip)
    if tiers.tight_heap:  # every part of the step pays the mapped blocks' page faults
        times["heap"] = (HEAP_COSTS.tight_step_ratio - 1) * sum(times.values())
    times["tiers"] = tiers.seconds

    def placed(name: str, instant: MemoryBreakdown) -> MemoryBreakdown:
        kept = {kind: getattr(instant, kind) - present[name][kind]
                + (present[name][kind] * tiers.device[kind] / state[kind] if state[kind] else 0.0) for kind in state}
        return replace(instant, **kept, host_params=tiers.host["params"], host_grads=tiers.host["grads"],
                       host_optimizer=tiers.host["optimizer"], buffers=instant.buffers + tiers.streaming)

    return max((placed(name, instant) for name, instant in instants.items()), key=lambda m: m.total), tiers
