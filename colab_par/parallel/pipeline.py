"""Pipeline parallel: cut a model into stages and run them with torch.distributed.pipelining.

Two jobs, nothing else:
- `split_model` gives one pp rank its stage modules, and every parameter keeps its original fully
  qualified name: checkpoints, parity checks and `full_state_dict` need no renaming table.
  colab_par's GPT and Hugging Face causal LMs are cut by their layers into pruned copies (the
  modules a stage does not own are never copied). Any other model, or any model given
  `split_points`, is traced by torch's own `pipeline()` on an example microbatch and cut before
  the named modules, or before repeated blocks chosen to balance parameter counts.
- `PipelineRunner` wraps those parts in `PipelineStage`s and one of torch's schedules (GPipe, 1F1B,
  interleaved 1F1B, zero-bubble V) behind one call: `step(inputs, targets)` for token batches,
  `step_batch(batch)` for any batch of the kit's convention, so the training loop is the same for
  every layout.

Stage placement follows torch's schedules: one stage per rank for gpipe/1f1b; "loop" placement for
interleaved (rank r holds r, r+pp, r+2pp, ...); "V" placement for zbv (rank r holds r and 2pp-1-r,
so the first and the last stage share rank 0).
"""
from __future__ import annotations

import copy
import math
import operator
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, SplitPoint,
                                          pipeline)
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from colab_par import compat
from colab_par.layout import Layout
from colab_par.parallel.batch import Batch, _forward_keywords, batch_size, batch_to, check_batch
from colab_par.parallel.blocks import find_blocks
from colab_par.parallel.mesh import default_device

__all__ = ["stage_ids", "stage_owner", "split_model", "auto_split_points", "HFCausalLMStage",
           "TracedInterface", "PipelineRunner"]

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
              "interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}
_MULTI_STAGE = ("interleaved", "zbv")


# ---- which stages live where --------------------------------------------------------------------
def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Stage indices held by `pp_rank`, in the order torch's schedule for the layout expects."""
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{layout.pp - 1} for pp={layout.pp}")
    pp, v = layout.pp, layout.virtual_stages
    if layout.pp_schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if layout.pp_schedule == "interleaved":
        return [pp_rank + k * pp for k in range(v)]
    return [pp_rank]


def stage_owner(layout: Layout, stage: int) -> int:
    """The pp rank that holds `stage` (the inverse of `stage_ids`)."""
    for rank in range(layout.pp):
        if stage in stage_ids(layout, rank):
            return rank
    raise ValueError(f"stage {stage} does not exist; the layout has "
                     f"{layout.pp * layout.virtual_stages} stages")


def _stage_layers(stage: int, n_stages: int, n_layers: int) -> range:
    per_stage = n_layers // n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


# ---- splitting ----------------------------------------------------------------------------------
def split_model(model: nn.Module, layout: Layout | str, pp_rank: int, *,
                split_points: Sequence[str] | None = None, block_types: Sequence[type | str] = (),
                example_batch: Batch | None = None) -> list[nn.Module]:
    """This rank's stage modules, one per stage id; parameters keep the model's own FQNs.

    colab_par's `GPT` (layers in a ModuleDict) and Hugging Face ``*ForCausalLM`` decoders
    (``model.embed_tokens / model.layers / model.norm / lm_head``) are cut by their layers. Any
    other model, and any model given `split_points`, is traced by torch's `pipeline()` on
    `example_batch` (one microbatch of this rank's share, in the batch convention of
    `colab_par.parallel.batch`) and cut before each module named in `split_points`, or before
    repeated blocks (`find_blocks(model, block_types)`) chosen to balance parameter counts.
    The source model is left untouched.
    """
    layout = Layout.parse(layout).validate()
    stage_ids(layout, pp_rank)  # refuses a rank outside the pipeline before any work
    if split_points is None and layer_count(model) is not None:
        return _split_by_layers(model, layout, pp_rank, layer_count(model))
    if example_batch is None:
        raise TypeError(f"split_model cuts colab_par's GPT and Hugging Face *ForCausalLM by their "
                        f"layers; {type(model).__name__} is neither; use pp=1 for it, or pass "
                        "example_batch= (one microbatch of this rank's share, e.g. (images, labels)) "
                        "so torch's pipeline() can trace it and cut it into stages")
    return _split_traced(model, layout, pp_rank, split_points, block_types, example_batch)


