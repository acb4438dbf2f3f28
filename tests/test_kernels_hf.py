"""Hugging Face decoders with colab_par's kernels patched in (apply_kernels, hf_causal_lm_loss).

The patched model's loss and every parameter gradient must be as close to exact arithmetic as the
unpatched model's own float32 run. The Triton code runs in a spawned TRITON_INTERPRET=1 worker
(see test_kernels.py for why); launch counts prove every patched module really ran its kernel.
"""
from __future__ import annotations

import types
from collections import Counter
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from colab_par.kernels import InterpreterProcess, rms_norm
from colab_par.models.hf import causal_lm_logits
from colab_par.models.hf_kernels import apply_kernels, hf_causal_lm_loss
from parity import LLAMA_SIZES, batches, build_model

VOCAB, SEQ = LLAMA_SIZES["vocab_size"], LLAMA_SIZES["max_position_embeddings"]
EPS32 = torch.finfo(torch.float32).eps
# A correct patch only reorders and fuses float32 arithmetic, so its distance from the float64
# result is of the order torch's own float32 run shows (5-11 units of eps x a tensor's largest value
# here). Every tensor may be this many times the worst such torch error: the patched and fused runs
# measured on 2026-11-23 needed at most 1.21x; a norm with a 10x eps needs ~10^5x, a RoPE with the
# wrong sign or another row's angles ~500x.
ROUNDING_FACTOR = 4
KERNEL_LAUNCHES = {"rms_norm": "rms_norm", "swiglu": "swiglu", "apply_rope": "rope"}  # patch -> launch names


@pytest.fixture(scope="module")
def interpreter():
    with InterpreterProcess(timeout=300) as worker:
        yield worker


# ---------------------------------------------------------------- helpers (run inside the worker)

