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
from colab_par.compat.trees import tree_leaves, tree_map

_FAKE_PG = "torch.testing._internal.distributed.fake_pg"
_MEM_TRACKER = "torch.distributed._tools.mem_tracker"
_MOD_TRACKER = "torch.distributed._tools.mod_tracker"
_MODULE_TRACKER = "torch.utils.module_tracker"
_FAKE_TENSOR = "torch._subclasses.fake_tensor"


def init_fake_world(rank: int, world_size: int) -> None:
    """Start this process as `rank` of a `world_size` world whose collectives move nothing
    (torch's `fake` backend): every rank-dependent shape and allocation is the real one."""
    import torch.distributed as dist

    fake_pg = _torch_private(_FAKE_PG)
    if not hasattr(fake_pg, "FakeStore"):
        raise _missing("torch", f"{_FAKE_PG}.FakeStore")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


def local_flop_counter() -> Any:
    """torch's `FlopCounterMode`, counting what this rank computes: a DTensor operator by its local
    shards' shapes. torch's counter sees a DTensor operator with its global shapes where DTensor
    dispatches it in Python (a sharding it has not cached yet: a first step) and the local
    operator otherwise, so under tensor parallel its count depended on the step it ran in (tp4:
    4x). Reads the counter's private `_count_flops` and DTensor's `_local_tensor`."""
    from torch.distributed.tensor import DTensor
    from torch.utils.flop_counter import FlopCounterMode

    if not hasattr(FlopCounterMode, "_count_flops"):
        raise _missing("torch", "torch.utils.flop_counter.FlopCounterMode._count_flops")

    def local(value: Any) -> Any:
        return value._local_tensor if isinstance(value, DTensor) else value

    class LocalFlopCounter(FlopCounterMode):
        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            mapped = tree_map(local, (out, args, kwargs))
            super()._count_flops(func_packet, *mapped)
            return out

    return LocalFlopCounter(display=False)


def memory_tracker() -> Any:
    """A fresh `MemTracker`: a dispatch mode that sorts every live tensor storage into parameters,
    buffers, gradients, activations, temporaries, optimizer state and other.

    A pipeline stage is a root module called once per microbatch in one step, which torch's
    tracker refuses (it takes a second root call for the next iteration); this one records each
    call's forward peak as it does for a submodule used twice, so `module_phase_peaks` sees the
    largest microbatch's."""
    private = _torch_private(_MEM_TRACKER)
    tracker, states = getattr(private, "MemTracker", None), getattr(private, "_ModState", None)
    if tracker is None or states is None or not hasattr(tracker, "_pre_fw_hook"):
        raise _missing("torch", f"{_MEM_TRACKER}.MemTracker._pre_fw_hook")

    class MicrobatchTracker(tracker):
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            if module not in self.memory_tracking or self._mod_tracker.is_bw:
                return super()._pre_fw_hook(module, inputs)
            snapshot = self.get_tracker_snapshot()
            stats = self.memory_tracking[module]
            stats.local_peak = {device: kinds["Total"] for device, kinds in snapshot.items()}
            stats.snapshots.setdefault(states.PEAK_FW, []).append(snapshot)

    return MicrobatchTracker()


