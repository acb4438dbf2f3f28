"""What the kit's probe (colab_par.cluster.probe) reads about this process's collectives: process
groups, their sequence numbers, torch's flight recorder, and the GPUs NVML lists."""
from __future__ import annotations

from typing import Any

from colab_par.compat.support import _missing


def group_sequence(group: Any) -> int | None:
    """How many collectives this rank has issued on `group` (`_get_sequence_number_for_group`, private;
    gloo and NCCL count every call, point-to-point included); None where the backend keeps no count."""
    sequence = getattr(group, "_get_sequence_number_for_group", None)
    if sequence is None:
        raise _missing("torch", "ProcessGroup._get_sequence_number_for_group")
    try:
        return int(sequence())
    except RuntimeError:  # a backend without sequence numbers
        return None


def gpu_uuids() -> list[str] | None:
    """The UUIDs of the GPUs NVML lists, in its order, without initialising CUDA
    (`torch.cuda._raw_device_uuid_nvml`, private); None where NVML does not answer."""
    import warnings

    import torch

    raw = getattr(torch.cuda, "_raw_device_uuid_nvml", None)
    if raw is None:
        raise _missing("torch", "torch.cuda._raw_device_uuid_nvml")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Can't initialize NVML": None says it
            return raw()
    except OSError:  # no libnvidia-ml
        return None


def flight_record() -> dict[str, Any]:
    """torch's flight recorder of this process's collectives (`_dump_fr_trace`, private): the
    unretired entries ("entries": profiling_name, process_group, record_id, ...) and each group's
    ranks ("pg_config"); recorded only when TORCH_FR_BUFFER_SIZE was set before the groups formed."""
    import pickle

    from torch._C import _distributed_c10d

    dump = getattr(_distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        raise _missing("torch", "torch._C._distributed_c10d._dump_fr_trace")
    return pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=True))


def process_groups() -> list[Any]:
    """Every live process group of this process (`distributed_c10d._world.pg_names`, private)."""
    from torch.distributed import distributed_c10d

    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None)
    if names is None:
        raise _missing("torch", "distributed_c10d._world.pg_names")
    return list(names)


def rebind_group(group: Any, store: Any, rank: int, size: int, timeout: Any) -> Any:
    """Make every collective torch resolves by `group`'s name (DTensor's, through its DeviceMesh)
    run on a fresh gloo group over `store` instead, with this process at `rank` of `size`; returns
    that group, which the caller keeps (torch's registry holds it weakly). For the survivors of a
    lost peer, whose own group's connections were broken. The old group object itself stays broken:
    code that kept it fails, never hangs. Private: `_unregister_process_group`,
    `_register_process_group`, `ProcessGroup._register_backend`, `_set_default_backend`,
    `_set_group_name`."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    name = group.group_name
    for needed in ("_unregister_process_group", "_register_process_group"):
        if not hasattr(distributed_c10d, needed):
            raise _missing("torch", f"distributed_c10d.{needed}")
    for needed in ("_register_backend", "_set_default_backend", "_set_group_name"):
        if not hasattr(dist.ProcessGroup, needed):
            raise _missing("torch", f"ProcessGroup.{needed}")
    fresh = dist.ProcessGroup(store, rank, size)
    fresh._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    fresh._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                            dist.ProcessGroupGloo(store, rank, size, timeout))
    fresh._set_group_name(name)
    distributed_c10d._unregister_process_group(name)
    distributed_c10d._register_process_group(name, fresh)
    return fresh
