"""The kit's Triton kernels inside Hugging Face decoders, patched per model instance.

Like Liger-Kernel, the model's own modules are rerouted to our kernels without editing
transformers' files; unlike a module-wide monkeypatch, only the given model changes, so an
unpatched model of the same family in the same process (a reference, a second trial) is untouched:
- RMSNorm and MLP modules get an instance ``forward`` (class, parameters and their names stay, so
  state dicts, checkpoints and tensor-parallel plans see the same model);
- attention modules get their class's own forward rebuilt over the modeling module's globals with
  ``apply_rotary_pos_emb`` overridden (``_GlobalsOverlay``): the one name that forward looks up.
Every patched call falls back to the family's own code where our kernel does not apply (DTensors,
partial rotary, ``kernels="auto"`` off CUDA). ``hf_causal_lm_loss`` scores the last hidden states
with the fused linear cross-entropy, so the (tokens x vocab) logits are never built.
"""
from __future__ import annotations

import importlib
import inspect
import types
from typing import Any, Callable

import torch
from torch import nn

from colab_par.kernels import apply_rope, fused_linear_cross_entropy, rms_norm, swiglu
from colab_par.kernels._dispatch import is_dtensor

__all__ = ["KERNEL_MODES", "apply_kernels", "hf_causal_lm_loss", "supports_kernels", "require_kernels",
           "fused_loss_mismatch", "fuse_loss_into_forward"]

KERNEL_MODES = ("torch", "triton", "auto")

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type>; each family's RMSNorm
# is Llama's (x * rsqrt(mean(x^2) + eps) * weight), its MLP silu(gate) * up, its RoPE rotate-half,
# and its *ForCausalLM logits plain lm_head(hidden) (no softcapping or scaling).
_FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3"}
_PATCHED = "_colab_par_kernels"  # attribute on the root model: (mode, list of what was patched)


def supports_kernels(model: nn.Module) -> bool:
    """True for a transformers model (a PreTrainedModel) whose config names a family whose modules
    ``apply_kernels`` knows."""
    from colab_par.models.hf import is_hf_model

    return is_hf_model(model) and getattr(model.config, "model_type", None) in _FAMILIES


def require_kernels(model: nn.Module) -> None:
    """Refuse, naming the families and the way out, a model ``apply_kernels`` cannot patch."""
    if not supports_kernels(model):
        raise ValueError(f"{type(model).__name__} has nothing colab_par's kernels can patch: apply_kernels knows "
                         f"the Hugging Face families {sorted(_FAMILIES)}; use kernels='torch' for this model")


def apply_kernels(model: nn.Module, kernels: str = "auto") -> list[str]:
    """Route a Hugging Face decoder's RMSNorm, SwiGLU MLP and RoPE to colab_par.kernels, in place.

    ``kernels``: "triton" always calls our kernels (which dispatch to compiled Triton on CUDA, the
    interpreter under TRITON_INTERPRET=1, else their torch reference); "auto" calls them for CUDA
    tensors only and the model's own code elsewhere; "torch" changes nothing. Returns
    "<module name>: <kernel>" for every patched module. Applying the same mode again is a no-op.
    """
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels={kernels!r}; choose one of {KERNEL_MODES}")
    if kernels == "torch":
        return []
    done = getattr(model, _PATCHED, None)
    if done is not None:
        if done[0] != kernels:
            raise ValueError(f"{type(model).__name__} already has kernels={done[0]!r} patched in; build a fresh "
                             f"model to use kernels={kernels!r}")
        return list(done[1])
    require_kernels(model)
    model_type = model.config.model_type
    prefix = _FAMILIES[model_type]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    norm_cls, mlp_cls, attn_cls = (getattr(modeling, prefix + suffix) for suffix in ("RMSNorm", "MLP", "Attention"))
    attention_forward = _rope_forward(attn_cls, kernels)
    patched = []
    for name, module in model.named_modules():
        if isinstance(module, norm_cls):
            module.forward = types.MethodType(_norm_forward(type(module).forward, kernels), module)
            patched.append(f"{name}: rms_norm")
        elif isinstance(module, mlp_cls) and _is_silu(_activation(module)):
            module.forward = types.MethodType(_mlp_forward(type(module).forward, kernels), module)
            patched.append(f"{name}: swiglu")
        elif isinstance(module, attn_cls) and attention_forward is not None:
            module.forward = types.MethodType(attention_forward, module)
            patched.append(f"{name}: apply_rope")
    if not patched:
        raise ValueError(f"{type(model).__name__} has no {prefix}RMSNorm, SiLU {prefix}MLP or {prefix}Attention "
                         "module colab_par's kernels can patch; use kernels='torch' for this model")
    setattr(model, _PATCHED, (kernels, tuple(patched)))
    return patched


