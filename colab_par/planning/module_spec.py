"""The planner's view of a model the kit did not write: sizes from its parameters, activations and
FLOPs from one measured sample.

A decoder is described by a handful of sizes (`flops.ModelSpec`); an arbitrary `nn.Module` is
not, so `ModuleSpec.probe` runs one forward and backward of a single sample in this process and
records what the planner needs: parameters, the largest unit FSDP gathers at once (the biggest
repeated block, or the whole model when it has none), bytes saved for backward, and FLOPs counted
by torch's FlopCounterMode. Which layouts `parallelize` accepts for it follows from the same
facts (`config()` feeds layout.py's rules).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

__all__ = ["ModuleSpec"]


@dataclass(frozen=True)
class ModuleSpec:
    """Sizes of any model, per sample; see the module docstring."""

    name: str
    n_params: int
    unit_params: int  # parameters FSDP gathers at once: the largest block, or all of them
    n_blocks: int
    activation_bytes: float  # saved for backward, per sample, in the probe's dtype
    flops_per_sample: float  # forward + backward
    tensor_parallel: bool  # a tensor-parallel plan exists (the model's own or the user's)
    trainable_params: int | None = None  # parameters that train (a PEFT model's adapters); None: all
    tied_params: bool = False  # one parameter under two names (a head tied to the embeddings)

    @property
    def trainable(self) -> float:
        """The share of the parameters that train (gradients and optimizer state only for them)."""
        return 1.0 if self.trainable_params is None else self.trainable_params / self.n_params

    @classmethod
    def probe(cls, model: nn.Module, example_batch: Any, *, blocks: Sequence[type | str] | None = None,
              tp_plan: dict | None = None, loss_fn: Callable | None = None) -> "ModuleSpec":
        """Measure `model` on the first sample of `example_batch` (a batch as `parallelize` takes
        it). Gradients the probe leaves are cleared."""
        from torch.utils.flop_counter import FlopCounterMode

        from colab_par.parallel.adapters import is_peft_model
        from colab_par.data.batch import (batch_size, call_model, check_batch, default_batch_loss,
                                              slice_batch)
        from colab_par.parallel.blocks import find_blocks
        from colab_par.parallel.tensor_parallel import has_tp_plan
        from colab_par.parallel.activations import ActivationMeter

        check_batch(example_batch)
        sample = slice_batch(example_batch, batch_size(example_batch), 0)
        meter = ActivationMeter()
        with FlopCounterMode(display=False) as counter:
            with meter.measure():
                loss = (loss_fn or default_batch_loss)(call_model(model, sample), sample)
            loss.backward()
        model.zero_grad(set_to_none=True)
        found = find_blocks(model, blocks)
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        unit = max((sum(p.numel() for p in block.parameters()) for _, _, block in found), default=params)
        tied = sum(1 for _ in model.named_parameters(remove_duplicate=False)) > sum(1 for _ in model.parameters())
        return cls(name=type(model).__name__, n_params=params, unit_params=unit, n_blocks=len(found),
                   activation_bytes=float(meter.bytes), flops_per_sample=float(counter.get_total_flops()),
                   tensor_parallel=tp_plan is not None or has_tp_plan(
                       model.get_base_model() if is_peft_model(model) else model), trainable_params=trainable,
                   tied_params=tied)

    def config(self, seq_len: int = 0) -> dict[str, int]:
        """The sizes layout.py's rules read for a model of this kind."""
        return {"n_blocks": self.n_blocks, "generic_model": 1, "tp_plan": int(self.tensor_parallel),
                "tied_params": int(self.tied_params)}
