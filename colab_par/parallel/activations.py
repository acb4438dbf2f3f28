"""How many bytes a step's forward saves for backward: the activation memory the planner and the
Trainer's dashboard report. On CUDA the allocator's peak says this too; on CPU nothing else does."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ActivationMeter"]


class ActivationMeter:
    """Bytes of the floating-point tensors saved for backward during forward (the activation memory
    of a step), each storage once; storages of `exclude` (e.g. the parameters) are not counted.
    DTensors count their local pieces, pending functional collectives their results.

    On CUDA the allocator's peak says this too; on CPU nothing else measures it.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.bytes = 0
        self._seen: set[int] = set()
        self._exclude = {_local(t).untyped_storage().data_ptr() for t in exclude}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # runs for every tensor saved in forward: plain tensors skip the unwrapping (a no_grad
        # context costs more than the rest of this hook)
        local = tensor if type(tensor) in _PLAIN else _local(tensor)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return tensor  # a tensor subclass without storage of its own
        key = storage.data_ptr()
        if local.is_floating_point() and key and key not in self._seen and key not in self._exclude:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def measure(self) -> Iterator["ActivationMeter"]:
        self.bytes, self._seen = 0, set()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _identity):
            yield self


_PLAIN = (torch.Tensor, nn.Parameter)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor (its local piece) or a pending functional collective."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        wait = getattr(tensor, "trigger_wait", None)  # AsyncCollectiveTensor
        return wait() if wait is not None else tensor


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
