"""Expert parallel: each rank holds n_experts/ep experts of every MoE layer; tokens travel to them.

The ep ranks are drawn from the data-parallel ranks (`mesh.build_expert_mesh`): a group of ep
neighbouring dp ranks splits every layer's experts, so each rank's expert weights are a DTensor
sharded by expert over that group (full state dicts and gradient norms gather them as any DTensor).
Forward, a rank sends each routed token to the rank holding its expert and gets the outputs back
(`AllToAllDispatch`: the uneven per-expert counts are exchanged first, then the tokens, both with
`all_to_all_single`; backward runs the same exchanges reversed).

Gradients: the non-expert parameters are averaged over dp as usual. An expert's gradient already
sums the contributions of every token of its ep group that reached it, so it is SUMMED over the
ranks holding the same expert ("edp", dp/ep of them) and divided by dp, not by dp/ep: zero=0 with
`GradientAverager`'s bucketed all-reduces, zero=2/3 with the experts fully_shard'ed over edp
(FSDP divides by dp/ep) and their sharded gradients then scaled by 1/ep (`ScaleGradients`: FSDP's
own `set_gradient_divide_factor` reduces with PREMUL_SUM, which gloo lacks). The routers'
balance-loss statistics are summed over all ranks sharing the global batch (`MoE.stats_group`),
with or without ep. Hugging Face MoE families take the same path from their own ep plan
(`hf_experts.py`), their balance loss made global there.

With tp the same step splits every expert inside too (`expert_tensor.py`): the weights become one
DTensor over the (ep, tp) mesh, which zero 2/3 fully_shard over edp as it is (FSDP over three
mesh dims). With pp it runs on each stage after the split, and `StageExperts` lets the pipeline
runner carry each stage's balance losses into its backward (a Hugging Face family's share of its
own loss too: `stage_balance.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from colab_par.layout import Layout
from colab_par.models.moe import Experts, MoE, inverse_permutation
from colab_par.parallel.data_parallel import GradientAverager, fsdp_options
from colab_par.parallel.expert_tensor import GPT_EXPERT_SPLITS, TensorSplit, hf_expert_splits
from colab_par.parallel.hf_experts import GlobalBalanceLoss, HFExpertLayer, balance_loss_for, hf_expert_layers
from colab_par.parallel.mesh import MESH_DIMS, build_expert_mesh, build_mesh
from colab_par.parallel.stage_balance import StageBalance

__all__ = ["moe_layers", "apply_expert_parallel", "ExpertStep", "StageExperts", "AllToAllDispatch", "ScaleGradients"]

Layer = MoE | HFExpertLayer


def moe_layers(modules: nn.Module | list[nn.Module]) -> list[Layer]:
    """The mixture-of-experts layers of a model (or of its pipeline parts), in order: the kit's
    MoE modules and the Hugging Face experts modules `apply_expert_parallel` wrapped."""
    parts = modules if isinstance(modules, list) else [modules]
    return [m if isinstance(m, MoE) else m.colab_par_experts for part in parts for m in part.modules()
            if isinstance(m, MoE) or isinstance(getattr(m, "colab_par_experts", None), HFExpertLayer)]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


class AllToAllDispatch:
    """`MoE.dispatch` under expert parallel: rows grouped by global expert go to the ranks holding
    those experts, run there grouped by local expert, and come back in the order they left."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size = group, dist.get_world_size(group)

    # Row counts that cross ranks decide every shape here: traced, each read of them is a graph
    # break, with small graphs between them each compiled on its own. Under compile the exchange
    # and the experts behind it run eagerly, as one call.
    @torch.compiler.disable(reason="the all-to-all's row counts are data")
    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor,
                 experts: Experts | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        from_each = torch.empty_like(counts)  # (source rank, local expert) row counts
        dist.all_to_all_single(from_each, counts, group=self.group)
        from_each = from_each.view(self.size, -1)
        send = counts.view(self.size, -1).sum(1).tolist()
        receive = from_each.sum(1).tolist()
        arrived = _AllToAll.apply(tokens, send, receive, self.group)  # by source, then expert
        local = torch.arange(from_each.shape[1], device=counts.device).repeat(self.size)
        order = torch.repeat_interleave(local, from_each.reshape(-1)).argsort(stable=True)
        out = experts(arrived[order], from_each.sum(0))[inverse_permutation(order)]
        return _AllToAll.apply(out, receive, send, self.group)


class ScaleGradients:
    """Multiply the gradients of `params` by `factor`, after they were reduced (an averager's role)."""

    def __init__(self, params: list[nn.Parameter], factor: float):
        self.params, self.factor = params, factor

    @torch.no_grad()
    def __call__(self) -> None:
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(self.factor)


