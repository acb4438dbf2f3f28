"""Forward passes through pipeline stages one call at a time, outside torch's schedules.

Generation cannot run inside a schedule: torch's schedules infer activation shapes once and run a
fixed number of microbatches, while a decode step changes shapes (the prompt, then one token) and
each stage keeps state between calls (the KV cache of its own layers). `StageChain` runs the stages
in order: a rank runs each stage it holds, sends the output to the rank of the next stage
(point-to-point in the pp group) and receives its input from the rank of the previous one. The
last stage's output stays on its rank. Stages sit idle while others compute, as decoding is
sequential anyway.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from colab_par.layout import Layout
from colab_par.parallel.pipeline.stages import stage_ids, stage_owner

__all__ = ["StageChain"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 8  # dtype, ndim, up to six dims


class StageChain:
    """This rank's stages of a pipeline, run in stage order by `__call__` (see module docstring)."""

    def __init__(self, parts: list[nn.Module], layout: Layout, pp_group: dist.ProcessGroup,
                 device: torch.device):
        self.pp_rank = dist.get_rank(pp_group)
        self.parts = dict(zip(stage_ids(layout, self.pp_rank), parts))
        self.n_stages = layout.pp * layout.virtual_stages
        self.owners = [stage_owner(layout, stage) for stage in range(self.n_stages)]
        self.group, self.device = pp_group, device

    @property
    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.parts

    def __call__(self, first_input: torch.Tensor | None,
                 run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """``run(stage_module, input)`` through every stage; `first_input` is the first stage's input
        (where this rank holds it). Returns the last stage's output on its rank, None elsewhere."""
        x = None
        for stage in range(self.n_stages):
            part = self.parts.get(stage)
            if part is None:
                continue
            if stage == 0:
                x = first_input
            elif self.owners[stage - 1] != self.pp_rank:
                x = self._receive(self.owners[stage - 1])
            x = run(part, x)
            if stage + 1 < self.n_stages and self.owners[stage + 1] != self.pp_rank:
                self._send(x, self.owners[stage + 1])
                x = None
        return x if self.holds_last else None

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        if tensor.dtype not in _DTYPES or tensor.dim() > _HEADER - 2:
            raise ValueError(f"a stage handed on a {tensor.dtype} tensor of {tensor.dim()} dims; stages "
                             f"pass tensors of at most {_HEADER - 2} dims in one of {_DTYPES}")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header, group=self.group, group_dst=to)
        dist.send(tensor.contiguous(), group=self.group, group_dst=to)

    def _receive(self, source: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.group, group_src=source)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.recv(tensor, group=self.group, group_src=source)
        return tensor
