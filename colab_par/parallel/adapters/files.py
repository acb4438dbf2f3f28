"""Adapter files out and in, in peft's own format, whatever the layout.

In: a PEFT model built on meta is filled from the base model's safetensors under the base's names
(peft renames ``q_proj.weight`` to ``q_proj.base_layer.weight``) and from an adapter directory under
the keys peft writes (`PeftWeights`); the directory is checked against the model from its headers
before any weight is read. Out: the adapter's tensors under peft's keys (`adapter_state`), or the
base model with the adapters merged in (`merged_state`): each tuner layer's full tensors are
gathered by the ranks holding them and merged by peft's own ``merge`` on those copies, so no rank
ever holds more than one layer whole.
"""
from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from colab_par.compat import unwrapped_name
from colab_par.parallel.adapters.model import Adapters, is_tuner_layer, peft_model_of
from colab_par.parallel.init_record import drawing_random_values

__all__ = ["PeftWeights", "adapter_state", "merged_state", "peft_factory", "peft_source",
           "check_adapter_directory", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG = "adapter_config.json"  # peft.utils.CONFIG_NAME
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft.utils.SAFETENSORS_WEIGHTS_NAME


# ---- in ----------------------------------------------------------------------------------------------
class PeftWeights:
    """A `WeightSource` for a PEFT model's inner model: each tensor by the inner model's own name,
    read from the base model's files under its base name, or from an adapter file under peft's key."""

    def __init__(self, base: Any, base_names: dict[str, str], adapter: Any = None,
                 adapter_keys: dict[str, str] | None = None):
        self.base, self.base_names = base, base_names
        self.adapter, self.adapter_keys = adapter, adapter_keys or {}

    def _where(self, name: str) -> tuple[Any, str] | None:
        key = self.adapter_keys.get(name)
        if self.adapter is not None and key is not None and key in self.adapter:
            return self.adapter, key
        original = self.base_names.get(name)
        if self.base is not None and original is not None and original in self.base:
            return self.base, original
        return None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._where(name) is not None

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        source, original = self._where(name)
        return source.read(original, index)


def peft_factory(build: Callable[[], nn.Module], config: Any) -> Callable[[], nn.Module]:
    """A factory of `build()` with `config`'s adapters added. The adapters' random init draws from
    the generator even where the base's is only recorded (its weights come from files), so they get
    exactly the values ``get_peft_model`` gives them in one process with the same seed."""
    def build_peft() -> nn.Module:
        base = build()
        with drawing_random_values():
            return peft_model_of(base, copy.deepcopy(config))

    return build_peft


def peft_source(build: Callable[[], nn.Module], base_weights: Any, base_path: Path, *, lora: Any,
                adapter: str | os.PathLike | None, is_trainable: bool) -> tuple[Callable[[], nn.Module], PeftWeights]:
    """For `from_pretrained`: the factory of the PEFT model (new adapters from the peft config
    `lora`, or those of the adapter directory `adapter`) and the weights filling it by its names.
    Everything that can be wrong is refused here, from a meta build and the files' headers: targets
    that match no module, an adapter directory that does not fit this base."""
    from peft import PeftConfig

    from colab_par.models.hf_weights import SafetensorsWeights

    folder = None if adapter is None else Path(adapter)
    if folder is not None:
        if not (folder / ADAPTER_CONFIG).is_file():
            raise ValueError(f"{folder} has no {ADAPTER_CONFIG}; give a PEFT adapter directory (what "
                             "colab_par.save_pretrained of a PEFT model or peft's save_pretrained writes)")
        config = PeftConfig.from_pretrained(str(folder))
        config.inference_mode = not is_trainable
    else:
        if not callable(getattr(lora, "to_dict", None)) or not hasattr(lora, "peft_type"):
            raise TypeError(f"lora={lora!r}; give a peft config, e.g. peft.LoraConfig(r=8, target_modules=[...])")
        config = copy.deepcopy(lora)
        config.base_model_name_or_path = config.base_model_name_or_path or str(base_path)
    trained_for = getattr(config, "base_model_name_or_path", None) or "another model"
    factory = peft_factory(build, config)
    with torch.device("meta"):
        try:
            model = factory()
        except ValueError as error:  # targets this base lacks: another family's adapter
            if folder is None:
                raise
            targets = config.target_modules
            shown = targets if isinstance(targets, str) else ", ".join(
                sorted(targets)[:3] + (["..."] if len(targets) > 3 else []))
            raise ValueError(f"adapter {folder} does not fit this base: it was trained for {trained_for}, and its "
                             f"target modules ({shown}) match none of this model's layers; load it onto the "
                             "base it was trained on") from error
    adapters = Adapters.of(model)
    (name,) = adapters.configs
    files = None
    if folder is not None:
        shapes = {key[len(adapters.prefix):]: tuple(t.shape) for key, t in model.state_dict().items()}
        files = SafetensorsWeights(folder, single_file=ADAPTER_WEIGHTS)
        check_adapter_directory(files, adapters, shapes, folder, trained_for)
    return factory, PeftWeights(base_weights, adapters.base_names, files, adapters.file_keys[name])


def check_adapter_directory(files: Any, adapters: Adapters, shapes: dict[str, tuple[int, ...]],
                            path: Path, base: str) -> None:
    """Refuse an adapter file that does not fit the model (a key it lacks or has extra, a shape that
    differs), from the headers alone; `shapes`: the meta model's inner state name -> shape; `base`:
    the model the adapter's config says it was trained for."""
    (adapter,) = adapters.configs
    expected = {key: shapes[name] for name, key in adapters.file_keys[adapter].items()}
    missing = [key for key in expected if key not in files]
    extra = [key for key in files.names() if key not in expected]
    if missing or extra:
        key = (missing or extra)[0]
        where = (f"lacks {key}, which this base's adapters need" if missing else
                 f"holds {key}, which this base has no place for")
        raise ValueError(f"adapter {path} {where} ({len(missing)} missing, {len(extra)} extra): it was trained "
                         f"for {base}, not this base model; load it onto the base it was trained on")
    for key, shape in expected.items():
        found = files.header(key)[0]
        if tuple(found) != tuple(shape):
            raise ValueError(f"adapter {path}: {key} is {list(found)} there but this base needs {list(shape)}; "
                             f"the adapter was trained for {base} (other layer sizes); load it onto that base")


# ---- out ---------------------------------------------------------------------------------------------
def adapter_state(local: dict[str, torch.Tensor], adapters: Adapters, adapter: str) -> dict[str, torch.Tensor]:
    """This rank's tensors of `adapter` under the keys of peft's adapter file."""
    keys = adapters.file_keys[adapter]
    return {keys[name]: tensor for name, tensor in local.items() if name in keys}


def merged_state(parts: list[nn.Module], local: dict[str, torch.Tensor],
                 adapters: Adapters) -> dict[str, Any]:
    """The base model's tensors under its own names, those of tuner layers merged (`MergedTensor`);
    of a ``modules_to_save`` module only the active trained copy."""
    layers = _tuner_layers(parts)
    merged_names = adapters.merged_names
    out: dict[str, Any] = {}
    for name, tensor in local.items():
        original = merged_names.get(name)
        if original is None:
            continue
        layer = next(((prefix, module) for prefix, module in layers.items() if name.startswith(f"{prefix}.")), None)
        out[original] = tensor if layer is None else MergedTensor(layer[1], name[len(layer[0]) + 1:], tensor,
                                                                 adapters.active)
    return out


class MergedTensor:
    """One tensor of a tuner layer's base with the adapters merged in, computed when called: every
    rank of the stage gathers the layer's tensors (collectives in the same order), and peft's
    ``merge`` runs on those full copies."""

    def __init__(self, layer: nn.Module, name: str, like: torch.Tensor, active: list[str]):
        self.layer, self.name, self.active = layer, name, active
        self.shape, self.dtype = tuple(like.shape), like.dtype

    def __call__(self) -> torch.Tensor:
        full = {name: _whole(p) for name, p in self.layer.named_parameters()}
        with _holding(self.layer, full):
            self.layer.merge(adapter_names=self.active)
        return full[self.name].detach()


def _whole(param: torch.Tensor) -> nn.Parameter:
    """A whole copy of `param`, a Parameter so that it can stand in the layer while peft merges."""
    whole = param.full_tensor() if isinstance(param, DTensor) else param
    return nn.Parameter(whole.detach().clone(), requires_grad=False)


@contextlib.contextmanager
def _holding(layer: nn.Module, full: dict[str, nn.Parameter]) -> Iterator[None]:
    """The layer's parameters replaced by `full` (its whole tensors) while peft merges into them."""
    swapped = []
    for name, tensor in full.items():
        owner_name, _, attr = name.rpartition(".")
        owner = layer.get_submodule(owner_name)
        swapped.append((owner, attr, owner.get_parameter(attr)))
        owner.register_parameter(attr, tensor)
    merged = list(layer.merged_adapters)
    try:
        yield
    finally:
        for owner, attr, original in swapped:
            owner.register_parameter(attr, original)
        layer.merged_adapters[:] = merged


def _tuner_layers(parts: list[nn.Module]) -> dict[str, nn.Module]:
    """The outermost tuner layers of this rank's parts, by their name in the inner model."""
    found: dict[str, nn.Module] = {}
    for part in parts:
        root = part.module if isinstance(part, DistributedDataParallel) else part
        for name, module in root.named_modules():
            clean = unwrapped_name(name)
            if is_tuner_layer(module) and not any(clean.startswith(f"{outer}.") for outer in found):
                found[clean] = module
    return found
