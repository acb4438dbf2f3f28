"""Shared helpers for parity tests: one engine-side training run and its single-process reference.

The reference trains the same initial model on the same global batches with the same optimizer,
with no parallel wrapper at all, so a layout passes only if its distributed arithmetic reproduces
plain training. Engines build their model from a rank-dependent seed on purpose: parity then also
proves that `parallelize` starts every rank from rank 0's parameters.
"""
from __future__ import annotations

import math
import os
import sys
from functools import lru_cache
from typing import Any

import cloudpickle
import torch

import any_models

# Engines cannot import this test module by name: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Ten steps: a wrong update shows in the very next loss (1e-5 relative), and on the learnable
# batches the loss falls visibly within ten (the tiny GPT's from 4.18 to 3.93).
STEPS = 10
BATCH = 4
SEED = 1234
LR = 1e-3
GPT_SIZES = dict(vocab_size=64, seq_len=16, n_layer=4, n_head=4, n_kv_head=2, d_model=32,
                 kernels="torch")
# The kit's GPT by kind; "gpt-odd-vocab" has a vocabulary no tp degree of the tests divides (as
# GPT-2's 50,257 tokens), so tensor parallel splits it unevenly.
ODD_VOCAB = 101
# The MoE GPT (tests/test_experts.py): 2 layers of 4 experts, 2 per token; "-aux" adds the
# load-balancing loss with a weight large enough that per-rank statistics would show.
MOE_SIZES = {**GPT_SIZES, "n_layer": 2, "n_experts": 4, "top_k": 2}
GPT_KINDS = {"gpt": GPT_SIZES, "gpt-odd-vocab": {**GPT_SIZES, "vocab_size": ODD_VOCAB},
             "gpt-moe": MOE_SIZES, "gpt-moe-aux": {**MOE_SIZES, "aux_loss_coef": 0.1}}
LLAMA_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, head_dim=8)
HF_TOKENS = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary


# Hugging Face decoder families that ship a tensor-parallel plan: kind -> (config, model) class names.
HF_DECODERS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM")}

# Hugging Face mixture-of-experts families (tests/test_hf_experts.py): 2 layers of 4 experts, 2 per
# token, every layer sparse; "<kind>-aux" switches the family's own load-balancing loss on with a
# weight large enough that per-rank statistics would show.
MOE_COMMON = dict(num_hidden_layers=2, num_experts_per_tok=2, router_aux_loss_coef=0.1)
HF_MOE = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       mlp_only_layers=[])),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, n_group=1,
                         topk_group=1, first_k_dense_replace=0, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, layer_types=None,
                                                           attn_implementation="eager")),
}


def hf_moe_model(kind: str) -> torch.nn.Module:
    """A tiny Hugging Face MoE model of `kind` (HF_MOE, optionally "-aux")."""
    import transformers

    family, aux = kind.removesuffix("-aux"), kind.endswith("-aux")
    config_name, model_name, sizes = HF_MOE[family]
    options = {"attn_implementation": "sdpa", **LLAMA_SIZES, **MOE_COMMON, **sizes}  # GPT-OSS: eager
    config = getattr(transformers, config_name)(**options, **HF_TOKENS, output_router_logits=aux,
                                                tie_word_embeddings=False)
    return getattr(transformers, model_name)(config)


def batches(vocab_size: int, seq_len: int, steps: int = STEPS, batch: int = BATCH) -> list[tuple]:
    """Fixed (inputs, targets) global batches: a learnable next-token pattern plus noise."""
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab_size, (batch, 1), generator=gen)
        seq = (start + 3 * torch.arange(seq_len + 1)) % vocab_size
        noise = torch.rand(seq.shape, generator=gen) < 0.2
        seq = torch.where(noise, torch.randint(0, vocab_size, seq.shape, generator=gen), seq)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


