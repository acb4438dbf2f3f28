"""Triton kernels vs float64 torch references, with the Triton code itself running in the interpreter.

Triton fixes interpretation at import time and other test modules import triton early (via
torch.distributed), so the kernel checks run in one spawned worker that imported triton with
TRITON_INTERPRET=1 (colab_par.kernels.InterpreterProcess). Every check poisons kernel outputs with
NaN and asserts that the interpreter path really launched.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from colab_par.kernels import (FusedAdamW, InterpreterProcess, apply_rope, backend, cross_entropy,
                               fused_linear_cross_entropy, interpreter_active, layer_norm, rms_norm, swiglu)
from colab_par.kernels import _dispatch

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module")
def interpreter():
    with InterpreterProcess(timeout=300) as worker:
        yield worker


# ---------------------------------------------------------------- helpers (run inside the worker)

def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, loose: float = 1.0) -> None:
    """Compare with a float64 reference: fp32 to ~1e-5, bf16 to its rounding (2^-7 relative)."""
    rel = (1e-5 if dtype == F32 else 2 ** -7) * loose
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.nan_to_num(0.0).abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=rel, atol=rel * max(scale, 1e-3), equal_nan=True)


@contextlib.contextmanager
def interpreted(*kernel_names: str):
    """Poison outputs and prove each named kernel launched on the interpreter path."""
    before = {name: _dispatch.launches[(name, "triton-interpreter")] for name in kernel_names}
    with _dispatch.poisoned_outputs():
        yield
    for name in kernel_names:
        assert _dispatch.launches[(name, "triton-interpreter")] > before[name], f"{name} did not run in Triton"


def leaves(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """(input-dtype leaf, float64 leaf) pairs holding the same values."""
    out = []
    for t in tensors:
        low = t.to(dtype)
        out += [low.clone().requires_grad_(), low.double().requires_grad_()]
    return out


def check_backend_is_interpreter() -> None:
    assert interpreter_active()
    assert backend(torch.zeros(1)) == "triton-interpreter"


@contextlib.contextmanager
def single_rank_mesh():
    """A real one-rank gloo process group and CPU device mesh, torn down afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def check_dtensor_takes_torch_path() -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from colab_par.kernels.rms_norm import rms_norm_reference
    with single_rank_mesh() as mesh:
        x, w = torch.randn(4, 6, 8), torch.rand(8) + 0.5
        x_dt, w_dt = distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Replicate()])
        before = _dispatch.triton_launches()
        assert backend(x_dt) == "torch" and backend(x) == "triton-interpreter"
        y = rms_norm(x_dt, w_dt)
        assert _dispatch.triton_launches() == before
        torch.testing.assert_close(y.full_tensor(), rms_norm_reference(x, w))


def check_fused_adamw_updates_dtensor_shards() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    with single_rank_mesh() as mesh:
        start = torch.randn(10, 3)
        sharded = torch.nn.Parameter(distribute_tensor(start, mesh, [Shard(0)]))
        plain = torch.nn.Parameter(start.clone())
        ours, reference = FusedAdamW([sharded], lr=0.1), torch.optim.AdamW([plain], lr=0.1)
        with interpreted("adamw"):
            for _ in range(3):
                for param, opt in ((sharded, ours), (plain, reference)):
                    opt.zero_grad()
                    (param.sin() * param).sum().backward()
                    opt.step()
        assert sharded.grad.placements == sharded.placements
        torch.testing.assert_close(sharded.full_tensor(), plain.detach(), rtol=1e-5, atol=1e-6)


def check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from colab_par.kernels.rms_norm import rms_norm_reference
    torch.manual_seed(0)
    x, x64, w, w64 = leaves(dtype, torch.randn(shape), torch.rand(shape[-1]) + 0.5)
    w, w64 = w.detach().float().requires_grad_(), w64  # fp32 weight with low-precision activations
    dy = torch.randn(shape).to(dtype)
    with interpreted("rms_norm_forward", "rms_norm_backward"):
        y = rms_norm(x, w, 1e-6)
        y.backward(dy)
    y64 = rms_norm_reference(x64, w64, 1e-6)
    y64.backward(dy.double())
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == F32
    assert_matches(y, y64, dtype)
    assert_matches(x.grad, x64.grad, dtype)
    assert_matches(w.grad, w64.grad, F32, loose=10)