def layer_count(model: nn.Module) -> int | None:
    """How many layers a model cut by its layers has (colab_par's GPT, a Hugging Face
    ``*ForCausalLM``); None for any other model."""
    if _is_hf_causal_lm(model):
        return len(model.model.layers)
    if isinstance(getattr(model, "layers", None), nn.ModuleDict):
        return len(model.layers)
    return None


def layer_stage(model: nn.Module, stage: int, n_stages: int, layers: range) -> nn.Module:
    """Stage `stage` of `n_stages` of a model cut by its layers, holding `layers` (the first stage
    also the embedding, the last the final norm and head); parameters keep their FQNs."""
    build = _hf_stage if _is_hf_causal_lm(model) else _gpt_stage
    return build(model, stage, n_stages, layers)


def _split_by_layers(model: nn.Module, layout: Layout, pp_rank: int, n_layers: int) -> list[nn.Module]:
    n_stages = layout.pp * layout.virtual_stages
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers do not split into pp·virtual_stages = {n_stages} "
                         "equal stages; choose pp·virtual_stages dividing the layer count")
    return [layer_stage(model, stage, n_stages, _stage_layers(stage, n_stages, n_layers))
            for stage in stage_ids(layout, pp_rank)]


def _pruned_copy(model: nn.Module, drop: list[nn.Module]) -> nn.Module:
    """Deep copy in which every module in `drop` becomes None: the memo makes copy.deepcopy map
    them to None instead of copying their parameters."""
    memo = {id(module): None for module in drop}
    return copy.deepcopy(model, memo)


def _gpt_stage(model: nn.Module, stage: int, n_stages: int, owned: range) -> nn.Module:
    layer_keys = list(model.layers.keys())
    drop = [model.layers[key] for i, key in enumerate(layer_keys) if i not in owned]
    if stage > 0:
        drop.append(model.tok_embeddings)
    if stage < n_stages - 1:
        drop += [model.norm, model.output]
    part = _pruned_copy(model, drop)
    for i, key in enumerate(layer_keys):
        if i not in owned:
            del part.layers[key]
    return part


