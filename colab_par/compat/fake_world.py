"""What the dry run at scale (planning/dry_run/) reads of torch's private tools: the `fake` process
group backend, `FakeTensorMode` and the memory tracker of `torch.distributed._tools`.

The fake backend is registered only when `torch.testing._internal.distributed.fake_pg` is imported
(its `FakeStore` is the store it is started with); `MemTracker` lives in the private
`torch.distributed._tools.mem_tracker`, and its per-module phase peaks and overall peak are kept in
attributes without a public reader.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from colab_par.compat.support import _missing, _torch_private
from colab_par.compat.torch_ops import torch_dispatch_mode
from colab_par.compat.trees import tree_leaves

_FAKE_PG = "torch.testing._internal.distributed.fake_pg"
_MEM_TRACKER = "torch.distributed._tools.mem_tracker"
_FAKE_TENSOR = "torch._subclasses.fake_tensor"


def init_fake_world(rank: int, world_size: int) -> None:
    """Start this process as `rank` of a `world_size` world whose collectives move nothing
    (torch's `fake` backend): every rank-dependent shape and allocation is the real one."""
    import torch.distributed as dist

    fake_pg = _torch_private(_FAKE_PG)
    if not hasattr(fake_pg, "FakeStore"):
        raise _missing("torch", f"{_FAKE_PG}.FakeStore")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


def memory_tracker() -> Any:
    """A fresh `MemTracker`: a dispatch mode that sorts every live tensor storage into parameters,
    buffers, gradients, activations, temporaries, optimizer state and other."""
    tracker = getattr(_torch_private(_MEM_TRACKER), "MemTracker", None)
    if tracker is None:
        raise _missing("torch", f"{_MEM_TRACKER}.MemTracker")
    return tracker()


def tracked_kinds(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """One device's bytes by kind ("Parameter", "Gradient", "Optstate", "Activation", "Temp",
    "Buffer", "Other", "Total") from a tracker snapshot {device: {kind: bytes}}, summed over devices."""
    kinds: dict[str, int] = {}
    for per_device in snapshot.values():
        for kind, size in per_device.items():
            name = getattr(kind, "value", kind)
            kinds[name] = kinds.get(name, 0) + int(size)
    return kinds


def module_phase_peaks(tracker: Any, module: Any) -> dict[str, dict[str, int]]:
    """{"forward": kinds, "backward": kinds} at the tracker's peak while `module` ran its forward
    and its backward (`memory_tracking[module].snapshots[PEAK_FW / PEAK_BW]`); {} for a phase it
    did not run."""
    states = getattr(_torch_private(_MEM_TRACKER), "_ModState", None)
    stats = getattr(tracker, "memory_tracking", None)
    if states is None or stats is None:
        raise _missing("torch", f"{_MEM_TRACKER}.MemTracker.memory_tracking")
    snapshots = stats[module].snapshots if module in stats else {}
    peaks = {}
    for phase, state in (("forward", states.PEAK_FW), ("backward", states.PEAK_BW)):
        taken = snapshots.get(state) or []
        peaks[phase] = tracked_kinds(taken[-1]) if taken else {}
    return peaks


@contextmanager
def fake_tensors() -> Iterator[Any]:
    """torch's `FakeTensorMode` (private module): tensors with shapes, dtypes and devices but no
    storage, so a rank of a model far larger than this machine runs its step. Real tensors given
    to it (token batches) are taken as inputs.

    Integer index arithmetic stays real: torch 2.13's DTensor and DeviceMesh read values of small
    index tensors they build (a mesh's coordinates, `(mesh == rank).nonzero()`, when FSDP joins
    the dp and tp meshes; a shard's offsets, `int(torch.arange(...)[0])`), which a fake tensor
    cannot answer. An op runs for real when no fake tensor enters it and it is integer work: its
    tensor inputs all integer or boolean, or, without tensor inputs, an integer result."""
    fake_module = _torch_private(_FAKE_TENSOR)
    mode_class = getattr(fake_module, "FakeTensorMode", None)
    unset = getattr(fake_module, "unset_fake_temporarily", None)
    if mode_class is None or unset is None:
        raise _missing("torch", f"{_FAKE_TENSOR}.FakeTensorMode / unset_fake_temporarily")

    class RealIndexArithmetic(torch_dispatch_mode()):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            leaves = tree_leaves((args, kwargs))
            if _integer_work(func, leaves, kwargs, fake_module.FakeTensor):
                with unset():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)

    with mode_class(allow_non_fake_inputs=True) as mode, RealIndexArithmetic():
        yield mode


def _integer_work(func: Any, leaves: list, kwargs: dict, fake_class: type) -> bool:
    """`fake_tensors`' rule for an op that runs for real (see there)."""
    import torch

    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if any(isinstance(tensor, fake_class) or tensor.is_meta for tensor in tensors):
        return False
    if tensors:
        return all(not tensor.is_floating_point() and not tensor.is_complex() for tensor in tensors)
    dtype = kwargs.get("dtype")
    if dtype is not None:
        return not dtype.is_floating_point and not dtype.is_complex
    numbers = [leaf for leaf in leaves if isinstance(leaf, (int, float)) and not isinstance(leaf, bool)]
    return func.__name__.startswith("arange") and all(isinstance(number, int) for number in numbers)
