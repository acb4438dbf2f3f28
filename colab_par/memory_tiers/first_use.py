"""What the tiers learn from forward passes: the order the first forward uses the parameters
(chunks follow it, so the step streams them in the order training touches them), and whether a
training forward ran since the last step (a step after one is a training step: the warm-up and
the step the placement measures).
"""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["FirstUse"]


class FirstUse:
    """Forward pre-hooks on `modules`: the first-use `order` of `trainable`, and the forward mark."""

    def __init__(self, modules: list[nn.Module], trainable: list[nn.Parameter]):
        self.order: list[nn.Parameter] = []
        self.forward_seen = False
        wanted = {id(p) for p in trainable}
        seen: set[int] = set()

        def used(owned: list[nn.Parameter]) -> Any:
            def hook(module: nn.Module, args: Any) -> None:
                for p in owned:
                    if id(p) not in seen:
                        seen.add(id(p))
                        self.order.append(p)
            return hook

        def mark(module: nn.Module, args: Any) -> None:
            self.forward_seen = True

        self._marks = [module.register_forward_pre_hook(mark) for module in modules]
        self._ordering = []
        for module in modules:
            for sub in module.modules():
                owned = [p for p in sub.parameters(recurse=False) if id(p) in wanted]
                if owned:
                    self._ordering.append(sub.register_forward_pre_hook(used(owned)))

    def take_forward(self) -> bool:
        """Whether a forward ran since the last call."""
        seen, self.forward_seen = self.forward_seen, False
        return seen

    def stop_ordering(self) -> None:
        """The chunks are built: the order is no longer needed."""
        for handle in self._ordering:
            handle.remove()
        self._ordering = []

    def remove(self) -> None:
        self.stop_ordering()
        for handle in self._marks:
            handle.remove()
        self._marks = []