@contextmanager
def following_split_backward() -> Iterator[None]:
    """While in it, the memory tracker follows a backward split by `autograd.grad` (the zero-bubble
    V schedule: a stage's input gradients first, its weight gradients later). Its module hooks wait
    for the gradients of every input of a module ("all" mode), which asks autograd whether each
    input's node will run, and autograd.grad cannot answer for a node its inputs do not need (the
    embedding's, in the input-gradient pass). Here a module's backward ends at its first input
    gradient ("any"): the same moment for a module with one input that needs a gradient, as a
    pipeline stage's is."""
    modules = [_torch_private(name) for name in (_MOD_TRACKER, _MODULE_TRACKER)]  # memory's and FLOPs' trackers
    originals = [getattr(module, "register_multi_grad_hook", None) for module in modules]
    if None in originals:
        raise _missing("torch", "register_multi_grad_hook in " + ", ".join((_MOD_TRACKER, _MODULE_TRACKER)))

    def any_mode(register: Any) -> Any:
        def register_multi_grad_hook(tensors: Any, fn: Any, *, mode: str = "all") -> Any:
            return register(tensors, fn, mode="any")
        return register_multi_grad_hook

    for module, register in zip(modules, originals):
        module.register_multi_grad_hook = any_mode(register)
    try:
        yield
    finally:
        for module, register in zip(modules, originals):
            module.register_multi_grad_hook = register


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
    and its backward (`memory_tracking[module].snapshots[PEAK_FW / PEAK_BW]`, the largest of its
    calls: a pipeline stage runs once per microbatch); {} for a phase it did not run."""
    states = getattr(_torch_private(_MEM_TRACKER), "_ModState", None)
    stats = getattr(tracker, "memory_tracking", None)
    if states is None or stats is None:
        raise _missing("torch", f"{_MEM_TRACKER}.MemTracker.memory_tracking")
    snapshots = stats[module].snapshots if module in stats else {}
    peaks = {}
    for phase, state in (("forward", states.PEAK_FW), ("backward", states.PEAK_BW)):
        taken = snapshots.get(state) or []
        peaks[phase] = max((tracked_kinds(snapshot) for snapshot in taken), key=lambda kinds: kinds.get("Total", 0),
                           default={})
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
    tensor inputs all integer or boolean, or, without tensor inputs, an integer result; an op on
    meta tensors alone stays on meta for real, unless it allocates on a device (`to_empty`'s
    `empty_like(..., device=)`, which must give a fake tensor: a real one would be allocated, and
    its views would not share its storage in the tracker's eyes).

    Two ops a trace without data cannot run as torch's fake kernels do: a router's tokens per
    expert (`_balanced_counts`: a balanced router's) and a float32 grouped matmul
    (`_grouped_mm_any_dtype`)."""
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
            if func is histogram_add and _counts_of_fake_choices(args, fake_module.FakeTensor):
                with unset():
                    return _balanced_counts(*args)
            if func is grouped_mm and args[0].dtype != bfloat16:
                return _grouped_mm_any_dtype(func, *args, **kwargs)
            return func(*args, **kwargs)

    from torch import bfloat16, ops

    grouped_mm = getattr(getattr(ops.aten, "_grouped_mm", None), "default", None)
    histogram_add = ops.aten.index_add_.default
    with mode_class(allow_non_fake_inputs=True) as mode, RealIndexArithmetic():
        yield mode


def _counts_of_fake_choices(args: tuple, fake_class: type) -> bool:
    """Whether an `index_add_` counts fake choices into a real integer histogram (a router's
    tokens per expert, `models.moe.expert_counts`: zeros made for real, being integer work, then
    fake indices added): values a trace without data cannot know."""
    target, index, source = args[0], args[2], args[3]
    return (not isinstance(target, fake_class) and not target.is_floating_point() and target.dim() == 1
            and isinstance(index, fake_class) and isinstance(source, fake_class) and not source.is_floating_point())


def _balanced_counts(target: Any, dim: int, index: Any, source: Any) -> Any:
    """`_counts_of_fake_choices`' histogram as a balanced router fills it: the index's entries (one
    count each) spread evenly over the bins, the remainder one each to the first. The step's shapes
    follow from it (the rows each expert and each expert-parallel peer gets); their sum, every
    rank's own rows, is exact whatever the routing."""
    bins, total = target.shape[0], index.numel()
    target.add_(total // bins)
    target[:total % bins].add_(1)
    return target


def _grouped_mm_any_dtype(func: Any, mat_a: Any, mat_b: Any, *args: Any, **kwargs: Any) -> Any:
    """`aten._grouped_mm` of float32 (or float16) operands on fake tensors: torch 2.13's fake
    kernel takes only bf16 (the CUDA kernel's rule), while the CPU kernel the kit's experts run
    takes float32 too. The output's shape does not depend on the dtype: the bf16 op's, in the
    operands' dtype (the casts are fake: nothing is stored, and no tracker above sees them)."""
    import torch

    dtype = mat_a.dtype
    out = func(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), *args, **kwargs)
    return out.to(dtype)


