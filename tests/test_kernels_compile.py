"""Every Triton kernel compiles for an H100 (sm_90) down to a cubin, with no GPU present.

The interpreter (test_kernels.py) checks the numbers but is laxer than the compiler (types of
loop-carried values, constexpr use, pointer casts); ahead-of-time compilation with Triton's bundled
ptxas catches those errors on a CPU-only machine.
"""
from __future__ import annotations

import importlib

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from colab_par.kernels import interpreter_active

FLOAT_ARGS = {"eps", "label_smoothing", "grad_scale", "lr", "beta1", "beta2", "weight_decay"}
FP32_POINTERS = ("rstd", "mean_ptr", "partial", "loss_ptr", "step_size", "bias2", "w_ptr", "b_ptr")
INT64_POINTERS = ("target", "pointer_table", "numel_table", "chunk_table")

# (module, kernel, constexprs, num_warps)
CASES = [
    ("rms_norm", "_rms_norm_forward_kernel", dict(BLOCK_ROWS=4, BLOCK=1024, ONE_CHUNK=True), 4),
    ("rms_norm", "_rms_norm_forward_kernel", dict(BLOCK_ROWS=1, BLOCK=8192, ONE_CHUNK=False), 16),
    ("rms_norm", "_rms_norm_backward_kernel", dict(BLOCK_ROWS=4, BLOCK=1024, ONE_CHUNK=True), 4),
    ("rms_norm", "_rms_norm_backward_kernel", dict(BLOCK_ROWS=1, BLOCK=8192, ONE_CHUNK=False), 16),
    ("layer_norm", "_layer_norm_forward_kernel", dict(BLOCK=4096, ONE_CHUNK=True), 8),
    ("layer_norm", "_layer_norm_forward_kernel", dict(BLOCK=8192, ONE_CHUNK=False), 16),
    ("layer_norm", "_layer_norm_backward_kernel", dict(BLOCK=4096, ONE_CHUNK=True), 8),
    ("layer_norm", "_layer_norm_backward_kernel", dict(BLOCK=8192, ONE_CHUNK=False), 16),
    ("rope", "_rope_kernel", dict(BLOCK_TOKENS=2, BLOCK_Q_HEADS=32, BLOCK_K_HEADS=8, BLOCK_HALF=64,
                                  BACKWARD=False), 4),
    ("rope", "_rope_kernel", dict(BLOCK_TOKENS=2, BLOCK_Q_HEADS=32, BLOCK_K_HEADS=8, BLOCK_HALF=64,
                                  BACKWARD=True), 4),
    ("swiglu", "_swiglu_forward_kernel", dict(BLOCK=1024), 4),
    ("swiglu", "_swiglu_backward_kernel", dict(BLOCK=1024), 4),
    ("cross_entropy", "_cross_entropy_kernel", dict(BLOCK=8192, WRITE_GRAD=True, SMOOTHING=True), 16),
    ("cross_entropy", "_cross_entropy_kernel", dict(BLOCK=8192, WRITE_GRAD=False, SMOOTHING=False), 16),
    ("adamw", "_adamw_kernel", dict(DTYPE=triton.language.bfloat16, CHUNK=65536, BLOCK=1024), 4),
]


def signature(kernel, constexprs: dict) -> dict[str, str]:
    """Argument types as a bf16 training step would launch them (fp32 weights and statistics)."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in FLOAT_ARGS:
            types[name] = "fp32"
        elif any(key in name for key in INT64_POINTERS):
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*fp32" if any(key in name for key in FP32_POINTERS) else "*bf16"
        elif name.endswith("_table"):
            types[name] = "*fp32"
        else:
            types[name] = "i32"
    return types


@pytest.mark.slow
@pytest.mark.skipif(interpreter_active(), reason="triton was imported in interpreter mode: no compiler path")
@pytest.mark.parametrize("module_name, kernel_name, constexprs, num_warps", CASES,
                         ids=[f"{k}-{'-'.join(f'{n}={v}' for n, v in c.items() if isinstance(v, bool))}"
                              for _, k, c, _ in CASES])
def test_kernel_compiles_for_sm90(module_name, kernel_name, constexprs, num_warps):
    kernel = getattr(importlib.import_module(f"colab_par.kernels.{module_name}"), kernel_name)
    source = ASTSource(kernel, signature(kernel, constexprs), constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "enable_fp_fusion": True})
    assert compiled.asm["cubin"], f"{kernel_name} produced no cubin"
