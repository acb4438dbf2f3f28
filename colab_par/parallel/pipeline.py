"""Pipeline parallel: cut a model into stages and run them with torch.distributed.pipelining.

Two jobs, nothing else:
- `split_model` gives one pp rank its stage modules. A stage is a copy of the model holding only
  its own modules (the others are never copied), and every parameter keeps its original fully
  qualified name: checkpoints, parity checks and `full_state_dict` need no renaming table.
- `PipelineRunner` wraps those parts in `PipelineStage`s and one of torch's schedules (GPipe, 1F1B,
  interleaved 1F1B, zero-bubble V) behind one `step(inputs, targets)` call, so the training loop is
  the same for every layout.

Stage placement follows torch's schedules: one stage per rank for gpipe/1f1b; "loop" placement for
interleaved (rank r holds r, r+pp, r+2pp, ...); "V" placement for zbv (rank r holds r and 2pp-1-r,
so the first and the last stage share rank 0).
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

from colab_par import compat
from colab_par.layout import Layout

__all__ = ["stage_ids", "stage_owner", "split_model", "HFCausalLMStage", "PipelineRunner"]

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
              "interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}
_MULTI_STAGE = ("interleaved", "zbv")


# ---- which stages live where --------------------------------------------------------------------
def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Stage indices held by `pp_rank`, in the order torch's schedule for the layout expects."""
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{layout.pp - 1} for pp={layout.pp}")
    pp, v = layout.pp, layout.virtual_stages
    if layout.pp_schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if layout.pp_schedule == "interleaved":
        return [pp_rank + k * pp for k in range(v)]
    return [pp_rank]


def stage_owner(layout: Layout, stage: int) -> int:
    """The pp rank that holds `stage` (the inverse of `stage_ids`)."""
    for rank in range(layout.pp):
        if stage in stage_ids(layout, rank):
            return rank
    raise ValueError(f"stage {stage} does not exist; the layout has "
                     f"{layout.pp * layout.virtual_stages} stages")


def _stage_layers(stage: int, n_stages: int, n_layers: int) -> range:
    per_stage = n_layers // n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


# ---- splitting ----------------------------------------------------------------------------------
def split_model(model: nn.Module, layout: Layout | str, pp_rank: int) -> list[nn.Module]:
    """This rank's stage modules, one per stage id, each a pruned copy of `model`.

    Works for the reference `GPT` (layers in a ModuleDict) and Hugging Face ``*ForCausalLM``
    decoders with ``model.embed_tokens / model.layers / model.norm / lm_head`` (Llama family).
    The source model is left untouched; modules a stage does not own are never copied.
    """
    layout = Layout.parse(layout).validate()
    if _is_hf_causal_lm(model):
        build, n_layers = _hf_stage, len(model.model.layers)
    elif isinstance(getattr(model, "layers", None), nn.ModuleDict):
        build, n_layers = _gpt_stage, len(model.layers)
    else:
        raise TypeError(f"split_model cuts colab_par's GPT (layers in a ModuleDict) or a Hugging "
                        f"Face *ForCausalLM (model.layers and lm_head); {type(model).__name__} is "
                        "neither; use pp=1 for it")
    n_stages = layout.pp * layout.virtual_stages
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers do not split into pp·virtual_stages = {n_stages} "
                         "equal stages; choose pp·virtual_stages dividing the layer count")
    return [build(model, stage, n_stages, _stage_layers(stage, n_stages, n_layers))
            for stage in stage_ids(layout, pp_rank)]


def _pruned_copy(model: nn.Module, drop: list[nn.Module]) -> nn.Module:
    """Deep copy in which every module in `drop` becomes None: the memo makes copy.deepcopy map
    them to None instead of copying their parameters."""
    memo = {id(module): None for module in drop}
    return copy.deepcopy(model, memo)


def _gpt_stage(model: nn.Module, stage: int, n_stages: int, owned: range) -> nn.Module:
    layer_keys = list(model.layers.keys())
    drop = [model.layers[key] for i, key in enumerate(layer_keys) if i not in owned]
    if stage > 0:
        drop.append(model.tok_embeddings)
    if stage < n_stages - 1:
        drop += [model.norm, model.output]
    part = _pruned_copy(model, drop)
    for i, key in enumerate(layer_keys):
        if i not in owned:
            del part.layers[key]
    return part


