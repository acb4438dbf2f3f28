"""Every private or undocumented torch, ipyparallel, ipykernel, transformers and triton API colab_par
relies on.

These APIs can change in any release without a deprecation. Keeping them here means a version
drift fails with one `CompatError` naming the supported range, instead of an AttributeError deep
inside a training step, and one test per entry (tests/test_compat.py) checks the installed
versions. An entry whose API is missing raises `CompatError`; the few that return a fallback
instead (a slower path, never a wrong one) say so in their docstring, and their test proves the
installed versions take the fast path. Everything else in the kit uses public APIs only:
tests/test_compat.py scans the package for private torch, transformers, triton and ipyparallel
names outside this file (the exceptions it still allows are listed there, each with its
reason). Imports are lazy: transformers stays optional, and the notebook client never pays for
engine-side modules.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Iterator

__all__ = ["CompatError", "SUPPORTED", "DCP_METADATA_GLOBALS", "dcp_metadata_path", "flatten_mesh",
           "STAGE_COMPUTE_HOOKS", "check_stage_compute_hooks", "hf_tp_plan",
           "ipp_engine_kernel_class", "ENGINE_MAIN_CODE", "ENGINE_MAIN_FILE",
           "CONTROLLER_MAIN_CODE", "prompt_heart_monitor", "run_controller", "task_futures",
           "engine_kernel", "engine_shell", "after_output", "publish_status", "engine_idents", "mux_stream",
           "client_context",
           "client_io_loop", "client_reply_handler", "unanswered",
           "checkpoint_wrapper", "sdpa_aten_ops",
           "torch_dispatch_mode", "pin_inductor_vector_width", "device_constructors", "op_schema", "storage_key",
           "module_reset",
           "triton_interpreted", "assert_async", "tree_flatten", "tree_unflatten", "tree_map", "tree_leaves",
           "hf_token_losses", "answer_control_requests", "send_control_requests", "group_sequence",
           "process_groups", "compile_seconds", "grouped_mm", "grouped_mm_is_one_op", "fused_optimizer_devices",
           "recompile_limit",
           "failing_at_recompile_limit", "recompile_limit_error", "swapped_parameters", "hf_output_recorder",
           "storage_holder", "dtensor_over", "fsdp_offload_policy", "non_persistent_buffers", "client_metadata",
           "failed_at", "flight_record", "gpu_uuids", "local_shard_offsets", "output_futures", "output_mark",
           "output_since", "unflatten_mesh", "unwrapped_name"]

SUPPORTED = {"torch": "torch>=2.6,<3", "ipyparallel": "ipyparallel>=9", "ipykernel": "ipykernel>=6.9.1,<8",
             "transformers": "transformers>=5.9", "triton": "triton>=3.0"}
"""The ranges pyproject.toml declares; a missing private API names the one it belongs to."""


class CompatError(RuntimeError):
    """An installed package lacks a private API colab_par needs (its version is out of range)."""


def _missing(package: str, what: str) -> CompatError:
    try:
        installed = version(package)
    except PackageNotFoundError:
        installed = "not installed"
    return CompatError(f"{what} is missing from {package} {installed}; colab_par supports "
                       f"{SUPPORTED[package]}: install a version in that range")


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


# ---- torch grouped matmul --------------------------------------------------------------------------
_GROUPED_DTYPES = ("float32", "bfloat16", "float16")


def grouped_mm_is_one_op(tokens: Any, weights: Any) -> bool:
    """Whether `grouped_mm` of these operands is one `torch._grouped_mm` (under torch.compile: one
    traced op) rather than its loop of matmuls over Python ints read from the row counts."""
    import torch

    aligned = all(size * tokens.element_size() % 16 == 0 for size in (tokens.shape[1], weights.shape[2]))
    traceable = not torch.compiler.is_compiling() or tokens.dtype == torch.bfloat16
    return (hasattr(torch, "_grouped_mm") and aligned and traceable and tokens.dtype == weights.dtype
            and str(tokens.dtype).removeprefix("torch.") in _GROUPED_DTYPES)


def grouped_mm(tokens: Any, weights: Any, ends: Any) -> Any:
    """Rows of `tokens` grouped by expert (group g ends at row ends[g]) times that expert's matrix
    of `weights` (experts, in, out): one `torch._grouped_mm` (private, no public equivalent yet)
    where it takes the inputs (float32/bf16/fp16, rows of whole 16-byte multiples, CPU included),
    a loop of matmuls otherwise (float64 references, odd widths, a torch without it, and under
    torch.compile anything but bf16, which is all its fake-tensor kernel takes)."""
    import torch

    if grouped_mm_is_one_op(tokens, weights):
        out = torch._grouped_mm(tokens.contiguous(), weights.contiguous(), offs=ends)
        if out.requires_grad:  # its CPU backward needs a dense gradient (not an expanded one)
            out.register_hook(lambda grad: grad.contiguous())
        return out
    starts = [0, *ends.tolist()]
    return torch.cat([tokens[start:end] @ weights[expert]
                      for expert, (start, end) in enumerate(zip(starts, starts[1:]))])


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


# ---- transformers ----------------------------------------------------------------------------------
def hf_tp_plan(model: Any) -> dict[str, str]:
    """A transformers model's own tensor-parallel plan, FQN pattern -> style (private `_tp_plan`,
    which `post_init` fills from the config's `base_model_tp_plan`); {} when it has none or is not
    a transformers model."""
    if not hasattr(model, "_tp_plan") and _is_transformers_model(model):
        raise _missing("transformers", "PreTrainedModel._tp_plan")
    return dict(getattr(model, "_tp_plan", None) or {})


def _is_transformers_model(model: Any) -> bool:
    """Whether `model` is a transformers PreTrainedModel (without importing transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


# ---- ipyparallel -----------------------------------------------------------------------------------
ENGINE_MAIN_CODE = "from ipyparallel.engine.app import main; main()"
"""Python that starts an engine (`ipyparallel.engine.app.main`, what `ipengine` runs)."""

ENGINE_MAIN_FILE = "ipyparallel/engine/app.py"
"""The source file of that entry point: the bottom frame of an engine's main thread in a stack dump."""

CONTROLLER_MAIN_CODE = "from colab_par.compat import run_controller; run_controller()"
"""Python that starts the kit's controller: `ipcontroller` with `prompt_heart_monitor`."""


def prompt_heart_monitor() -> type:
    """ipyparallel's heart monitor, registering a new engine when its heart first answers a ping.

    Its own (`ipyparallel.controller.heartmonitor.HeartMonitor.beat`, undocumented) notices a new
    heart only at the beat after the ping it answered, so every engine waits one more heartbeat
    period to be registered (0.1 s of each start at the kit's period). Known hearts are judged as
    before, at each beat."""
    from ipyparallel.controller import heartmonitor

    base = heartmonitor.HeartMonitor
    if not all(hasattr(base, name) for name in ("handle_pong", "handle_new_hearts", "hearts", "responses")):
        raise _missing("ipyparallel", "HeartMonitor.handle_pong / handle_new_hearts")

    class PromptHeartMonitor(base):
        def handle_pong(self, msg: list) -> None:
            super().handle_pong(msg)
            heart = msg[0]
            if heart in self.responses and heart not in self.hearts:
                self.handle_new_hearts({heart})

    return PromptHeartMonitor


def run_controller() -> None:
    """Run `ipcontroller` (`ipyparallel.controller.app.main`) with `prompt_heart_monitor`. Its
    heart monitor runs in a `multiprocessing.Process` forked from this one (Linux's start method up
    to Python 3.13), which keeps the class; a process that imported afresh would beat as before."""
    from ipyparallel.controller import heartmonitor
    from ipyparallel.controller.app import main

    heartmonitor.HeartMonitor = prompt_heart_monitor()
    main()


def task_futures(result: Any) -> list[Any]:
    """One future per engine of an AsyncResult (`AsyncResult._children`, undocumented), or of a
    lean direct call (`colab_par.cluster.direct_call.DirectCall.rank_futures`).

    The public API reports a task only once every engine is done; a rank that failed while another
    still waits in a collective is visible only here.
    """
    futures = getattr(result, "rank_futures", None)
    if futures is None:
        futures = getattr(result, "_children", None)
    if futures is None:
        raise _missing("ipyparallel", "AsyncResult._children (per-engine futures)")
    return list(futures)


def failed_at(future: Any, error: Any) -> Any:
    """When an engine's part of a task failed: the lean call's `error.completed`, else the
    reply metadata's (`MessageFuture.output.metadata`, undocumented); None when the reply did not
    say (then that failure sorts after those that did)."""
    completed = getattr(error, "completed", None)
    if completed is None:
        metadata = getattr(getattr(future, "output", None), "metadata", None)
        if not isinstance(metadata, dict):
            raise _missing("ipyparallel", "MessageFuture.output.metadata")
        completed = metadata.get("completed")
    return completed


def ipp_engine_kernel_class() -> type:
    """The kernel class of an ipyparallel engine (`ipyparallel.engine.kernel`, undocumented)."""
    try:
        from ipyparallel.engine.kernel import IPythonParallelKernel
    except ImportError:
        raise _missing("ipyparallel", "ipyparallel.engine.kernel.IPythonParallelKernel") from None
    return IPythonParallelKernel


def engine_kernel() -> Any:
    """The running engine's kernel (`ipykernel.kernelbase.Kernel.instance()`)."""
    from ipykernel.kernelbase import Kernel

    return Kernel.instance()


def engine_shell(kernel: Any) -> tuple[Any, Callable[[Any, list], Any]] | None:
    """An engine's shell lock and dispatch for requests from another socket (`colab_par.cluster.direct`),
    or None where this ipykernel lacks what they need (before 7.0, or a kernel with subshells): a
    documented fallback, the client then keeps ipyparallel's route (slower, not wrong).

    Holding the lock (`Kernel._main_asyncio_lock`, undocumented) runs one request at a time with
    those from the controller. ``dispatch(stream, frames)`` then runs a request exactly as the
    kernel runs one from its controller (`Kernel.dispatch_shell`: SIGINT handling, busy/idle
    status, aborts), with `stream` as the kernel's shell stream while it runs: the stream
    dispatch_shell replies on."""
    lock = getattr(kernel, "_main_asyncio_lock", None)
    if (getattr(kernel, "_supports_kernel_subshells", True) or lock is None
            or not hasattr(kernel, "dispatch_shell") or not hasattr(kernel, "shell_stream")):
        return None

    async def dispatch(stream: Any, frames: list) -> None:
        own, kernel.shell_stream = kernel.shell_stream, stream
        try:
            await kernel.dispatch_shell(frames)
        finally:
            kernel.shell_stream = own

    return lock, dispatch


def after_output(streams: list[Any], then: Callable[[], None]) -> None:
    """Call `then` (a publication, e.g. the idle status that ends a task's output) after the
    pending output of ipykernel's `streams` is published, without waiting for it here: both are
    queued on the streams' output thread (`OutStream._flush`, `pub_thread.schedule`,
    undocumented), where a flush queues its message again, so `then` runs there after the flush.
    `OutStream.flush` would wait for that thread instead: a thread round trip per stream. Where
    those internals are missing it does exactly that (a documented fallback: slower, same order)."""
    schedule = getattr(getattr(streams[0], "pub_thread", None), "schedule", None)
    if schedule is None or not all(hasattr(stream, "_flush") for stream in streams):
        for stream in streams:
            stream.flush()
        then()
        return

    def flush_then() -> None:
        for stream in streams:
            stream._flush()
        then()

    schedule(flush_then)


def publish_status(kernel: Any, status: str, parent: dict) -> None:
    """Publish the engine's execution state ("busy"/"idle") on iopub for the shell request `parent`
    (`Kernel._publish_status`, private in ipykernel): "idle" tells the client that request's
    output is complete."""
    publish = getattr(kernel, "_publish_status", None)
    if publish is None:
        raise _missing("ipykernel", "Kernel._publish_status")
    publish(status, "shell", parent=parent)


def engine_idents(client: Any, engine_ids: list[int]) -> tuple[list[bytes], list[int]]:
    """The zmq identities of engines, and their ids (`Client._build_targets`, private)."""
    build = getattr(client, "_build_targets", None)
    if build is None:
        raise _missing("ipyparallel", "Client._build_targets")
    return build(engine_ids)


def mux_stream(client: Any) -> Any:
    """The client's stream to the controller's direct queue (what DirectView sends on; private)."""
    return _client_part(client, "_mux_stream")


def client_context(client: Any) -> Any:
    """The zmq context of an ipyparallel client (`Client._context`, private)."""
    return _client_part(client, "_context")


def client_io_loop(client: Any) -> Any:
    """The event loop of the client's I/O thread, which owns its sockets (`Client._io_loop`)."""
    return _client_part(client, "_io_loop")


def client_reply_handler(client: Any) -> Callable[[list], None]:
    """What the client does with an execute/apply reply from its queues (`Client._dispatch_reply`)."""
    return _client_part(client, "_dispatch_reply")


def client_metadata(client: Any) -> Any:
    """The client's per-request books, filled from iopub (`Client.metadata`, a defaultdict of
    `Metadata` by msg_id: stdout, data, outputs, ...)."""
    return _client_part(client, "metadata")


def output_futures(client: Any) -> dict[str, Any]:
    """Futures the client resolves when an engine's idle status for a msg_id arrives, i.e. all of
    that request's output has (`Client._output_futures`, private)."""
    return _client_part(client, "_output_futures")


def output_mark(session: Any, streams: list[Any]) -> tuple[int, list[Any]]:
    """Where an engine's publishing stands (`output_since` compares): the messages its session
    has made (`Session.message_count`, which every message's id counts) and the buffers its
    output streams write into (`OutStream._buffers`, replaced at each flush; private)."""
    return getattr(session, "message_count", -1), [getattr(stream, "_buffers", None) for stream in streams]


def output_since(mark: tuple[int, list[Any]], session: Any, streams: list[Any]) -> bool:
    """Whether anything was (or is about to be) published since `mark`: a message made (data,
    display, an error), text written and waiting in a stream, or a stream flushed meanwhile.
    Unknown internals answer True (then the caller waits for the output, as always)."""
    count, buffers = mark
    if count < 0 or getattr(session, "message_count", -1) != count:
        return True
    for stream, before in zip(streams, buffers):
        now = getattr(stream, "_buffers", None)
        if before is None or now is not before or getattr(stream, "_flush_pending", True) or any(
                buffer.tell() for buffer in list(now.values())):
            return True
    return False


def unanswered(client: Any) -> dict[int, int]:
    """How many of this client's requests each engine id has not answered yet
    (`Client._outstanding_dict`, by engine uuid; private)."""
    by_uuid, engines = _client_part(client, "_outstanding_dict"), _client_part(client, "_engines")
    return {engine_id: len(by_uuid.get(uuid, ())) for engine_id, uuid in engines.items()}


def _client_part(client: Any, name: str) -> Any:
    part = getattr(client, name, None)
    if part is None:
        raise _missing("ipyparallel", f"Client.{name}")
    return part


# ---- activation checkpointing ----------------------------------------------------------------------
def checkpoint_wrapper(module: Any, **options: Any) -> Any:
    """torch's activation-checkpoint module wrapper (`torch.distributed.algorithms._checkpoint`)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap
    except ImportError:
        raise _missing("torch", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper") from None
    return wrap(module, **options)


def unwrapped_name(name: str) -> str:
    """A parameter name with the checkpoint wrapper's inserted module name taken out."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    except ImportError:
        raise _missing("torch", "checkpoint_wrapper._CHECKPOINT_PREFIX") from None
    return name.replace(_CHECKPOINT_PREFIX, "")


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


_SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def sdpa_aten_ops() -> list[Any]:
    """The private aten kernels `scaled_dot_product_attention` dispatches to (default overloads)."""
    import torch

    found = [getattr(torch.ops.aten, name).default for name in _SDPA_OPS
             if hasattr(torch.ops.aten, name)]
    if not found:
        raise _missing("torch", "aten::_scaled_dot_product_* attention kernels")
    return found


# ---- dispatch modes and aten op metadata ---------------------------------------------------
@cache
def _torch_private(module: str) -> Any:
    """A private torch module, imported once; a missing one names the supported range."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing("torch", module) from None


def torch_dispatch_mode() -> type:
    """The base class of a `__torch_dispatch__` mode (`TorchDispatchMode`, described in torch's
    "Extending PyTorch" notes but living in the private `torch.utils._python_dispatch`)."""
    mode = getattr(_torch_private("torch.utils._python_dispatch"), "TorchDispatchMode", None)
    if mode is None:
        raise _missing("torch", "torch.utils._python_dispatch.TorchDispatchMode")
    return mode


def device_constructors() -> set[Callable]:
    """The torch functions that take a `device=` and create a tensor: those `torch.device(...)` as a
    context manager redirects (`torch.utils._device._device_constructors`)."""
    constructors = getattr(_torch_private("torch.utils._device"), "_device_constructors", None)
    if constructors is None:
        raise _missing("torch", "torch.utils._device._device_constructors")
    return constructors()


def op_schema(func: Any) -> Any:
    """The schema of an aten overload (`OpOverload._schema`): its arguments and returns with their
    alias annotations, i.e. which arguments it writes and whether its result is a view."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        raise _missing("torch", "OpOverload._schema")
    return schema


def storage_key(tensor: Any) -> int:
    """An identity of `tensor`'s storage that holds on the meta device too, where every data pointer
    is 0 (`UntypedStorage._cdata`, the address of the storage object)."""
    key = getattr(tensor.untyped_storage(), "_cdata", None)
    if key is None:
        raise _missing("torch", "UntypedStorage._cdata")
    return key


@contextlib.contextmanager
def swapped_parameters(module: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """`module`'s own parameters named in `replacements` replaced by those tensors (plain tensors
    with their autograd history, e.g. a DTensor's local piece) for the duration: torch's
    `functional_call` swaps through the module's call, which a wrapped forward cannot use
    (`Module._parameters`)."""
    own = getattr(module, "_parameters", None)
    if not isinstance(own, dict):
        raise _missing("torch", "nn.Module._parameters")
    saved = {name: own[name] for name in replacements}
    try:
        own.update(replacements)
        yield
    finally:
        own.update(saved)


def module_reset(module: Any) -> Callable[[], None] | None:
    """The method that (re)initialises `module`'s own parameters: `reset_parameters`, or the private
    `_reset_parameters` torch's own MultiheadAttention and Transformer keep instead; None if none."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


# ---- torch.compile -----------------------------------------------------------------------------------
_COMPILE_PHASES = ("_compile.compile_inner", "backward._backward_impl")  # a frame; a lazy backward


def compile_seconds() -> float:
    """Seconds `torch.compile` has spent compiling in this process so far: each frame (dynamo and
    the forward graph) and each backward graph, compiled lazily at the first backward
    (`torch._dynamo.utils.compilation_time_metrics`)."""
    metrics = getattr(_torch_private("torch._dynamo.utils"), "compilation_time_metrics", None)
    if not isinstance(metrics, dict):
        raise _missing("torch", "torch._dynamo.utils.compilation_time_metrics")
    return float(sum(sum(metrics.get(phase, ())) for phase in _COMPILE_PHASES))


def fused_optimizer_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on
    (`torch.utils._foreach_utils._get_fused_kernels_supported_devices`)."""
    devices = getattr(_torch_private("torch.utils._foreach_utils"), "_get_fused_kernels_supported_devices", None)
    if devices is None:
        raise _missing("torch", "torch.utils._foreach_utils._get_fused_kernels_supported_devices")
    return list(devices())


def _dynamo_config() -> Any:
    config = getattr(_torch_private("torch._dynamo"), "config", None)
    if config is None or not hasattr(config, "recompile_limit") or not hasattr(config, "fail_on_recompile_limit_hit"):
        raise _missing("torch", "torch._dynamo.config.recompile_limit / fail_on_recompile_limit_hit")
    return config


def recompile_limit() -> int:
    """How many input shapes (or guard failures) dynamo compiles one code object for."""
    return int(_dynamo_config().recompile_limit)


def failing_at_recompile_limit() -> Any:
    """A context in which reaching the recompile limit raises `recompile_limit_error()` instead of
    dynamo's silent fallback to eager."""
    return _dynamo_config().patch(fail_on_recompile_limit_hit=True)


def recompile_limit_error() -> type:
    """What dynamo raises at the recompile limit under `failing_at_recompile_limit`."""
    error = getattr(_torch_private("torch._dynamo.exc"), "FailOnRecompileLimitHit", None)
    if error is None:
        raise _missing("torch", "torch._dynamo.exc.FailOnRecompileLimitHit")
    return error


def pin_inductor_vector_width() -> int:
    """Fix inductor's CPU vector width (``cpp.simdlen``) to the one it would pick now, and return it.

    Left unset, inductor picks it per compile from ATEN_CPU_CAPABILITY, but its graph cache keys
    on its config, not on that choice: code generated for avx512 was served under avx2 and built
    with avx2's headers (NaN losses), and under "default" failed to build at all. Pinned, the
    width is part of the key (`torch._inductor.cpu_vec_isa.pick_vec_isa`)."""
    config = getattr(_torch_private("torch._inductor"), "config", None)
    pick = getattr(_torch_private("torch._inductor.cpu_vec_isa"), "pick_vec_isa", None)
    if config is None or pick is None or not hasattr(config, "cpp"):
        raise _missing("torch", "torch._inductor.config.cpp.simdlen / cpu_vec_isa.pick_vec_isa")
    if config.cpp.simdlen is None:
        config.cpp.simdlen = pick().bit_width()
    return config.cpp.simdlen


# ---- triton --------------------------------------------------------------------------------------------
@cache
def _interpreted_function() -> type:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        raise _missing("triton", "triton.runtime.interpreter.InterpretedFunction") from None
    return InterpretedFunction


def assert_async(condition: Any, message: str) -> None:
    """Fail with ``message`` where the 0-d boolean ``condition`` is false, without a host sync: on CUDA
    a device-side assertion queued on the stream, on CPU an immediate error (`torch._assert_async`)."""
    import torch

    check = getattr(torch, "_assert_async", None)
    if check is None:
        raise _missing("torch", "torch._assert_async")
    check(condition, message)


def triton_interpreted(function: Any) -> bool:
    """Whether a triton function was built for the interpreter (`TRITON_INTERPRET=1` when triton
    was imported) rather than for compilation (`triton.runtime.interpreter.InterpretedFunction`,
    internal to triton)."""
    return isinstance(function, _interpreted_function())


# ---- pytrees (torch.utils._pytree) -----------------------------------------------------------------
@cache
def _pytree() -> Any:
    try:
        from torch.utils import _pytree
    except ImportError:
        raise _missing("torch", "torch.utils._pytree") from None
    for name in ("tree_flatten", "tree_unflatten", "tree_map"):
        if not callable(getattr(_pytree, name, None)):
            raise _missing("torch", f"torch.utils._pytree.{name}")
    return _pytree


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of a nested tuple/list/dict (ModelOutputs included) and its structure
    (`torch.utils._pytree.tree_flatten`; torch has no public pytree module yet)."""
    return _pytree().tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The inverse of `tree_flatten` (`torch.utils._pytree.tree_unflatten`)."""
    return _pytree().tree_unflatten(leaves, spec)


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` with `function` applied to every leaf (`torch.utils._pytree.tree_map`)."""
    return _pytree().tree_map(function, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested tuples / lists / dicts (`torch.utils._pytree.tree_leaves`)."""
    return _pytree().tree_leaves(tree)


# ---- transformers' losses ----------------------------------------------------------------------------
@cache
def hf_output_recorder(model: Any, output: str) -> Any:
    """What a transformers model records for `output` (e.g. "router_logits": the router modules
    and which of their outputs), from its `_can_record_outputs`; None when it records none."""
    if not hasattr(model, "_can_record_outputs") and _is_transformers_model(model):
        raise _missing("transformers", "PreTrainedModel._can_record_outputs")
    return (getattr(model, "_can_record_outputs", None) or {}).get(output)


def hf_token_losses() -> dict[str, Callable]:
    """transformers' per-token language-model losses, ``loss(logits, labels, vocab_size,
    num_items_in_batch)``: "causal" shifts the labels by one, "masked" does not
    (`transformers.loss.loss_utils`, undocumented). A model's `loss_function` is one of them when it
    is a language model."""
    try:
        from transformers.loss import loss_utils
    except ImportError as error:
        raise _missing("transformers", f"transformers.loss.loss_utils ({error})") from None
    losses = {"causal": getattr(loss_utils, "ForCausalLMLoss", None),
              "masked": getattr(loss_utils, "ForMaskedLMLoss", None)}
    for kind, loss in losses.items():
        if not callable(loss):
            raise _missing("transformers", f"transformers.loss.loss_utils's {kind} language-model loss")
    return losses


# ---- the engines' control channel and process-group internals (colab_par.cluster.probe) --------------------
def answer_control_requests(answers: dict[str, Callable[[dict], dict]]) -> None:
    """On an engine: answer each control-channel request type with ``answers[type](content)``.

    ipykernel's control thread (`Kernel.control_handlers`, undocumented) runs the answer while the
    main thread is busy with a task, which is the point: it can say where that thread waits.
    """
    from ipykernel.kernelbase import Kernel

    kernel = Kernel.instance()
    handlers = getattr(kernel, "control_handlers", None)
    if handlers is None or getattr(kernel, "control_thread", None) is None:
        raise _missing("ipykernel", "an engine kernel with a control thread (Kernel.control_handlers)")

    def handler(answer: Callable[[dict], dict], reply_type: str) -> Callable[..., None]:
        def handle(stream: Any, idents: Any, parent: dict) -> None:
            try:
                content = {"status": "ok", **answer(parent["content"])}
            except Exception as exc:  # noqa: BLE001 - the asker gets the error, the engine goes on
                content = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            kernel.session.send(stream, reply_type, content, parent, ident=idents)
        return handle

    for request, answer in answers.items():
        handlers[request] = handler(answer, request.removesuffix("_request") + "_reply")


def send_control_requests(client: Any, engine_ids: list[int], request: str, content: dict) -> list[Any]:
    """Send `request` on the control channel to each engine; one future per engine resolving to the
    reply message (`Client._send` on `Client._control_stream`, private: the public control calls
    cover only signal, abort, clear and shutdown)."""
    send, stream = getattr(client, "_send", None), getattr(client, "_control_stream", None)
    build_targets = getattr(client, "_build_targets", None)
    if send is None or stream is None or build_targets is None:
        raise _missing("ipyparallel", "Client._send / _control_stream / _build_targets")
    return [send(stream, request, content=content, ident=ident) for ident in build_targets(engine_ids)[0]]


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


# ---- FSDP2 ---------------------------------------------------------------------------------------
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


_ABSENT = object()


def non_persistent_buffers(module: Any) -> set[str]:
    """Names of `module`'s own buffers registered with ``persistent=False``
    (`nn.Module._non_persistent_buffers_set`, private: no public query says which buffers stay out of
    the state dict)."""
    names = getattr(module, "_non_persistent_buffers_set", None)
    if names is None:
        raise _missing("torch", "nn.Module._non_persistent_buffers_set")
    return set(names)