def _wants_kernel(kernels: str, tensor: torch.Tensor) -> bool:
    """GPT's rule: "triton" always, "auto" on CUDA; DTensors keep the family's own code."""
    return (kernels == "triton" or tensor.is_cuda) and not is_dtensor(tensor)


def _norm_forward(original: Callable, kernels: str) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _wants_kernel(kernels, hidden_states) or is_dtensor(self.weight):
            return original(self, hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return forward


def _activation(mlp: nn.Module) -> Any:
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def _is_silu(activation: Any) -> bool:
    from transformers.activations import SiLUActivation
    return isinstance(activation, (nn.SiLU, SiLUActivation))


def _mlp_forward(original: Callable, kernels: str) -> Callable:
    """down(silu(gate) * up); Phi-3 computes gate and up with one fused gate_up_proj."""
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not _wants_kernel(kernels, x):
            return original(self, x)
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if is_dtensor(gate):
            return original(self, x)
        return self.down_proj(swiglu(gate, up))
    return forward


class _GlobalsOverlay(dict):
    """Globals for a rebuilt function: its own entries first, then the live module namespace.

    A dict subclass is read through ``__missing__`` by CPython's global lookup, so later changes to
    the modeling module (another library's patch) still reach the rebuilt forward.
    """

    def __init__(self, base: dict[str, Any], **overrides: Any):
        super().__init__(overrides)
        self.base = base

    def __missing__(self, name: str) -> Any:
        return self.base[name]


def _rope_forward(attention_cls: type, kernels: str) -> Callable | None:
    """The attention class's forward with its ``apply_rotary_pos_emb`` routed to our kernel, or None
    when that forward does not call a module-level ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.
    Decorators around forward (transformers 5.24 wraps it in ``deprecate_kwarg``) are kept: each is
    rebuilt around the rebuilt function it wrapped."""
    inner = inspect.unwrap(attention_cls.forward)
    original = inner.__globals__.get("apply_rotary_pos_emb")
    if ("apply_rotary_pos_emb" not in inner.__code__.co_names or not callable(original)
            or str(inspect.signature(original)) != "(q, k, cos, sin, unsqueeze_dim=1)"):
        return None

    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        rotated = _rope_heads_first(q, k, cos, sin, unsqueeze_dim) if _wants_kernel(kernels, q) else None
        return rotated if rotated is not None else original(q, k, cos, sin, unsqueeze_dim)

    return _with_rotary(attention_cls.forward, rotary)


def _with_rotary(function: Callable, rotary: Callable) -> Callable | None:
    """`function` with the module-level name ``apply_rotary_pos_emb`` resolving to `rotary`; a
    decorator's wrapper is copied with its closure pointing at the rebuilt inner function (None
    when the wrapper does not hold that function in its closure)."""
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        globals_ = _GlobalsOverlay(function.__globals__, apply_rotary_pos_emb=rotary)
        rebuilt = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__,
                                     function.__closure__)
    else:
        rebuilt_inner = _with_rotary(inner, rotary)
        cells = function.__closure__ or ()
        if rebuilt_inner is None or not any(_holds(cell, inner) for cell in cells):
            return None
        closure = tuple(types.CellType(rebuilt_inner) if _holds(cell, inner) else cell for cell in cells)
        rebuilt = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                     function.__defaults__, closure)
        rebuilt.__wrapped__ = rebuilt_inner
    rebuilt.__kwdefaults__, rebuilt.__qualname__ = function.__kwdefaults__, function.__qualname__
    return rebuilt