# PEFT models, kind "<base kind>+<adapter>" (tests/test_adapters.py): the base with PEFT_LAYERS
# layers, peft's adapter on its linear layers (the head too for the kit's GPT, whose plan shards it
# along the sequence under sp). Dropout 0, so parity holds step by step.
PEFT_LAYERS = 2
PEFT_TARGETS = {"gpt": ["wq", "wv", "wo", "w1", "w2", "output"], "llama": "all-linear", "gpt2": "all-linear",
                "qwen2": "all-linear"}


def peft_config(adapter: str, base_kind: str, **changes: Any) -> Any:
    """peft's config for `adapter` ("lora", "dora", "ia3", "lora_head": LoRA and the output head
    trained whole, peft's modules_to_save) on `base_kind`."""
    import peft

    targets = changes.pop("target_modules", PEFT_TARGETS[base_kind])
    if adapter == "ia3":
        feedforward = {"gpt": ["w2"], "gpt2": ["c_proj"]}.get(base_kind, ["down_proj"])
        return peft.IA3Config(target_modules=targets, feedforward_modules=feedforward, **changes)
    options = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, use_dora=adapter == "dora",
                   modules_to_save=["lm_head"] if adapter == "lora_head" else None)
    return peft.LoraConfig(**{**options, **changes})


def peft_base(base_kind: str) -> torch.nn.Module:
    """A PEFT_LAYERS-layer model of `base_kind` ("gpt", a Hugging Face family), from the generator."""
    import transformers

    if base_kind == "gpt":
        from colab_par.models import GPT, GPTConfig
        return GPT(GPTConfig(**{**GPT_SIZES, "n_layer": PEFT_LAYERS}))
    if base_kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            **{**any_models.GPT2, "n_layer": PEFT_LAYERS}, **HF_TOKENS, tie_word_embeddings=False))
    config_name, model_name = HF_DECODERS[base_kind]
    config = getattr(transformers, config_name)(**{**LLAMA_SIZES, "num_hidden_layers": PEFT_LAYERS}, **HF_TOKENS,
                                                attn_implementation="sdpa", tie_word_embeddings=False)
    return getattr(transformers, model_name)(config)


def build_model(kind: str, seed: int | None) -> torch.nn.Module:
    """The model of `kind`, seeded with `seed` first (None: from the generator as it stands)."""
    if seed is not None:
        torch.manual_seed(seed)
    if "+" in kind:
        import peft

        base_kind, adapter = kind.split("+")
        return peft.get_peft_model(peft_base(base_kind), peft_config(adapter, base_kind))
    if kind in any_models.MODELS:
        return any_models.MODELS[kind]()
    if kind in GPT_KINDS:
        from colab_par.models import GPT, GPTConfig
        return GPT(GPTConfig(**GPT_KINDS[kind]))
    if kind.removesuffix("-aux") in HF_MOE:
        return hf_moe_model(kind)
    if kind in HF_DECODERS:
        import transformers
        config_name, model_name = HF_DECODERS[kind]
        config = getattr(transformers, config_name)(**LLAMA_SIZES, **HF_TOKENS, attn_implementation="sdpa",
                                                    tie_word_embeddings=False)
        return getattr(transformers, model_name)(config)
    raise ValueError(f"unknown model kind {kind!r}; choose 'gpt' or one of {sorted(HF_DECODERS)}")


def _vocab_seq(kind: str) -> tuple[int, int]:
    kind = kind.partition("+")[0]
    if kind in GPT_KINDS:
        return GPT_KINDS[kind]["vocab_size"], GPT_KINDS[kind]["seq_len"]
    return LLAMA_SIZES["vocab_size"], LLAMA_SIZES["max_position_embeddings"]


def takes_tokens(kind: str) -> bool:
    """Language models train on (tokens, targets) pairs, passed to the kit as two arguments."""
    return kind not in any_models.MODELS or kind in any_models.TOKEN_KINDS


def training_batches(kind: str, steps: int = STEPS) -> list[Any]:
    """Global batches: (tokens, targets) pairs for language models, the kind's own otherwise."""
    if not takes_tokens(kind):
        return any_models.make_batches(kind, steps)
    if "+" in kind:  # adapters on a random base learn one repeated batch within a few steps
        return batches(*_vocab_seq(kind), 1) * steps
    return batches(*_vocab_seq(kind), steps)


