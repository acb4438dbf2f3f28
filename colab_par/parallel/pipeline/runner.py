"""Running pipeline stages: torch's `PipelineStage`s and schedules behind one call.

`PipelineRunner` wraps a rank's stage modules (from `split_model`) in `PipelineStage`s and one of
torch's schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble V): `step(inputs, targets)` for token
batches, `step_batch(batch)` for any batch of the kit's convention, so the training loop is the
same for every layout.

colab_par's GPT cut by layers also takes a dict batch of its own forward keywords: `tokens`, per-row
`positions` and a fresh `KVCache` whose `keep` marks left padding (how generation and GRPO feed
prompts of several lengths). The positions and padding mask go to every stage as keywords, split
per microbatch by the schedule, and each stage forward gets a fresh cache of its microbatch's rows;
the batch's other keys reach the loss only, sliced with their microbatch.
"""
from __future__ import annotations

import functools
import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
from torch.nn.parallel import DistributedDataParallel

from colab_par import compat
from colab_par.compat import tree_flatten, tree_map
from colab_par.layout import Layout
from colab_par.data.batch import Batch, batch_size, batch_to, check_batch
from colab_par.models.gpt import GPT, KVCache
from colab_par.parallel.pipeline.decode import StageChain
from colab_par.parallel.pipeline.stages import TiedTensor, stage_ids, stage_owner
from colab_par.parallel.pipeline.traced import TracedInterface

__all__ = ["PipelineRunner"]

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
              "interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}
_MULTI_STAGE = ("interleaved", "zbv")


class _BusyClock:
    """Adds up compute time inside stage chunks and the wall time of a step.

    CUDA work is asynchronous, so on GPUs spans are CUDA events on the compute stream, read only
    when the step's idle share is asked for (telemetry asks once its step is read: no stall);
    on CPU they are perf_counter intervals.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        """A new step: spans go into a fresh reading; earlier readings keep theirs."""
        self.reading = _Reading()

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.reading.events.append((kind, start, end))
        else:
            started = time.perf_counter()
            yield
            self.reading.seconds[kind] += time.perf_counter() - started


class _Reading:
    """One step's busy and wall seconds; CUDA events are resolved (waited for) when first read."""

    def __init__(self) -> None:
        self.seconds = {"busy": 0.0, "wall": 0.0}
        self.events: list[tuple[str, Any, Any]] = []

    def idle_share(self) -> float:
        for kind, start, end in self.events:
            end.synchronize()
            self.seconds[kind] += start.elapsed_time(end) / 1000.0
        self.events.clear()
        wall = self.seconds["wall"]
        return max(0.0, 1.0 - self.seconds["busy"] / wall) if wall > 0 else 0.0


