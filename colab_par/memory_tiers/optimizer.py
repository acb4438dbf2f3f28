"""`TieredAdamW`: torch's AdamW over chunks of state placed across device, host and disk.

The optimizer a layout with memory tiers trains with. It is a `torch.optim.Optimizer` (param_groups,
LR schedulers, zero_grad and torch's state_dict format per parameter work as with AdamW), built
from the user's Adam/AdamW settings. Its state lives in chunks (`chunks.py`) whose stores
(`stores.py`) the placement (`placement.py`) puts in a tier after measuring the first training
step. The step streams: chunk i+1 is prefetched while chunk i updates with torch's own AdamW
function (the user's foreach/fused choice, so a model whose state stays resident steps exactly
as under AdamW), then chunk i is written back and evicted. On CUDA, chunks whose moments are in
host memory or on disk step on the host; their gradients come down and parameters go up on a
side stream through pinned buffers (`transfers.py`), the next chunk's while this one updates.

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

import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from colab_par.memory_tiers.host_heap import loosen_heap, tighten_heap, trim_host_heap
from colab_par.memory_tiers import chunks as chunking
from colab_par.memory_tiers.chunks import Chunk, Slot, build_chunks, local
from colab_par.memory_tiers.host_adam import AdamWHyper, host_adamw_step
from colab_par.compat import dtensor_over, storage_holder
from colab_par.memory_tiers.param_pages import PagedParameters
from colab_par.memory_tiers.measure import PeakWindow, counted_bytes, resident_bytes
from colab_par.memory_tiers.ownership import Ownership
from colab_par.memory_tiers.placement import FAST, Measured, TierBudgetError, budget_text, place
from colab_par.memory_tiers.stores import DiskStore, MemoryStore, RunFolder, check_disk_room
from colab_par.memory_tiers.transfers import Transfers
from colab_par.layout.tier_options import MemoryTiers, format_bytes

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
        self._fused_by_compile = fused_by_compile
        self._cuda = device.type == "cuda"
        self._transfers = Transfers(device)
        self._folder: RunFolder | None = None
        self._chunks: list[Chunk] | None = None
        self._stores: list[dict[str, Any]] = []
        self._grads_tier = FAST
        pinned = tiers.grads if tiers.grads in ("disk", "host") and grads_movable else None
        self._grads_pinned = None if pinned == "host" and device.type != "cuda" else pinned
        self._placed = False
        self._training_steps = 0  # steps with a forward since the tiers were applied
        self._steps: dict[int, torch.Tensor] = {}
        self._written: set[int] = set()  # parameters whose gradient of this step is in a grads store
        self._grad_scale = 1.0  # clipping's factor for the held gradients, applied when the step reads them
        self._arrivals: dict[int, int] = defaultdict(int)  # gradients written per chunk since zero_grad
        self._slot_of: dict[int, tuple[Chunk, Slot]] = {}
        self._moving = 0
        self.last_moved = 0  # bytes read + written between tiers in the last step
        self.working = 0  # measured working memory of a step (0 until measured)
        self._measure_at = 2  # the training step whose working memory places the state
        self._loosen: weakref.finalize | None = None  # set while glibc hands freed large blocks back (_settle)
        self._forward_seen = False
        held = self._param_bytes()
        self._at_apply = resident_bytes(device)
        self.baseline = min(baseline, self._at_apply - held)
        self._fixed = self._at_apply - self.baseline
        self._params_on_disk = tiers.params == "disk"  # the layout allows it on CPU ranks under zero0 only
        if self._params_on_disk and (self._cuda or zero1_group is not None):
            raise ValueError("params@disk keeps the parameters of a CPU rank under zero0 in files; on CUDA or "
                             "under zero1 drop the params@ token")
        self._check_streaming_fits()
        self._hooks = self._record_first_use(modules) + self._grad_hooks()
        self._pages = PagedParameters(self, modules, self._params()) if self._params_on_disk else None
        self.register_state_dict_post_hook(_moments_as_dtensors)
        if self._params_on_disk:  # the parameters leave memory now, before the first step needs them all
            self._ensure_chunks()  # so in the parameters' order, not the first forward's
            self._place(measured=False)
        self._peak = PeakWindow(device)  # its own span of the process's peak (measure.py)

    # ---- construction ---------------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def _param_bytes(self) -> int:
        return sum(local(p).numel() * local(p).element_size() for p in self._params())

    def _owns(self, p: nn.Parameter) -> bool:
        """Whether this rank keeps `p`'s state: always, or under zero1 for its share."""
        return self._ownership is None or self._ownership.owns(p)

    def _check_streaming_fits(self) -> None:
        """Before training: what this rank holds now plus two streamed chunks must fit the budget,
        whatever the warm-up step will measure."""
        budget = self.tiers.budget
        if budget is None:
            return
        elements = [local(p).numel() for p in self._params() if self._owns(p)]
        chunk = min(sum(elements), max([self.chunk_bytes // 4] + elements))
        arrays = 3 + self._params_on_disk  # master, exp_avg, exp_avg_sq (+ the parameters)
        stream = 2 * arrays * 4 * chunk  # the current and the prefetched chunk
        held = self._fixed - (self._param_bytes() if self._params_on_disk else 0)  # parameters leave
        if held + stream > budget:
            raise TierBudgetError(
                f"rank {self.rank}: a budget of {format_bytes(budget)} is below what this rank holds before "
                f"training: parameters and layout buffers {held / 2 ** 20:.0f} MiB plus two streamed "
                f"chunks {stream / 2 ** 20:.0f} MiB; give at least {budget_text(held + stream)}, or "
                "shard the parameters (zero3, more dp ranks)")

    def _record_first_use(self, modules: list[nn.Module]) -> list[Any]:
        """Forward pre-hooks: the order the first forward uses the parameters (chunks follow it),
        and a mark that a training forward ran before a step (a warm-up to measure)."""
        trainable = {id(p) for p in self._params() if self._owns(p)}
        self._order: list[nn.Parameter] = []
        seen: set[int] = set()

        def used(owned: list[nn.Parameter]) -> Any:
            def hook(module: nn.Module, args: Any) -> None:
                for p in owned:
                    if id(p) not in seen:
                        seen.add(id(p))
                        self._order.append(p)
            return hook

        def mark(module: nn.Module, args: Any) -> None:
            self._forward_seen = True

        hooks = [module.register_forward_pre_hook(mark) for module in modules]
        for module in modules:
            for sub in module.modules():
                owned = [p for p in sub.parameters(recurse=False) if id(p) in trainable]
                if owned:
                    hooks.append(sub.register_forward_pre_hook(used(owned)))
        self._order_hooks = hooks[len(modules):]
        return hooks[:len(modules)]

    def _grad_hooks(self) -> list[Any]:
        """Where gradients may leave the fast tier: write each into its chunk as soon as it is
        complete (FSDP calls these hooks after its reduce-scatter) and free it."""
        may_move = self.tiers.grads in ("disk", "host") or (
            self.tiers.grads == "auto" and self.tiers.budget is not None and self.tiers.uses_disk)
        if not may_move or not self._grads_movable:
            return []
        me = weakref.ref(self)  # autograd holds hooks in C++, out of reach of Python's cycle collector

        def ready(p: nn.Parameter) -> None:
            optimizer = me()
            if optimizer is not None:
                optimizer._grad_ready(p)

        return [p.register_post_accumulate_grad_hook(ready) for p in self._params() if self._owns(p)]

    # ---- chunks and placement -------------------------------------------------------------------
    def _ensure_chunks(self) -> None:
        if self._chunks is not None:
            return
        groups = [[p for p in group["params"] if self._owns(p)] for group in self.param_groups]
        self._chunks = build_chunks(groups, self._order, self.chunk_bytes)
        for handle in self._order_hooks:
            handle.remove()
        self._order_hooks = []
        self._stores = [{} for _ in self._chunks]
        self._slot_of = {id(slot.param): (chunk, slot) for chunk in self._chunks for slot in chunk.slots}

    def _plan(self, working: int, pessimistic: bool) -> tuple[dict[str, str], list[dict[str, str]]]:
        grad_bytes = self._param_bytes()  # a gradient per local parameter (under zero1 DDP holds all)
        sizes = [{kind: chunk.bytes_of(kind) for kind in chunk.state_kinds()} for chunk in self._chunks]
        params_chunk = max(chunk.bytes_of("params") for chunk in self._chunks) if self._params_on_disk else 0
        return place(self.tiers, sizes, Measured(self._fixed, working, grad_bytes, params_chunk), cuda=self._cuda,
                     grads_movable=self._grads_movable, has_disk=self.tiers.uses_disk, rank=self.rank,
                     pessimistic=pessimistic)

    def _budget_binds(self, working: int) -> bool:
        """Whether, with this working memory, the budget pushes auto state off the fast tier (or
        cannot hold the step at all)."""
        try:
            grads, plan = self._plan(working, pessimistic=False)
        except TierBudgetError:
            return True
        auto_grads_out = self.tiers.grads == "auto" and self._grads_movable and grads["grads"] != FAST
        auto_state_out = self.tiers.optimizer == "auto" and any(tier != FAST for chunk in plan for tier in chunk.values())
        return auto_grads_out or auto_state_out

    def _settle(self) -> None:
        """At the measured step: place from its working memory. Where the budget binds and glibc's
        heap still keeps freed blocks resident (about half a step's working memory), hand them back
        from now on (`host_heap.tighten_heap`, undone at `release`) and measure the next step instead."""
        working = self._measured_working()
        if not self._cuda and self._loosen is None and self._budget_binds(working) and tighten_heap():
            self._loosen = weakref.finalize(self, loosen_heap)  # undone with this optimizer
            self._measure_at += 1
            return
        self.working = working
        self._place(measured=True)

    def _place(self, measured: bool) -> None:
        """Place every chunk's state: pessimistically (auto kinds in the overflow tier) before a
        step was measured, else from the measured working memory; values move with their chunks."""
        grads, plan = self._plan(self.working, pessimistic=not measured)
        self._grads_tier = grads["grads"] if self._grads_movable else FAST
        moves = []
        for chunk, tiers in zip(self._chunks, plan):
            wanted = dict(tiers)
            if self._grads_tier != FAST:
                wanted["grads"] = self._grads_tier
            if self._params_on_disk:
                wanted["params"] = "disk"
            moves.append((chunk, wanted))
        self._check_disk_room(moves)
        for chunk, wanted in moves:
            self._move(chunk, wanted)
        if self._params_on_disk and not self._placed:
            trim_host_heap()  # the parameters' old memory: glibc would keep it resident
        self._placed = True

    def _check_disk_room(self, moves: list[tuple[Chunk, dict[str, str]]]) -> None:
        """Refuse the placement before any value moves if its new disk files do not fit the folder."""
        need = sum(chunk.bytes_of(kind) for chunk, wanted in moves for kind, tier in wanted.items()
                   if tier == "disk" and getattr(self._stores[chunk.index].get(kind), "tier", None) != "disk")
        if need:
            check_disk_room(self._disk_folder(), need, self.rank)

    def _disk_folder(self) -> str:
        if self._folder is None:
            self._folder = RunFolder(self.tiers.disk_folder or "tmp", self, self.rank)
        return self._folder.path

    def _move(self, chunk: Chunk, wanted: dict[str, str]) -> None:
        """Give each kind of `chunk` a store in its wanted tier, carrying values over."""
        stores = self._stores[chunk.index]
        if "grads" in stores and "grads" not in wanted:  # gradients back to ordinary .grad tensors
            self._return_gradients(chunk, stores.pop("grads"))
        for kind, tier in wanted.items():
            old = stores.get(kind)
            if old is not None and old.tier == tier:
                continue
            new = self._new_store(chunk, kind, tier)
            if old is not None:
                new.tensor.copy_(old.tensor)
                old.close()
            elif kind in ("master", "params"):
                for slot in chunk.slots:
                    slot.of(new.tensor).copy_(local(slot.param).detach())
            if kind == "params" and old is None:
                self._rehome_parameters(chunk, new)
            new.evict(dirty=old is not None or kind in ("master", "params"))
            stores[kind] = new
        self._bind(chunk)

    def _rehome_parameters(self, chunk: Chunk, store: Any) -> None:
        """The chunk's parameters' storage becomes the store's file (`param_pages.py`); their
        memory is freed, so what this rank held at apply shrinks by their bytes."""
        for slot in chunk.slots:
            storage_holder(slot.param).data = slot.of(store.tensor)
        self._at_apply -= store.nbytes
        self._fixed -= store.nbytes

    def parameter_pages(self, param: nn.Parameter) -> tuple[int, int, Any] | None:
        """For `PagedParameters`: (chunk index, its parameter count, its parameters' disk store)."""
        found = self._slot_of.get(id(param))
        store = self._stores[found[0].index].get("params") if found else None
        return None if store is None else (found[0].index, len(found[0].slots), store)

    def _measured_working(self) -> int:
        """The peak since the last reset beyond what was resident when the tiers were applied and
        the state resident now: activations, gathered parameters, temporaries, allocator slack."""
        resident = counted_bytes(self.device, [local(p.grad) for p in self._params() if p.grad is not None]
                                 + [store.tensor for stores in self._stores for store in stores.values()
                                    if not store.tier_on_disk])
        return max(0, self._peak.bytes() - self._at_apply - resident)

    def _return_gradients(self, chunk: Chunk, store: Any) -> None:
        self._transfers.wait_host()  # gradients still coming down
        for slot in chunk.slots:
            if id(slot.param) in self._written:
                slot.param.grad = _like(slot.param, slot.of(store.tensor).to(chunk.device, copy=True))
                self._written.discard(id(slot.param))
        self._arrivals.pop(chunk.index, None)
        store.close()

    def _new_store(self, chunk: Chunk, kind: str, tier: str) -> Any:
        dtype = chunk.dtype if kind in ("grads", "params") else torch.float32
        if tier == "disk":
            store = DiskStore(self._disk_folder(), f"chunk{chunk.index}.{kind}", chunk.numel, dtype, self.rank)
        else:
            on_host = tier == "host" and self._cuda
            store = MemoryStore(chunk.numel, dtype, torch.device("cpu") if on_host else chunk.device, tier,
                                pinned=on_host)
        return store

    def _bind(self, chunk: Chunk) -> None:
        """torch's AdamW state of each parameter: plain views of the chunk's stores, where the
        stores live (a DTensor's local shape; `state_dict` wraps them, `load_state_dict` fills them)."""
        stores, device = self._stores[chunk.index], self._step_device(chunk)
        for slot in chunk.slots:
            p = slot.param
            step = self._steps.get(id(p))
            if step is None or step.device != device:
                step = torch.zeros((), dtype=torch.float32, device=device) if step is None else step.to(device)
                self._steps[id(p)] = step
            self.state[p] = {"step": step, **{kind: slot.of(stores[kind].tensor) for kind in _MOMENTS}}

    def _step_device(self, chunk: Chunk) -> torch.device:
        """Where AdamW's step counts of `chunk` live: on its device for torch's fused kernel there,
        on the host for the host step and the foreach path (as torch's AdamW keeps them)."""
        group = self.param_groups[chunk.group]
        on_device = group.get("fused") and not self._host_step(group, self._stores[chunk.index])
        return chunk.device if on_device else torch.device("cpu")

    # ---- gradients ------------------------------------------------------------------------------
    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self._placed and self.tiers.budget is not None and self._grads_movable:
            # a budget holds from the first backward: place pessimistically now (gradients leave
            # as they arrive), not at the first step, after every gradient was already resident
            self._ensure_chunks()
            self._place(measured=False)
        elif not self._placed and self._grads_tier == FAST and self._grads_pinned is not None:
            self._pin_gradients()  # pinned off the fast tier: already from the warm-up's backward
        if self._grads_tier == FAST or p.grad is None:
            return  # gradients stay ordinary tensors (for now: auto placement waits for the warm-up)
        chunk, slot = self._slot_of[id(p)]
        store = self._stores[chunk.index]["grads"]
        view, grad = slot.of(store.tensor), local(p.grad)
        if id(p) in self._written:  # gradient accumulation: a second backward adds in place, where the store is
            self._transfers.wait_host()  # the first backward's copy has landed
            if grad.device != view.device:
                grad = grad.to(view.device)
                self._moving += grad.numel() * grad.element_size()
            view.add_(grad)
        else:  # on CUDA a copy on the side stream: backward goes on meanwhile (transfers.py)
            self._transfers.copy([(view, grad)])
            self._written.add(id(p))
        p.grad = None
        self._arrivals[chunk.index] += 1
        if self._arrivals[chunk.index] % len(chunk.slots) == 0:  # every slot's gradient of this backward is in
            if store.tier_on_disk:
                self._transfers.wait_host()  # written to the file only once it has landed
            self._moving += store.evict(dirty=True)

    def _pin_gradients(self) -> None:
        self._ensure_chunks()
        self._grads_tier = self._grads_pinned
        for chunk in self._chunks:
            self._stores[chunk.index]["grads"] = self._new_store(chunk, "grads", self._grads_tier)

    def held_gradient_squares(self) -> dict[int, float]:
        """id(param) -> the sum of squares of this rank's piece of its gradient, where a grads store
        holds it: read a chunk at a time and dropped again, so a norm never has them all resident."""
        out: dict[int, float] = {}
        self._transfers.wait_host()
        for chunk in self._chunks or []:
            slots = [slot for slot in chunk.slots if id(slot.param) in self._written]
            if not slots:
                continue
            store = self._stores[chunk.index]["grads"]
            self._moving += store.prefetch()
            for slot in slots:  # in the gradient's own dtype, as for gradients that stayed tensors
                out[id(slot.param)] = float(torch.linalg.vector_norm(slot.of(store.tensor)).double() ** 2)
            store.evict(dirty=False)
        return out

    def scale_held_gradients(self, factor: float) -> None:
        """Clipping: the held gradients count `factor` times when the step reads them (scaling them
        in place would read and write every chunk once more)."""
        self._grad_scale *= factor

    def _grad_of(self, chunk: Chunk, slot: Slot) -> torch.Tensor | None:
        if id(slot.param) in self._written:
            held = slot.of(self._stores[chunk.index]["grads"].tensor)
            return held if self._grad_scale == 1.0 else held * self._grad_scale
        grad = slot.param.grad
        return None if grad is None else local(grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._written.clear()
        self._arrivals.clear()
        self._grad_scale = 1.0

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_chunks()
        self._transfers.wait_host()  # the gradients backward wrote out have landed
        forward_seen, self._forward_seen = self._forward_seen, False
        self._training_steps += forward_seen
        if forward_seen and self._training_steps == 1:
            self.working = self._measured_working()  # the warm-up's, reported until a step is measured
        if not self._placed:
            self._place(measured=False)
        elif forward_seen and self._training_steps == self._measure_at and self.tiers.budget is not None:
            self._settle()  # from a later step, whose peak no first-call growth inflates
        self._stream(0, prefetch=True)
        coming = self._download(self._chunks[0]) if self._chunks else None
        for chunk in self._chunks:
            staged = coming
            if chunk.index + 1 < len(self._chunks):
                self._stream(chunk.index + 1, prefetch=True)
                coming = self._download(self._chunks[chunk.index + 1])
            self._update(chunk, staged)
            self._stream(chunk.index, prefetch=False)
        self._transfers.join()  # the parameters sent up are there before the next forward
        self._moving += self._transfers.moved
        self._transfers.moved = 0
        if self._ownership is not None:
            self._ownership.share()  # zero1: every rank gets the parameters their owners updated
        if self._pages is not None:
            self._moving += self._pages.take_read()  # read in forward and backward
        self.last_moved, self._moving = self._moving, 0
        if forward_seen and self._training_steps < self._measure_at:
            self._peak.mark()  # the next step's peak is the one measured
        return loss

    def _stream(self, index: int, prefetch: bool) -> None:
        for kind, store in self._stores[index].items():
            self._moving += store.prefetch() if prefetch else store.evict(dirty=kind != "grads")

    def _download(self, chunk: Chunk) -> dict[str, Any] | None:
        """On CUDA, for a chunk the host steps: start bringing its gradients on the device and its
        float32 parameters without a master down into pinned staging (the next chunk's come down
        while the host updates this one). {"event", "params": {id: host}, "grads": {id: host}}."""
        if not self._cuda or not self._host_step(self.param_groups[chunk.group], self._stores[chunk.index]):
            return None
        pairs, params, grads = [], {}, {}
        for slot in chunk.slots:
            grad = None if id(slot.param) in self._written else slot.param.grad
            if grad is None and id(slot.param) not in self._written:
                continue
            if grad is not None:
                grad = local(grad)
                grads[id(slot.param)] = slot.of(self._transfers.staging(chunk.index, "grads", grad.dtype, chunk.numel))
                pairs.append((grads[id(slot.param)], grad))
            if not chunk.master:
                param = local(slot.param)
                params[id(slot.param)] = slot.of(self._transfers.staging(chunk.index, "params", param.dtype,
                                                                         chunk.numel))
                pairs.append((params[id(slot.param)], param))
        return {"event": self._transfers.copy(pairs), "params": params, "grads": grads}

    def _update(self, chunk: Chunk, staged: dict[str, Any] | None = None) -> None:
        group = self.param_groups[chunk.group]
        stores = self._stores[chunk.index]
        params, grads, avgs, squares, steps, back, ids = [], [], [], [], [], [], []
        for slot in chunk.slots:
            grad = self._grad_of(chunk, slot)
            if grad is None:
                continue
            target = slot.of(stores["master"].tensor) if chunk.master else local(slot.param)
            ids.append(id(slot.param))
            params.append(target)
            grads.append(grad)
            avgs.append(slot.of(stores["exp_avg"].tensor))
            squares.append(slot.of(stores["exp_avg_sq"].tensor))
            steps.append(self._steps[id(slot.param)])
            if chunk.master:
                back.append((local(slot.param), target))
        if not params:
            return
        beta1, beta2 = group["betas"]
        if self._host_step(group, stores):
            # ZeRO-Offload's split on CUDA: gradients come down (in their own dtype, widened on the
            # host), float32 parameters without a master come down too, and go back up updated,
            # through pinned staging on the side stream (`_download`, transfers.py); the moments
            # never cross. On a CPU rank every tensor is already here.
            if staged is not None:
                self._transfers.wait_host(staged["event"])
                params_here = [staged["params"].get(key, p) for key, p in zip(ids, params)]
                grads = [staged["grads"].get(key, g) for key, g in zip(ids, grads)]
            else:
                params_here = params
            host_adamw_step(params_here, [g.to(p.dtype) for g, p in zip(grads, params_here)], avgs, squares, steps,
                            AdamWHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                       weight_decay=group["weight_decay"], maximize=group.get("maximize", False)))
            self._transfers.copy([(home, here) for home, here in zip(params, params_here) if here is not home]
                                 + back)
            return
        staged = [_on(t, chunk.device) for t in params + avgs + squares] if self._cuda else None
        work = [s for s, _ in staged] if staged else params + avgs + squares
        n = len(params)
        on_device = [g.to(chunk.device, p.dtype) for g, p in zip(grads, params)]
        adamw(work[:n], on_device, work[n:2 * n], work[2 * n:], [], steps,
              foreach=group.get("foreach"), fused=group.get("fused"), amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=group.get("maximize", False))
        for on_device, home in staged or []:
            if on_device is not home:
                home.copy_(on_device)
        for working, master in back:
            working.copy_(master.to(working.device))
        # what crossed between the GPU and host memory: staged state down and back up, gradients
        # held on the host down, a host master up
        self._moving += sum(2 * _nbytes(home) for on_device, home in staged or [] if on_device is not home) + \
            sum(_nbytes(g) for g in grads if g.device != chunk.device) + \
            sum(_nbytes(master) for working, master in back if master.device != working.device)

    def _host_step(self, group: dict[str, Any], stores: dict[str, Any]) -> bool:
        """Whether this chunk steps with the fast host kernel, where the user named no AdamW
        implementation: on a CPU rank when any of its state is off the fast tier (host memory is
        the device there); on CUDA when its moments are off the device, so they are updated where
        they are, never staged to the GPU. A chunk kept resident steps with the user's own choice,
        exactly as plain AdamW. `fused` that `compile` chose (`fused_by_compile`) is no user's choice."""
        if group.get("foreach") is not None or (group.get("fused") and not self._fused_by_compile):
            return False
        if self._cuda:
            return stores["exp_avg"].tier != FAST
        return any(store.tier != FAST for store in stores.values())

    # ---- checkpoints ----------------------------------------------------------------------------
    def place_state(self) -> None:
        """Chunks placed and AdamW's state bound (zeros, step 0) without a step. torch's state-dict
        helpers otherwise create the state by a step with a zero gradient for every parameter,
        all of them resident at once."""
        self._ensure_chunks()
        if not self._placed:
            self._place(measured=False)

    def disk_stores(self) -> list[Any]:
        """The stores on the disk tier (`checkpoint_pages.py` drops their pages during DCP I/O)."""
        return [store for stores in self._stores for store in stores.values() if store.tier_on_disk]

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
                for kind in _MOMENTS:
                    if kind in values:
                        mine[kind].copy_(local(values[kind]))
                if "step" in values:
                    mine["step"].copy_(torch.as_tensor(values["step"]))
            if chunk.master:  # the model's own (loaded) parameters are the master values
                for slot in chunk.slots:
                    slot.of(self._stores[chunk.index]["master"].tensor).copy_(local(slot.param).detach())
            self._stream(chunk.index, prefetch=False)
        self._moving = 0

    # ---- reports --------------------------------------------------------------------------------
    @property
    def heap_tightened(self) -> bool:
        """Whether the budget bound at the measured step, so glibc now returns freed large blocks."""
        return self._loosen is not None and self._loosen.alive

    def placed_bytes(self) -> dict[str, dict[str, int]]:
        """tier -> {"params": bytes, "optimizer": bytes, "grads": bytes} of the state this
        optimizer's stores hold (parameters only where `params@disk` put them in a store)."""
        out = {tier: {"params": 0, "optimizer": 0, "grads": 0} for tier in ("device", "host", "disk")}
        for stores in self._stores:
            for kind, store in stores.items():
                out[store.tier][kind if kind in ("grads", "params") else "optimizer"] += store.nbytes
        return out

    def release(self) -> None:
        """Close the stores and remove the disk tier's files now (else at garbage collection / exit)."""
        for handle in self._hooks:
            handle.remove()
        if self._pages is not None:
            self._pages.remove()
        for stores in self._stores:
            for store in stores.values():
                store.close()
        self._stores = [{} for _ in self._stores]
        self.state = defaultdict(dict)
        if self._loosen is not None:
            self._loosen()
        if self._folder is not None:
            self._folder.remove()


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _moments_as_dtensors(optimizer: TieredAdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """state_dict's post-hook: each moment of a DTensor parameter as a DTensor like it over the
    store's own view, where the store lives (no copy to the mesh's device), so DCP saves what the
    stores hold and its load writes into them; other values are the stores' views as they are."""
    state = state_dict["state"]
    for index, p in enumerate(optimizer._params()):
        if isinstance(p, DTensor) and index in state:
            state[index] = {kind: dtensor_over(value, p) if kind in _MOMENTS else value
                            for kind, value in state[index].items()}
    return state_dict


def _like(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """A gradient (this rank's piece, on the parameter's device) as its parameter is: a DTensor
    of the same mesh and placements."""
    if not isinstance(param, DTensor):
        return grad
    return DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _on(tensor: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor on `device`, the tensor): a copy only where it lives elsewhere (CUDA ranks)."""
    return (tensor if tensor.device == device else tensor.to(device, non_blocking=True)), tensor

