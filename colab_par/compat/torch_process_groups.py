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


def rebind_group(group: Any, store: Any, timeout: Any) -> None:
    """Make `group` itself run every collective and point-to-point call on a fresh gloo backend over
    `store`, this process at the same rank of the same size: for the survivors of a lost peer whose
    own group's connections were broken. Whatever holds the group object (DTensor's meshes by name,
    pipeline stages, context-parallel attention, plans that captured it) then reaches the new one.
    A process group keeps one backend per backend type and reuses it when that type is registered
    again, so the fresh one is registered as the custom type, which the CPU's calls then take.
    Private: `ProcessGroup._register_backend`."""
    import torch
    import torch.distributed as dist

    if not hasattr(dist.ProcessGroup, "_register_backend"):
        raise _missing("torch", "ProcessGroup._register_backend")
    fresh = dist.ProcessGroupGloo(store, group.rank(), group.size(), timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, fresh)


def registered_gloo_group(store: Any, ranks: list[int], name: str, timeout: Any) -> Any:
    """A gloo group of the world's `ranks` (this process among them) formed over `store` alone and
    registered as torch's own groups are, so `dist.*` calls, object collectives and DCP take it:
    `dist.new_group` would rendezvous on the default group, which a lost peer broke. `name` must
    be new in this world; `dist.destroy_process_group(group)` ends it. Private:
    `distributed_c10d._new_process_group_helper`, `_world.pg_group_ranks`."""
    from torch.distributed import distributed_c10d

    helper = getattr(distributed_c10d, "_new_process_group_helper", None)
    if helper is None:
        raise _missing("torch", "distributed_c10d._new_process_group_helper")
    me = distributed_c10d._get_default_group().rank()
    group, _ = helper(len(ranks), ranks.index(me), list(ranks), "gloo", store, name, timeout=timeout)
    distributed_c10d._world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(ranks)}  # as new_group
    return group
