"""Pipeline stages cut by layers: colab_par's GPT and Hugging Face decoders.

A stage is a copy of the model holding only its own layers (the first stage also what runs before
them, the last also what runs after them); the other stages' modules are never copied, and every
parameter keeps its fully qualified name, so checkpoints, parity checks and `full_state_dict` need
no renaming table.
- colab_par's `GPT`: its layers are a ModuleDict keyed by index and its embedding / head may be
  None, so a stage is the same class with the other stages' modules deleted.
- A Hugging Face decoder (`is_hf_decoder`: its own loss is a causal LM's and its forward takes
  ``inputs_embeds``), whatever its modules are called: its layers are its repeated blocks
  (`find_blocks`: ``model.layers``, ``transformer.h``, ...); the modules with parameters registered
  before them go with the first stage, those after them with the last. A stage runs the model's own
  forward, in which the other stages' layers are `_PassThrough`s and their other modules `_Absent`:
  a later stage feeds the hidden states it received in at its first layer (the pass-throughs
  before it return them), an earlier one hands on what its last layer returned (the first
  pass-through after it keeps it). Masks, positions and rotary embeddings are thus the model's
  own, whatever the family. An `_Absent` module run at a time its stage did not expect (a module
  registered before the layers but run after them) is refused at once.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from colab_par.layout import Layout
from colab_par.models.gpt import GPT
from colab_par.models.hf import is_hf_decoder
from colab_par.parallel.blocks import find_blocks
from colab_par.parallel.pipeline.stages import TiedTensor, stage_ids, stage_layers, tensors_across_stages

__all__ = ["layer_count", "layer_stage", "layer_units", "split_by_layers", "StandIn"]


def layer_count(model: nn.Module) -> int | None:
    """How many layers a model cut by its layers has (colab_par's GPT, a Hugging Face decoder);
    None for any other model."""
    if isinstance(model, GPT):
        return len(model.layers)
    layers = _decoder_layers(model)
    return None if layers is None else len(layers)


def layer_stage(model: nn.Module, stage: int, n_stages: int, layers: range) -> nn.Module:
    """Stage `stage` of `n_stages` of a model cut by its layers, holding `layers` (the first stage
    also the embedding, the last the final norm and head); parameters keep their FQNs."""
    build = _gpt_stage if isinstance(model, GPT) else _decoder_stage
    part = build(model, stage, n_stages, layers)
    part.pipeline_layers = layers  # a generation cache sizes itself by the stage's own layers
    return part


def layer_units(model: nn.Module) -> tuple[list[nn.Module], list[tuple[str, nn.Module]], list[nn.Module]]:
    """A model `layer_count` knows, as the modules its first stage holds besides layers, its layers
    by name, and the modules its last stage holds besides layers."""
    if isinstance(model, GPT):
        return ([model.tok_embeddings], [(f"layers.{key}", layer) for key, layer in model.layers.items()],
                [model.norm, model.output])
    layers = _decoder_layers(model)
    if layers is None:
        raise TypeError(f"{type(model).__name__} is neither colab_par's GPT nor a Hugging Face decoder")
    names = {id(module): name for name, module in model.named_modules()}
    before, after = _outer_modules(model, layers)
    return [m for _, m in before], [(names[id(layer)], layer) for layer in layers], [m for _, m in after]


def split_by_layers(model: nn.Module, layout: Layout, pp_rank: int) -> list[nn.Module]:
    """This rank's stages of a model `layer_count` knows, one per stage id."""
    n_layers, n_stages = layer_count(model), layout.pp * layout.virtual_stages
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers do not split into pp·virtual_stages = {n_stages} "
                         "equal stages; choose pp·virtual_stages dividing the layer count")
    ties = [] if isinstance(model, GPT) else _decoder_ties(model, n_stages, layout)
    parts = [layer_stage(model, stage, n_stages, stage_layers(stage, n_stages, n_layers))
             for stage in stage_ids(layout, pp_rank)]
    for part in parts:
        part.pipeline_ties = ties  # every rank knows every tie: the gradient sum is collective
    return parts


# ---- colab_par's GPT ------------------------------------------------------------------------------
def _gpt_stage(model: GPT, stage: int, n_stages: int, owned: range) -> nn.Module:
    layer_keys = list(model.layers.keys())
    drop = [model.layers[key] for i, key in enumerate(layer_keys) if i not in owned]
    if stage > 0:
        drop.append(model.tok_embeddings)
    if stage < n_stages - 1:
        drop += [model.norm, model.output]
    part = copy.deepcopy(model, {id(module): None for module in drop})  # dropped: never copied
    for i, key in enumerate(layer_keys):
        if i not in owned:
            del part.layers[key]
    return part


# ---- Hugging Face decoders ------------------------------------------------------------------------
def _decoder_layers(model: nn.Module) -> list[nn.Module] | None:
    """A Hugging Face decoder's layers in order: its repeated blocks, when they share one container."""
    if not is_hf_decoder(model):
        return None
    found = find_blocks(model)
    if not found or len({id(container) for container, _, _ in found}) != 1:
        return None
    return [block for _, _, block in found]


