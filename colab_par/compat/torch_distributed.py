"""torch.distributed internals: DCP's metadata file, DeviceMesh flattening, the pipelining stage's
compute methods, DTensor's storage and constructor, and FSDP2's offload policy."""
from __future__ import annotations

import os
from typing import Any

from colab_par.compat.support import _missing


# ---- torch.distributed.checkpoint ------------------------------------------------------------------
DCP_METADATA_GLOBALS = frozenset({("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                  ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                                  ("torch.serialization", "_get_layout")})
"""Private globals DCP pickles into `.metadata` (besides its public metadata dataclasses)."""


def dcp_metadata_path(reader: Any, rank: int | None = None) -> os.PathLike:
    """The `.metadata` file a `FileSystemReader` reads (`_get_metadata_path`, private)."""
    get_path = getattr(reader, "_get_metadata_path", None)
    if get_path is None:
        raise _missing("torch", "FileSystemReader._get_metadata_path")
    return get_path(rank)


# ---- DeviceMesh ------------------------------------------------------------------------------------
def flatten_mesh(mesh: Any, name: str) -> Any:
    """`mesh` (a slice of several dims) flattened into one 1-D dim called `name` (`_flatten`)."""
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise _missing("torch", "DeviceMesh._flatten")
    return flatten(name)


def unflatten_mesh(mesh: Any, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """`mesh` with its dim `dim` split into dims `names` of `sizes` (`_unflatten`): the same ranks,
    the same root, so slices of it compose with the mesh's other slices (FSDP over dp)."""
    unflatten = getattr(mesh, "_unflatten", None)
    if unflatten is None:
        raise _missing("torch", "DeviceMesh._unflatten")
    return unflatten(dim, sizes, names)


# ---- torch.distributed.pipelining ------------------------------------------------------------------
STAGE_COMPUTE_HOOKS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
"""PipelineStage methods every schedule calls for a microbatch's compute (undocumented): a stage
subclass timing them measures busy time, and the pipeline bubble is the rest of the step."""


def check_stage_compute_hooks() -> None:
    """Refuse a torch whose PipelineStage lacks the compute methods the bubble clock wraps."""
    from torch.distributed.pipelining import PipelineStage

    for name in STAGE_COMPUTE_HOOKS:
        if not callable(getattr(PipelineStage, name, None)):
            raise _missing("torch", f"PipelineStage.{name}")


# ---- DTensor -------------------------------------------------------------------------------------------
def storage_holder(tensor: Any) -> Any:
    """The tensor object whose storage holds `tensor`'s values: a DTensor's own local tensor
    (`DTensor._local_tensor`; `to_local()` hands a Parameter(DTensor) a fresh view), else itself.
    Assigning its `.data` re-homes the values without a new Parameter object."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    held = getattr(tensor, "_local_tensor", None)
    if held is None:
        raise _missing("torch", "DTensor._local_tensor")
    return held


def dtensor_over(local: Any, like: Any) -> Any:
    """A DTensor of `like`'s mesh, placements, shape and stride over `local` itself, wherever it
    lives (`DTensor.from_local` copies a host tensor onto a CUDA mesh's device): the private
    constructor `DTensor(local, DTensorSpec, requires_grad=)`."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    except ImportError:
        raise _missing("torch", "torch.distributed.tensor._dtensor_spec.DTensorSpec") from None
    spec = DTensorSpec(like.device_mesh, tuple(like.placements),
                       tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def local_shard_offsets(shape: Any, mesh: Any, placements: Any) -> tuple[int, ...]:
    """Where this rank's block of a Shard/Replicate DTensor starts in the full tensor, per dim."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        raise _missing("torch", "torch.distributed.tensor._utils.compute_local_shape_and_global_offset") from None
    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[1])


# ---- FSDP2 ---------------------------------------------------------------------------------------
_ABSENT = object()


def fsdp_offload_policy(module: Any) -> Any:
    """The `OffloadPolicy` `fully_shard` applied to `module`'s own parameters, or None where it
    manages none (`FSDPModule._get_fsdp_state()._fsdp_param_group.offload_policy`, private: FSDP2
    has no public getter). Memory reports read offload from FSDP itself, not from the layout."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise _missing("torch", "FSDPModule._get_fsdp_state")
    group = getattr(get_state(), "_fsdp_param_group", _ABSENT)
    if group is _ABSENT:
        raise _missing("torch", "FSDPState._fsdp_param_group")
    if group is None:
        return None
    if not hasattr(group, "offload_policy"):
        raise _missing("torch", "FSDPParamGroup.offload_policy")
    return group.offload_policy


def forget_dtensor_plans() -> None:
    """Clear DTensor's caches of sharding plans: the sharding propagation caches, Python's and the
    C++ fast path's (`torch.distributed.tensor.debug._clear_sharding_prop_cache`), and the
    redistribute plans (`_redistribute._gen_transform_infos`, the planners); all private. A
    DeviceMesh equals any mesh of the same ranks and dim names whatever its groups, so after the
    world is re-formed a cached plan hands new DTensors the old world's mesh, whose groups are gone
    ("Could not resolve the process group registered under the name ...")."""
    from torch.distributed.tensor import _redistribute, debug

    clear_propagation = getattr(debug, "_clear_sharding_prop_cache", None)
    transforms = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)
    planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    for name, found in (("debug._clear_sharding_prop_cache", clear_propagation),
                        ("_redistribute._gen_transform_infos.cache_clear", transforms),
                        ("_redistribute.clear_redistribute_planner_cache", planners)):
        if found is None:
            raise _missing("torch", f"torch.distributed.tensor.{name}")
    clear_propagation()
    transforms()
    planners()