def _is_hf_causal_lm(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (hasattr(model, "lm_head") and inner is not None and hasattr(inner, "layers")
            and hasattr(inner, "embed_tokens"))


def _hf_stage(model: nn.Module, stage: int, n_stages: int, owned: range) -> nn.Module:
    inner = model.model
    embed, head = inner.embed_tokens, model.lm_head
    if embed is not None and head is not None and head.weight is embed.weight:
        raise ValueError("the model ties lm_head to embed_tokens, which pipeline parallel puts on "
                         "different ranks; load it with tie_word_embeddings=False")
    drop = [layer for i, layer in enumerate(inner.layers) if i not in owned]
    if stage > 0:
        drop.append(embed)
    last = stage == n_stages - 1
    if not last:
        drop.append(inner.norm)
    inner_part = _pruned_copy(inner, drop)
    inner_part.layers = nn.ModuleDict({str(i): inner_part.layers[i] for i in owned})
    return HFCausalLMStage(inner_part, copy.deepcopy(head) if last else None,
                           compat.hf_tp_plan(model))


class HFCausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM: tokens|hidden -> hidden|logits.

    Attribute names mirror ``*ForCausalLM`` (``model.embed_tokens``, ``model.layers.<i>``,
    ``model.norm``, ``lm_head``) so parameter names equal the unsplit model's. ``model.layers`` is
    a ModuleDict keyed by the original layer index: a ModuleList would renumber a later stage's
    layers from 0. ``config`` and ``_tp_plan`` (the full model's plan; patterns naming modules
    of other stages match nothing) are kept so tensor-parallel plans apply to a stage unchanged. The forward mirrors
    ``LlamaModel.forward`` without a KV cache.
    """

    def __init__(self, model: nn.Module, lm_head: nn.Module | None,
                 tp_plan: dict[str, str] | None = None):
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        self.config = model.config
        self._tp_plan = dict(tp_plan or {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = compat.create_causal_mask(inner.config, h, position_ids)
        position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings,
                      position_ids=position_ids)
        if inner.norm is not None:
            h = inner.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


# ---- splitting any model: traced by torch's pipeline() -------------------------------------------
@dataclass(frozen=True)
class TracedInterface:
    """How the runner feeds the stages of a traced model and reads the last one's outputs.

    torch's `pipeline()` traces one graph for the example's microbatch shapes, and stages pass
    only tensors to each other. So every stage takes the batch's tensors as keywords ``input_<i>``
    (i: the leaf's index in the model's flattened ``(args, kwargs)``) and uses those it needs (an
    attention mask read by the last stage is not relayed through the others), and the last stage
    returns the model output's tensors flat; `outputs` gives back the model's own structure
    (tensor, tuple, dict, ModelOutput) for the loss.
    """

    dict_keys: tuple[str, ...] | None  # the batch keys the model takes; None for a tuple batch
    in_spec: TreeSpec  # structure of the model's (args, kwargs)
    fed: dict[int, tuple[tuple[int, ...], torch.dtype]]  # leaf -> traced microbatch shape, dtype
    out_spec: TreeSpec
    out_constants: dict[int, Any]  # output leaves that are not tensors, as traced

    def inputs(self, batch: Batch, n_microbatches: int) -> dict[str, torch.Tensor]:
        """Every stage's keyword inputs for `batch`; refuses a batch the trace does not fit."""
        leaves, spec = tree_flatten(_model_inputs(batch, self.dict_keys))
        if spec != self.in_spec:
            raise ValueError("this batch's structure differs from the example batch the model was "
                             "traced with; give batches shaped like that example, or split the "
                             "model again with an example of the new structure")
        fed = {}
        for i, (shape, dtype) in self.fed.items():
            leaf, want = leaves[i], (shape[0] * n_microbatches, *shape[1:])
            if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) != want or leaf.dtype != dtype:
                got = (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf)
                raise ValueError(f"model input {i} was traced for microbatches of {shape} {dtype}, "
                                 f"so with microbatches={n_microbatches} it must be {want} {dtype}, "
                                 f"not {got}: a traced pipeline has fixed shapes. Keep batch shapes "
                                 "fixed (e.g. DataLoader(drop_last=True)), or split the model again "
                                 "with an example of the new shape")
            fed[f"input_{i}"] = leaf
        return fed

    def outputs(self, flat: torch.Tensor | tuple[torch.Tensor, ...]) -> Any:
        """The model's outputs from the last stage's flat tensors."""
        tensors = iter((flat,) if isinstance(flat, torch.Tensor) else flat)
        leaves = [self.out_constants[i] if i in self.out_constants else next(tensors)
                  for i in range(self.out_spec.num_leaves)]
        return tree_unflatten(leaves, self.out_spec)


def _model_inputs(batch: Batch, dict_keys: tuple[str, ...] | None) -> tuple[tuple, dict]:
    """The model's (args, kwargs) for `batch`, as `colab_par.parallel.batch.call_model` calls it."""
    if isinstance(batch, dict):
        missing = [key for key in dict_keys or () if key not in batch]
        if missing:
            raise ValueError(f"the batch lacks {missing}, which the model was traced with; "
                             "give every batch the example batch's keys")
        return (), {key: batch[key] for key in dict_keys or ()}
    return tuple(batch[:-1]), {}


def auto_split_points(model: nn.Module, n_stages: int,
                      block_types: Sequence[type | str] = ()) -> list[str]:
    """The blocks to split before so that `n_stages` stages hold about equal parameter counts.

    Blocks are `find_blocks(model, block_types or None)`; every stage gets at least one. A parameter
    outside the blocks counts with the next block in registration order (the last block for those
    after it), which puts a stem on the first stage and a head on the last for the usual model.
    """
    blocks = find_blocks(model, list(block_types) or None)
    if len(blocks) < n_stages:
        found = f"{len(blocks)} repeated blocks" if blocks else "no repeated blocks"
        raise ValueError(f"{type(model).__name__} has {found} to split between, but the layout has "
                         f"pp·virtual_stages = {n_stages} stages of at least one block each; use "
                         "fewer stages, name the block classes (block_types=[...]), or name the "
                         "modules to split before (split_points=[...])")
    owner = {id(p): i for i, (_, _, block) in enumerate(blocks) for p in block.parameters()}
    weights, pending = [0] * len(blocks), 0
    for param in model.parameters():
        if id(param) in owner:
            weights[owner[id(param)]] += param.numel() + pending
            pending = 0
        else:
            pending += param.numel()
    weights[-1] += pending
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(blocks[i][2])] for i in balanced_cuts(weights, n_stages)]


