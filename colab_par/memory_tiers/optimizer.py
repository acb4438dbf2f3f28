"""`TieredAdamW`: torch's AdamW over chunks of state placed across device, host and disk.

The optimizer a layout with memory tiers trains with. It is a `torch.optim.Optimizer` (param_groups,
LR schedulers, zero_grad and torch's state_dict format per parameter work as with AdamW), built
from the user's Adam/AdamW settings. Its state lives in chunks (`chunks.py`) whose stores
(`stores.py`, by kind in `chunk_stores.py`) the placement (`placement.py`, measured in
`measured_placement.py`) puts in a tier after measuring the first training step. The step
streams: chunk i+1 is prefetched while chunk i updates (`chunk_update.py`: torch's own AdamW
function with the user's foreach/fused choice, so a model whose state stays resident steps
exactly as under AdamW), then chunk i is written back and evicted. On CUDA, chunks whose moments
are in host memory or on disk step on the host; their gradients come down and parameters go up
on a side stream through pinned buffers (`transfers.py`), the next chunk's while this one
updates. Gradients may leave the fast tier as backward completes them (`held_grads.py`).

Its `state` holds plain views of the stores, where they live (host or disk memory stays there);
`state_dict` wraps a DTensor parameter's moments as DTensors over those same views (never copied
to the mesh's device), so DCP saves what the stores hold and loads into them, and
`load_state_dict` copies each value into its store in the store's dtype.

Memory this rank may use = the budget + the process's baseline: what it held before the model
was built (interpreter, torch, libraries), the stated fixed overhead outside the budget.

Under zero1 (`zero1_group`) the optimizer still spans every parameter (param_groups, schedulers,
zero_grad as with AdamW) but keeps state, chunks and tiers for this rank's share only
(`ownership.py`), updates those and broadcasts them; its state_dict holds that share, as
ZeroRedundancyOptimizer's inner optimizer does, so DCP saves the union and reshards it.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.compat import dtensor_over
from colab_par.layout.tier_options import MemoryTiers
from colab_par.memory_tiers import chunks as chunking
from colab_par.memory_tiers.chunk_stores import ChunkStores
from colab_par.memory_tiers.chunk_update import MOMENTS, ChunkUpdater
from colab_par.memory_tiers.chunks import Chunk, Slot, local
from colab_par.memory_tiers.first_use import FirstUse
from colab_par.memory_tiers.held_grads import HeldGradients
from colab_par.memory_tiers.measured_placement import MeasuredPlacement
from colab_par.memory_tiers.ownership import Ownership
from colab_par.memory_tiers.param_pages import PagedParameters
from colab_par.memory_tiers.placement import FAST
from colab_par.memory_tiers.stores import RunFolder
from colab_par.memory_tiers.transfers import Transfers

__all__ = ["TieredAdamW", "check_optimizer"]


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, naming the way out, what the tiered step cannot reproduce exactly."""
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(f"memory tiers update the state where it lives with AdamW's arithmetic; "
                         f"{kind.__name__} is not supported: use torch.optim.AdamW (or Adam) in "
                         "optimizer_fn, or drop the tiers tokens from the layout")
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("differentiable") or group.get("capturable"):
            raise ValueError("memory tiers support AdamW without amsgrad, differentiable or capturable; "
                             "build the optimizer without them")
        if kind is torch.optim.Adam and group["weight_decay"] and not group.get("decoupled_weight_decay"):
            raise ValueError("torch Adam's weight_decay adds an L2 term to the gradient, which the tiered "
                             "AdamW step does not; use torch.optim.AdamW (decoupled decay) or weight_decay=0")


