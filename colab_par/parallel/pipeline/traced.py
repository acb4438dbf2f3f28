"""Pipeline stages of any model: traced by torch's `pipeline()` and cut before named modules.

A model the kit cannot cut by its layers (or any model given `split_points`) is traced on an
example microbatch (one microbatch of this rank's share, in the batch convention of
`colab_par.data.batch`) and cut before each module named in `split_points`, or before repeated
blocks (`find_blocks`) chosen to balance parameter counts. Every parameter keeps its fully
qualified name; a tensor several stages use stays one tensor (`stages.tensors_across_stages`).
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.distributed.pipelining import SplitPoint, pipeline

from colab_par.compat import tree_flatten, tree_unflatten
from colab_par.layout import Layout
from colab_par.data.batch import Batch, forward_keywords, batch_to, check_batch
from colab_par.parallel.blocks import find_blocks
from colab_par.parallel.mesh import default_device
from colab_par.parallel.pipeline.stages import stage_ids, tensors_across_stages

__all__ = ["TracedInterface", "auto_split_points", "balanced_cuts", "split_traced"]


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
    in_spec: Any  # structure of the model's (args, kwargs) (a pytree TreeSpec)
    fed: dict[int, tuple[tuple[int, ...], torch.dtype]]  # leaf -> traced microbatch shape, dtype
    out_spec: Any
    out_constants: dict[int, Any]  # output leaves that are not tensors, as traced

    def inputs(self, batch: Batch, n_microbatches: int) -> dict[str, torch.Tensor]:
        """Every stage's keyword inputs for `batch`; refuses a batch the trace does not fit."""
        leaves, spec = tree_flatten(model_inputs(batch, self.dict_keys))
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


def model_inputs(batch: Batch, dict_keys: tuple[str, ...] | None) -> tuple[tuple, dict]:
    """The model's (args, kwargs) for `batch`, as `colab_par.data.batch.call_model` calls it."""
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


def split_traced(model: nn.Module, layout: Layout, pp_rank: int,
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
    holders: dict[str, set[int]] = {}
    for k, stage in enumerate(plan.modules):
        for name in stage.state_dict():
            holders.setdefault(name, set()).add(k)
    ties = tensors_across_stages(model, holders, layout)
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
        accepted = forward_keywords(model)
        dict_keys = tuple(key for key in example if key in accepted)
    leaves, in_spec = tree_flatten(model_inputs(example, dict_keys))
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
        graph.set_codegen(fx.graph.CodeGen())  # pipeline() may give stage 0 the model's signature
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
