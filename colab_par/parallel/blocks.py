"""Which modules of a model are its repeated blocks: the units FSDP shards, activation checkpointing
wraps and pipeline parallel cuts between.

Any `nn.Module` qualifies. Found automatically, the blocks are the children of an `nn.ModuleList`,
`nn.Sequential` or `nn.ModuleDict` that share a class and hold parameters, at least two of them
(a transformer's layers, a CNN's stages); the search stops at the first such container on every
path, so blocks never nest. The user may instead name the block classes (types or class names).
A model with no repeated blocks has none: it is then sharded as one unit.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from torch import nn

__all__ = ["Block", "find_blocks", "replace_block"]

Block = tuple[nn.Module, str, nn.Module]  # (container, key in it, the block)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_blocks(model: nn.Module, blocks: Sequence[type | str] | None = None, *,
                strict: bool = True) -> list[Block]:
    """The blocks of `model` in forward order (module registration order).

    `blocks`: the block classes (or their names) to use instead of the automatic search; with
    `strict`, each must match at least one module, else the error lists the model's module classes.
    """
    if blocks is not None:
        return _named_blocks(model, blocks, strict)
    found: list[Block] = []
    _search(model, found)
    return found


def replace_block(container: nn.Module, key: str, new: nn.Module) -> None:
    """Put `new` where `container[key]` was (activation checkpointing wraps blocks this way)."""
    if isinstance(container, nn.ModuleDict):
        container[key] = new
    elif isinstance(container, (nn.ModuleList, nn.Sequential)):
        container[int(key)] = new
    else:
        setattr(container, key, new)


def _search(module: nn.Module, found: list[Block]) -> None:
    if isinstance(module, _CONTAINERS):
        children = list(module.named_children())
        counts = Counter(type(child) for _, child in children if _has_parameters(child))
        repeated = {cls for cls, count in counts.items() if count >= 2}
        if repeated:
            for key, child in children:
                if type(child) in repeated:
                    found.append((module, key, child))
                else:
                    _search(child, found)
            return
    for _, child in module.named_children():
        _search(child, found)


def _named_blocks(model: nn.Module, blocks: Sequence[type | str], strict: bool) -> list[Block]:
    wanted = list(blocks)
    if not wanted and not strict:
        return []  # the model has no blocks: the caller treats it as one unit
    if not wanted or not all(isinstance(b, (type, str)) for b in wanted):
        raise TypeError(f"blocks={blocks!r}: give block classes or class names, e.g. "
                        f"blocks=[{type(next(iter(model.children()), model)).__name__}]")
    def matches(module: nn.Module) -> bool:
        return any(type(module) is b if isinstance(b, type) else type(module).__name__ == b
                   for b in wanted)
    found: list[Block] = []
    seen: set[int] = set()  # a block's own sub-blocks are not blocks again
    for name, module in model.named_modules():
        if not name or not matches(module) or any(id(p) in seen for p in _ancestors(model, name)):
            continue
        parent_name, _, key = name.rpartition(".")
        found.append((model.get_submodule(parent_name), key, module))
        seen.add(id(module))
    missing = [b for b in wanted if not any(
        (type(block) is b if isinstance(b, type) else type(block).__name__ == b) for _, _, block in found)]
    if missing and strict:
        names = sorted({type(m).__name__ for m in model.modules() if _has_parameters(m)})
        raise ValueError(f"blocks={[getattr(b, '__name__', b) for b in missing]} match no module "
                         f"of {type(model).__name__}; its module classes are: {', '.join(names)}")
    return found


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    return [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None
