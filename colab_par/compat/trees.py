"""Pytrees: nested tuples/lists/dicts flattened and rebuilt (`torch.utils._pytree`; torch has no public
pytree module yet)."""
from __future__ import annotations

from functools import cache
from typing import Any, Callable

from colab_par.compat.support import _missing


@cache
def _pytree() -> Any:
    try:
        from torch.utils import _pytree
    except ImportError:
        raise _missing("torch", "torch.utils._pytree") from None
    for name in ("tree_flatten", "tree_unflatten", "tree_map"):
        if not callable(getattr(_pytree, name, None)):
            raise _missing("torch", f"torch.utils._pytree.{name}")
    return _pytree


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of a nested tuple/list/dict (ModelOutputs included) and its structure
    (`torch.utils._pytree.tree_flatten`; torch has no public pytree module yet)."""
    return _pytree().tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The inverse of `tree_flatten` (`torch.utils._pytree.tree_unflatten`)."""
    return _pytree().tree_unflatten(leaves, spec)


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` with `function` applied to every leaf (`torch.utils._pytree.tree_map`)."""
    return _pytree().tree_map(function, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested tuples / lists / dicts (`torch.utils._pytree.tree_leaves`)."""
    return _pytree().tree_leaves(tree)