def loss_and_grads(model: torch.nn.Module, positions: str = "shared", fused: bool = False) -> dict[str, torch.Tensor]:
    """One forward/backward on a fixed batch of 4 x 16 tokens: the loss and every parameter's gradient.

    positions "shared": one (1, seq) row for the batch (HF's default); "rows": every row its own
    positions, spaced 1, 2, 3, 4 apart (a shift alone would not show: RoPE sees only distances);
    fused: hf_causal_lm_loss with shared positions.
    """
    inputs, targets = batches(VOCAB, SEQ, steps=1)[0]
    model.zero_grad(set_to_none=True)
    if fused:
        loss = hf_causal_lm_loss(model, inputs, torch.arange(SEQ), targets)
    else:
        rows = positions == "rows"
        position_ids = torch.arange(SEQ)[None] * (torch.arange(1, len(inputs) + 1)[:, None] if rows else 1)
        # an explicit mask keeps the plain causal mask: HF reads positions that do not step by 1 as packed sequences
        mask = torch.ones_like(inputs) if rows else None
        logits = model(input_ids=inputs, position_ids=position_ids, attention_mask=mask, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return {"loss": loss.detach(), **{name: p.grad.detach().clone() for name, p in model.named_parameters()}}


def _units(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest distance from the float64 result, in units of eps32 x the tensor's largest value."""
    return float((got.double() - exact).abs().max() / (EPS32 * exact.abs().max().clamp_min(1e-30)))


def tiny(kind: str) -> torch.nn.Module:
    """parity.py's tiny model, made so a wrong patch shows: its norms' eps at 1e-5 (not the 1e-6 default
    a patch could hard-code), and query/key weights 10x larger so attention scores are O(1) and the
    rotary angles matter (at init they are ~1e-3 and attention is nearly uniform)."""
    model = build_model(kind, 0)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 1e-5
            if hasattr(module, "q_proj"):
                module.q_proj.weight.mul_(10)
                module.k_proj.weight.mul_(10)
    return model


@lru_cache(maxsize=None)
def exact_and_budget(kind: str, positions: str) -> tuple[dict[str, torch.Tensor], float]:
    """The unpatched model's float64 loss and gradients, and the error budget its float32 run sets."""
    exact = loss_and_grads(tiny(kind).double(), positions)
    torch_fp32 = loss_and_grads(tiny(kind), positions)
    return exact, ROUNDING_FACTOR * max(1.0, max(_units(torch_fp32[k], exact[k]) for k in exact))


def assert_near_exact(kind: str, positions: str, got: dict[str, torch.Tensor]) -> None:
    exact, budget = exact_and_budget(kind, positions)
    assert got.keys() == exact.keys()
    for name in exact:
        units = _units(got[name], exact[name])
        assert units <= budget, (f"{kind} ({positions} positions) {name}: {units:.1f} units of eps from exact, "
                                 f"further than the unpatched float32 model's {budget / ROUNDING_FACTOR:.1f} x "
                                 f"{ROUNDING_FACTOR}")


def launches_during(run, patched: list[str]) -> tuple[Counter, Counter]:
    """(expected, actual) kernel launches of `run()`: each patched module once forward, once backward."""
    from colab_par.kernels import _dispatch
    per_kernel = Counter(KERNEL_LAUNCHES[entry.split(": ")[1]] for entry in patched)
    names = [f"{kernel}_{way}" for kernel in per_kernel for way in ("forward", "backward")]
    before = {name: _dispatch.launches[(name, "triton-interpreter")] for name in names}
    run()
    actual = Counter({name: _dispatch.launches[(name, "triton-interpreter")] - before[name] for name in names})
    expected = Counter({f"{kernel}_{way}": n for kernel, n in per_kernel.items() for way in ("forward", "backward")})
    return expected, actual


def sabotage(model: torch.nn.Module, how: str) -> None:
    """Deliberately wrong patches for the negative controls."""
    if how == "wrong_eps":  # the final norm calls the kernel with 10x its eps
        norm = model.model.norm
        norm.forward = types.MethodType(lambda self, x: rms_norm(x, self.weight, 10 * self.variance_epsilon), norm)
    elif how == "skip_rope":  # attention back on the class's own forward
        for layer in model.model.layers:
            del layer.self_attn.forward


def check_patched_model_matches(kind: str, how: str | None = None) -> list[str]:
    from colab_par.kernels import interpreter_active
    assert interpreter_active()
    model = tiny(kind)
    patched = apply_kernels(model, "triton")
    if how:
        sabotage(model, how)
    for positions in ("shared", "rows"):
        result = {}
        expected, actual = launches_during(lambda: result.update(loss_and_grads(model, positions)), patched)
        assert actual == expected, f"{kind}: kernel launches {dict(actual)}, expected {dict(expected)}"
        assert_near_exact(kind, positions, result)
    return patched


class LargestHeadProduct(TorchDispatchMode):
    """Most token rows of any op output that reads the head weight and ends in the vocabulary: the
    logits of that many tokens existed at once."""

    def __init__(self, head_weight: torch.Tensor):
        super().__init__()
        self.storage, self.vocab, self.rows = head_weight.untyped_storage().data_ptr(), head_weight.shape[0], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads_head = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.storage
                         for t in tree_leaves((args, kwargs)))
        for t in tree_leaves(out):
            if reads_head and isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def check_fused_loss_never_builds_logits(kind: str) -> None:
    from colab_par.kernels import _dispatch
    n_tokens = batches(VOCAB, SEQ, steps=1)[0][0].numel()
    model = tiny(kind)
    apply_kernels(model, "triton")
    head_calls = []
    model.lm_head.register_forward_hook(lambda *_: head_calls.append(1))
    before = _dispatch.launches[("cross_entropy", "triton-interpreter")]
    with LargestHeadProduct(model.lm_head.weight) as probe:
        result = loss_and_grads(model, fused=True)  # the same arithmetic as shared positions
    assert head_calls == [], "the fused loss called lm_head, which builds the logits"
    assert 0 < probe.rows < n_tokens, (f"logits of {probe.rows} of {n_tokens} tokens existed at once "
                                       "(0: the probe saw no head product)")
    assert _dispatch.launches[("cross_entropy", "triton-interpreter")] > before, "the cross-entropy kernel did not run"
    assert_near_exact(kind, "shared", result)
    with LargestHeadProduct(model.lm_head.weight) as probe:  # the probe sees the logits where they are built
        loss_and_grads(model)
    assert probe.rows == n_tokens and head_calls


def check_auto_on_cpu_is_the_model_itself(kind: str) -> None:
    from colab_par.kernels import _dispatch
    model = tiny(kind)
    assert apply_kernels(model, "auto")
    before = sum(_dispatch.launches.values())
    got = loss_and_grads(model)
    assert sum(_dispatch.launches.values()) == before, "kernels='auto' launched Triton on CPU"
    reference = loss_and_grads(tiny(kind))
    assert all(torch.equal(got[k], reference[k]) for k in reference), "kernels='auto' changed the CPU arithmetic"


def check_sharded_head_is_refused() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny("llama")
        mesh = init_device_mesh("cpu", (1,))
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
        inputs, targets = batches(VOCAB, SEQ, steps=1)[0]
        with pytest.raises(ValueError, match="lm_head.weight is a DTensor"):
            hf_causal_lm_loss(model, inputs, torch.arange(SEQ), targets)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_patched_model_matches_unpatched_loss_and_gradients(interpreter, kind):
    patched = interpreter.run(check_patched_model_matches, kind)
    n_layers = LLAMA_SIZES["num_hidden_layers"]
    assert Counter(entry.split(": ")[1] for entry in patched) == {
        "rms_norm": 2 * n_layers + 1, "swiglu": n_layers, "apply_rope": n_layers}
    assert "model.layers.0.input_layernorm: rms_norm" in patched and "model.norm: rms_norm" in patched


def test_a_wrong_eps_fails_the_parity_check(interpreter):
    with pytest.raises(AssertionError, match="units of eps from exact"):
        interpreter.run(check_patched_model_matches, "llama", "wrong_eps")


def test_a_skipped_patch_fails_the_launch_check(interpreter):
    with pytest.raises(AssertionError, match="kernel launches"):
        interpreter.run(check_patched_model_matches, "llama", "skip_rope")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_loss_matches_logits_cross_entropy_without_logits(interpreter, kind):
    interpreter.run(check_fused_loss_never_builds_logits, kind)


def test_auto_on_cpu_runs_the_models_own_code(interpreter):
    interpreter.run(check_auto_on_cpu_is_the_model_itself, "llama")


def test_fused_loss_refuses_a_sharded_head(interpreter):
    interpreter.run(check_sharded_head_is_refused)


# ---------------------------------------------------------------- in this process (torch path)

@pytest.mark.parametrize("kind", ["qwen3", "mistral", "phi3"])
def test_other_families_get_every_patch(kind):
    model = tiny(kind)
    patched = Counter(entry.split(": ")[1] for entry in apply_kernels(model, "triton"))
    n_layers = LLAMA_SIZES["num_hidden_layers"]
    norms = 2 * n_layers + 1 + (2 * n_layers if kind == "qwen3" else 0)  # Qwen3's q_norm and k_norm
    assert patched == {"rms_norm": norms, "swiglu": n_layers, "apply_rope": n_layers}


def test_partial_rotary_stays_with_the_models_own_rope():
    """Phi-3 with partial_rotary_factor < 1 rotates part of each head; the kernel rotates whole heads,
    so the patched attention hands those calls back to HF."""
    import transformers
    from parity import HF_TOKENS

    def phi3() -> torch.nn.Module:
        torch.manual_seed(0)
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **LLAMA_SIZES, **HF_TOKENS, attn_implementation="sdpa", tie_word_embeddings=False, rope_parameters=rope))

    reference, model = phi3(), phi3()
    assert "model.layers.0.self_attn: apply_rope" in apply_kernels(model, "triton")
    inputs = batches(VOCAB, SEQ, steps=1)[0][0]
    expected = reference(input_ids=inputs).logits
    # the norms' and SwiGLU's torch references only reorder float32 products: a few ulps of the largest logit
    torch.testing.assert_close(model(input_ids=inputs).logits, expected, rtol=0,
                               atol=16 * EPS32 * expected.abs().max().item())