def _holds(cell: types.CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _rope_heads_first(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """HF's rotation through ``apply_rope``, or None where the kernel does not cover the call.

    HF passes q/k as (batch, heads, seq, head_dim) (unsqueeze_dim=1) and cos/sin as (batch or 1, seq,
    head_dim); the kernel takes (batch, seq, heads, head_dim) and one (seq, head_dim) table, so
    per-row positions are handled by folding the batch into the sequence.
    """
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or is_dtensor(cos):
        return None
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    batch, seq, _, head_dim = q.shape
    if cos.shape[-1] != head_dim or cos.shape[1] != seq or cos.shape[0] not in (1, batch):
        return None  # partial rotary (e.g. Phi-3 with partial_rotary_factor < 1) stays with HF
    if cos.shape[0] == 1:
        q_out, k_out = apply_rope(q, k, cos[0], sin[0])
    else:
        q_out, k_out = apply_rope(q.reshape(1, batch * seq, *q.shape[2:]), k.reshape(1, batch * seq, *k.shape[2:]),
                                  cos.reshape(batch * seq, head_dim), sin.reshape(batch * seq, head_dim))
        q_out, k_out = q_out.view(q.shape), k_out.view(k.shape)
    return (q_out.transpose(1, 2), k_out.transpose(1, 2)) if unsqueeze_dim == 1 else (q_out, k_out)


def hf_causal_lm_loss(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy of a Hugging Face causal LM without materialising its logits.

    Runs the base model for the last hidden states and scores them against ``lm_head.weight`` with
    ``fused_linear_cross_entropy`` (tokens (batch, seq), positions (seq,), targets (batch, seq)); equal to
    cross-entropy over ``causal_lm_logits``. Under autocast the head runs in the autocast dtype, as
    ``lm_head`` would. A sharded (DTensor) lm_head is refused: compute logits and a loss instead.
    """
    return _fused_loss(model, _fusable_head(model, "hf_causal_lm_loss"), tokens, positions, targets, ignore_index)


def _fusable_head(model: nn.Module, caller: str) -> nn.Linear:
    """The model's output head, after refusing a model whose own loss the fused one would not be
    (`caller` names who asks, in the message)."""
    name = type(model).__name__
    if not supports_kernels(model):
        raise ValueError(f"{caller}: {name} is not one of the Hugging Face families {sorted(_FAMILIES)} "
                         "whose logits are plain lm_head(hidden); use causal_lm_logits and a loss_fn")
    mismatch = fused_loss_mismatch(model)
    if mismatch is not None:
        raise ValueError(f"{caller}: {mismatch}; use causal_lm_logits and the model's own loss")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"{caller}: {name}'s output head must be an nn.Linear without bias, got {head!r}; "
                         "use causal_lm_logits and a loss_fn")
    return head


def _fused_loss(model: nn.Module, head: nn.Linear, tokens: torch.Tensor, positions: torch.Tensor,
                targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """`hf_causal_lm_loss` for a model `_fusable_head` accepted: what can change between calls is
    checked here (the head's weight sharded, the shapes)."""
    name = type(model).__name__
    if is_dtensor(head.weight):
        raise ValueError(f"hf_causal_lm_loss: {name}.lm_head.weight is a DTensor (sharded by tensor parallel or "
                         "FSDP), and the fused loss needs the whole vocabulary on this rank; use "
                         "causal_lm_logits and a loss_fn for this layout")
    if tokens.dim() != 2 or targets.shape != tokens.shape or positions.shape != tokens.shape[1:]:
        raise ValueError(f"hf_causal_lm_loss: tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} must "
                         f"both be (batch, seq) and positions {tuple(positions.shape)} must be (seq,)")
    hidden = model.base_model(input_ids=tokens, position_ids=positions.expand(tokens.shape[0], -1),
                              use_cache=False).last_hidden_state
    weight, device_type = head.weight, hidden.device.type
    if torch.is_autocast_enabled(device_type):  # lm_head's matmul would run in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return fused_linear_cross_entropy(hidden, weight, targets, ignore_index)


def fused_loss_mismatch(model: nn.Module) -> str | None:
    """Why the fused linear cross-entropy would not be this model's own loss, or None when it is:
    the model must run its family's causal-LM forward (transformers' mapping for its config, not a
    subclass's own), score with transformers' ForCausalLMLoss and scale or cap no logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    name = type(model).__name__
    try:
        family = MODEL_FOR_CAUSAL_LM_MAPPING[type(model.config)]
    except KeyError:
        return f"{name}'s config {type(model.config).__name__} has no causal-LM class in transformers"
    if type(model).forward is not family.forward:
        return f"{name} runs its own forward, not {family.__name__}'s"
    if model.loss_function is not ForCausalLMLoss:
        return f"{name} scores with {getattr(model.loss_function, '__name__', model.loss_function)}, not ForCausalLMLoss"
    changed = [key for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
               if getattr(model.config, key, None) not in (None, 1, 1.0)]
    return f"{name}'s config sets {', '.join(changed)}" if changed else None


def fuse_loss_into_forward(model: nn.Module) -> None:
    """Let ``model(input_ids=..., position_ids=..., colab_par_targets=targets)`` return the fused
    `hf_causal_lm_loss` (other calls run the model's own forward).

    Going through the model's own call keeps whatever wraps it working: DDP's gradient hooks and
    FSDP's unsharding of the root (lm_head included) run around the fused loss as around logits.
    """
    _fusable_head(model, "fuse_loss_into_forward")  # checked once here, not at every step
    model.forward = types.MethodType(_forward_with_fused_loss, model)


def _forward_with_fused_loss(self: nn.Module, *args: Any, colab_par_targets: torch.Tensor | None = None,
                             **kwargs: Any) -> Any:
    if colab_par_targets is None:
        return type(self).forward(self, *args, **kwargs)
    return _fused_loss(self, self.get_output_embeddings(), kwargs["input_ids"], kwargs["position_ids"][0],
                       colab_par_targets)
