"""transformers internals: a model's tensor-parallel plan and recorded outputs, and its token losses.
transformers stays optional: nothing here imports it before a model or loss is asked for."""
from __future__ import annotations

import sys
from functools import cache
from typing import Any, Callable

from colab_par.compat.support import _missing


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
