"""What the layout rules (and the planner) need to know about a model, read from its config.

A config may be the kit's GPTConfig, a Hugging Face config or a plain mapping, each with its own
spelling of the same size; `model_sizes` reads any of them into one dict of ints.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# blocks of d_model in a packed q|k|v projection, by model_type (GPT-2's Conv1D c_attn)
PACKED_ATTENTION = {"gpt2": 3}

_SIZE_NAMES = {
    "d_model": ("d_model", "hidden_size", "n_embd", "dim"),
    "vocab_size": ("vocab_size",),
    "n_layer": ("n_layer", "num_hidden_layers", "n_layers", "num_layers"),
    "n_head": ("n_head", "num_attention_heads", "n_heads"),
    "n_kv_head": ("n_kv_head", "num_key_value_heads", "n_kv_heads"),
    "seq_len": ("seq_len", "max_position_embeddings", "block_size"),
    "ffn_hidden": ("ffn_hidden", "intermediate_size", "n_inner"),
    # a model the kit did not write (module_spec.ModuleSpec.config): its repeated blocks, and
    # whether a tensor-parallel plan exists for it
    "n_blocks": ("n_blocks",),
    "generic_model": ("generic_model",),
    "tp_plan": ("tp_plan",),
    "tied_params": ("tied_params",),  # one parameter under two names (module_spec.ModuleSpec)
    # experts per mixture-of-experts layer (the kit's GPT, Qwen-MoE, Mixtral, DeepSeek spellings)
    "n_experts": ("n_experts", "num_experts", "num_local_experts", "n_routed_experts"),
    # experts a token runs, and an expert's width where it differs from a dense layer's
    "top_k": ("top_k", "num_experts_per_tok"),
    "expert_hidden": ("moe_intermediate_size",),
}


def model_sizes(config: Any) -> dict[str, int]:
    """The sizes the rules (and the planner) need, from a GPTConfig, a Hugging Face config or a
    mapping, whatever the spelling; missing sizes are simply absent."""
    if config is None:
        return {}
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    sizes: dict[str, int] = {}
    for key, spellings in _SIZE_NAMES.items():
        for name in spellings:
            value = get(name, None)
            if value is not None:
                sizes[key] = int(value)
                break
    if "n_kv_head" not in sizes and "n_head" in sizes:
        sizes["n_kv_head"] = sizes["n_head"]
    return sizes


def has_expert_plan(model_config: Any) -> bool:
    """A Hugging Face MoE family whose experts ep can split: its config's own expert plan
    dispatches tokens to them (or a sizes mapping that says so)."""
    if isinstance(model_config, Mapping):
        return bool(model_config.get("expert_plan"))
    return "ep_dispatch_experts" in (getattr(model_config, "base_model_ep_plan", None) or {}).values()


def is_hugging_face(model_config: Any) -> bool:
    """A Hugging Face config (it names its model_type), or a sizes mapping that says it is one."""
    return bool(getattr(model_config, "model_type", None) or (isinstance(model_config, Mapping)
                                                              and model_config.get("hugging_face")))
