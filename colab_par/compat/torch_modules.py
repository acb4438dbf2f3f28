"""nn.Module internals: the activation-checkpoint wrapper and its parameter names, parameters swapped
for a call, (re)initialisation methods, and buffers kept out of the state dict."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from colab_par.compat.support import _missing


def checkpoint_wrapper(module: Any, **options: Any) -> Any:
    """torch's activation-checkpoint module wrapper (`torch.distributed.algorithms._checkpoint`)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap
    except ImportError:
        raise _missing("torch", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper") from None
    return wrap(module, **options)


def unwrapped_name(name: str) -> str:
    """A parameter name with the checkpoint wrapper's inserted module name taken out."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    except ImportError:
        raise _missing("torch", "checkpoint_wrapper._CHECKPOINT_PREFIX") from None
    return name.replace(_CHECKPOINT_PREFIX, "")


@contextlib.contextmanager
def swapped_parameters(module: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """`module`'s own parameters named in `replacements` replaced by those tensors (plain tensors
    with their autograd history, e.g. a DTensor's local piece) for the duration: torch's
    `functional_call` swaps through the module's call, which a wrapped forward cannot use
    (`Module._parameters`)."""
    own = getattr(module, "_parameters", None)
    if not isinstance(own, dict):
        raise _missing("torch", "nn.Module._parameters")
    saved = {name: own[name] for name in replacements}
    try:
        own.update(replacements)
        yield
    finally:
        own.update(saved)


def module_reset(module: Any) -> Callable[[], None] | None:
    """The method that (re)initialises `module`'s own parameters: `reset_parameters`, or the private
    `_reset_parameters` torch's own MultiheadAttention and Transformer keep instead; None if none."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def non_persistent_buffers(module: Any) -> set[str]:
    """Names of `module`'s own buffers registered with ``persistent=False``
    (`nn.Module._non_persistent_buffers_set`, private: no public query says which buffers stay out of
    the state dict)."""
    names = getattr(module, "_non_persistent_buffers_set", None)
    if names is None:
        raise _missing("torch", "nn.Module._non_persistent_buffers_set")
    return set(names)


def reset_ddp_reducer(ddp: Any) -> None:
    """Put DDP's reducer back to its state between steps (`Reducer._reset_state`, private, as DDP's
    own `_update_process_group` does): a backward a lost peer broke half-way leaves it expecting
    the rest of that backward, and the next one fails with "Expected to mark a variable ready only
    once"."""
    reset = getattr(getattr(ddp, "reducer", None), "_reset_state", None)
    if reset is None:
        raise _missing("torch", "DistributedDataParallel.reducer._reset_state")
    reset()
