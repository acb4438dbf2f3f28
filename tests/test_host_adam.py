"""`adamw_chunk_step` against AdamW's formula in float64 (Loshchilov & Hutter; torch's AdamW
documentation), over several steps, with weight decay, maximize and bfloat16 gradients.

The tolerance follows from float32 arithmetic (unit roundoff u = 2^-24). Per step k (1-based):
m_k = β1·m + (1-β1)·g carries at most 3u relative to the magnitude sum m̄_k = β1·m̄ + (1-β1)·|g|
per step (a multiply-add pair and the stored rounding), accumulating to 3k·u·m̄_k (m can cancel, its
magnitude sum cannot); v_k (all terms positive) to 3k·u·v_k relative, so √v to (1.5k + 1)·u. The
update lr/bc1 · m / (√v/√bc2 + ε) adds ≤ 4u (two divisions, a multiply, the sum), and the parameter
two roundings of its own magnitude (decay and subtraction). So the parameter's error after n steps
is at most Σ_k [2u·|p_k| + lr/bc1_k/denom_k · (3k·u·m̄_k + (1.5k + 5)·u·|m_k|)], computed along the
float64 trajectory; the bf16 gradients widen exactly, so they add nothing.
"""
from __future__ import annotations

import pytest
import torch

from colab_par.memory_tiers.host_adam import AdamWHyper, adamw_chunk_step

U = 2.0 ** -24  # float32 unit roundoff
STEPS = 6


def _reference(param: torch.Tensor, grads: list[torch.Tensor], hyper: AdamWHyper) -> tuple[torch.Tensor, torch.Tensor]:
    """(parameter after the steps, elementwise error bound), float64, AdamW as torch documents it."""
    p = param.double()
    m, v, m_mag = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    bound = torch.zeros_like(p)
    for k, grad in enumerate(grads, start=1):
        g = -grad.double() if hyper.maximize else grad.double()
        bound += 2 * U * p.abs()
        p = p * (1 - hyper.lr * hyper.weight_decay)
        m = hyper.beta1 * m + (1 - hyper.beta1) * g
        m_mag = hyper.beta1 * m_mag + (1 - hyper.beta1) * g.abs()
        v = hyper.beta2 * v + (1 - hyper.beta2) * g * g
        bc1, bc2 = 1 - hyper.beta1 ** k, 1 - hyper.beta2 ** k
        denom = v.sqrt() / bc2 ** 0.5 + hyper.eps
        p = p - hyper.lr / bc1 * m / denom
        bound += hyper.lr / bc1 / denom * (3 * k * U * m_mag + (1.5 * k + 5) * U * m.abs())
        bound += 2 * U * p.abs()
    return p, bound


def _grads(n: int, dtype: torch.dtype, generator: torch.Generator) -> list[torch.Tensor]:
    """Gradients of mixed scale and sign, a few exact zeros (where v stays 0 and ε decides)."""
    out = []
    for _ in range(STEPS):
        grad = torch.randn(n, generator=generator, dtype=torch.float64) * torch.logspace(-4, 1, n, dtype=torch.float64)
        grad[::97] = 0.0
        out.append(grad.to(dtype))
    return out


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hyper", [AdamWHyper(lr=1e-2, weight_decay=0.1),
                                   AdamWHyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0),
                                   AdamWHyper(lr=1e-2, weight_decay=0.05, maximize=True)],
                         ids=["decay", "no-decay", "maximize"])
def test_chunk_step_matches_the_float64_formula(grad_dtype: torch.dtype, hyper: AdamWHyper) -> None:
    generator = torch.Generator().manual_seed(7)
    n = 10_007  # odd: the fused kernel's vector tail is exercised
    param0 = torch.randn(n, generator=generator)
    grads = _grads(n, grad_dtype, generator)
    param, exp_avg, exp_avg_sq = param0.clone(), torch.zeros(n), torch.zeros(n)
    step = torch.zeros((), dtype=torch.float32)
    scratch = torch.full((n + 5,), float("nan"))  # longer than the chunk; stale contents must not leak
    for grad in grads:
        adamw_chunk_step(param, grad, exp_avg, exp_avg_sq, step, hyper, scratch=scratch)
    expected, bound = _reference(param0, grads, hyper)
    assert step.item() == STEPS
    error = (param.double() - expected).abs()
    moved = (expected - param0.double()).abs()
    assert moved.median() > 100 * bound.median()  # the steps moved the parameters far beyond the bound
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max().item():.3g}"


def test_chunk_step_without_scratch_equals_with_scratch() -> None:
    generator = torch.Generator().manual_seed(3)
    param = torch.randn(513, generator=generator)
    grad = torch.randn(513, generator=generator).to(torch.bfloat16)
    states = [[param.clone(), torch.zeros(513), torch.zeros(513), torch.zeros(())] for _ in range(2)]
    adamw_chunk_step(*states[0][:1], grad, *states[0][1:], AdamWHyper())
    adamw_chunk_step(*states[1][:1], grad, *states[1][1:], AdamWHyper(), scratch=torch.empty(600))
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_chunk_must_be_flat_float32() -> None:
    with pytest.raises(ValueError, match="flat float32"):
        adamw_chunk_step(torch.zeros(4, dtype=torch.float64), torch.zeros(4), torch.zeros(4), torch.zeros(4),
                         torch.zeros(()), AdamWHyper())


def test_staging_buffers_alternate_so_one_chunk_comes_down_while_the_other_updates() -> None:
    """Consecutive chunks get different staging buffers (chunk i+1's copy must not land in the
    buffer chunk i is being updated in); every other chunk reuses one. On a CPU rank copies are
    plain and count no bytes between device and host."""
    from colab_par.memory_tiers.transfers import Transfers

    transfers = Transfers(torch.device("cpu"))
    first, second = (transfers.staging(turn, "grads", torch.float32, 8) for turn in (0, 1))
    assert first.data_ptr() != second.data_ptr()
    assert transfers.staging(2, "grads", torch.float32, 8).data_ptr() == first.data_ptr()
    assert transfers.staging(0, "params", torch.float32, 8).data_ptr() != first.data_ptr()
    source = torch.arange(8.0)
    assert transfers.copy([(first, source)]) is None and torch.equal(first, source) and transfers.moved == 0
