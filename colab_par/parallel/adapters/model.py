"""What a PEFT model is, from peft's own classes: its inner model, its tuner layers, which tensors
belong to the base model (and under which of the base's names) and which are adapters (and under
which key peft's adapter file stores them).

peft wraps a model twice (``PeftModel`` → its tuner, e.g. ``LoraModel`` → the model) and replaces
each targeted layer by a tuner layer holding the original as ``base_layer`` next to the adapters
(``lora_A``, ``lora_B``, ...). For a tuner (LoRA, IA3, LoHa, ...), ``PeftModel.forward`` only calls
the inner model, so the kit parallelizes the inner model as it would any other, its tuner layers in
place, and keeps the facts below (`Adapters`) for saving and rebuilding.
"""
from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

__all__ = ["Adapters", "is_peft_model", "is_tuner_layer", "is_auxiliary_wrapper", "base_layer_of", "base_name",
           "peft_model_of", "layer_names"]


def _peft() -> Any:
    """peft, if something imported it (any PEFT model has)."""
    return sys.modules.get("peft")


def is_peft_model(model: Any) -> bool:
    peft = _peft()
    return peft is not None and isinstance(model, peft.PeftModel)


def is_tuner_layer(module: nn.Module) -> bool:
    """A layer peft put in place of a targeted one (it holds the original as ``base_layer``)."""
    peft = _peft()
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    return isinstance(module, BaseTunerLayer)


def base_layer_of(module: nn.Module) -> nn.Module:
    """The layer `module` stands for: a tuner layer's base layer, any other module itself."""
    return module.get_base_layer() if is_tuner_layer(module) else module


def is_auxiliary_wrapper(module: nn.Module) -> bool:
    """peft's wrapper of a module trained whole or in part (``modules_to_save``, trainable tokens)."""
    peft = _peft()
    if peft is None:
        return False
    from peft.utils.other import AuxiliaryTrainingWrapper
    return isinstance(module, AuxiliaryTrainingWrapper)


def base_name(model: nn.Module, name: str, merging: Sequence[str] | None = None) -> str | None:
    """The name a tensor of `model` (a PEFT model's inner model) has in the base model, or None for an
    adapter's tensor: a tuner layer's ``base_layer`` and a ``modules_to_save`` wrapper's
    ``original_module`` and trained copies stand for the module they wrap. `merging` (the active
    adapters): only what a merged model keeps of such a wrapper, the active copy where there is one."""
    parts, kept, module, i = name.split("."), [], model, 0
    while i < len(parts) - 1:
        part = parts[i]
        if is_tuner_layer(module):
            if part != "base_layer":
                return None
            module, i = module.base_layer, i + 1
            continue
        if is_auxiliary_wrapper(module):
            children = dict(module.named_children())
            copies = children.get("modules_to_save") or {}
            active_copy = merging is not None and any(adapter in copies for adapter in merging)
            if part == "original_module" and not active_copy:
                module, i = children[part], i + 1
            elif part == "modules_to_save" and (merging is None or parts[i + 1] in merging):
                module, i = copies[parts[i + 1]], i + 2
            else:
                return None
            continue
        kept.append(part)
        module, i = module.get_submodule(part), i + 1
    return ".".join(kept + parts[-1:])


def layer_names(model: nn.Module, limit: int = 12) -> str:
    """The distinct last names of `model`'s layers holding weights (what LoRA targets may name)."""
    names = dict.fromkeys(name.rpartition(".")[2] for name, module in model.named_modules()
                          if name and not list(module.children()) and list(module.parameters(recurse=False)))
    shown = list(names)[:limit]
    return ", ".join(shown) + (", ..." if len(names) > limit else "")


def peft_model_of(base: nn.Module, config: Any, adapter_name: str = "default") -> nn.Module:
    """``peft.get_peft_model(base, config)``, a target that matches nothing refused with the names
    that exist."""
    from peft import get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    try:
        return get_peft_model(base, config, adapter_name=adapter_name)
    except NoMatchingPeftModuleError:
        targets = getattr(config, "target_modules", None)
        shown = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
        raise ValueError(f"{type(config).__name__}(target_modules={shown!r}) matches no module of "
                         f"{type(base).__name__}; its layers are named {layer_names(base)}: name some "
                         "of those (e.g. target_modules=['q_proj', 'v_proj'] for Llama-style models)") from None


# Tuners whose PeftModel.forward does more than call the inner model.
_NEEDS_PEFT_FORWARD = {"POLY": "routes each batch by task_ids", "XLORA": "mixes adapters in its own forward"}