@dataclass
class ExpertStep:
    """What the experts step leaves for training: the experts' gradient reduction after backward
    (None without ep), a Hugging Face family's global balance loss to add to each loss (None
    where the model has none switched on; the kit's GPT adds its own), and under pipeline
    parallel the stages' balance losses and counts (`StageExperts`, for the runner)."""

    averager: GradientAverager | ScaleGradients | None = None
    balance: GlobalBalanceLoss | None = None
    stages: "StageExperts | None" = None


class _CarryLoss(torch.autograd.Function):
    """`output` unchanged; backward also starts `loss`'s backward (gradient 1): a loss computed
    inside a pipeline stage reaches the parameters it depends on with the stage's own backward."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


class StageExperts:
    """Pipeline parallel: the MoE layers of this rank's stages, seen by the runner once per stage
    forward of each microbatch. Their balance losses (the kit's GPT adds them in its loss_fn, which
    only the last stage calls, and which sees no stage's layers) ride on the stage's output into
    its backward, weighted like the microbatch's loss; so does a Hugging Face family's share of
    its own balance loss (`stage_balance.StageBalance`). Their token counts are summed over the
    step's microbatches, so `last_counts` holds the step's (as without pp)."""

    def __init__(self, parts: list[nn.Module], balance: StageBalance | None = None):
        self.layers = [moe_layers(part) for part in parts]
        self.balance = balance
        self.counts: list[list[torch.Tensor | None]] = []
        self.loss = 0.0

    def begin(self) -> None:
        self.counts, self.loss = [[None] * len(layers) for layers in self.layers], 0.0
        if self.balance is not None:
            self.balance.begin()

    def after_forward(self, index: int, output: Any, weight: float) -> Any:
        """After part `index`'s forward of one microbatch whose loss weighs `weight`. Forwards
        outside a training step (an evaluation's) and torch's shape inference on a stage's first
        step (no gradients, meta inputs) count nothing and carry no loss."""
        if not self.counts or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) \
                or output.is_meta:
            return output
        sums = self.counts[index]
        for i, layer in enumerate(self.layers[index]):
            if layer.last_counts is not None:
                sums[i] = layer.last_counts if sums[i] is None else sums[i] + layer.last_counts
        terms = [term for layer in self.layers[index] if isinstance(layer, MoE)
                 for term in [layer.take_aux_loss()] if term is not None]
        share = self.balance.after_forward(weight) if self.balance is not None else None
        if share is not None:
            terms.append(share)  # a zero: its backward is the family loss's gradient share
        if not terms:
            return output
        loss = sum(terms) * weight
        self.loss += float(loss.detach())
        return _CarryLoss.apply(output, loss)

    def finish(self) -> float:
        """The step's balance loss on this rank's stages (as weighted in the loss); the layers'
        `last_counts` become the step's."""
        for layers, sums in zip(self.layers, self.counts):
            for layer, total in zip(layers, sums):
                if total is not None:
                    layer.last_counts = total
        self.counts = []
        return self.loss + (self.balance.finish() if self.balance is not None else 0.0)


def _expert_weights(layer: Layer) -> tuple[nn.Module, list[str]]:
    """The module holding a layer's packed expert weights and their names (leading dim = expert)."""
    if isinstance(layer, MoE):
        return layer.experts, [name for name, _ in layer.experts.named_parameters(recurse=False)]
    others = {name for name, _ in layer.module.named_parameters()} - set(layer.weight_names)
    if others:
        raise ValueError(f"the experts module {type(layer.module).__name__} also holds {sorted(others)}, "
                         "which its ep plan does not split by expert; train this model with ep=1 and tp=1")
    return layer.module, layer.weight_names


def _tensor_split(model: nn.Module, layer: Layer, experts: nn.Module, names: list[str],
                  tp_group: dist.ProcessGroup) -> TensorSplit:
    """How tp splits this layer's experts inside: the kit's GPT by its own plan, a Hugging Face
    family by its ``base_model_tp_plan``."""
    if isinstance(layer, MoE):
        split, owner = TensorSplit(tp_group, GPT_EXPERT_SPLITS), "feed_forward.experts"
    else:
        split, owner = TensorSplit(tp_group, hf_expert_splits(model, layer.name, names)), layer.name
    split.check(experts, owner)
    return split


def _weights_mesh(layout: Layout, device: torch.device) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The mesh expert weights are DTensors on ((ep, tp), ep or tp: the dims that split them)
    and, with ep, the ("edp", "ep") expert mesh."""
    whole, _ = build_mesh(layout, device)
    expert_mesh = build_expert_mesh(layout, device) if layout.ep > 1 else None
    dims = tuple(name for name in ("ep", "tp") if getattr(layout, name) > 1)
    source = expert_mesh if expert_mesh is not None else whole
    return source[dims if len(dims) > 1 else dims[0]], expert_mesh


def _stage_balance(parts: list[nn.Module], layout: Layout, device: torch.device,
                   balance: GlobalBalanceLoss | None) -> StageBalance | None:
    """Under pp, this rank's side of a Hugging Face family's balance loss (None without one). Every
    stage must take part in it (each sends its router logits to the others, which wait for them):
    a stage without MoE layers is refused on every rank, before anything waits."""
    if layout.pp == 1 or not getattr(getattr(parts[0], "config", None), "output_router_logits", False):
        return None
    pp_group = build_mesh(layout, device)[0]["pp"].get_group()
    here = torch.tensor([balance is not None], dtype=torch.int64, device=device)
    fewest, most = here.clone(), here.clone()
    dist.all_reduce(fewest, dist.ReduceOp.MIN, group=pp_group)
    dist.all_reduce(most, dist.ReduceOp.MAX, group=pp_group)
    if int(most) and not int(fewest):
        raise ValueError("output_router_logits=True but a pipeline stage of this model holds no MoE layer, "
                         "so it cannot take part in the family's balance loss over all layers; cut the "
                         "stages so that each holds one (e.g. fewer stages) or set config.output_router_logits=False")
    if balance is None:
        return None
    if len(parts) > 1:
        raise ValueError("the routers' balance loss of a Hugging Face MoE (output_router_logits=True) is "
                         "built for one pipeline stage per rank; use pp_schedule 'gpipe' or '1f1b' or set "
                         "config.output_router_logits=False")
    return StageBalance(balance, _exchange_group(layout, device), device)


def _exchange_group(layout: Layout, device: torch.device) -> dist.ProcessGroup:
    """A process group of this rank's pp ranks of its own (every rank creates all of them, in
    order): the balance loss's messages never queue behind or between the schedule's (NCCL
    matches point-to-point messages in order, whatever their tags)."""
    whole = build_mesh(layout, device)[0].mesh
    ranks = whole.movedim(MESH_DIMS.index("pp"), -1).reshape(-1, layout.pp).tolist()
    return dist.new_subgroups_by_enumeration(ranks)[0]


def apply_expert_parallel(parts: list[nn.Module], layout: Layout, device: torch.device,
                          data_group: dist.ProcessGroup | None) -> ExpertStep:
    """On the model (or this rank's pipeline stages): give the MoE layers their balance-statistics
    group (`data_group`, the ranks sharing the global batch); for ep > 1 keep this rank's experts,
    route tokens by all-to-all and set up the experts' gradient reduction; for tp > 1 keep this
    rank's slice of every expert (`expert_tensor.py`)."""
    layers: list[Layer] = moe_layers(parts) or [layer for part in parts for layer in hf_expert_layers(part)]
    balance = balance_loss_for(parts[0], data_group)
    stage_balance = _stage_balance(parts, layout, device, balance)
    balance = None if stage_balance is not None else balance
    stages = StageExperts(parts, stage_balance) if layout.pp > 1 and layers else None
    for layer in layers:
        layer.stats_group = data_group
    if (layout.ep == 1 and layout.tp == 1) or not layers:
        return ExpertStep(None, balance, stages)
    weights_mesh, expert_mesh = _weights_mesh(layout, device)
    tp_mesh = build_mesh(layout, device)[0]["tp"]
    ep_rank = expert_mesh["ep"].get_local_rank() if expert_mesh is not None else 0
    dispatch = AllToAllDispatch(expert_mesh["ep"].get_group()) if expert_mesh is not None else None
    params: list[nn.Parameter] = []
    for layer in layers:
        experts, names = _expert_weights(layer)
        split = _tensor_split(parts[0], layer, experts, names, tp_mesh.get_group()) if layout.tp > 1 else None
        for name in names:
            weight = getattr(experts, name)
            mine, placements = weight.detach(), []
            if layout.ep > 1:
                mine, placements = mine.chunk(layout.ep)[ep_rank], [Shard(0)]
            if split is not None:
                dim = split.splits[name].dim
                mine, placements = mine.chunk(layout.tp, dim)[tp_mesh.get_local_rank()], [*placements, Shard(dim)]
            sharded = nn.Parameter(DTensor.from_local(mine.clone(), weights_mesh, placements, run_check=False),
                                   requires_grad=weight.requires_grad)
            experts.register_parameter(name, sharded)
        layer.tensor_split = split
        if expert_mesh is None:
            continue  # tp alone: the experts' gradients are averaged over dp like every other
        layer.dispatch = dispatch
        if layout.zero >= 2:
            fully_shard(experts, mesh=expert_mesh["edp"], **fsdp_options(layout, expert_mesh.device_type))
        params += experts.parameters()  # FSDP's own, where it replaced them
    if expert_mesh is None:
        return ExpertStep(None, balance, stages)
    if layout.zero >= 2:
        return ExpertStep(ScaleGradients(params, 1.0 / layout.ep), balance, stages)
    return ExpertStep(GradientAverager(params, expert_mesh["edp"].get_group(), divisor=layout.dp), balance, stages)