def _integer_work(func: Any, leaves: list, kwargs: dict, fake_class: type) -> bool:
    """`fake_tensors`' rule for an op that runs for real (see there)."""
    import torch

    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if any(isinstance(tensor, fake_class) for tensor in tensors):
        return False
    if tensors and all(tensor.is_meta for tensor in tensors):
        return kwargs.get("device") in (None, "meta") or torch.device(kwargs["device"]).type == "meta"
    if any(tensor.is_meta for tensor in tensors):
        return False
    if tensors:
        return all(not tensor.is_floating_point() and not tensor.is_complex() for tensor in tensors)
    dtype = kwargs.get("dtype")
    if dtype is not None:
        return not dtype.is_floating_point and not dtype.is_complex
    numbers = [leaf for leaf in leaves if isinstance(leaf, (int, float)) and not isinstance(leaf, bool)]
    return func.__name__.startswith("arange") and all(isinstance(number, int) for number in numbers)


_PIPELINE_STAGE = "torch.distributed.pipelining.stage"
_PIPELINE_UTILS = "torch.distributed.pipelining._utils"


@contextmanager
def pipeline_metadata(stage_inputs: Any) -> Iterator[None]:
    """Answer torch's pipeline shape inference in a fake world, where nothing is received.

    torch 2.13's `PipelineStage` learns, on its first step, the shapes its neighbours exchange:
    a stage receives the previous stage's output metadata (`_recv_meta`, a pickled object sent
    point to point) and, backwards, the next stage's input-gradient metadata. A fake world's
    receive leaves its buffer empty, so inside this context `_recv_meta` answers for the absent
    neighbour: forwards the metadata of ``stage_inputs(stage_index)`` (the tensors that stage
    takes, computed by the caller), backwards gradients shaped like this stage's own outputs
    (what the next stage derives from the same tensors). Its metadata sends are dropped (no one
    listens, and the pickled object cannot become a tensor under `fake_tensors`); the steps'
    own sends and receives are left as they are."""
    stage_module = _torch_private(_PIPELINE_STAGE)
    utils = _torch_private(_PIPELINE_UTILS)
    stage_class = getattr(stage_module, "PipelineStage", None)
    needed = ("_StageForwardMeta", "_StageBackwardMeta", "extract_tensor_metas", "_derive_grad_metas")
    hooks = ("_recv_meta", "_send_meta")
    if stage_class is None or not all(hasattr(stage_class, h) for h in hooks) or not all(hasattr(utils, n) for n in needed):
        raise _missing("torch", f"{_PIPELINE_STAGE}.PipelineStage._recv_meta/_send_meta and {_PIPELINE_UTILS} "
                       "metadata types")

    def recv_meta(stage: Any, src_stage: int) -> Any:
        if src_stage < stage.stage_index:
            return utils._StageForwardMeta(forward_metas=utils.extract_tensor_metas(stage_inputs(stage.stage_index)))
        return utils._StageBackwardMeta(backward_metas=utils._derive_grad_metas(stage._stage_meta.outputs))

    def send_meta(stage: Any, meta: Any, dst_stage: int) -> None:
        return None

    originals = {hook: getattr(stage_class, hook) for hook in hooks}
    stage_class._recv_meta, stage_class._send_meta = recv_meta, send_meta
    try:
        yield
    finally:
        for hook, original in originals.items():
            setattr(stage_class, hook, original)