def _is_hf_causal_lm(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (hasattr(model, "lm_head") and inner is not None and hasattr(inner, "layers")
            and hasattr(inner, "embed_tokens"))


def _hf_stage(model: nn.Module, stage: int, n_stages: int, owned: range) -> nn.Module:
    inner = model.model
    embed, head = inner.embed_tokens, model.lm_head
    if embed is not None and head is not None and head.weight is embed.weight:
        raise ValueError("the model ties lm_head to embed_tokens, which pipeline parallel puts on "
                         "different ranks; load it with tie_word_embeddings=False")
    drop = [layer for i, layer in enumerate(inner.layers) if i not in owned]
    if stage > 0:
        drop.append(embed)
    last = stage == n_stages - 1
    if not last:
        drop.append(inner.norm)
    inner_part = _pruned_copy(inner, drop)
    inner_part.layers = nn.ModuleDict({str(i): inner_part.layers[i] for i in owned})
    return HFCausalLMStage(inner_part, copy.deepcopy(head) if last else None,
                           compat.hf_tp_plan(model))


class HFCausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM: tokens|hidden -> hidden|logits.

    Attribute names mirror ``*ForCausalLM`` (``model.embed_tokens``, ``model.layers.<i>``,
    ``model.norm``, ``lm_head``) so parameter names equal the unsplit model's. ``model.layers`` is
    a ModuleDict keyed by the original layer index: a ModuleList would renumber a later stage's
    layers from 0. ``config`` and ``_tp_plan`` (the full model's plan; patterns naming modules
    of other stages match nothing) are kept so tensor-parallel plans apply to a stage unchanged. The forward mirrors
    ``LlamaModel.forward`` without a KV cache.
    """

    def __init__(self, model: nn.Module, lm_head: nn.Module | None,
                 tp_plan: dict[str, str] | None = None):
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        self.config = model.config
        self._tp_plan = dict(tp_plan or {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = compat.create_causal_mask(inner.config, h, position_ids)
        position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings,
                      position_ids=position_ids)
        if inner.norm is not None:
            h = inner.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


# ---- running ------------------------------------------------------------------------------------
class _BusyClock:
    """Adds up compute time inside stage chunks and the wall time of a step.

    CUDA work is asynchronous, so on GPUs spans are CUDA events on the compute stream read once
    after the step; on CPU they are perf_counter intervals.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._seconds = {"busy": 0.0, "wall": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
        else:
            started = time.perf_counter()
            yield
            self._seconds[kind] += time.perf_counter() - started

    def idle_share(self) -> float:
        if self._events:
            torch.cuda.synchronize(self.device)
            for kind, start, end in self._events:
                self._seconds[kind] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        wall = self._seconds["wall"]
        return max(0.0, 1.0 - self._seconds["busy"] / wall) if wall > 0 else 0.0


class _TimedStage(PipelineStage):
    """A PipelineStage that clocks its compute; the schedule waits for p2p outside these calls,
    so wall time minus this is the time the rank sat idle (the bubble plus communication)."""

    def __init__(self, *args, clock: _BusyClock, **kwargs):
        super().__init__(*args, **kwargs)
        self._clock = clock

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

    Stages and schedule are built on the first `step` (and again if the batch shape changes):
    torch infers the activation shapes from that first microbatch. Gradients accumulate in the
    parts' parameters; the optimizer step is the caller's.

    `last_bubble` is the share of the last step's wall time this rank spent outside stage compute
    (waiting on p2p or idle in the pipeline bubble). The first step after a (re)build also
    includes torch's one-off shape inference.
    """

    def __init__(self, parts: list[nn.Module], layout: Layout | str, pp_group: dist.ProcessGroup,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device | str):
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
        self.last_bubble = 0.0
        self._loss_fn = loss_fn
        self._loss_weight = 1.0
        self._clock = _BusyClock(self.device)
        self._schedule = None
        self._built_for: tuple | None = None

    def _stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Each microbatch loss carries loss_scale / n_microbatches, so the summed gradients are the
        # scaled batch-mean gradient. (torch's own scale_grads would also divide gradients that
        # earlier accumulation steps left in .grad, so it stays off.)
        return self._loss_fn(output, target) * self._loss_weight

    def _build(self) -> None:
        compat.check_stage_compute_hooks()  # _TimedStage's clock wraps them
        stages = [_TimedStage(part, sid, self.n_stages, self.device, group=self.pp_group,
                              clock=self._clock)
                  for part, sid in zip(self.parts, self.stage_ids)]
        schedule_cls = _SCHEDULES[self.layout.pp_schedule]
        target = stages if self.layout.pp_schedule in _MULTI_STAGE else stages[0]
        self._schedule = schedule_cls(target, n_microbatches=self.layout.microbatches,
                                      loss_fn=self._stage_loss, scale_grads=False)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0) -> float:
        """Forward + backward of this rank's dp slice; returns the batch mean loss on every pp rank."""
        n_mb = self.layout.microbatches
        if inputs.shape[0] % n_mb:
            raise ValueError(f"batch of {inputs.shape[0]} does not split into microbatches={n_mb}; "
                             f"use a per-dp-rank batch that is a multiple of {n_mb}")
        if not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale={loss_scale} must be a positive finite number "
                             "(e.g. 1/accumulation_steps)")
        key = (tuple(inputs.shape), inputs.dtype, tuple(targets.shape))
        if key != self._built_for:
            self._build()
            self._built_for = key
        self._loss_weight = loss_scale / n_mb
        args = (inputs.to(self.device),) if self.has_first else ()
        target = targets.to(self.device) if self.has_last else None
        losses: list[torch.Tensor] = []
        self._clock.reset()
        with self._clock.span("wall"):
            self._schedule.step(*args, target=target, losses=losses if self.has_last else None,
                                return_outputs=False)
        self.last_bubble = self._clock.idle_share()
        return self._broadcast_mean_loss(losses, loss_scale)

    def _broadcast_mean_loss(self, losses: list[torch.Tensor], loss_scale: float) -> float:
        if self.has_last:
            loss = (torch.stack([l.detach().float() for l in losses]).sum() / loss_scale).reshape(1)
        else:
            loss = torch.zeros(1, device=self.device)
        owner = stage_owner(self.layout, self.n_stages - 1)
        dist.broadcast(loss, group=self.pp_group, group_src=owner)
        return loss.item()
