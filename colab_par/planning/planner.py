"""`plan()`: the search over layouts for the fastest that fits, and the planner's public names.

Pure Python and arithmetic (torch is imported only to measure the CPU): the picker and the planner
work in a notebook kernel with no cluster. Each layout is costed by `layout_estimate.estimate`
from the bytes of `memory_estimate` and the seconds of `time_estimate`; the formulas, with their
sources, are in docs/planner.md: model state from the ZeRO paper (Rajbhandari et al. 2020,
Table 1), activations from Korthikanti et al. 2022, collective volumes from the ring algorithms,
the pipeline bubble from Narayanan et al. 2021 and compute from 6Ψ FLOPs per token plus attention.
`plan(..., verify=k)` checks the best k by running them (`dry_run.verify`: spawned dry runs).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

from colab_par.layout import CP_MODES, TP_MODES, Choices, Layout, LayoutError, splits_backward, valid_layouts
from colab_par.layout.tier_options import MemoryTiers
from colab_par.planning.dry_run.verify import Verification, check_verifiable, verify as verify_layout
from colab_par.planning.devices import (CPU_PROCESS_BYTES, CPU_WRAPPER_COST, DEVICES, GiB, DeviceSpec,
                                        cpu_compute_costs, cpu_device, get_device, measure_cpu_device)
from colab_par.planning.flops import ModelSpec, flops_per_token
from colab_par.planning.layout_estimate import Plan, estimate, spec_of
from colab_par.planning.memory_estimate import (FROZEN_BYTES, INIT_BYTES, INIT_MODES, MemoryBreakdown,
                                                activation_bytes_per_layer, check_init, init_peak_bytes,
                                                model_state_bytes)
from colab_par.planning.module_spec import ModuleSpec
from colab_par.planning.time_estimate import packed_attention_bytes, pipeline_bubble

__all__ = ["MemoryBreakdown", "ModelSpec", "DeviceSpec", "Plan", "DEVICES", "GiB", "INIT_MODES", "INIT_BYTES",
           "FROZEN_BYTES", "model_state_bytes", "init_peak_bytes",
           "activation_bytes_per_layer", "pipeline_bubble", "get_device", "measure_cpu_device",
           "cpu_device", "cpu_compute_costs", "estimate", "search_space", "preferred",
           "candidate_layouts", "plan", "flops_per_token", "packed_attention_bytes", "CPU_PROCESS_BYTES",
           "CPU_WRAPPER_COST", "VerifiedPlan"]


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
         grad_clip: bool = False, verify: int = 0) -> list[Plan]:
    """Valid layouts for `model` on `world_size` devices, best first: fitting before not fitting,
    then by predicted step time, then fewer parallel dimensions, then less memory.
    `model` is a GPTConfig, a Hugging Face config, a dict of sizes, or a `ModuleSpec` (any
    nn.Module, probed; `seq_len` is then unused); ``dataclasses.replace(ModelSpec.of(config),
    frozen_copies=1)`` also counts GRPO's reference policy with full weights, a frozen sharded copy
    (`MemoryBreakdown.reference`). A plan fits only if building the model the `init` way fits too
    (see `estimate`). A MoE model's layouts include ep, costed at
    `expert_load` (see `estimate`). `tiers` (e.g. ``MemoryTiers(budget="8GiB", disk="tmp")``)
    puts every candidate under that budget and those tiers instead of trying FSDP's offload;
    `grad_clip` as in `estimate`. `verify=k` dry-runs the first k (`dry_run.verify`, fake
    tensors, every rank role; `model` a GPTConfig or Hugging Face config)
    and returns them as `VerifiedPlan`s, whose `fits` is the trace's verdict too: one the planner
    said fits but whose traced step does not moves behind those that fit."""
    check_init(init)
    if not isinstance(verify, int) or verify < 0:
        raise ValueError(f"verify={verify!r}: give how many of the best plans to dry-run, e.g. 1 (0: none)")
    if verify:
        check_verifiable(model)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer, e.g. 8")
    spec = spec_of(model)
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
    plans.sort(key=_rank)
    if verify:
        plans[:verify] = [_verified(option, model, dev, world_size, (global_batch, seq_len), optimizer)
                          for option in plans[:verify]]
        plans.sort(key=_rank)
    return plans[:top] if top else plans


def _rank(option: Plan) -> tuple:
    """Fitting first, then faster, then fewer parallel dimensions, then less memory."""
    return (not option.fits, round(option.step_time, 9),
            sum(getattr(option.layout, d) > 1 for d in ("tp", "pp", "cp", "ep")), option.memory.peak)


@dataclass(frozen=True)
class VerifiedPlan(Plan):
    """A plan checked by dry runs of its rank roles (`plan(..., verify=k)`): `fits` holds only if
    the planner and the trace both say so; the planner's own verdict is `verification.predicted_fits`."""

    verification: Verification | None = None

    def __str__(self) -> str:
        checked = self.verification
        return (f"{super().__str__()}  traced {checked.peak / GiB:.2f} GiB "
                f"{'fits' if checked.fits else 'OOM: ' + checked.overflow}")


def _verified(option: Plan, model: Any, device: DeviceSpec, world_size: int, batch: tuple[int, int],
              optimizer: str) -> VerifiedPlan:
    """`option` with the dry runs of its layout's rank roles on `device`."""
    checked = verify_layout(model, option.layout, world_size, device=device, batch=batch,
                            optimizer=optimizer)
    kept = {field.name: getattr(option, field.name) for field in fields(option)}
    return VerifiedPlan(**{**kept, "fits": option.fits and checked.fits}, verification=checked)


def _cheapest_fitting(spec: ModelSpec, layout: Layout, options: dict[str, Any]) -> Plan:
    """The first of: as is, selective then full recompute (none under a split backward),
    each also offloaded (zero >= 2, no memory tiers), that fits; the last tried if none does."""
    for checkpointing in ("none",) if splits_backward(layout) else ("none", "selective", "full"):
        for offload in ((False, True) if layout.zero >= 2 and not layout.tiers.enabled else (False,)):
            option = estimate(spec, layout.replace(checkpointing=checkpointing, offload=offload), **options)
            if option.fits:
                return option
    return option