def check_layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from colab_par.kernels.layer_norm import layer_norm_reference
    torch.manual_seed(1)
    x, x64, w, w64, b, b64 = leaves(dtype, torch.randn(shape) * 2 + 1, torch.rand(shape[-1]) + 0.5,
                                    torch.randn(shape[-1]))
    dy = torch.randn(shape).to(dtype)
    with interpreted("layer_norm_forward", "layer_norm_backward"):
        y = layer_norm(x, w, b, 1e-5)
        y.backward(dy)
    y64 = layer_norm_reference(x64, w64, b64, 1e-5)
    y64.backward(dy.double())
    assert_matches(y, y64, dtype)
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert_matches(got, ref, dtype, loose=2)


def check_rope(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    from colab_par.kernels.rope import apply_rope_reference
    from colab_par.models.gpt import rope_cos_sin
    torch.manual_seed(2)
    q, q64, k, k64 = leaves(dtype, torch.randn(batch, seq, heads, head_dim),
                            torch.randn(batch, seq, kv_heads, head_dim))
    cos, sin = rope_cos_sin(torch.arange(seq) + 5, head_dim, 10000.0, torch.float32)
    dq, dk = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
    with interpreted("rope_forward", "rope_backward"):
        q_out, k_out = apply_rope(q, k, cos, sin)
        torch.autograd.backward([q_out, k_out], [dq, dk])
    q_ref, k_ref = apply_rope_reference(q64, k64, cos.double(), sin.double())
    torch.autograd.backward([q_ref, k_ref], [dq.double(), dk.double()])
    for got, ref in ((q_out, q_ref), (k_out, k_ref), (q.grad, q64.grad), (k.grad, k64.grad)):
        assert_matches(got, ref, dtype)


def check_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from colab_par.kernels.swiglu import swiglu_reference
    torch.manual_seed(3)
    g, g64, u, u64 = leaves(dtype, torch.randn(shape) * 3, torch.randn(shape))
    dy = torch.randn(shape).to(dtype)
    with interpreted("swiglu_forward", "swiglu_backward"):
        y = swiglu(g, u)
        y.backward(dy)
    y64 = swiglu_reference(g64, u64)
    y64.backward(dy.double())
    for got, ref in ((y, y64), (g.grad, g64.grad), (u.grad, u64.grad)):
        assert_matches(got, ref, dtype)


def check_cross_entropy(rows: int, vocab: int, targets: list[int], reduction: str, smoothing: float,
                        dtype: torch.dtype) -> None:
    from colab_par.kernels.cross_entropy import cross_entropy_reference
    torch.manual_seed(4)
    x, x64 = leaves(dtype, torch.randn(rows, vocab) * 4)
    target = torch.tensor(targets)
    with interpreted("cross_entropy"):
        logits = x * 1  # a non-leaf, so its buffer becomes the gradient as in a model
        loss = cross_entropy(logits, target, reduction=reduction, label_smoothing=smoothing)
        grad_out = torch.rand(loss.shape) + 0.5
        loss.backward(grad_out)
    ref = cross_entropy_reference(x64, target, reduction=reduction, label_smoothing=smoothing)
    ref.backward(grad_out.double())
    assert loss.dtype == F32
    assert_matches(loss, ref, F32, loose=10)
    assert_matches(x.grad, x64.grad, dtype, loose=2)
    if all(t == -100 for t in targets):
        assert x.grad.abs().sum() == 0


def check_cross_entropy_rejects_bad_target() -> None:
    """The range check is an assertion queued without a host sync: on CPU it raises before any kernel."""
    before = _dispatch.triton_launches()
    for bad in ([1, 5], [-1, 0]):
        with pytest.raises(RuntimeError, match=r"outside \[0, 5\).*ignore_index=-100"):
            cross_entropy(torch.randn(2, 5, requires_grad=True) * 1, torch.tensor(bad))
        with pytest.raises(RuntimeError, match=r"outside \[0, 5\)"):
            fused_linear_cross_entropy(torch.randn(2, 3), torch.randn(5, 3), torch.tensor(bad))
    assert _dispatch.triton_launches() == before


def check_fused_linear_cross_entropy(tokens: int, hidden: int, vocab: int, ignore_every: int,
                                     dtype: torch.dtype) -> None:
    from colab_par.kernels.fused_linear_cross_entropy import chunk_rows, fused_linear_cross_entropy_reference
    torch.manual_seed(5)
    h, h64, w, w64 = leaves(dtype, torch.randn(tokens, hidden), torch.randn(vocab, hidden) * 0.3)
    target = torch.randint(0, vocab, (tokens,))
    target[::ignore_every] = -100
    assert chunk_rows(tokens, vocab, hidden) < tokens or tokens == 1, "the case must exercise chunking"
    with interpreted("cross_entropy"):
        loss = fused_linear_cross_entropy(h, w, target)
        loss.backward(torch.tensor(1.5))
    ref = fused_linear_cross_entropy_reference(h64, w64, target)
    (1.5 * ref).backward()
    loose = 1 if dtype == F32 else 4  # the bf16 matmul rounds the logits themselves
    assert_matches(loss, ref, F32 if dtype == F32 else BF16, loose=loose * 10)
    assert_matches(h.grad, h64.grad, dtype, loose=loose * 5)
    assert_matches(w.grad, w64.grad, dtype, loose=loose * 5)


def check_fused_adamw_matches_torch() -> None:
    from colab_par.kernels import adamw
    default_chunk, adamw.CHUNK = adamw.CHUNK, 2 * adamw.BLOCK  # small program chunks: 5000 elements span 3
    try:
        compare_fused_adamw_with_torch_adamw()
    finally:
        adamw.CHUNK = default_chunk


def compare_fused_adamw_with_torch_adamw() -> None:
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3))
    big = torch.nn.Parameter(torch.randn(5000))  # several program chunks, the last one partial
    frozen = torch.nn.Parameter(torch.randn(4))  # never gets a gradient
    twin, twin_big, twin_frozen = copy.deepcopy(model), copy.deepcopy(big), copy.deepcopy(frozen)

    def groups(m, b, f):
        return [{"params": list(m.parameters()) + [f]}, {"params": [b], "lr": 3e-3, "weight_decay": 0.0}]

    ours = FusedAdamW(groups(model, big, frozen), lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    reference = torch.optim.AdamW(groups(twin, twin_big, twin_frozen), lr=1e-2, betas=(0.8, 0.95), eps=1e-7,
                                  weight_decay=0.1)
    x = torch.randn(16, 7)
    with interpreted("adamw"):
        for _ in range(10):
            for m, b, opt in ((model, big, ours), (twin, twin_big, reference)):
                opt.zero_grad()
                (m(x).pow(2).mean() + b.sin().sum()).backward()
                opt.step()
    for got, ref in zip([*model.parameters(), big, frozen], [*twin.parameters(), twin_big, twin_frozen]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert ours.state[big]["step"] == 10 and frozen not in ours.state


# ---------------------------------------------------------------- tests

def test_worker_runs_triton_interpreter(interpreter):
    interpreter.run(check_backend_is_interpreter)


def test_dtensor_takes_the_torch_path(interpreter):
    interpreter.run(check_dtensor_takes_torch_path)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (2, 3, 64), (150, 40), (3, 9000)],
                         ids=["one-row", "width-33", "3d", "several-row-tiles", "above-block"])