def balanced_cuts(weights: list[int], parts: int) -> list[int]:
    """Start indices of parts 1.. of the contiguous split of `weights` with the smallest maximum
    part (dynamic programming: best[k][i] is that maximum for the first i weights in k parts)."""
    n = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], start[k][i] = load, j
    cuts, i = [], n
    for k in range(parts, 1, -1):
        i = start[k][i]
        cuts.append(i)
    return cuts[::-1]


def _checked_split_points(model: nn.Module, split_points: Sequence[str], n_stages: int) -> list[str]:
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise TypeError(f"split_points={split_points!r}: give a list of module names to split "
                        "before, e.g. split_points=['layers.2']")
    points = list(split_points)
    if len(points) != n_stages - 1:
        raise ValueError(f"{len(points)} split points make {len(points) + 1} stages, but the layout "
                         f"has pp·virtual_stages = {n_stages}; name {n_stages - 1} modules to split "
                         "before")
    if len(set(points)) != len(points):
        raise ValueError(f"split_points={points} names a module twice; name each module once")
    modules = dict(model.named_modules())
    for point in points:
        if not point or point not in modules:
            shown = [name for name in modules if name and name.count(".") <= 1][:12]
            raise ValueError(f"split point {point!r} names no module of {type(model).__name__}; "
                             f"split before one of its submodules, e.g. {shown}")
    return points


def _split_traced(model: nn.Module, layout: Layout, pp_rank: int,
                  split_points: Sequence[str] | None, block_types: Sequence[type | str],
                  example_batch: Batch) -> list[nn.Module]:
    if layout.tp > 1 or layout.cp > 1:
        raise ValueError("a traced pipeline stage is a graph with the example's shapes fixed, which "
                         "tensor and context parallel would change; use tp=1 and cp=1 with pp for "
                         f"{type(model).__name__}, or pp=1")
    check_batch(example_batch)
    n_stages = layout.pp * layout.virtual_stages
    points = (_checked_split_points(model, split_points, n_stages) if split_points is not None
              else auto_split_points(model, n_stages, block_types))
    pipe, interface = _trace(model, example_batch, points)
    plan = _StagePlan(pipe.split_gm, n_stages, type(model).__name__)
    ties = _tensors_across_stages(model, plan.modules, layout)
    parts = []
    for stage in stage_ids(layout, pp_rank):
        part = plan.rewire(stage)
        part.pipeline_io = interface  # PipelineRunner.step_batch feeds the stage through it
        part.pipeline_ties = ties  # every rank knows every tie: the gradient sum is collective
        parts.append(part)
    return parts