class _TimedStage(PipelineStage):
    """A PipelineStage that clocks its compute; the schedule waits for p2p outside these calls,
    so wall time minus this is the time the rank sat idle (the bubble plus communication)."""

    def __init__(self, *args, clock: _BusyClock, after_forward: Callable[[Any], Any] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._clock, self._after_forward = clock, after_forward

    def forward_maybe_with_nosync(self, *args, **kwargs):
        """A microbatch's forward (not torch's shape inference on a first step, which runs the
        module on placeholder inputs), passed to `after_forward`."""
        output = super().forward_maybe_with_nosync(*args, **kwargs)
        return output if self._after_forward is None else self._after_forward(output)

    def forward_one_chunk(self, *args, **kwargs):
        with self._clock.span("busy"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self._clock.span("busy"):
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self._clock.span("busy"):
            return super().backward_weight_one_chunk(*args, **kwargs)


class PipelineRunner:
    """Forward+backward of one batch through this rank's stages with the layout's schedule.

    Stages and schedule are built on the first step (and again if the batch shape changes):
    torch infers the activation shapes from that first microbatch. Gradients accumulate in the
    parts' parameters; the optimizer step is the caller's. The last stage scores its outputs with
    ``loss_fn(logits, targets)`` in `step` and ``batch_loss_fn(outputs, microbatch)`` in
    `step_batch` (`loss_fn` when no `batch_loss_fn` is given; a caller may swap `batch_loss_fn`
    between steps, as GRPO does while a rollout trains).

    `stage_losses` (the experts step's `StageExperts`, for MoE models) sees every stage forward of
    each microbatch and may attach a loss computed inside the stage (the routers' balance losses)
    to its output; those losses count in the returned loss.

    `last_bubble` is the share of the last step's wall time this rank spent outside stage compute
    (waiting on p2p or idle in the pipeline bubble). The first step after a (re)build also
    includes torch's one-off shape inference.
    """

    def __init__(self, parts: list[nn.Module], layout: Layout | str, pp_group: dist.ProcessGroup,
                 loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device | str, *,
                 batch_loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
                 stage_losses: Any = None):
        self.layout = Layout.parse(layout).validate()
        if dist.get_world_size(pp_group) != self.layout.pp:
            raise ValueError(f"the pp process group has {dist.get_world_size(pp_group)} ranks but "
                             f"layout.pp={self.layout.pp}; pass mesh['pp'].get_group()")
        self.pp_group = pp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.stage_ids = stage_ids(self.layout, self.pp_rank)
        if len(parts) != len(self.stage_ids):
            raise ValueError(f"pp rank {self.pp_rank} holds stages {self.stage_ids} but got "
                             f"{len(parts)} parts; build them with split_model(model, layout, "
                             f"{self.pp_rank})")
        self.parts = list(parts)
        self.n_stages = self.layout.pp * self.layout.virtual_stages
        self.has_first = 0 in self.stage_ids
        self.has_last = self.n_stages - 1 in self.stage_ids
        self.device = torch.device(device)
        self._loss_fn = loss_fn
        self.batch_loss_fn = batch_loss_fn or loss_fn
        self._score: Callable[[Any, torch.Tensor], torch.Tensor] = loss_fn
        self._loss_weight = 1.0
        first = self.parts[0]
        inner = first.module if isinstance(first, DistributedDataParallel) else first
        self._traced: TracedInterface | None = getattr(inner, "pipeline_io", None)
        self._gpt = isinstance(inner, GPT)
        self._padding_hooked = False
        self._ties: list[TiedTensor] = list(getattr(inner, "pipeline_ties", ()))
        self._clock = _BusyClock(self.device)
        self._stage_losses = stage_losses
        self._schedule = None
        self._built_for: tuple | None = None

    @property
    def last_bubble(self) -> float:
        """The idle share of the last step (0.0 before one ran); see `bubble_reading`."""
        return self.bubble_reading()()

    def bubble_reading(self) -> Callable[[], float]:
        """The last step's idle share, computed when called: on CUDA that waits for the step's
        events, so a caller that reads once per optimizer step calls it then."""
        return self._clock.reading.idle_share

    def tied_copies(self) -> list[list[tuple[int, nn.Parameter]]]:
        """Per tensor several stages use, this rank's copies of it with their stage ids."""
        copies: list[list[tuple[int, nn.Parameter]]] = []
        for tie in self._ties:
            mine: dict[int, tuple[int, nn.Parameter]] = {}
            for stage, part in zip(self.stage_ids, self.parts):
                for name, param in part.named_parameters(remove_duplicate=False):
                    if name in tie.names:
                        mine.setdefault(id(param), (stage, param))
            copies.append(list(mine.values()))
        return copies

    def duplicate_copies(self) -> set[int]:
        """ids of the copies a norm must skip: all but the first one on the first stage (a stage
        may hold a tensor twice, under two names), so each tensor counts once."""
        skip: set[int] = set()
        for tie, copies in zip(self._ties, self.tied_copies()):
            counted = [param for stage, param in copies if stage == tie.first_stage][:1]
            skip |= {id(param) for _, param in copies if all(param is not kept for kept in counted)}
        return skip

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """Sum each tied tensor's gradient over its copies on all stages and give every copy the
        sum, so the optimizer moves them alike (they start equal)."""
        for tie, copies in zip(self._ties, self.tied_copies()):
            total = torch.zeros(tie.shape, dtype=tie.dtype, device=self.device)
            for _, param in copies:
                if param.grad is not None:
                    total += param.grad
            dist.all_reduce(total, group=self.pp_group)
            for _, param in copies:
                param.grad = total.clone()

    def _stage_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        # Each microbatch loss carries loss_scale / n_microbatches, so the summed gradients are the
        # scaled batch-mean gradient. (torch's own scale_grads would also divide gradients that
        # earlier accumulation steps left in .grad, so it stays off.)
        return self._score(output, target) * self._loss_weight

    def _after_stage_forward(self, index: int, output: Any) -> Any:
        return self._stage_losses.after_forward(index, output, self._loss_weight)

    def _build(self) -> None:
        compat.check_stage_compute_hooks()  # _TimedStage's clock wraps them
        after = (lambda index: None) if self._stage_losses is None else (
            lambda index: functools.partial(self._after_stage_forward, index))
        stages = [_TimedStage(part, sid, self.n_stages, self.device, group=self.pp_group,
                              clock=self._clock, after_forward=after(index))
                  for index, (part, sid) in enumerate(zip(self.parts, self.stage_ids))]
        schedule_cls = _SCHEDULES[self.layout.pp_schedule]
        target = stages if self.layout.pp_schedule in _MULTI_STAGE else stages[0]
        self._schedule = schedule_cls(target, n_microbatches=self.layout.microbatches,
                                      loss_fn=self._stage_loss, scale_grads=False)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0,
             on_device: bool = False) -> float | torch.Tensor:
        """Forward + backward of this rank's dp slice; returns the batch mean loss on every pp rank
        (`on_device`: as a float64 tensor on the device, not read: the caller reads it once per
        optimizer step)."""
        if self._traced is not None:  # a traced model takes its tokens as a (tokens, targets) batch
            return self.step_batch((inputs, targets), loss_scale=loss_scale, on_device=on_device,
                                   score=lambda outputs, rows: self._loss_fn(outputs, rows[-1]))
        self._check_step(inputs.shape[0], loss_scale)
        loss = self._run(*self._token_inputs(inputs, targets, self._loss_fn), loss_scale)
        return loss if on_device else loss.item()

    def step_batch(self, batch: Batch, *, loss_scale: float = 1.0,
                   score: Callable[[Any, Batch], torch.Tensor] | None = None,
                   on_device: bool = False) -> float | torch.Tensor:
        """`step` for this rank's dp share of any batch in the kit's convention: a tuple
        ``(*inputs, target)`` or a dict (see `colab_par.data.batch`).

        The last stage scores each microbatch with ``batch_loss_fn(outputs, microbatch)``. torch's
        schedules split only a tensor target, so the target they carry is the batch's row index
        (arange), and the loss looks its microbatch up by those rows. Returns the batch mean loss
        on every pp rank (`on_device`: as in `step`).
        """
        check_batch(batch)
        self._check_step(batch_size(batch), loss_scale)
        loss = self._run(*self._batch_inputs(batch, score or self.batch_loss_fn), loss_scale)
        return loss if on_device else loss.item()

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 score: Callable[[Any, torch.Tensor], torch.Tensor]) -> float:
        """Forward only (no gradients, nothing trained): the sum over the microbatches of this
        rank's dp slice of ``score(logits, targets)``, on every pp rank."""
        if self._traced is not None:
            return self.evaluate_batch((inputs, targets), lambda outputs, rows: score(outputs, rows[-1]))
        self._check_step(inputs.shape[0], 1.0)
        return self._run_forward(*self._token_inputs(inputs, targets, score))

    def evaluate_batch(self, batch: Batch, score: Callable[[Any, Batch], torch.Tensor]) -> float:
        """`evaluate` for any batch: the sum of ``score(outputs, microbatch)`` on every pp rank."""
        check_batch(batch)
        self._check_step(batch_size(batch), 1.0)
        return self._run_forward(*self._batch_inputs(batch, score))

    def _token_inputs(self, inputs: torch.Tensor, targets: torch.Tensor,
                      score: Callable[[Any, torch.Tensor], torch.Tensor]) -> tuple:
        """(schedule key, args, kwargs, target) of a token batch; the last stage scores with `score`."""
        args = (inputs.to(self.device),) if self.has_first else ()
        target = targets.to(self.device) if self.has_last else None
        self._score = score
        return (tuple(inputs.shape), inputs.dtype, tuple(targets.shape)), args, {}, target

    def _batch_inputs(self, batch: Batch, score: Callable[[Any, Batch], torch.Tensor]) -> tuple:
        """(schedule key, args, kwargs, target) of any batch; the last stage scores with `score`."""
        size = batch_size(batch)
        batch = batch_to(batch, self.device)
        if self._traced is not None:
            args, kwargs = (), self._traced.inputs(batch, self.layout.microbatches)
        elif isinstance(batch, dict) and self._gpt and "tokens" in batch:
            args, kwargs = ((batch["tokens"],) if self.has_first else ()), self._gpt_keywords(batch)
        elif isinstance(batch, dict):  # stages cut by layers take token ids
            if set(batch) != {"input_ids", "labels"}:
                raise ValueError(f"a batch with {sorted(set(batch) - {'input_ids', 'labels'}) or 'no labels'} "
                                 "cannot cross pipeline stages cut by layers, which take token ids only; "
                                 "give {'input_ids': ..., 'labels': ...} (padding labelled -100), "
                                 "(tokens, targets), or split the model with split_points= and an example batch")
            args, kwargs = ((batch["input_ids"],) if self.has_first else ()), {}
        else:
            args, kwargs = (tuple(batch[:-1]) if self.has_first else ()), {}
        shapes = tuple((tuple(t.shape), t.dtype) for t in tree_flatten(batch)[0]
                       if isinstance(t, torch.Tensor))
        outputs = self._traced.outputs if self._traced is not None else (lambda out: out)
        self._score = lambda output, rows: score(outputs(output), _rows(batch, rows))
        target = torch.arange(size) if self.has_last else None
        return ("batch", shapes), args, kwargs, target

    def _gpt_keywords(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """What every GPT stage takes of a batch of the GPT's keywords, as tensors the schedule splits
        by rows: per-row positions, and the padding mask of a fresh cache (a stage's pre-hook makes a
        cache of each microbatch's rows from it: `_padding_cache`)."""
        tokens, positions, cache = batch["tokens"], batch.get("positions"), batch.get("cache")
        kwargs = {} if positions is None else {"positions": positions.expand(tokens.shape[0], -1)}
        if cache is None:
            return kwargs
        if not isinstance(cache, KVCache) or cache.start != 0 or cache.keep.shape != tokens.shape:
            raise ValueError("a GPT batch crosses pipeline stages with a fresh KVCache(keep) marking its padding "
                             f"(keep of the tokens' shape {tuple(tokens.shape)}, start 0), not {cache!r}")
        if not self._padding_hooked:
            for part in self.parts:
                inner = part.module if isinstance(part, DistributedDataParallel) else part
                inner.register_forward_pre_hook(_padding_cache, with_kwargs=True)
            self._padding_hooked = True
        return {**kwargs, "keep": cache.keep}

    def _check_step(self, size: int, loss_scale: float) -> None:
        n_mb = self.layout.microbatches
        if size % n_mb:
            raise ValueError(f"batch of {size} does not split into microbatches={n_mb}; "
                             f"use a per-dp-rank batch that is a multiple of {n_mb}")
        if not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale={loss_scale} must be a positive finite number "
                             "(e.g. 1/accumulation_steps)")

    def _run(self, key: tuple, args: tuple, kwargs: dict[str, Any], target: torch.Tensor | None,
             loss_scale: float) -> torch.Tensor:
        """The step's loss as a float64 tensor of one element on the device, not read."""
        self._ensure_built(key)
        self._loss_weight = loss_scale / self.layout.microbatches
        losses: list[torch.Tensor] = []
        self._clock.reset()
        if self._stage_losses is not None:
            self._stage_losses.begin()
        with self._clock.span("wall"):
            self._schedule.step(*args, target=target, losses=losses if self.has_last else None,
                                return_outputs=False, **kwargs)
        if self._stage_losses is None:
            return self._broadcast_mean_loss(losses, loss_scale)
        inside = torch.tensor(self._stage_losses.finish(), dtype=torch.float64, device=self.device)
        if self.has_last:
            inside += torch.stack([l.detach().double() for l in losses]).sum()
        dist.all_reduce(inside, group=self.pp_group)  # every stage's losses, on every pp rank
        return inside / loss_scale

    def _run_forward(self, key: tuple, args: tuple, kwargs: dict[str, Any],
                     target: torch.Tensor | None) -> float:
        """The schedule's forward-only pass (`eval`); the sum of the microbatch scores. torch's
        zero-bubble V schedule has no forward-only pass (its runtime still moves input gradients
        between the two stages of a rank), so there the stages run one microbatch at a time."""
        self._loss_weight = 1.0
        losses: list[torch.Tensor] = []
        if self.layout.pp_schedule == "zbv":
            self._forward_in_order(args, kwargs, target, losses)
        else:
            self._ensure_built(key)
            with torch.no_grad():
                self._schedule.eval(*args, target=target, losses=losses if self.has_last else None,
                                    return_outputs=False, **kwargs)
        total = torch.stack([l.detach().double() for l in losses]).sum() if self.has_last else None
        return self._broadcast_from_last(total).item()

    def _forward_in_order(self, args: tuple, kwargs: dict[str, torch.Tensor], target: torch.Tensor | None,
                          losses: list[torch.Tensor]) -> None:
        if self._traced is not None:
            raise ValueError("torch's zero-bubble V schedule has no forward-only pass, and stages traced by "
                             "pipeline() run only inside a schedule; evaluate this model under pp_schedule "
                             "'1f1b', 'gpipe' or 'interleaved'")
        chain = StageChain(self.parts, self.layout, self.pp_group, self.device)
        n_mb = self.layout.microbatches
        pieces = args[0].chunk(n_mb) if self.has_first else [None] * n_mb
        targets = target.chunk(n_mb) if self.has_last else [None] * n_mb
        keywords = [{key: value.chunk(n_mb)[index] for key, value in kwargs.items()} for index in range(n_mb)]
        with torch.no_grad():
            for piece, piece_target, keyword in zip(pieces, targets, keywords):
                output = chain(piece, lambda part, x: part(x, **keyword))
                if self.has_last:
                    losses.append(self._score(output, piece_target))

    def start_afresh(self) -> None:
        """Build the stages and schedule anew at the next step: one that failed half-way (a lost
        peer broke its p2p) leaves torch's schedule holding the losses of the microbatches it ran,
        which the next step's backward would take for its own (their graphs already freed)."""
        self._built_for = None

    def _ensure_built(self, key: tuple) -> None:
        if key != self._built_for:
            self._build()
            self._built_for = key

    def _broadcast_mean_loss(self, losses: list[torch.Tensor], loss_scale: float) -> torch.Tensor:
        loss = (torch.stack([l.detach().float() for l in losses]).sum() / loss_scale) if self.has_last else None
        return self._broadcast_from_last(loss)

    def _broadcast_from_last(self, value: torch.Tensor | None) -> torch.Tensor:
        """`value` of the rank holding the last stage, on every pp rank (a float scalar)."""
        if value is None:
            value = torch.zeros(1, dtype=torch.float64, device=self.device)
        value = value.reshape(1).to(torch.float64)
        dist.broadcast(value, group=self.pp_group, group_src=stage_owner(self.layout, self.n_stages - 1))
        return value


def _padding_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A GPT stage's forward pre-hook: the padding mask `keep` of this call's rows becomes the fresh
    `KVCache` the GPT masks left padding with (a cache cannot be split by the schedule, a mask can)."""
    if "keep" not in kwargs:
        return args, kwargs
    kwargs = dict(kwargs)
    kwargs["cache"] = KVCache(kwargs.pop("keep"))
    return args, kwargs


def _rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """The microbatch of `batch` whose row indices are `rows`: torch's schedules split the target
    into contiguous chunks, so that is a slice of every tensor."""
    start, count = int(rows[0]), rows.numel()
    return tree_map(lambda t: t[start:start + count]
                    if isinstance(t, torch.Tensor) and t.dim() else t, batch)