def test_rms_norm(interpreter, shape, dtype):
    interpreter.run(check_rms_norm, shape, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 7), (6, 33), (2, 9000)], ids=["one-row", "width-33", "above-block"])
def test_layer_norm(interpreter, shape, dtype):
    interpreter.run(check_layer_norm, shape, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sizes", [(1, 1, 1, 1, 2), (2, 5, 4, 2, 12), (1, 3, 3, 1, 64), (1, 37, 8, 2, 64)],
                         ids=["one-token", "gqa-headdim-12", "mqa-headdim-64", "several-programs"])
def test_rope(interpreter, sizes, dtype):
    interpreter.run(check_rope, *sizes, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1,), (3, 1000), (2, 5, 7)], ids=["one-element", "several-blocks", "3d"])
def test_swiglu(interpreter, shape, dtype):
    interpreter.run(check_swiglu, shape, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [
    (1, 5, [3], "mean", 0.0),
    (4, 37, [1, -100, 36, 0], "mean", 0.0),
    (4, 37, [1, -100, 36, 0], "sum", 0.1),
    (3, 37, [2, -100, 5], "none", 0.2),
    (3, 37, [-100, -100, -100], "mean", 0.0),
    (2, 32000, [31999, 7], "mean", 0.0),
], ids=["one-row", "ignore", "sum-smoothing", "none-smoothing", "all-ignored", "vocab-32k"])
def test_cross_entropy(interpreter, case, dtype):
    interpreter.run(check_cross_entropy, *case, dtype)