def _trace(model: nn.Module, example_batch: Batch, points: list[str]) -> tuple[Any, TracedInterface]:
    """torch's `pipeline()` on a copy of `model` called with the example's tensors as keywords.

    The traced module is a shallow copy of the model copy whose `forward` takes the batch's
    tensors flat; it shares the copy's modules and parameters, so the stages' parameter names are
    the model's own. (The copy is needed because `pipeline()` rewires the forwards of the modules
    it splits before.)
    """
    device = next(model.parameters(), torch.empty(0)).device
    example = batch_to(example_batch, device)
    dict_keys = None
    if isinstance(example, dict):
        accepted = _forward_keywords(model)
        dict_keys = tuple(key for key in example if key in accepted)
    leaves, in_spec = tree_flatten(_model_inputs(example, dict_keys))
    fed = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim()}
    traced = copy.deepcopy(model)
    seen: dict[str, Any] = {}

    def flat_forward(**inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = tree_unflatten([inputs[f"input_{i}"] if i in fed else leaf
                                       for i, leaf in enumerate(leaves)], in_spec)
        out, seen["spec"] = tree_flatten(traced.forward(*args, **kwargs))
        seen["constants"] = {i: v for i, v in enumerate(out) if not isinstance(v, torch.Tensor)}
        return tuple(v for v in out if isinstance(v, torch.Tensor))

    shell = copy.copy(traced)
    shell.forward = flat_forward
    try:
        pipe = pipeline(shell, (), {f"input_{i}": t for i, t in fed.items()},
                        split_spec={point: SplitPoint.BEGINNING for point in points})
    except Exception as error:
        cause = error.__cause__ or error
        detail = (str(cause).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"torch's pipeline() could not trace {type(model).__name__} on the example "
                         f"batch and split it before {points} ({type(cause).__name__}: {detail}). "
                         "Pipeline parallel for a model colab_par does not know needs one whole "
                         "graph (torch.export): remove data-dependent Python control flow from "
                         "forward, or use pp=1") from error
    if device.type == "meta":  # traced before the shards exist: tensors the graph makes go to the rank's device
        _retarget_devices(pipe.split_gm, default_device())
    fed_meta = {i: (tuple(t.shape), t.dtype) for i, t in fed.items()}
    return pipe, TracedInterface(dict_keys, in_spec, fed_meta, seen["spec"], seen["constants"])


def _retarget_devices(root: fx.GraphModule, device: torch.device) -> None:
    """A graph traced on the meta device creates its tensors (positions, masks) there; point every
    `device=` the trace recorded at the rank's device."""
    for module in root.modules():  # GraphModules and torch.export's InterpreterModules
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        def retarget(value: Any) -> Any:
            return device if isinstance(value, torch.device) and value.type == "meta" else value

        for node in graph.nodes:
            node.args = tuple(retarget(value) for value in node.args)
            node.kwargs = {key: retarget(value) for key, value in node.kwargs.items()}
        if isinstance(module, fx.GraphModule):
            module.recompile()


def _tensors_across_stages(model: nn.Module, stages: list[nn.Module], layout: Layout) -> list["TiedTensor"]:
    """Refuse a split that would lose a tensor from checkpoints; return the tensors several stages
    use (an MLM head tied to the word embeddings). Each of those stages trains a copy, and
    `PipelineRunner.sync_tied_gradients` sums their gradients so the copies stay one tensor, as
    Megatron does for embeddings shared by the first and last stage."""
    holders: dict[str, set[int]] = {}
    for k, stage in enumerate(stages):
        for name in stage.state_dict():
            holders.setdefault(name, set()).add(k)
    aliases: dict[int, list[str]] = {}  # a tied tensor has several names
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    ties = []
    for key, names in aliases.items():
        held = set().union(*(holders.get(name, set()) for name in names))
        if not held:
            what = f"{names} are one tied tensor" if len(names) > 1 else f"{names[0]} is"
            raise ValueError(f"{what} not used by forward on the example batch, so no stage would "
                             "hold it and checkpoints would lose it; delete the unused module, or "
                             "use pp=1")
        if len(held) == 1:
            continue
        if layout.zero >= 2:
            raise ValueError(f"{names} are one tied tensor used by stages {sorted(held)}; its copies "
                             "are kept equal by summing their gradients, which FSDP's sharded "
                             "gradients (zero 2/3) do not support yet; use zero=0 or 1, or untie them "
                             "(e.g. tie_word_embeddings=False)")
        ties.append(TiedTensor(tuple(name for name in names if name in holders), min(held),
                               tuple(tensors[key].shape), tensors[key].dtype))
    return ties


class TiedTensor(NamedTuple):
    """One tensor whose names live on several pipeline stages (see `_tensors_across_stages`)."""

    names: tuple[str, ...]  # the names stages hold it under
    first_stage: int  # the copy a norm counts
    shape: tuple[int, ...]
    dtype: torch.dtype


class _StagePlan:
    """The stages of a traced pipeline, rewired for `PipelineStage`.

    In torch's split graph a stage may read values of any earlier stage and the model's inputs.
    `PipelineStage` receives only from the previous stage, so each stage is rewired to take, as
    positional inputs, exactly the values crossing the boundary before it (an earlier stage's value
    is relayed stage by stage) and the model's inputs as keywords; it returns the values crossing
    the boundary after it (the last stage: the model's flat outputs).
    """

    def __init__(self, root: fx.GraphModule, n_stages: int, model_name: str):
        calls = [node for node in root.graph.nodes if node.op == "call_module"]
        if len(calls) != n_stages:
            raise ValueError(f"tracing split {model_name} into {len(calls)} stages, not "
                             f"pp·virtual_stages = {n_stages}: a split point's module is not called "
                             "by forward, is called more than once, or runs before any other "
                             "computation (its stage would be empty); split before modules that "
                             "forward calls exactly once, after the first")
        self.modules: list[fx.GraphModule] = [root.get_submodule(call.target) for call in calls]
        stage_of = {call: k for k, call in enumerate(calls)}

        def value(node: fx.Node) -> tuple:
            if node.op == "placeholder":
                return ("input", node.target)
            if node in stage_of:
                return ("stage", stage_of[node], None)
            return ("stage", stage_of[node.args[0]], node.args[1])  # getitem of a stage's outputs

        self.args = [[value(a) for a in call.args] for call in calls]
        output = next(node for node in root.graph.nodes if node.op == "output")
        self.final = [value(a) for a in tree_flatten(output.args[0])[0]]
        last_use: dict[tuple, int] = {}
        for k, used in enumerate(self.args + [self.final]):
            for v in used:
                last_use[v] = min(k, n_stages - 1)
        self.crossing = [[v for v in last_use if v[0] == "stage" and v[1] <= k < last_use[v]]
                         for k in range(n_stages - 1)]
        for k, values in enumerate(self.crossing):
            if not values:
                raise ValueError(f"stage {k + 1} of {model_name} uses nothing that stage {k} or "
                                 "before computes; choose split points along forward's data flow")

    def rewire(self, k: int) -> fx.GraphModule:
        gm = self.modules[k]
        graph = gm.graph
        graph._codegen = fx.graph.CodeGen()  # pipeline() may give stage 0 the model's signature
        old = [node for node in graph.nodes if node.op == "placeholder"]
        output = next(node for node in graph.nodes if node.op == "output")
        with graph.inserting_before(next(iter(graph.nodes))):
            received = {v: graph.placeholder(f"activation_{i}")
                        for i, v in enumerate(self.crossing[k - 1] if k else [])}
            feed = graph.placeholder("**inputs")
        fed: dict[tuple, fx.Node] = {}

        def source(v: tuple) -> Any:
            if v[0] == "input":
                if v not in fed:
                    with graph.inserting_after(feed):
                        fed[v] = graph.call_function(operator.getitem, (feed, v[1]))
                return fed[v]
            if v[1] == k:
                own = output.args[0]
                return own if v[2] is None else own[v[2]]
            return received[v]

        for node, v in zip(old, self.args[k], strict=True):
            node.replace_all_uses_with(source(v))
            graph.erase_node(node)
        sent = self.final if k == len(self.modules) - 1 else self.crossing[k]
        output.args = (tuple(source(v) for v in sent),)
        graph.lint()
        gm.recompile()
        return gm


# ---- running ------------------------------------------------------------------------------------
class _BusyClock:
    """Adds up compute time inside stage chunks and the wall time of a step.

    CUDA work is asynchronous, so on GPUs spans are CUDA events on the compute stream read once
    after the step; on CPU they are perf_counter intervals.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._seconds = {"busy": 0.0, "wall": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
        else:
            started = time.perf_counter()
            yield
            self._seconds[kind] += time.perf_counter() - started

    def idle_share(self) -> float:
        if self._events:
            torch.cuda.synchronize(self.device)
            for kind, start, end in self._events:
                self._seconds[kind] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        wall = self._seconds["wall"]
        return max(0.0, 1.0 - self._seconds["busy"] / wall) if wall > 0 else 0.0


class _TimedStage(PipelineStage):
    """A PipelineStage that clocks its compute; the schedule waits for p2p outside these calls,
    so wall time minus this is the time the rank sat idle (the bubble plus communication)."""

    def __init__(self, *args, clock: _BusyClock, **kwargs):
        super().__init__(*args, **kwargs)
        self._clock = clock

    def forward_one_chunk(self, *args, **kwargs):
        with self._clock.span("busy"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self._clock.span("busy"):
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self._clock.span("busy"):
            return super().backward_weight_one_chunk(*args, **kwargs)


class PipelineRunner:
    """Forward+backward of one batch through this rank's stages with the layout's schedule.

    Stages and schedule are built on the first step (and again if the batch shape changes):
    torch infers the activation shapes from that first microbatch. Gradients accumulate in the
    parts' parameters; the optimizer step is the caller's. The last stage scores its outputs with
    ``loss_fn(logits, targets)`` in `step` and ``batch_loss_fn(outputs, microbatch)`` in
    `step_batch` (`loss_fn` when no `batch_loss_fn` is given).

    `last_bubble` is the share of the last step's wall time this rank spent outside stage compute
    (waiting on p2p or idle in the pipeline bubble). The first step after a (re)build also
    includes torch's one-off shape inference.
    """

    def __init__(self, parts: list[nn.Module], layout: Layout | str, pp_group: dist.ProcessGroup,
                 loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device | str, *,
                 batch_loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None):
        self.layout = Layout.parse(layout).validate()
        if dist.get_world_size(pp_group) != self.layout.pp:
            raise ValueError(f"the pp process group has {dist.get_world_size(pp_group)} ranks but "
                             f"layout.pp={self.layout.pp}; pass mesh['pp'].get_group()")
        self.pp_group = pp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.stage_ids = stage_ids(self.layout, self.pp_rank)
        if len(parts) != len(self.stage_ids):
            raise ValueError(f"pp rank {self.pp_rank} holds stages {self.stage_ids} but got "
                             f"{len(parts)} parts; build them with split_model(model, layout, "
                             f"{self.pp_rank})")
        self.parts = list(parts)
        self.n_stages = self.layout.pp * self.layout.virtual_stages
        self.has_first = 0 in self.stage_ids
        self.has_last = self.n_stages - 1 in self.stage_ids
        self.device = torch.device(device)
        self.last_bubble = 0.0
        self._loss_fn = loss_fn
        self._batch_loss_fn = batch_loss_fn or loss_fn
        self._score: Callable[[Any, torch.Tensor], torch.Tensor] = loss_fn
        self._loss_weight = 1.0
        first = self.parts[0]
        inner = first.module if isinstance(first, DistributedDataParallel) else first
        self._traced: TracedInterface | None = getattr(inner, "pipeline_io", None)
        self._ties: list[TiedTensor] = list(getattr(inner, "pipeline_ties", ()))
        self._clock = _BusyClock(self.device)
        self._schedule = None
        self._built_for: tuple | None = None

    def tied_copies(self) -> list[list[tuple[int, nn.Parameter]]]:
        """Per tensor several stages use, this rank's copies of it with their stage ids."""
        copies: list[list[tuple[int, nn.Parameter]]] = []
        for tie in self._ties:
            mine: dict[int, tuple[int, nn.Parameter]] = {}
            for stage, part in zip(self.stage_ids, self.parts):
                for name, param in part.named_parameters(remove_duplicate=False):
                    if name in tie.names:
                        mine.setdefault(id(param), (stage, param))
            copies.append(list(mine.values()))
        return copies

    def duplicate_copies(self) -> set[int]:
        """ids of the copies a norm must skip: all but the first one on the first stage (a stage
        may hold a tensor twice, under two names), so each tensor counts once."""
        skip: set[int] = set()
        for tie, copies in zip(self._ties, self.tied_copies()):
            counted = [param for stage, param in copies if stage == tie.first_stage][:1]
            skip |= {id(param) for _, param in copies if all(param is not kept for kept in counted)}
        return skip

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """Sum each tied tensor's gradient over its copies on all stages and give every copy the
        sum, so the optimizer moves them alike (they start equal)."""
        for tie, copies in zip(self._ties, self.tied_copies()):
            total = torch.zeros(tie.shape, dtype=tie.dtype, device=self.device)
            for _, param in copies:
                if param.grad is not None:
                    total += param.grad
            dist.all_reduce(total, group=self.pp_group)
            for _, param in copies:
                param.grad = total.clone()

    def _stage_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        # Each microbatch loss carries loss_scale / n_microbatches, so the summed gradients are the
        # scaled batch-mean gradient. (torch's own scale_grads would also divide gradients that
        # earlier accumulation steps left in .grad, so it stays off.)
        return self._score(output, target) * self._loss_weight

    def _build(self) -> None:
        compat.check_stage_compute_hooks()  # _TimedStage's clock wraps them
        stages = [_TimedStage(part, sid, self.n_stages, self.device, group=self.pp_group,
                              clock=self._clock)
                  for part, sid in zip(self.parts, self.stage_ids)]
        schedule_cls = _SCHEDULES[self.layout.pp_schedule]
        target = stages if self.layout.pp_schedule in _MULTI_STAGE else stages[0]
        self._schedule = schedule_cls(target, n_microbatches=self.layout.microbatches,
                                      loss_fn=self._stage_loss, scale_grads=False)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0) -> float:
        """Forward + backward of this rank's dp slice; returns the batch mean loss on every pp rank."""
        if self._traced is not None:  # a traced model takes its tokens as a (tokens, targets) batch
            return self.step_batch((inputs, targets), loss_scale=loss_scale,
                                   score=lambda outputs, rows: self._loss_fn(outputs, rows[-1]))
        self._check_step(inputs.shape[0], loss_scale)
        args = (inputs.to(self.device),) if self.has_first else ()
        target = targets.to(self.device) if self.has_last else None
        self._score = self._loss_fn
        return self._run((tuple(inputs.shape), inputs.dtype, tuple(targets.shape)), args, {},
                         target, loss_scale)

    def step_batch(self, batch: Batch, *, loss_scale: float = 1.0,
                   score: Callable[[Any, Batch], torch.Tensor] | None = None) -> float:
        """`step` for this rank's dp share of any batch in the kit's convention: a tuple
        ``(*inputs, target)`` or a dict (see `colab_par.parallel.batch`).

        The last stage scores each microbatch with ``batch_loss_fn(outputs, microbatch)``. torch's
        schedules split only a tensor target, so the target they carry is the batch's row index
        (arange), and the loss looks its microbatch up by those rows. Returns the batch mean loss
        on every pp rank.
        """
        check_batch(batch)
        size = batch_size(batch)
        self._check_step(size, loss_scale)
        batch = batch_to(batch, self.device)
        if self._traced is not None:
            args, kwargs = (), self._traced.inputs(batch, self.layout.microbatches)
        elif isinstance(batch, dict):
            raise TypeError("the stages of colab_par's GPT and Hugging Face causal LMs take token "
                            "ids: pass (tokens, targets), or split the model with split_points= and "
                            "an example batch")
        else:
            args, kwargs = (tuple(batch[:-1]) if self.has_first else ()), {}
        shapes = tuple((tuple(t.shape), t.dtype) for t in tree_flatten(batch)[0]
                       if isinstance(t, torch.Tensor))
        outputs = self._traced.outputs if self._traced is not None else (lambda out: out)
        score = score or self._batch_loss_fn
        self._score = lambda output, rows: score(outputs(output), _rows(batch, rows))
        target = torch.arange(size) if self.has_last else None
        return self._run(("batch", shapes), args, kwargs, target, loss_scale)

    def _check_step(self, size: int, loss_scale: float) -> None:
        n_mb = self.layout.microbatches
        if size % n_mb:
            raise ValueError(f"batch of {size} does not split into microbatches={n_mb}; "
                             f"use a per-dp-rank batch that is a multiple of {n_mb}")
        if not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale={loss_scale} must be a positive finite number "
                             "(e.g. 1/accumulation_steps)")

    def _run(self, key: tuple, args: tuple, kwargs: dict[str, Any], target: torch.Tensor | None,
             loss_scale: float) -> float:
        if key != self._built_for:
            self._build()
            self._built_for = key
        self._loss_weight = loss_scale / self.layout.microbatches
        losses: list[torch.Tensor] = []
        self._clock.reset()
        with self._clock.span("wall"):
            self._schedule.step(*args, target=target, losses=losses if self.has_last else None,
                                return_outputs=False, **kwargs)
        self.last_bubble = self._clock.idle_share()
        return self._broadcast_mean_loss(losses, loss_scale)

    def _broadcast_mean_loss(self, losses: list[torch.Tensor], loss_scale: float) -> float:
        if self.has_last:
            loss = (torch.stack([l.detach().float() for l in losses]).sum() / loss_scale).reshape(1)
        else:
            loss = torch.zeros(1, device=self.device)
        owner = stage_owner(self.layout, self.n_stages - 1)
        dist.broadcast(loss, group=self.pp_group, group_src=owner)
        return loss.item()


def _rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """The microbatch of `batch` whose row indices are `rows`: torch's schedules split the target
    into contiguous chunks, so that is a slice of every tensor."""
    start, count = int(rows[0]), rows.numel()
    return tree_map(lambda t: t[start:start + count]
                    if isinstance(t, torch.Tensor) and t.dim() else t, batch)
