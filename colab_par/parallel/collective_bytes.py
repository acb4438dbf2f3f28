"""Count the bytes of every collective a rank issues: what communication formulas are checked by.

A TorchDispatchMode sees each c10d op (the in-place ones that ProcessGroup calls dispatch, and the
functional ones DTensor redistributions use). The payload counted is the full buffer: an
all-reduce's tensor, an all-gather's output, a reduce-scatter's input, a send's tensor. Ring
traffic per rank is (N-1)/N of that (twice for an all-reduce). Backward collectives count too: the
autograd engine runs a CPU backward on the calling thread, under the same mode.
"""
from __future__ import annotations

from typing import Any

import torch

from colab_par import compat
from colab_par.compat import tree_leaves

__all__ = ["CollectiveBytes"]

_FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor",
               "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
               "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast")


def _bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class CollectiveBytes(compat.torch_dispatch_mode()):
    """``with CollectiveBytes() as counted: ...``; then ``counted.bytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        namespace = getattr(func, "namespace", "")
        name = func.__name__.split(".")[0]
        if namespace == "c10d" and name not in ("barrier", "monitored_barrier"):
            # in-place c10d ops: (output, input) or (tensors, ...); the payload is the larger
            self.bytes += max(_bytes(args[:1]), _bytes(args[1:2]))
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            # functional ops return their output: an all-gather's is group_size × the input
            self.bytes += _bytes(args[:1]) * (args[1] if "all_gather" in name else 1)
        return func(*args, **(kwargs or {}))
