"""Bringing an engine variable into the notebook, gathered when it is sharded: the engine side.

`Cluster.pull` first asks every rank what the name holds and how big it is whole (`describe`, no
data moves), refuses what would not fit in the notebook's memory, then `gather`s: a DTensor's
`full_tensor()` and a sharded model's full state dict (a `ParallelModel`'s `full_state_dict`,
torch's `get_model_state_dict` for FSDP/DTensor modules) are collectives every rank joins;
anything else comes from the asked rank alone, on the CPU.
"""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["SHARDED", "describe", "gather"]

SHARDED = ("DTensor", "sharded model", "ParallelModel")  # kinds every rank must gather together
_WALK_ITEMS = 10_000


def describe(path: str) -> dict[str, Any]:
    """What `path` ("name" or "name.attr.attr") holds on this rank: kind, its whole size in bytes,
    `share` (ranks with the same share hold the same part: sizes add up over distinct shares) and
    a few words; kind "missing" (with why) when there is no such variable."""
    try:
        value = _resolve(path)
    except LookupError as error:
        return {"kind": "missing", "why": str(error)}
    kind, share = _kind(value), "all"
    if kind == "ParallelModel":
        share = f"stage {value.pp_rank}"
        size = sum(_state_bytes(part) for part in value.model_parts)
        what = f"the full state dict of a ParallelModel ({value.layout})"
    elif kind in ("sharded model", "model"):
        size = _state_bytes(value)
        what = f"the {'full ' * (kind == 'sharded model')}state dict of {type(value).__name__}"
    elif kind in ("DTensor", "tensor"):
        size = value.numel() * value.element_size()
        what = f"{kind} {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
        if kind == "DTensor":
            what += f" ({', '.join(map(str, value.placements))} over {value.device_mesh.size()} ranks)"
    else:
        size, what = _approx_bytes(value), type(value).__name__
    return {"kind": kind, "bytes": int(size), "share": share, "what": what}


def gather(path: str, rank: int) -> dict[str, Any] | None:
    """`path`'s value, whole and on the CPU, on the rank that ends up holding it (`rank`, or
    global rank 0 for a model's state dict); None on the other ranks. Every rank calls it for
    the sharded kinds (they gather together), only `rank` for the others."""
    import torch.distributed as dist

    value = _resolve(path)
    kind, me = _kind(value), dist.get_rank() if dist.is_initialized() else 0
    if kind == "DTensor":
        full = value.full_tensor().detach().cpu()
        return {"value": full} if me == rank else None
    if kind == "ParallelModel":
        state = value.full_state_dict()
        return {"value": state} if me == 0 else None
    if kind == "sharded model":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(value, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"value": state} if me == 0 else None
    if kind == "model":
        module = getattr(value, "module", value) if _is_ddp(value) else value
        return {"value": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}
    if kind == "tensor":
        return {"value": value.detach().cpu()}
    return {"value": value}


def _resolve(path: str) -> Any:
    from IPython import get_ipython

    first, *attributes = path.split(".")
    namespace = get_ipython().user_ns
    if first not in namespace:
        raise LookupError(f"no engine variable {first!r}")
    value = namespace[first]
    for depth, attribute in enumerate(attributes, start=1):
        if not hasattr(value, attribute):
            raise LookupError(f"{'.'.join([first, *attributes[:depth - 1]])} has no attribute {attribute!r}")
        value = getattr(value, attribute)
    return value


def _kind(value: Any) -> str:
    import torch

    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    parallel = sys.modules.get("colab_par.parallel")
    if parallel is not None and isinstance(value, parallel.ParallelModel):
        return "ParallelModel"
    if dtensor is not None and isinstance(value, dtensor):
        return "DTensor"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, torch.nn.Module):
        tensors = [*value.parameters(), *value.buffers()]
        return "sharded model" if dtensor is not None and any(isinstance(t, dtensor) for t in tensors) else "model"
    return "object"


def _is_ddp(value: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(value, DistributedDataParallel)


def _state_bytes(module: Any) -> int:
    """The whole size of a module's state (DTensor shapes are the global ones)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if hasattr(t, "numel"))


def _approx_bytes(value: Any) -> int:
    """Tensors and arrays inside containers by their data, other objects by their own size."""
    import torch

    total, stack, seen = 0, [value], 0
    while stack and seen < _WALK_ITEMS:
        item, seen = stack.pop(), seen + 1
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif hasattr(item, "nbytes") and isinstance(getattr(item, "nbytes"), int):
            total += item.nbytes  # numpy arrays
        elif isinstance(item, dict):
            total += sys.getsizeof(item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += sys.getsizeof(item)
            stack.extend(item)
        else:
            total += sys.getsizeof(item)
    return total