# How engines build the model: "module" (built normally), "meta" (under torch.device("meta")) or
# "factory" (a zero-argument callable parallelize builds on meta). PARITY_SOURCE runs the whole
# parity suite one way; tests/test_parallel_meta.py runs a cross-section the other ways.
SOURCES = ("module", "meta", "factory")
DEFAULT_SOURCE = os.environ.get("PARITY_SOURCE", "module")


def engine_model(kind: str, source: str) -> Any:
    """The model (or factory) an engine passes to parallelize, seeded per rank on purpose: only
    rank 0's initialisation may survive."""
    import torch.distributed as dist

    if source not in SOURCES:
        raise ValueError(f"source={source!r}; choose one of {SOURCES}")
    torch.manual_seed(SEED + dist.get_rank())
    if source == "factory":
        return lambda: build_model(kind, None)
    if source == "meta":
        with torch.device("meta"):
            return build_model(kind, None)
    return build_model(kind, None)


def engine_run(layout: str, kind: str = "gpt", steps: int = STEPS, source: str = DEFAULT_SOURCE, *,
               lr: float = LR, max_norm: float = math.inf, **options: Any) -> dict[str, Any]:
    """Runs on every engine: parallelize, train `steps` steps, return losses, gradient norms and state.

    The global gradient norm is read between backward and the optimizer step (clipping at infinity
    changes nothing): Adam is blind to a uniformly scaled gradient, the norm is not. A finite
    `max_norm` clips (compare with `reference_run(..., max_norm=...)`). `options` go to
    `parallelize` (loss_fn, blocks, tp_plan).
    """
    pm = _parallelized(engine_model(kind, source), layout, lr=lr, **options)
    run = _train(pm, kind, training_batches(kind, steps), max_norm)
    return {**run, "state": pm.full_state_dict()}


