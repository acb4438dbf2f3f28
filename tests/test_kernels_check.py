"""benchmarks/kernels.py's check_kernels, the float64 check gpu_check runs on every compiled kernel
before timing it, run here on CPU with the Triton code interpreted: it passes on the kit's kernels
and reports a kernel whose output is 1 % off."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from colab_par.kernels import InterpreterProcess

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"
KERNELS = ("rms_norm", "layer_norm", "rope", "swiglu", "cross_entropy (", "fused_linear_cross_entropy", "FusedAdamW")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("kernels_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_in_worker(broken: str | None) -> tuple[list[tuple], list[str]]:
    """interpreter_check, with ``broken`` (a kernel the benchmark calls) scaled by 1.01 if given."""
    bench = load_benchmark()
    if broken is not None:
        kernel = getattr(bench, broken)
        setattr(bench, broken, lambda *args, **kwargs: kernel(*args, **kwargs) * 1.01)
    return bench.interpreter_check()


@pytest.fixture(scope="module")
def interpreter():
    with InterpreterProcess(timeout=300) as worker:
        yield worker


def test_every_kernel_matches_float64_in_both_dtypes(interpreter):
    rows, failures = interpreter.run(check_in_worker, None)
    assert failures == []
    for kernel in KERNELS:
        dtypes = {dtype for name, dtype, *_ in rows if name.startswith(kernel)}
        assert dtypes == {torch.float32, torch.bfloat16}, kernel
    for name, dtype, forward, backward, limit in rows:
        assert forward <= limit and (backward is None or backward <= limit), name
        assert (backward is None) == name.startswith("FusedAdamW")  # every kernel with a backward has it checked


@pytest.mark.parametrize("broken", ["swiglu", "cross_entropy"])
def test_a_kernel_one_percent_off_is_a_failure(interpreter, broken):
    _, failures = interpreter.run(check_in_worker, broken)
    assert failures, f"{broken} scaled by 1.01 passed the check"
    assert all(failure.startswith(broken) for failure in failures), failures
    assert any("float32: forward" in failure for failure in failures)
    assert any("float32: backward" in failure for failure in failures)
