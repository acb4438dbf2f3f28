"""Tensor parallel (+ Megatron sequence parallel) through DTensor's ``parallelize_module``.

A plan maps module patterns (``fnmatch`` per dotted name, e.g. ``layers.*.mlp.up_proj``) to DTensor
``ParallelStyle``s or to the style strings of transformers' own plans, which are translated here to
torch's styles (a small style of our own only where torch has none). Where the plan comes from:
- the user's ``tp_plan``;
- a Hugging Face model's own ``_tp_plan``, or for BERT and GPT-2, which ship none, the kit's
  (`hf_plans.py`);
- the reference GPT: a Megatron plan. q/k/v and the SwiGLU gate/up projections are split by output
  columns, the attention and FFN output projections by input rows, so each block needs one
  all-reduce in forward (or, with sequence parallel, a reduce-scatter + all-gather pair that keeps
  norms and residuals sharded along the sequence). The vocabulary is sharded in the embedding and
  the output head, whose logits are gathered so any loss function works on them unchanged.
Every plan is checked against the model before anything is sharded (unknown or untrainable styles,
patterns that match nothing, uneven splits the next layers would see, tied weights sharded two
ways). A vocabulary tp does not divide is split unevenly (DTensor's uneven shards): the embedding
and a gathered head hide the split, so GPT-2's 50,257 tokens train under any tp.
"""
from __future__ import annotations

import contextlib
from fnmatch import fnmatch
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from colab_par import compat
from colab_par.models.hf import is_hf_model
from colab_par.models.moe import MoE
from colab_par.parallel.collectives import sum_grad_over
from colab_par.parallel.hf_plans import (KIT_PLANS, Conv1DColwise, Conv1DRowwise, base_prefix, bert_tp_plan,
                                        gpt2_tp_plan)
from colab_par.parallel.pipeline.layers import StandIn

__all__ = ["apply_tensor_parallel", "bert_tp_plan", "gpt2_tp_plan", "gpt_tp_plan", "has_tp_plan", "hf_tp_plan",
           "is_whole", "modules_matching", "resolve_tp_plan", "tp_plan_for", "HF_STYLES", "LocalParams",
           "ReplicatedGradSum", "ShardParameter"]

Plan = dict[str, Any]  # module pattern -> ParallelStyle or Hugging Face style string


# ---- the reference GPT ----------------------------------------------------------------------------
def gpt_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for `colab_par.models.GPT` (or a pipeline stage of it: missing parts are skipped)."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(input_layouts=between_blocks, output_layouts=Replicate())
    for name, layer in model.layers.items():
        prefix = f"layers.{name}"
        experts = isinstance(layer.feed_forward, MoE)  # split inside by the experts step (expert_tensor.py)
        if sequence_parallel:
            plan[f"{prefix}.attention_norm"] = SequenceParallel()
            plan[f"{prefix}.ffn_norm"] = SequenceParallel()
        # One replicated DTensor input shared by q/k/v (and gate/up): their input gradients are
        # summed as partial DTensors first, so backward needs one all-reduce, not one per projection.
        plan[f"{prefix}.attention"] = PrepareModuleInput(
            input_layouts=(between_blocks, None, None), desired_input_layouts=(Replicate(), None, None))
        if not experts:
            plan[f"{prefix}.feed_forward"] = PrepareModuleInput(
                input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),))
        ffn = () if experts else ("feed_forward.w1", "feed_forward.w3")
        for proj in ("attention.wq", "attention.wk", "attention.wv", *ffn):
            plan[f"{prefix}.{proj}"] = ColwiseParallel()
        for proj in ("attention.wo", *(() if experts else ("feed_forward.w2",))):
            plan[f"{prefix}.{proj}"] = RowwiseParallel(output_layouts=between_blocks)
    return plan