class TieredAdamW(torch.optim.Optimizer):
    """AdamW over this rank's local tensors (DDP parameters, FSDP / tensor-parallel local shards,
    pipeline stage parameters) with state in chunks across tiers; see the module docstring.
    `zero1_group`: the data-parallel group a zero1 layout partitions the state over (else None);
    `fused_by_compile`: the groups' ``fused=True`` is the `compile` option's, not the user's."""

    def __init__(self, optimizer: torch.optim.Optimizer, tiers: MemoryTiers, modules: list[nn.Module], *,
                 device: torch.device, rank: int, baseline: int, grads_movable: bool,
                 chunk_bytes: int | None = None, zero1_group: dist.ProcessGroup | None = None,
                 fused_by_compile: bool = False):
        check_optimizer(optimizer)
        groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
        super().__init__(groups, dict(optimizer.defaults))
        self.tiers, self.device, self.rank = tiers, device, rank
        self.chunk_bytes = chunk_bytes or chunking.CHUNK_BYTES
        self._ownership = None if zero1_group is None else Ownership(self._params(), zero1_group, self.chunk_bytes)
        self._grads_movable = grads_movable
        self._transfers = Transfers(device)
        self._home = ChunkStores(device, tiers.disk_folder or "tmp", rank)
        self._held = HeldGradients(self._home, self._transfers, tiers, device, grads_movable)
        self._updater = ChunkUpdater(self._home, self._held, self._transfers, fused_by_compile)
        self.last_moved = 0  # bytes read + written between tiers in the last step
        self._params_on_disk = tiers.params == "disk"  # the layout allows it on CPU ranks under zero0 only
        self._placement = MeasuredPlacement(tiers, self._home, self._held, self._params(), device=device, rank=rank,
                                            baseline=baseline, grads_movable=grads_movable,
                                            params_on_disk=self._params_on_disk)
        if self._params_on_disk and (device.type == "cuda" or zero1_group is not None):
            raise ValueError("params@disk keeps the parameters of a CPU rank under zero0 in files; on CUDA or "
                             "under zero1 drop the params@ token")
        owned = [p for p in self._params() if self._owns(p)]
        self._placement.check_streaming_fits([local(p).numel() for p in owned], self.chunk_bytes)
        self._first_use = FirstUse(modules, owned)
        self._hooks = self._grad_hooks(owned)
        self._pages = PagedParameters(self, modules, self._params()) if self._params_on_disk else None
        self.register_state_dict_post_hook(_moments_as_dtensors)
        if self._params_on_disk:  # the parameters leave memory now, before the first step needs them all
            self._ensure_chunks()  # so in the parameters' order, not the first forward's
            self._place()
        self._placement.start_measuring()

    # ---- construction ---------------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def _owns(self, p: nn.Parameter) -> bool:
        """Whether this rank keeps `p`'s state: always, or under zero1 for its share."""
        return self._ownership is None or self._ownership.owns(p)

    def _grad_hooks(self, owned: list[nn.Parameter]) -> list[Any]:
        """Where gradients may leave the fast tier: hand each to `held_grads.py` as soon as it is
        complete (FSDP calls these hooks after its reduce-scatter)."""
        may_move = self.tiers.grads in ("disk", "host") or (
            self.tiers.grads == "auto" and self.tiers.budget is not None and self.tiers.uses_disk)
        if not may_move or not self._grads_movable:
            return []
        me = weakref.ref(self)  # autograd holds hooks in C++, out of reach of Python's cycle collector

        def ready(p: nn.Parameter) -> None:
            optimizer = me()
            if optimizer is not None:
                optimizer._grad_ready(p)

        return [p.register_post_accumulate_grad_hook(ready) for p in owned]

    # ---- chunks and placement -------------------------------------------------------------------
    def _ensure_chunks(self) -> None:
        if self._home.chunks is not None:
            return
        groups = [[p for p in group["params"] if self._owns(p)] for group in self.param_groups]
        self._home.build(groups, self._first_use.order, self.chunk_bytes)
        self._first_use.stop_ordering()

    def _place(self) -> None:
        """Place pessimistically (before a step was measured) and bind AdamW's state to the stores."""
        self._placement.place(measured=False)
        self._bind_all()

    def _bind_all(self) -> None:
        for chunk in self._chunks:
            self._bind(chunk)

    def _bind(self, chunk: Chunk) -> None:
        """torch's AdamW state of `chunk`'s parameters: plain views of its stores (`chunk_update.py`)."""
        self.state.update(self._updater.state_of(self.param_groups[chunk.group], chunk))

    def _host_step(self, group: dict[str, Any], stores: dict[str, Any]) -> bool:
        """Whether a chunk with these stores steps with the fast host kernel (`ChunkUpdater.host_step`)."""
        return self._updater.host_step(group, stores)

    def parameter_pages(self, param: nn.Parameter) -> tuple[int, int, Any] | None:
        """For `PagedParameters`: (chunk index, its parameter count, its parameters' disk store)."""
        return self._home.parameter_pages(param)

    def parameters_held(self) -> contextlib.AbstractContextManager[None]:
        """Forward-only work (generation) inside keeps parameters placed on disk resident from their
        first read to the end, then drops them (`PagedParameters.held`); nothing otherwise."""
        return self._pages.held() if self._pages is not None else contextlib.nullcontext()

    def parameters_read(self) -> int:
        """Bytes the forwards have asked of the disk tier for parameters since the last step (0
        without `params@disk`): what a forward costs in paging."""
        return self._pages.read if self._pages is not None else 0

    # the chunks and their stores, as tests and the GPU check read them
    @property
    def _chunks(self) -> list[Chunk] | None:
        return self._home.chunks

    @property
    def _stores(self) -> list[dict[str, Any]]:
        return self._home.stores

    @property
    def _slot_of(self) -> dict[int, tuple[Chunk, Slot]]:
        return self._home.slot_of

    @property
    def _folder(self) -> RunFolder | None:
        return self._home.folder

    @property
    def _cuda(self) -> bool:
        """Whether the chunks are a GPU rank's (a test sets it to take the CUDA host step's path on CPU)."""
        return self._home.cuda

    @_cuda.setter
    def _cuda(self, value: bool) -> None:
        self._home.cuda = value

    # ---- gradients ------------------------------------------------------------------------------
    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        placed = self._placement.placed
        if not placed and self.tiers.budget is not None and self._grads_movable:
            # a budget holds from the first backward: place pessimistically now (gradients leave
            # as they arrive), not at the first step, after every gradient was already resident
            self._ensure_chunks()
            self._place()
        elif not placed and self._held.tier == FAST and self._held.pinned is not None:
            self._ensure_chunks()
            self._held.pin()  # pinned off the fast tier: already from the warm-up's backward
        self._held.take(p)

    def held_gradient_squares(self) -> dict[int, float]:
        """id(param) -> the sum of squares of this rank's piece of its gradient, where a grads store
        holds it: read a chunk at a time and dropped again, so a norm never has them all resident."""
        return self._held.squares()

    def scale_held_gradients(self, factor: float) -> None:
        """Clipping: the held gradients count `factor` times when the step reads them (scaling them
        in place would read and write every chunk once more)."""
        self._held.scale(factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._held.clear()

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_chunks()
        self._transfers.wait_host()  # the gradients backward wrote out have landed
        forward_seen = self._first_use.take_forward()
        if self._placement.before_step(forward_seen):
            self._bind_all()
        chunks, groups = self._chunks, self.param_groups
        self._home.stream(0, prefetch=True)
        coming = self._updater.download(groups[chunks[0].group], chunks[0]) if chunks else None
        for chunk in chunks:
            staged = coming
            if chunk.index + 1 < len(chunks):
                following = chunks[chunk.index + 1]
                self._home.stream(following.index, prefetch=True)
                coming = self._updater.download(groups[following.group], following)
            self._updater.update(groups[chunk.group], chunk, staged)
            self._home.stream(chunk.index, prefetch=False)
        self._transfers.join()  # the parameters sent up are there before the next forward
        self._home.moved += self._transfers.moved
        self._transfers.moved = 0
        if self._ownership is not None:
            self._ownership.share()  # zero1: every rank gets the parameters their owners updated
        if self._pages is not None:
            self._home.moved += self._pages.take_read()  # read in forward and backward
        self.last_moved, self._home.moved = self._home.moved, 0
        self._placement.after_step(forward_seen)
        return loss

    # ---- checkpoints ----------------------------------------------------------------------------
    def place_state(self) -> None:
        """Chunks placed and AdamW's state bound (zeros, step 0) without a step. torch's state-dict
        helpers otherwise create the state by a step with a zero gradient for every parameter,
        all of them resident at once."""
        self._ensure_chunks()
        if not self._placement.placed:
            self._place()

    def disk_stores(self) -> list[Any]:
        """The stores on the disk tier (`checkpoint_pages.py` drops their pages during DCP I/O)."""
        return self._home.disk_stores()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch AdamW's format; each value is copied into its chunk's store wherever that is
        placed, in the store's dtype, one tensor at a time. torch's param_groups handling is
        `Optimizer.load_state_dict`'s; its state handling is not: it casts every value to its
        parameter's dtype and device, so float32 moments of bf16 parameters would be rounded to
        bf16 and every moment would reach the GPU at once."""
        self.place_state()
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})  # the groups' settings, torch's checks
        indices = [index for group in state_dict["param_groups"] for index in group["params"]]
        index_of = {id(p): index for index, p in zip(indices, self._params())}
        for chunk in self._chunks:
            self._bind(chunk)
            for slot in chunk.slots:
                values, mine = saved.get(index_of[id(slot.param)], {}), self.state[slot.param]
                for kind in MOMENTS:
                    if kind in values:
                        mine[kind].copy_(local(values[kind]))
                if "step" in values:
                    mine["step"].copy_(torch.as_tensor(values["step"]))
            if chunk.master:  # the model's own (loaded) parameters are the master values
                for slot in chunk.slots:
                    slot.of(self._stores[chunk.index]["master"].tensor).copy_(local(slot.param).detach())
            self._home.stream(chunk.index, prefetch=False)
        self._home.moved = 0

    # ---- reports --------------------------------------------------------------------------------
    @property
    def working(self) -> int:
        """The measured working memory of a step (0 until measured)."""
        return self._placement.working

    @property
    def baseline(self) -> int:
        """What this rank held before the model was built: outside the budget."""
        return self._placement.baseline

    @property
    def heap_tightened(self) -> bool:
        """Whether the budget bound at the measured step, so glibc now returns freed large blocks."""
        return self._placement.heap_tightened

    def placed_bytes(self) -> dict[str, dict[str, int]]:
        """tier -> {"params": bytes, "optimizer": bytes, "grads": bytes} of the state this
        optimizer's stores hold (parameters only where `params@disk` put them in a store)."""
        return self._home.placed_bytes()

    def release(self) -> None:
        """Close the stores and remove the disk tier's files now (else at garbage collection / exit)."""
        for handle in self._hooks:
            handle.remove()
        self._first_use.remove()
        if self._pages is not None:
            self._pages.remove()
        self._home.close()
        self.state = defaultdict(dict)
        self._placement.release()


def _moments_as_dtensors(optimizer: TieredAdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """state_dict's post-hook: each moment of a DTensor parameter as a DTensor like it over the
    store's own view, where the store lives (no copy to the mesh's device), so DCP saves what the
    stores hold and its load writes into them; other values are the stores' views as they are."""
    state = state_dict["state"]
    for index, p in enumerate(optimizer._params()):
        if isinstance(p, DTensor) and index in state:
            state[index] = {kind: dtensor_over(value, p) if kind in MOMENTS else value
                            for kind, value in state[index].items()}
    return state_dict
