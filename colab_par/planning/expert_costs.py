"""What expert parallel costs one rank: the expert weights it holds, the bytes its all-to-alls move
and the load routing puts on its experts. Pure arithmetic (the planner's MoE terms), checked against
real dp·ep steps in tests/test_expert_costs.py.

How `colab_par.parallel.experts` runs a MoE layer under ep, which these formulas follow:
- every rank holds n_experts/ep of each layer's experts, sharded further by FSDP (zero 2/3) over
  the dp/ep ranks that hold the same experts; the other parameters are sharded over dp as usual;
- per layer and micro-step, forward exchanges the per-expert counts (one int64 each), sends each of
  its tokens' top_k (token, expert) rows to the expert's rank (dispatch) and gets the outputs back
  (combine); backward runs both row exchanges again, reversed. A rank sends its T·k rows and
  receives the R rows routed to its experts in each direction, so it sends and receives
  2·(T·k + R) rows a micro-step. Over an ep group the R's sum to the T·k's: R = T·k on average and
  `load` = R / (T·k) for one rank (above 1 on the rank whose experts the router favours).
- under pp a rank runs only its stage's MoE layers (`layers`), once per microbatch;
- under tp every tp rank is in its own ep group (with the other dp ranks of its tp index) and
  dispatches whole tokens: tp ranks share their data and the experts' input is not split (the tp
  split is inside each expert), so a tp rank sends what a rank without tp sends, not 1/tp of it.
- a Hugging Face family stores gate|up packed side by side, split over tp as a plain contiguous
  piece (`parallel.expert_tensor`): every forward regroups each layer's piece with one all-to-all
  of weights, not tokens, and backward sends its gradient back the same way
  (`packed_regroup_bytes`).
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["COUNT_BYTES", "local_expert_params", "all_to_all_bytes", "packed_regroup_bytes", "expert_flops_share",
           "ep_load"]

COUNT_BYTES = 8  # a per-expert token count crosses the ep group as an int64


def local_expert_params(spec: Any, ep: int) -> float:
    """Expert parameters a rank holds under `ep`, before any ZeRO sharding (all of them at ep=1)."""
    return spec.expert_params / ep


def all_to_all_bytes(spec: Any, ep: int, micro_tokens: int, act_bytes: int, load: float = 1.0,
                     layers: float | None = None) -> float:
    """Bytes one rank's all-to-alls send in one micro-step (it receives as many): over the MoE
    `layers` it runs (all of them by default; its stage's under pp), the count exchange and
    dispatch + combine forward and backward of `micro_tokens` tokens' top_k copies (`act_bytes`
    per element), the rank's experts receiving `load` times the mean. 0 without expert parallel.
    Of this, (ep-1)/ep leaves the rank on balanced routing."""
    if ep == 1 or not spec.n_experts:
        return 0.0
    rows = micro_tokens * spec.top_k
    per_layer = 2 * rows * (1 + load) * spec.d_model * act_bytes + spec.n_experts * COUNT_BYTES
    return (spec.n_layer if layers is None else layers) * per_layer


def packed_regroup_bytes(spec: Any, ep: int, tp: int, weight_bytes: int, layers: float | None = None,
                         forwards: int = 1) -> float:
    """Bytes one rank's regrouping all-to-alls send in one micro-step (it receives as many): over
    the MoE `layers` it runs, its tp piece of the packed gate|up weights of its n_experts/ep
    experts, `forwards` times (2 with full recompute) and its gradient once. 0 without tp or
    packing. Of this, (tp-1)/tp leaves the rank."""
    if tp == 1 or not spec.n_experts or not spec.packed_gate_up:
        return 0.0
    piece = spec.n_experts / ep * 2 * spec.expert_hidden * spec.d_model / tp * weight_bytes
    return (spec.n_layer if layers is None else layers) * (forwards + 1) * piece


def expert_flops_share(spec: Any, flops_per_token: float) -> float:
    """The share of a token's training FLOPs its experts take (6 · top_k · 3·d·width per layer)."""
    if not spec.n_experts:
        return 0.0
    return 6 * spec.n_layer * spec.top_k * 3 * spec.d_model * spec.expert_hidden / flops_per_token


def ep_load(counts: Sequence[Sequence[float]], ep: int) -> float:
    """The busiest rank's routed rows over the mean, worst layer, from one step's layer × expert
    token counts (the dashboard's heat map, `telemetry.expert_counts`): rank r of an ep group holds
    experts [r·E/ep, (r+1)·E/ep). 1.0 is perfect balance; ep=1 is always 1.0. What `plan` and
    `estimate` take as `expert_load`."""
    worst = 1.0
    for per_expert in counts:
        experts, total = len(per_expert), float(sum(per_expert))
        if experts % ep:
            raise ValueError(f"ep={ep} does not divide the {experts} experts of a layer")
        if total:
            size = experts // ep
            busiest = max(sum(per_expert[r * size:(r + 1) * size]) for r in range(ep))
            worst = max(worst, busiest * ep / total)
    return worst