def engine_run_moved(first: str, second: str, folder: str, kind: str = "gpt", steps: int = STEPS) -> dict[str, Any]:
    """`engine_run` whose training moves layouts halfway: trained under `first`, saved with
    `colab_par.save`, loaded (model and optimizer) under `second` and trained on from there."""
    from colab_par import load, save

    batches = training_batches(kind, steps)
    before = _parallelized(engine_model(kind, DEFAULT_SOURCE), first)
    done = _train(before, kind, batches[:steps // 2])
    save(before, folder)
    after = _parallelized(engine_model(kind, DEFAULT_SOURCE), second)
    load(after, folder)
    rest = _train(after, kind, batches[steps // 2:])
    return {key: done[key] + rest[key] for key in done} | {"state": after.full_state_dict()}


def _parallelized(model: Any, layout: str, *, lr: float = LR, **options: Any) -> Any:
    from colab_par import parallelize

    return parallelize(model, layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=lr), **options)


def _train(pm: Any, kind: str, batches: list[Any], max_norm: float = math.inf) -> dict[str, list[float]]:
    losses, grad_norms = [], []
    for batch in batches:
        # Language models take (tokens, targets) as two arguments; other models one batch object.
        losses.append(pm.forward_backward(*batch) if takes_tokens(kind) else pm.forward_backward(batch))
        grad_norms.append(pm.clip_grad_norm_(max_norm))
        pm.optimizer_step()
    return {"losses": losses, "grad_norms": grad_norms}


def bf16_engine_run(layout: str, **options: Any) -> dict[str, Any]:
    """`engine_run`, recording the dtype every nn.Linear's output had during training (a global
    forward hook): the proof that the matmuls ran in bf16, which close losses alone are not."""
    from torch.nn.modules.module import register_module_forward_hook

    dtypes: set[str] = set()

    def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            dtypes.add(str(output.dtype).removeprefix("torch."))

    handle = register_module_forward_hook(record)
    try:
        result = engine_run(layout, **options)
    finally:
        handle.remove()
    return {**result, "linear_dtypes": sorted(dtypes)}


# A float32 layout's losses stay within 1e-5 relative of the reference (`assert_parity`; its
# summation-order noise is ~1e-7). A run that rounds its matmuls to bfloat16 (8 significant bits)
# must end further away than any float32 layout may, or it cannot be told from one: measured on
# 2026-11-25, autocast runs (dp2 bf16, tp4 2d bf16) ended 4.9e-5 to 7.8e-5 away at worst over 20
# steps (the loss averages the rounding of 64 tokens), FSDP's bf16 parameters further.
BF16_MIN_LOSS_DIFFERENCE = 1e-5


def assert_close_to_fp32(results: list[dict], reference: dict, stray: float = 0.0) -> None:
    """bf16 compute with fp32 master weights (results of `bf16_engine_run`): every linear ran in
    bf16 on every rank, the losses differ from the fp32 reference as bf16 rounding must make them
    (`BF16_MIN_LOSS_DIFFERENCE`) yet stay within 2e-2 relative, weights within 5e-3.

    20 Adam steps at lr 1e-3 can move a weight by up to 2e-2; bf16 gradient noise flips the sign of
    a few near-zero updates (measured worst: 2.8e-3 on 2 of 2048 elements), hence 5e-3. Experts
    see a share of the tokens each, so more of their elements have near-zero gradients whose sign
    bf16 decides: a `stray` share of the elements may pass 5e-3, none the 2·lr·steps that updates
    of opposite sign at every step can reach. A missing or wrong update moves most elements.
    """
    for rank, result in enumerate(results):
        assert result["linear_dtypes"] == ["bfloat16"], (
            f"rank {rank}: linears ran in {result['linear_dtypes']}, not bf16")
    losses, expected = torch.tensor(results[0]["losses"]), torch.tensor(reference["losses"])
    torch.testing.assert_close(losses, expected, rtol=2e-2, atol=0.0)
    difference = ((losses - expected).abs() / expected.abs()).max().item()
    assert difference > BF16_MIN_LOSS_DIFFERENCE, (
        f"losses within {difference:.1e} of fp32: bf16 rounding should show (> {BF16_MIN_LOSS_DIFFERENCE})")
    flipped = 2 * LR * len(reference["losses"])
    for key, expected_state in reference["state"].items():
        got = results[0]["state"][key]
        assert got.dtype == torch.float32, "master weights must stay fp32"
        if not stray:
            torch.testing.assert_close(got, expected_state, rtol=0.0, atol=5e-3)
            continue
        apart = (got - expected_state).abs()
        beyond = int((apart > 5e-3).sum())
        assert beyond <= stray * apart.numel() and apart.max().item() <= flipped, \
            f"{key}: {beyond} of {apart.numel()} elements beyond 5e-3, max {apart.max().item():.1e}"


# Float32 unit roundoff, and how many units of its tensor's largest gradient element one element's
# gradient may move when only the summation order changes. Measured on 2026-11-23 over every parity
# test (GPT and Llama, 2 and 4 engines) under ATEN_CPU_CAPABILITY=default, avx2 and avx512: correct
# layouts needed at most 174, while the deliberately wrong runs of test_parity_bound.py needed
# 2800 and more. 1024 sits between them with a six-fold margin on the correct side.
ROUNDOFF = torch.finfo(torch.float32).eps / 2
NOISE_UNITS = 1024


@lru_cache(maxsize=None)
def reference_run(kind: str = "gpt", steps: int = STEPS, *, lr: float = LR,
                  frozen: str | None = None, grad_scale: float = 1.0, max_norm: float = math.inf) -> dict[str, Any]:
    """Single-process training of the same model and data, computed once per variant.

    Besides losses, gradient norms and the final state it returns `tolerance`: per parameter
    element, how far a correct run that differs only in float32 summation order can end up (see
    `_adam_sensitivity`). `frozen` (a parameter name) and `grad_scale` build deliberately wrong
    variants, which tests use to prove `assert_parity` rejects real errors. `max_norm` clips each
    step's gradients as `clip_grad_norm_` does (the norm reported is the one before clipping).
    """
    model = build_model(kind, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    named = _named_root(model)
    names = {id(p): name for name, p in named.state_dict(keep_vars=True).items()}
    slack = {name: torch.zeros_like(t, dtype=torch.float64) for name, t in named.state_dict().items()}
    noise: dict[str, torch.Tensor] = {}  # per element: the largest gradient noise seen so far
    losses, grad_norms = [], []
    for step, batch in enumerate(training_batches(kind, steps), start=1):
        loss = _plain_loss(kind, model, batch)
        loss.backward()
        cancelled = _cancelled_gradients(kind, model, batch)
        params = [p for p in model.parameters() if p.grad is not None]
        for p in params:
            if names[id(p)] == frozen:
                p.grad = None
            else:
                p.grad.mul_(grad_scale)
        grads = [p.grad for p in params if p.grad is not None]
        grad_norms.append(torch.linalg.vector_norm(
            torch.stack([g.norm(dtype=torch.float64) for g in grads])).item())
        if max_norm / (grad_norms[-1] + 1e-6) < 1.0:
            for g in grads:
                g.mul_(max_norm / (grad_norms[-1] + 1e-6))
        for p in params:
            if p.grad is not None:
                name = names[id(p)]
                # An exactly zero gradient had no terms to reorder (e.g. an embedding row no token
                # used); earlier noise still reaches this step through Adam's moments. A tensor
                # whose true gradient is zero (an attention key bias, to which softmax is blind)
                # holds only the rounding of terms that cancel, whose size its own values do not
                # show: Adam may turn it into up to a full step (the cap in _adam_sensitivity).
                here = torch.where(p.grad != 0, NOISE_UNITS * ROUNDOFF * p.grad.abs().max().double(), 0.0)
                if id(p) in cancelled:
                    here = torch.where(cancelled[id(p)], math.inf, here)
                noise[name] = torch.maximum(noise.get(name, here), here)
        optimizer.step()
        for p in params:
            if p.grad is not None:
                slack[names[id(p)]] += _adam_sensitivity(optimizer, p, step, noise[names[id(p)]], lr)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in named.state_dict().items()}
    # Tied parameters (an MLM head sharing the embedding) appear under several names and their
    # slack was summed under one of them. Storing a float32 parameter rounds it once per step.
    owner = {k: names[id(v)] for k, v in named.state_dict(keep_vars=True).items()}
    tolerance = {k: slack[owner[k]] + steps * ROUNDOFF * state[k].double().abs() for k in state}
    return {"losses": losses, "grad_norms": grad_norms, "state": state, "tolerance": tolerance}


def _named_root(model: torch.nn.Module) -> torch.nn.Module:
    """Whose names the state goes by: a PEFT model's inner model (the one the kit parallelizes)."""
    peft = sys.modules.get("peft")
    return model.get_base_model() if peft is not None and isinstance(model, peft.PeftModel) else model


def _plain_loss(kind: str, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss as a single-process script computes it (no kit code)."""
    import torch.nn.functional as F

    if not takes_tokens(kind):
        return any_models.plain_loss(kind, model, batch)
    x, y = batch
    if kind.partition("+")[0] in (*GPT_KINDS, "tinylm"):
        return model.loss_fn(model(x), y)
    out = model(input_ids=x, use_cache=False)
    loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(), y.reshape(-1))
    if getattr(out, "aux_loss", None) is not None:  # transformers' own balance loss, switched on
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


def _cancelled_gradients(kind: str, model: torch.nn.Module, batch: Any) -> dict[int, torch.Tensor]:
    """Per parameter id, the elements whose gradient on `batch` is zero in exact arithmetic though
    terms reach them: float64 gradients below 1e-9 of the largest one (float32 rounding alone is
    ~1e-7 relative) while float32 shows rounding there. Elements exactly zero in both had no terms
    (an unused embedding row, a dead ReLU's weights) and stay noise-free."""
    import copy

    from torch.utils._pytree import tree_map

    exact = copy.deepcopy(model).double()
    if getattr(getattr(exact, "config", None), "_experts_implementation", None):
        exact.config._experts_implementation = "eager"  # torch's _grouped_mm takes no float64
    exact.zero_grad(set_to_none=True)
    batch = tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                     batch)
    _plain_loss(kind, exact, batch).backward()
    pairs = [(p, q.grad) for p, q in zip(model.parameters(), exact.parameters()) if q.grad is not None]
    largest = max(g.abs().max().item() for _, g in pairs)
    rounded = {id(p): p.grad for p in model.parameters() if p.grad is not None}
    return {id(p): (g.abs() <= 1e-9 * largest) & (rounded[id(p)] != 0) for p, g in pairs}


def _adam_sensitivity(optimizer: torch.optim.Optimizer, param: torch.Tensor, step: int,
                      noise: torch.Tensor, lr: float) -> torch.Tensor:
    """Largest change of this step's Adam update when every gradient so far moves by `noise`
    (per element).

    The update is lr * m/d with m the bias-corrected first moment and d = sqrt(v) + eps. Moving
    every gradient by at most eta moves m by at most eta (a weighted mean) and sqrt(v) by at most
    eta (a weighted RMS), so the update moves by at most lr * (1 + |m|/d) * eta / d. Where d is
    itself at the noise level that bound is useless, and Kingma & Ba's bound on one Adam step,
    lr * max(1, (1 - beta1) / sqrt(1 - beta2)), caps the change at twice that step.
    """
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    beta1, beta2 = group["betas"]
    state = optimizer.state[param]
    denom = (state["exp_avg_sq"].double() / (1 - beta2 ** step)).sqrt() + group["eps"]
    ratio = (state["exp_avg"].double() / (1 - beta1 ** step)).abs() / denom
    step_bound = lr * max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)
    return torch.minimum(lr * (1 + ratio) * noise / denom, torch.full_like(denom, 2 * step_bound))


def assert_parity(results: list[dict[str, Any]], reference: dict[str, Any], rtol: float = 1e-5) -> None:
    """Every rank reports the same losses; they, the gradient norms and rank 0's final parameters
    match the reference.

    Losses and gradient norms agree to `rtol` relative: their float32 summation-order noise is
    ~1e-7. Each parameter element must lie within the reference's own `tolerance` for it, which
    follows from Adam's arithmetic: near-zero where the element had a real gradient, up to a few
    learning rates only where its gradient was at the rounding-noise level.
    """
    losses = [r["losses"] for r in results]
    assert all(l == losses[0] for l in losses), f"ranks disagree on the loss: {losses}"
    torch.testing.assert_close(torch.tensor(losses[0], dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64),
                               rtol=rtol, atol=0.0, msg=lambda m: f"losses: {m}")
    if "grad_norms" in results[0]:
        torch.testing.assert_close(torch.tensor(results[0]["grad_norms"], dtype=torch.float64),
                                   torch.tensor(reference["grad_norms"], dtype=torch.float64),
                                   rtol=rtol, atol=0.0, msg=lambda m: f"gradient norms: {m}")
    state = results[0]["state"]
    assert set(state) == set(reference["state"]), (
        f"keys differ: {sorted(set(state) ^ set(reference['state']))}")
    for key, expected in reference["state"].items():
        excess = (state[key].double() - expected.double()).abs() - reference["tolerance"][key]
        worst = int(excess.argmax())
        assert excess.flatten()[worst] <= 0, (
            f"{key}: element {worst} is {state[key].flatten()[worst].item():.8g}, reference "
            f"{expected.flatten()[worst].item():.8g}, beyond its Adam tolerance "
            f"{reference['tolerance'][key].flatten()[worst].item():.3g}")
    assert all(r["state"] == {} for r in results[1:]), "full_state_dict must be {} off rank 0"