def test_cross_entropy_rejects_out_of_range_target(interpreter):
    interpreter.run(check_cross_entropy_rejects_bad_target)


@pytest.mark.parametrize("case", [
    (10, 16, 300, 3, F32),
    (1, 8, 50, 2, F32),
    (4, 32, 32000, 3, F32),
    (6, 16, 300, 4, BF16),
], ids=["chunked", "one-token", "vocab-32k", "bf16"])
def test_fused_linear_cross_entropy(interpreter, case):
    interpreter.run(check_fused_linear_cross_entropy, *case)


def test_fused_adamw_matches_torch_adamw(interpreter):
    interpreter.run(check_fused_adamw_matches_torch)


def test_fused_adamw_updates_fsdp_style_dtensor_shards(interpreter):
    interpreter.run(check_fused_adamw_updates_dtensor_shards)


# ---------------------------------------------------------------- in this process (no interpreter)

@pytest.mark.skipif(interpreter_active(), reason="this process imported triton in interpreter mode")
def test_cpu_without_interpreter_uses_torch_and_says_so(monkeypatch):
    x, w = torch.randn(3, 8), torch.rand(8)
    before = _dispatch.triton_launches()
    torch.testing.assert_close(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (8,), w, 1e-6))
    assert backend(x) == "torch" and _dispatch.triton_launches() == before
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_dispatch, "_warned_late_interpret", False)
    with pytest.warns(RuntimeWarning, match="after triton was imported"):
        assert backend(x) == "torch"


@pytest.mark.skipif(interpreter_active(), reason="this process imported triton in interpreter mode")
def test_fused_linear_cross_entropy_chunks_on_the_torch_path_too():
    """Without Triton the chunking (and its memory saving) stays; the per-chunk gradient is torch's."""
    from colab_par.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_reference
    torch.manual_seed(7)
    h, h64, w, w64 = leaves(F32, torch.randn(9, 16), torch.randn(200, 16) * 0.3)
    target = torch.randint(0, 200, (9,))
    target[::4] = -100
    before = _dispatch.triton_launches()
    fused_linear_cross_entropy(h, w, target).backward(torch.tensor(0.5))
    (0.5 * fused_linear_cross_entropy_reference(h64, w64, target)).backward()
    assert _dispatch.triton_launches() == before
    assert_matches(h.grad, h64.grad, F32, loose=5)
    assert_matches(w.grad, w64.grad, F32, loose=5)


def test_bad_inputs_fail_before_work():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="size 8"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="bias"):
        layer_norm(x, torch.ones(8), torch.zeros(3))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), reduction="avg")
    with pytest.raises(ValueError, match=r"\(seq, head_dim\)"):
        apply_rope(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(ValueError, match="must match"):
        swiglu(torch.randn(3), torch.randn(4))
    with pytest.raises(ValueError, match="vocab, d"):
        fused_linear_cross_entropy(torch.randn(3, 8), torch.randn(10, 7), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="betas"):
        FusedAdamW([torch.nn.Parameter(torch.ones(2))], betas=(0.9, 1.0))