def test_modes_and_refusals():
    import transformers
    model = build_model("llama", 0)
    assert apply_kernels(model, "torch") == [] and not any("forward" in vars(m) for m in model.modules())
    first = apply_kernels(model, "triton")
    assert model.state_dict().keys() == build_model("llama", 0).state_dict().keys()
    assert apply_kernels(model, "triton") == first
    with pytest.raises(ValueError, match="already has kernels='triton'"):
        apply_kernels(model, "auto")
    with pytest.raises(ValueError, match="choose one of"):
        apply_kernels(build_model("llama", 0), "cuda")
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match="BertForMaskedLM has nothing colab_par's kernels can patch"):
        apply_kernels(bert, "triton")
    with pytest.raises(ValueError, match="BertForMaskedLM is not one of"):
        hf_causal_lm_loss(bert, torch.zeros(1, 4, dtype=torch.long), torch.arange(4), torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"positions \(8,\) must be \(seq,\)"):
        hf_causal_lm_loss(model, torch.zeros(1, 4, dtype=torch.long), torch.arange(8),
                          torch.zeros(1, 4, dtype=torch.long))


class VocabProductDtypes(TorchDispatchMode):
    """The dtypes of the matrix products whose output ends in the vocabulary (head logits, and here
    also the MLP's intermediate, which autocast runs in bf16 anyway)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.dtypes = vocab, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default) \
                and out.shape[-1] == self.vocab:
            self.dtypes.add(out.dtype)
        return out


def test_fused_loss_under_bf16_autocast_runs_the_head_in_bf16():
    """Under autocast lm_head runs in bfloat16; the fused loss scores the same bfloat16 operands."""
    from colab_par.kernels import fused_linear_cross_entropy
    model = build_model("llama", 0)
    inputs, targets = batches(VOCAB, SEQ, steps=1)[0]
    positions = torch.arange(SEQ)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = causal_lm_logits(model, inputs, positions)
        with VocabProductDtypes(VOCAB) as probe:
            fused = hf_causal_lm_loss(model, inputs, positions, targets)
        hidden = model.base_model(input_ids=inputs, position_ids=positions.expand(len(inputs), -1),
                                  use_cache=False).last_hidden_state
    assert probe.dtypes == {torch.bfloat16}, f"head products ran in {probe.dtypes}"
    bf16 = torch.bfloat16
    assert fused.item() == fused_linear_cross_entropy(hidden.to(bf16), model.lm_head.weight.to(bf16), targets).item()
    reference = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    # the two paths round the same bf16 products to bf16 independently: each logit differs by at most
    # two half-ulps (2 x 2^-8 relative), and the loss moves at most twice the largest logit shift
    assert abs(fused.item() - reference.item()) <= 2 * 2 * 2 ** -8 * logits.float().abs().max().item()
