"""Private aten ops and kernels (grouped matmul, attention kernels, async asserts, fused optimizers),
dispatch modes, and the metadata of ops and storages a dispatch mode reads."""
from __future__ import annotations

from typing import Any, Callable

from colab_par.compat.support import _missing, _torch_private


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


def fused_optimizer_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on
    (`torch.utils._foreach_utils._get_fused_kernels_supported_devices`)."""
    devices = getattr(_torch_private("torch.utils._foreach_utils"), "_get_fused_kernels_supported_devices", None)
    if devices is None:
        raise _missing("torch", "torch.utils._foreach_utils._get_fused_kernels_supported_devices")
    return list(devices())


def assert_async(condition: Any, message: str) -> None:
    """Fail with ``message`` where the 0-d boolean ``condition`` is false, without a host sync: on CUDA
    a device-side assertion queued on the stream, on CPU an immediate error (`torch._assert_async`)."""
    import torch

    check = getattr(torch, "_assert_async", None)
    if check is None:
        raise _missing("torch", "torch._assert_async")
    check(condition, message)