# ---- styles torch does not have -------------------------------------------------------------------
@contextlib.contextmanager
def _local_parameters(module: nn.Module, to_local: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Temporarily put `to_local(param)` in place of the module's own DTensor parameters."""
    originals = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    module._parameters.update({name: to_local(p) for name, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)


class LocalParams(ParallelStyle):
    """Runs the module's forward on the local shards of its own parameters.

    The activations between a colwise and a rowwise layer are plain local tensors (this rank's
    heads); a module there that uses a sharded parameter of its own directly (attention sinks, one
    per head) cannot mix it as a DTensor with them. Gradients go back to the shards unchanged.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        forward = module.forward

        def forward_on_local_params(*args: Any, **kwargs: Any) -> Any:
            with _local_parameters(module, lambda p: self._local(p, device_mesh)):
                return forward(*args, **kwargs)

        module.forward = forward_on_local_params
        return module

    def _local(self, param: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        return param.to_local()


class ReplicatedGradSum(LocalParams):
    """Replicated parameters of a module that runs on this rank's slice of the activations.

    Qwen3's per-head ``q_norm``/``k_norm`` sit after colwise projections: each rank normalises its
    own heads with the full weight, so no forward communication is needed, but each rank's weight
    gradient covers only its heads and the true gradient is their sum over the tp ranks. The sum
    happens in the autograd graph (not in a parameter hook), so it survives FSDP or anything else
    that swaps the parameter objects later.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                replicated = distribute_tensor(param.detach(), device_mesh, [Replicate()],
                                               src_data_rank=self.src_data_rank)
                module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        return super()._apply(module, device_mesh)

    def _local(self, param: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        return sum_grad_over(param.to_local(), device_mesh.get_group())


class ShardParameter(ParallelStyle):
    """Shards one bare parameter of a module (one that no Linear/Embedding owns, e.g. attention
    sinks); its owner must then run on local parameters (`LocalParams`)."""

    def __init__(self, name: str, placement: Placement):
        super().__init__()
        self.name, self.placement = name, placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        param = module._parameters[self.name]
        sharded = distribute_tensor(param.detach(), device_mesh, [self.placement], src_data_rank=self.src_data_rank)
        module.register_parameter(self.name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


class _Styles(ParallelStyle):
    """Several styles applied in order to the same module (a parameter entry and its owner's)."""

    def __init__(self, styles: list[ParallelStyle]):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            style.src_data_rank = self.src_data_rank
            module = style._apply(module, device_mesh)
        return module


def is_whole(style: ParallelStyle) -> bool:
    """The "replicate" style: the module stays whole on every rank."""
    return isinstance(style, _Styles) and not style.styles


class ExpertsSplitInside(ParallelStyle):
    """transformers' ``moe_tp_experts``: every tp rank holds a slice of every expert. The experts
    step has split the module already (`expert_tensor.py`, together with ep where there is one),
    and the plan's entries for the packed expert weights are its business: nothing left to do."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


def _check_split_experts(pattern: str, modules: list[nn.Module]) -> None:
    strangers = [type(m).__name__ for m in modules
                 if getattr(getattr(m, "colab_par_experts", None), "tensor_split", None) is None]
    if strangers:
        raise ValueError(f"'moe_tp_experts' for {pattern!r} names {', '.join(sorted(set(strangers)))}, which is "
                         "not an experts module of the model's expert plan (config.base_model_ep_plan); the "
                         "kit splits experts inside only there: drop the entry from tp_plan or use tp=1")


# ---- Hugging Face style strings -------------------------------------------------------------------
def _all_reduce_output() -> ParallelStyle:
    return PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())


# Every style transformers 5 plans use for dense training (its names in
# transformers.integrations.tensor_parallel.ALL_PARALLEL_STYLES), plus the 4.x names that mean the same.
HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,                                        # out features split, output local
    "rowwise": RowwiseParallel,                                        # in features split, output all-reduced
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),    # ... output all-gathered
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),     # full input, split locally
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocabulary split
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),  # embedding dim split
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    "replicated_with_grad_allreduce": ReplicatedGradSum,
    "all_reduce": _all_reduce_output,                                  # sum a partial output
    "local_params": LocalParams,
    "replicate": lambda: _Styles([]),                                  # every rank keeps the full module
    # transformers 4.x names
    "gather": _all_reduce_output,
    "local_colwise": ColwiseParallel,
    "local_rowwise": lambda: RowwiseParallel(output_layouts=Partial()),  # an ancestor's gather sums it
}
_EMBEDDING_ONLY = ("embedding_rowwise", "embedding_colwise")

# Styles of transformers' plans that cannot train here, and why.
_MOE = "expert-parallel styles: the kit's ep dimension splits experts (e.g. 'dp2 ep2')"
_REFUSED = {
    "packed_colwise": "fused weights packed with strided shards (outside an experts module)",
    "packed_rowwise": "fused weights packed with strided shards",
    "local_packed_rowwise": "fused weights packed with strided shards",
    "moe_identity_expert": "identity experts (zero-computation experts) are not split by the kit",
    "grouped_gemm": _MOE,
    "ep_dispatch_experts": _MOE,
    "ep_router": _MOE,
    "local": _MOE,
    "mla_kv_a_proj": "DeepSeek multi-head latent attention splits its projection output",
}


def _hf_style(pattern: str, name: str) -> ParallelStyle:
    if name in HF_STYLES:
        return HF_STYLES[name]()
    if name == "moe_tp_experts":
        return ExpertsSplitInside()
    if name in _REFUSED or name.startswith(("moe_", "ep_")) or "packed" in name or "expert" in name:
        why = _REFUSED.get(name, "mixture-of-experts or packed weights")
        raise ValueError(f"tensor-parallel style {name!r} for {pattern!r} cannot train here ({why}); "
                         "use tp=1 for this model, or pass parallelize(..., tp_plan=...) without it")
    raise ValueError(f"unknown tensor-parallel style {name!r} for {pattern!r}; supported: "
                     f"{', '.join(HF_STYLES)} (or a torch ParallelStyle)")


def _parameter_placement(pattern: str, name: str, param: torch.Tensor) -> Placement | None:
    """Where transformers puts a bare parameter its plan names (colwise: rows, rowwise: columns)."""
    if name in ("colwise", "local_colwise"):
        return Shard(max(param.dim() - 2, 0))
    if name in ("rowwise", "local_rowwise"):
        return Shard(param.dim() - 1)
    if name == "replicate":
        return None
    raise ValueError(f"{pattern!r} names a parameter, which takes 'colwise', 'rowwise' or 'replicate', "
                     f"not {name!r}")


# ---- plans of Hugging Face models -----------------------------------------------------------------
def hf_tp_plan(model: nn.Module) -> dict[str, Any]:
    """A transformers model's own ``_tp_plan`` (FQN pattern -> style name), or the kit's for
    families that ship none (`hf_plans.KIT_PLANS`: BERT, GPT-2)."""
    raw: dict[str, Any] = compat.hf_tp_plan(model)
    if not raw:  # the config's plan names the base model's modules
        config_plan = getattr(model.config, "base_model_tp_plan", None) or {}
        raw = {f"{base_prefix(model)}{k}": v for k, v in config_plan.items()}
    kit_plan = KIT_PLANS.get(getattr(model.config, "model_type", ""))
    if not raw and kit_plan is not None:
        raw = kit_plan(model)
    if not raw:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (_tp_plan / "
                         "config.base_model_tp_plan); pass parallelize(..., tp_plan={module pattern: "
                         "style}) or use a layout with tp=1")
    return raw


def has_tp_plan(model: nn.Module) -> bool:
    """Whether `model` brings a tensor-parallel plan of its own (transformers', or the kit's for its
    family): no `tp_plan` needs to be given for it."""
    if not is_hf_model(model):
        return False
    try:
        return bool(hf_tp_plan(model))
    except ValueError:
        return False


def tp_plan_for(model: nn.Module, user_plan: Plan | None, *, hf: bool,
                sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan `parallelize` applies: the user's (DTensor styles or Hugging Face style strings per
    module pattern), else the model's own (Hugging Face), else the reference GPT's."""
    if user_plan is not None or hf:
        own = user_plan is None
        plan = resolve_tp_plan(model, hf_tp_plan(model) if own else user_plan, own=own)
        if sequence_parallel and not any(isinstance(s, SequenceParallel) for s in plan.values()):
            raise ValueError(f"the layout asks for sequence parallel, but the tensor-parallel plan for "
                             f"{type(model).__name__} keeps no activation sharded along the sequence; drop "
                             "'sp' from the layout, or put SequenceParallel() / 'sequence_parallel' entries "
                             "on its norms in tp_plan")
        return plan
    if not isinstance(getattr(model, "layers", None), nn.ModuleDict) or not hasattr(model, "output"):
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan; pass "
                         "parallelize(..., tp_plan={module pattern: style}) (DTensor ParallelStyles or "
                         f"Hugging Face style strings: {', '.join(HF_STYLES)}) or use a layout with tp=1")
    return gpt_tp_plan(model, sequence_parallel)


# ---- checking a plan against a model --------------------------------------------------------------
def _resolve(model: nn.Module, pattern: str) -> tuple[list[nn.Module], list[tuple[nn.Module, str]], bool]:
    """What `pattern` names, matched the way ``parallelize_module`` does (fnmatch per dotted name):
    (modules, (owner, name) of bare parameters, whether some match is a module a pipeline stage
    does not hold: a None module or attribute, another stage's stand-in, or a layer index missing
    from a stage's ModuleDict of layers)."""
    atoms = pattern.split(".")
    frontier, pruned = [model], False
    for depth, atom in enumerate(atoms):
        children = []
        for module in frontier:
            for name, child in module._modules.items():
                if fnmatch(name, atom):
                    stand_in = child is None or isinstance(child, StandIn)
                    pruned |= stand_in
                    if not stand_in:
                        children.append(child)
            pruned |= module.__dict__.get(atom, False) is None  # a stage's `self.lm_head = None`
            pruned |= (isinstance(module, nn.ModuleDict) and atom.isdigit() and atom not in module._modules
                       and all(key.isdigit() for key in module._modules))
        if depth == len(atoms) - 1 and not children:
            params = [(module, name) for module in frontier for name, p in module._parameters.items()
                      if p is not None and fnmatch(name, atom)]
            return [], params, pruned
        frontier = children
    return frontier, [], pruned


def modules_matching(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The modules a plan pattern names, matched as ``parallelize_module`` matches them."""
    return _resolve(model, pattern)[0]


def resolve_tp_plan(model: nn.Module, plan: Plan, *, own: bool = False) -> dict[str, ParallelStyle]:
    """Check `plan` against `model` and translate style strings: module pattern -> ParallelStyle.

    Entries naming a bare parameter become a `ShardParameter` on its owner's pattern; those of an
    experts module split inside (``moe_tp_experts``) are the experts step's. `own`: the model's own
    plan, whose entries for modules this configuration lacks (a dense MLP where every layer is
    sparse) are skipped as transformers skips them.
    """
    if not isinstance(plan, dict):
        raise TypeError(f"tp_plan must be a dict of module pattern -> style, not {type(plan).__name__}")
    styles: dict[str, list[ParallelStyle]] = {}
    split_experts = {pattern for pattern, style in plan.items() if style == "moe_tp_experts"}
    for pattern, style in plan.items():
        if pattern.rpartition(".")[0] in split_experts:
            continue
        if not isinstance(style, (str, ParallelStyle)):
            raise TypeError(f"tp_plan[{pattern!r}] is {type(style).__name__}; use a torch ParallelStyle "
                            f"or one of {', '.join(HF_STYLES)}")
        built = _hf_style(pattern, style) if isinstance(style, str) else style  # fails before searching
        modules, params, pruned = _resolve(model, pattern)
        if not modules and not params:
            if pruned or own:
                continue  # another pipeline stage holds it, or this configuration has none
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                             f"its top-level modules are {', '.join(n for n, _ in model.named_children())}")
        if params:
            owner_pattern, _, name = pattern.rpartition(".")
            if not isinstance(style, str):
                raise ValueError(f"{pattern!r} names a parameter; give it 'colwise', 'rowwise' or "
                                 "'replicate' (a ParallelStyle applies to modules)")
            placement = _parameter_placement(pattern, style, params[0][0]._parameters[params[0][1]])
            if placement is not None:
                styles.setdefault(owner_pattern, []).append(ShardParameter(name, placement))
            if not isinstance(plan.get(owner_pattern), LocalParams) and plan.get(owner_pattern) != "local_params":
                raise ValueError(f"{pattern!r} shards a bare parameter, so its owner must run on local "
                                 f"parameters: add {owner_pattern!r}: 'local_params' to the plan")
            continue
        if style == "moe_tp_experts":
            _check_split_experts(pattern, modules)
        if style in _EMBEDDING_ONLY:
            wrong = [type(m).__name__ for m in modules if not isinstance(m, nn.Embedding)]
            if wrong:
                raise ValueError(f"style {style!r} for {pattern!r} shards nn.Embedding, but it matches "
                                 f"{', '.join(sorted(set(wrong)))}; use 'colwise'/'rowwise' for Linear layers")
        styles.setdefault(pattern, []).append(built)
    return {pattern: group[0] if len(group) == 1 else _Styles(group) for pattern, group in styles.items()}


def _placements(style: ParallelStyle, module: nn.Module) -> dict[str, Placement]:
    """Where `style` puts each of the module's own parameters (those it leaves alone are absent)."""
    params = {name: p for name, p in module._parameters.items() if p is not None}
    if isinstance(style, _Styles):
        return {k: v for inner in style.styles for k, v in _placements(inner, module).items()}
    if isinstance(style, ShardParameter):
        return {style.name: style.placement}
    if isinstance(style, (SequenceParallel, ReplicatedGradSum)):
        return {name: Replicate() for name in params}
    if isinstance(style, (Conv1DColwise, Conv1DRowwise)):
        return dict(style.placements)
    linear, embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {name: Shard(1 if embedding else 0) for name in params}
    if isinstance(style, RowwiseParallel):
        return {name: Replicate() if name == "bias" and linear else Shard(0 if embedding else 1)
                for name in params}
    return {}


def _split_stays_inside(style: ParallelStyle, module: nn.Module) -> bool:
    """Whether the module's split is invisible outside it, so DTensor may shard it unevenly (its
    first ``size % tp`` ranks one row more): a vocabulary-split embedding (the masked lookup sums
    whole rows), a column-split layer whose output is gathered, a row-split layer that splits its
    whole input itself. A split that leaves the module (a local column-split output, a row-split
    layer fed pieces) must cut heads and features where its neighbours do: evenly."""
    if isinstance(style, RowwiseParallel):
        return isinstance(style.input_layouts[0], Replicate)
    if isinstance(style, ColwiseParallel):
        return isinstance(style.output_layouts[0], Replicate)
    return False


def _check_shardable(model: nn.Module, plan: dict[str, ParallelStyle], tp: int) -> None:
    """Refuse, before anything is sharded, what `parallelize_module` would break on halfway or get
    wrong silently: one module under two patterns, Colwise/Rowwise on something other than
    Linear/Embedding, uneven splits whose pieces leave the module (`_split_stays_inside`), tied
    weights planned two ways."""
    owner: dict[int, str] = {}
    planned: dict[str, Placement] = {}  # parameter FQN -> where the plan puts it
    names = {id(m): name for name, m in model.named_modules()}
    for pattern, style in plan.items():
        for module in _resolve(model, pattern)[0]:
            name = names[id(module)]
            if id(module) in owner:
                raise ValueError(f"module {name!r} is matched by tp_plan patterns {owner[id(module)]!r} "
                                 f"and {pattern!r}; give each module one style")
            owner[id(module)] = pattern
            if (isinstance(style, (ColwiseParallel, RowwiseParallel))
                    and not isinstance(module, (nn.Linear, nn.Embedding))):
                raise ValueError(f"{type(style).__name__} on {name!r} ({type(module).__name__}) needs an "
                                 "nn.Linear or nn.Embedding; plan its Linear submodules instead")
            for pname, placement in _placements(style, module).items():
                size = module._parameters[pname].shape[placement.dim] if isinstance(placement, Shard) else 0
                if size % tp and not _split_stays_inside(style, module):
                    raise ValueError(
                        f"{type(style).__name__} on {name!r} splits {pname} dim {placement.dim} of size "
                        f"{size} over tp={tp}, which does not divide it, and its pieces leave the module "
                        "split (the layers after it would cut heads or features unevenly); choose a tp "
                        "that divides it, gather the output ('colwise_gather_output') or leave the "
                        "module out of the plan")
                planned[f"{name}.{pname}".lstrip(".")] = placement
    for fqns, _ in _tied_parameters(model):
        ways = {fqn: planned.get(fqn) for fqn in fqns}
        # An alias the plan does not name follows the planned copy (BERT's cls.predictions.bias
        # is its decoder's bias), unless its owner computes with it as a layer of its own.
        computing = {fqn for fqn in fqns if isinstance(_owner_and_name(model, fqn)[0], (nn.Linear, nn.Embedding))}
        if len({way for fqn, way in ways.items() if way is not None or fqn in computing}) > 1:
            raise ValueError(f"{' and '.join(fqns)} are one tied parameter, but the tp plan places it "
                             f"differently: {ways} (None: not sharded); plan both modules to split it the "
                             "same way (e.g. the embedding 'embedding_rowwise' with the head "
                             "'colwise_gather_output') or untie them (tie_word_embeddings=False)")


def _tied_parameters(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Parameters registered under more than one name: (all their FQNs, the parameter)."""
    seen: dict[int, tuple[list[str], nn.Parameter]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                seen.setdefault(id(param), ([], param))[0].append(f"{module_name}.{name}".lstrip("."))
    return [(sorted(set(names)), p) for names, p in seen.values() if len(set(names)) > 1]


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, Any]) -> nn.Module:
    """Shard `module` in place over `tp_mesh` (a no-op plan on a size-1 mesh is skipped)."""
    if tp_mesh.size() == 1:
        return module
    _check_shardable(module, plan, tp_mesh.size())
    ties = [[_owner_and_name(module, fqn) for fqn in fqns] for fqns, _ in _tied_parameters(module)]
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    parallelize_module(module, tp_mesh, plan)
    for name, param in module.named_parameters():  # torch's SequenceParallel makes every parameter trainable
        if name in frozen:
            param.requires_grad_(False)
    for members in ties:  # each style replaced its own copy of a tied parameter: tie them again
        params = [getattr(owner, name) for owner, name in members]
        shared = next((p for p in params if isinstance(p, DTensor)), params[0])
        for owner, name in members:
            setattr(owner, name, shared)
    for submodule in module.modules():
        if isinstance(submodule, nn.Embedding):
            _keep_gradient_sharded_like(submodule.weight)
    return module


def _owner_and_name(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    owner, _, name = fqn.rpartition(".")
    return model.get_submodule(owner), name


def _keep_gradient_sharded_like(param: nn.Parameter) -> None:
    """DTensor's embedding backward returns a full-size (Replicate) gradient for a vocab-sharded
    weight; chunking it back to the weight's placement (no communication) keeps (t-1)/t of the
    embedding's gradient bytes off every tensor-parallel rank."""
    if isinstance(param, DTensor) and param.requires_grad:  # a frozen one (under adapters) has none
        param.register_hook(lambda grad: grad.redistribute(placements=param.placements)
                            if isinstance(grad, DTensor) and grad.placements != param.placements else grad)