@dataclass
class Adapters:
    """A PEFT model's adapters as `parallelize` keeps them (`ParallelModel.adapters`).

    `configs`: adapter name -> peft config; `active`: the adapters the model runs;
    `file_keys`: adapter name -> {inner state name: key in peft's adapter file}; `base_names`: inner
    state name -> the base model's name, for the base's tensors; `merged_names`: the same for what a
    merged model keeps; `trainable`: inner names that train.
    """

    configs: dict[str, Any]
    active: list[str]
    prefix: str  # the inner model's name inside the PeftModel ("base_model.model.")
    file_keys: dict[str, dict[str, str]]
    base_names: dict[str, str]
    merged_names: dict[str, str]
    trainable: frozenset[str]

    @classmethod
    def of(cls, peft_model: nn.Module) -> "Adapters":
        """Read everything off a PeftModel (before anything is sharded); refuses what the kit
        cannot run: adapters that need PeftModel.forward (prompt learning, Poly, X-LoRA)."""
        from peft import get_peft_model_state_dict

        configs = dict(peft_model.peft_config)
        for name, config in configs.items():
            kind = str(getattr(config.peft_type, "value", config.peft_type))
            if config.is_prompt_learning or kind in _NEEDS_PEFT_FORWARD:
                why = _NEEDS_PEFT_FORWARD.get(kind, "adds virtual tokens to the inputs in PeftModel.forward")
                raise ValueError(f"adapter {name!r} is {kind}, which {why}; the kit trains the model inside "
                                 "the PeftModel and cannot run that. Use a tuner that lives in the layers "
                                 "(LoRA, DoRA, IA3, LoHa, LoKr, ...), e.g. peft.LoraConfig")
        inner = peft_model.get_base_model()
        prefix = next(f"{name}." for name, module in peft_model.named_modules() if module is inner)
        state = peft_model.state_dict(keep_vars=True)
        file_keys = {}
        for name in configs:
            saved = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=name,
                                              save_embedding_layers=False)
            key_of = {id(tensor): key for key, tensor in saved.items()}
            keys = {full[len(prefix):]: key_of[id(t)] for full, t in state.items() if id(t) in key_of}
            unmapped = sorted(set(saved) - set(keys.values()))
            if unmapped:
                raise ValueError(f"peft's file for adapter {name!r} holds {unmapped[0]}, which is computed "
                                 "rather than a tensor of the model; the kit cannot save this adapter type")
            file_keys[name] = keys
        inner_state = inner.state_dict(keep_vars=True)
        active = list(peft_model.active_adapters)
        base_names = {name: found for name in inner_state if (found := base_name(inner, name)) is not None}
        merged_names = {name: found for name in inner_state
                        if (found := base_name(inner, name, merging=active)) is not None}
        trainable = frozenset(name for name, p in inner.named_parameters() if p.requires_grad)
        return cls(configs, active, prefix, file_keys, base_names, merged_names, trainable)

    # ---- what gets saved ---------------------------------------------------------------------------
    def adapter_to_save(self, requested: str | None = None) -> str:
        """The adapter `save_pretrained` writes: `requested`, else the one the model runs."""
        if requested is not None:
            if requested not in self.configs:
                raise ValueError(f"adapter_name={requested!r}; this model has adapters {sorted(self.configs)}")
            return requested
        if len(self.active) != 1:
            raise ValueError(f"the model runs adapters {self.active} together; pass adapter_name= one of them "
                             "to save_pretrained (each is written as its own adapter directory)")
        return self.active[0]

    # ---- rebuilding (relayout) ---------------------------------------------------------------------
    def factory(self, base_factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        """A zero-argument factory of the same PEFT model: `base_factory()`, the same adapters added,
        the same parameters trainable."""
        build = functools.partial(_rebuild, base_factory, self.configs, self.active, self.trainable)
        build.config = getattr(base_factory, "config", None)  # type: ignore[attr-defined]
        return build


def _rebuild(base_factory: Callable[[], nn.Module], configs: dict[str, Any], active: list[str],
             trainable: frozenset[str]) -> nn.Module:
    (first, config), *others = configs.items()
    model = peft_model_of(base_factory(), copy.deepcopy(config), adapter_name=first)
    for name, config in others:
        model.add_adapter(name, copy.deepcopy(config))
    model.base_model.set_adapter(active if len(active) > 1 else active[0])
    for name, param in model.get_base_model().named_parameters():
        param.requires_grad_(name in trainable)
    return model