def _outer_modules(model: nn.Module, layers: list[nn.Module]) -> tuple[list[tuple[str, nn.Module]], ...]:
    """The modules outside the layers that hold parameters of their own: (name, module) of those
    registered before the layers (the first stage's) and after them (the last stage's)."""
    inside = {id(module) for layer in layers for module in layer.modules()}
    first = next(name for name, module in model.named_modules() if module is layers[0]).split(".")
    around = {".".join(first[:depth]) for depth in range(len(first))}  # the layers' ancestors
    before, after, seen_layers = [], [], False
    for name, module in model.named_modules():
        if id(module) in inside:
            seen_layers = True
            continue
        if next(module.parameters(recurse=False), None) is None:
            continue
        if name in around:
            raise ValueError(f"{name or type(model).__name__} holds parameters of its own around the "
                             "decoder's layers, which no pipeline stage can take alone; pass "
                             "example_batch= so torch's pipeline() traces it, or use pp=1")
        (after if seen_layers else before).append((name, module))
    return before, after


def _decoder_ties(model: nn.Module, n_stages: int, layout: Layout) -> list[TiedTensor]:
    """The tensors several stages hold (a head tied to the embeddings), refused with tensor parallel."""
    layers = _decoder_layers(model)
    before, after = _outer_modules(model, layers)
    stage_of = {id(module): {0} for _, module in before} | {id(module): {n_stages - 1} for _, module in after}
    for i, layer in enumerate(layers):
        stage = next(k for k in range(n_stages) if i in stage_layers(k, n_stages, len(layers)))
        stage_of.update({id(module): {stage} for module in layer.modules()})
    modules = dict(model.named_modules(remove_duplicate=False))
    everywhere = set(range(n_stages))  # parameter-free modules' buffers (rotary tables) stay on every stage
    holders = {name: stage_of.get(id(modules[name.rpartition(".")[0]]), everywhere)
               for name in model.state_dict(keep_vars=True)}
    ties = tensors_across_stages(model, holders, layout)
    if ties and layout.tp > 1:
        raise ValueError(f"{[tie.names for tie in ties]} are one tied tensor on several pipeline stages, whose "
                         "gradients are summed between them, which tensor-parallel pieces do not support yet; "
                         "untie them (tie_word_embeddings=False), or use tp=1 or pp=1")
    return ties


def _decoder_stage(model: nn.Module, stage: int, n_stages: int, owned: range) -> nn.Module:
    layers = _decoder_layers(model)
    before, after = _outer_modules(model, layers)
    run = _StageRun(first=stage == 0, last=stage == n_stages - 1)
    stand_ins: dict[int, nn.Module] = {id(layer): _PassThrough(run, i, owned)
                                       for i, layer in enumerate(layers) if i not in owned}
    if not run.first:
        stand_ins.update({id(module): _Absent(run, name, "before") for name, module in before})
    if not run.last:
        stand_ins.update({id(module): _Absent(run, name, "after") for name, module in after})
    part = copy.deepcopy(model, dict(stand_ins))  # the memo puts stand-ins where those modules were
    part.forward = _StageForward(part, run)
    return part


class _StageRun:
    """One stage's state during its forward: the hidden states it received, the ones its last layer
    returned, and where the model's forward is (before, among or after the layers)."""

    def __init__(self, *, first: bool, last: bool):
        self.first, self.last = first, last
        self.received: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.phase = "before"


class StandIn(nn.Module):
    """A module of another pipeline stage, in a stage's copy of the model (no parameters)."""


class _PassThrough(StandIn):
    """Another stage's layer: before this stage's layers it gives the received hidden states, just
    after them it keeps what the last one returned; otherwise the hidden states pass unchanged."""

    def __init__(self, run: _StageRun, index: int, owned: range):
        super().__init__()
        self.run, self.feeds, self.keeps = run, index < owned.start, index == owned.stop

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.feeds:
            self.run.phase = "layers"
            return self.run.received
        if self.keeps:
            self.run.phase, self.run.output = "after", hidden_states
        return hidden_states


class _Absent(StandIn):
    """Another stage's module outside the layers: contributes zeros, at the time it was expected."""

    def __init__(self, run: _StageRun, name: str, when: str):
        super().__init__()
        self.run, self.name, self.when = run, name, when

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.run.phase != self.when:
            held, ran = ("first", "after") if self.when == "before" else ("last", "before")
            raise ValueError(f"{self.name} is registered {self.when} the decoder's layers, so the {held} pipeline "
                             f"stage holds it, but the model's forward runs it {ran} them; pass "
                             "example_batch= so torch's pipeline() traces the model, or use pp=1")
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is not None and tensor.is_floating_point():
            return torch.zeros_like(tensor)
        return torch.zeros((), device=None if tensor is None else tensor.device)


class _StageForward:
    """A decoder stage's forward: token ids (first stage) or hidden states in, hidden states or
    (last stage) logits out, through the model's own forward. Keywords go to that forward
    (generation passes its cache, attention mask and positions)."""

    def __init__(self, part: nn.Module, run: _StageRun):
        self.part, self.run = part, run
        self.options = {"use_cache": False} if "use_cache" in inspect.signature(type(part).forward).parameters else {}

    def __call__(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        run, forward, options = self.run, type(self.part).forward, {**self.options, **kwargs}
        run.phase, run.output = "before", None
        if run.first:
            out = forward(self.part, input_ids=x, **options)
        else:
            run.received = x
            out = forward(self.part, inputs_embeds=x, **options)  # shapes for masks and positions
            run.received = None
        if run.last:
            return out.logits
        if not isinstance(run.output, torch.Tensor):
            raise ValueError(f"{type(self.part).__name__}'s layers did not hand on a hidden-states tensor "
                             "between them, which cutting it by layers needs; pass example_batch= so "
                             "torch's pipeline() traces it, or use pp=1")
        return run.output
