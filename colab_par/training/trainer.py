"""The training loop: one loop for every layout, run on every engine (or in plain Python).

`Trainer` drives a `ParallelModel`: gradient accumulation, clipping through the model's own
shard-aware norm, LR warm-up + cosine, seeding per mesh role, periodic DCP checkpoints, and telemetry
rows that go to `history`, to the notebook dashboard (through `datapub` on engines) or to
terminal lines. Plotting lives in dashboard.py, measuring in telemetry.py.
"""
from __future__ import annotations

import contextlib
import csv
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from colab_par.parallel.inference import evaluation
from colab_par.training import recovery
from colab_par.compat import compile_seconds
from colab_par.training import telemetry as telem
from colab_par.data import BatchList, TokenDataset
from colab_par.data.sources import DataPlace, DataSource, data_source, dp_total
from colab_par.data.eval_rows import EvalRows
from colab_par.training.loggers import Logger, RunLogs
from colab_par.data.batch import batch_size, batch_to, check_batch
from colab_par.profiling import recorder
from colab_par.profiling.steps import ProfileSteps, StepProfiler

__all__ = ["Trainer", "WarmupCosine"]


@dataclass(frozen=True)
class WarmupCosine:
    """LR factor: linear warm-up over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.total_steps < 1 or not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"WarmupCosine({self.warmup_steps}, {self.total_steps}, {self.min_ratio}): "
                             "need warmup_steps >= 0, total_steps >= 1 and 0 <= min_ratio <= 1")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


ON_FAILURE = ("raise", "restart")
class Trainer:
    """Train `pm` on `data` for `steps` optimizer steps.

    `data` is a `TokenDataset` (its `batch_size` is the global batch of ONE micro-step, so a step
    sees `batch_size * grad_accum` sequences), for any other model a `BatchList` of global
    batches (a plain list is wrapped in one), or the user's own data: a torch Dataset,
    IterableDataset, DataLoader or Hugging Face `datasets.Dataset` with `batch_size=` the GLOBAL
    batch (a DataLoader's own batch_size is read as global), shuffled with `seed` (or the
    DataLoader's `generator`), read by the DataLoader's workers with its pinning and prefetch where
    it has them (`colab_par.data.sources`: each rank reads only its rows, the position is saved in
    checkpoints).
    `lr_schedule(step) -> factor` multiplies each param
    group's initial LR. `grad_clip` clips the global norm across all shards. `log_every` sets how
    often a telemetry row is recorded and published (with `telemetry=True` a log step also
    measures memory, activations and the grad norm). With `ckpt_dir`, a checkpoint is saved at the
    end of every `fit` and every `ckpt_every` steps.

    With `eval_data` (a `TokenDataset` with `eval_batches` global batches, a `BatchList` or a list
    of global batches, or held-out rows of the kinds `data` takes, read whole each time in global
    batches of the training batch size or the DataLoader's own, split over dp without a row read
    twice: `colab_par.data.eval_rows`) and `eval_every`, the model is evaluated every `eval_every` steps and after
    the last one (`ParallelModel.evaluate`, which changes no training state): a row with
    ``kind: "eval"``, `eval_loss`, `eval_perplexity` (language models) and the units counted
    joins `history`, the dashboard's data and checkpoints. `evaluate()` does the same on demand.

    `on_failure="restart"` (with `ckpt_dir` and `ckpt_every`): when an engine dies while the cell
    that fits this trainer runs, the kit restarts the engines and runs the cell again; its `fit`
    then resumes from the last committed checkpoint (history included), at most `max_restarts`
    times (`Cluster.execute`). `"raise"` (the default) fails the cell.

    `log_dir`: rank 0 writes TensorBoard event files there from the rows in `history` (and every
    rank's memory figures); `loggers`: more loggers of the same rows (`colab_par.training.loggers`).

    `profile_steps` (a step number, ``(first, last)`` or a `ProfileSteps`) records those steps
    with torch.profiler on every rank: trace files per rank, and on rank 0 `timeline`, the per-rank
    picture, shown in the notebook when the last of them ends (`colab_par.profiling`).
    """

    def __init__(self, pm: Any, data: Any, *, steps: int, batch_size: int | None = None,
                 lr_schedule: Callable[[int], float] | None = None, grad_clip: float | None = None,
                 grad_accum: int = 1, log_every: int = 1, ckpt_dir: str | os.PathLike | None = None,
                 ckpt_every: int | None = None, seed: int = 0, telemetry: bool = True,
                 on_failure: str = "raise", max_restarts: int = 3,
                 log_dir: str | os.PathLike | None = None, loggers: list[Logger] | None = None,
                 profile_steps: int | tuple[int, int] | ProfileSteps | None = None,
                 eval_data: Any = None, eval_every: int | None = None, eval_batches: int | None = None):
        _check_positive(steps=steps, grad_accum=grad_accum, log_every=log_every)
        if eval_data is not None:
            eval_data = evaluation.eval_data(eval_data, batch_size or getattr(data, "batch_size", None))
        _check_eval(eval_data, eval_every, eval_batches)
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure={on_failure!r} is not one of {', '.join(ON_FAILURE)}")
        if on_failure == "restart" and (ckpt_dir is None or ckpt_every is None):
            raise ValueError("on_failure='restart' resumes from the last checkpoint: pass ckpt_dir= (a "
                             "folder every rank sees) and ckpt_every= (e.g. 50 steps)")
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts!r} must be a whole number >= 0, e.g. 3")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip={grad_clip!r} must be a positive float or None (no clipping)")
        if ckpt_every is not None:
            _check_positive(ckpt_every=ckpt_every)
            if ckpt_dir is None:
                raise ValueError("ckpt_every is set but ckpt_dir is None; pass ckpt_dir='<folder>'")
        if isinstance(data, (list, tuple)):
            data = BatchList(data)
        if isinstance(data, (TokenDataset, BatchList)) and batch_size is not None:
            raise ValueError(f"batch_size= is for your own datasets; a {type(data).__name__} sets its "
                             "own batches: leave batch_size out")
        if not isinstance(data, (TokenDataset, BatchList)):
            data = data_source(data, batch_size, seed=seed)
        if isinstance(data, BatchList):
            check_batch(data.global_batch(0))
        if isinstance(data, DataSource):
            data.check(pm)
        if isinstance(eval_data, EvalRows):
            eval_data.check(pm)
        self.pm, self.data, self.steps = pm, data, steps
        self.lr_schedule, self.grad_clip, self.grad_accum = lr_schedule, grad_clip, grad_accum
        self.log_every, self.ckpt_dir, self.ckpt_every = log_every, ckpt_dir, ckpt_every
        self.seed, self.telemetry = seed, telemetry
        self.eval_data, self.eval_every, self.eval_batches = eval_data, eval_every, eval_batches
        self.on_failure, self.max_restarts = on_failure, max_restarts
        self._profile = StepProfiler(ProfileSteps.of(profile_steps)) if profile_steps is not None else None
        self.step = 0
        self.data_position = 0
        self.history: list[dict] = []
        self._logs = RunLogs.build(log_dir, loggers, dist.get_rank() if dist.is_initialized() else 0)
        self._data_place: tuple[Any, DataPlace] | None = None  # (pm, where it reads data)
        self._expert_load: tuple[Any, telem.ExpertLoad | None] | None = None  # (pm, its MoE layers' load)
        self.base_lrs = [group.get("initial_lr", group["lr"]) for group in pm.optimizer.param_groups]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        pm.rng.seed(seed)  # one stream per mesh role (parallel/rng.py)
        tokens = isinstance(data, TokenDataset)
        self._flops_per_token = telemetry_flops_per_token(pm, data.seq_len) if telemetry and tokens else 0.0
        self._measured_flops: float | None = None  # per rank and step, counted where no formula applies
        self._peak = telem.device_peak_flops(pm.device, pm.layout.precision) if telemetry else 0.0
        self._activations = telem.ActivationMeter()
        self._compile_s = 0.0  # torch.compile's seconds since the last row (layout "compile")
        if on_failure == "restart":
            self._announce_recovery()

    # ---- running --------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> list[dict]:
        """Train until step `stop_at` (default: `steps`); returns the rows recorded in this call."""
        stop_at = self.steps if stop_at is None else min(stop_at, self.steps)
        if self.on_failure == "restart" and recovery.resume_requested(self.ckpt_dir):
            self._resume()
        publisher = self._publisher()
        first = len(self.history)
        if self._logs is not None:
            self._logs.begin(self.history, self.step, torch.device(self.pm.device))
        try:
            while self.step < stop_at:
                row = self.train_step()
                if self._logs is not None:
                    self._logs.after_step(self.history, row, torch.device(self.pm.device))
                if row is not None and publisher is not None:
                    publisher.publish(self.history, force=self.step >= stop_at)
                if self._eval_due():
                    self.evaluate()
                    if publisher is not None:
                        publisher.publish(self.history, force=True)
                due = self.ckpt_every is not None and self.step % self.ckpt_every == 0
                if self.ckpt_dir is not None and (due or self.step == stop_at):
                    self.save_checkpoint()
        finally:
            if isinstance(self.data, DataSource):
                self.data.close()
            if self._logs is not None:
                self._logs.end(self.history)
            if publisher is not None:
                publisher.publish(self.history, force=True, done=True)
                self._finish_local()
        return self.history[first:]

    def train_step(self) -> dict | None:
        """One optimizer step (with `grad_accum` micro-steps); returns its row on log steps."""
        pm, log = self.pm, (self.step + 1) % self.log_every == 0 or self.step + 1 == self.steps
        measure = self.telemetry and log
        if self._profile is not None:
            self._profile.before_step(self.step + 1)
        compiled_before = compile_seconds() if pm.layout.compile else 0.0
        if measure:
            telem.mark_peak(torch.device(pm.device))  # the step's own span of the allocator's peak
        mark = recorder.open_mark(self.step + 1)  # brackets exactly what step_time measures
        clock = telem.StepClock(torch.device(pm.device), mark=recorder.is_recording())
        losses, bubbles, samples, tokens = [], [], 0, 0
        experts = self._experts()
        if experts is not None:
            experts.start_step()
        for micro in range(self.grad_accum):
            with clock.phase("data"):
                batch, counted = self._next_batch()
            meter = self._activations.measure() if measure and micro == 0 else contextlib.nullcontext()
            count = self._count_flops() if measure and micro == 0 else contextlib.nullcontext()
            options = dict(loss_scale=1.0 / self.grad_accum, sync_grads=micro == self.grad_accum - 1)
            with clock.phase("forward_backward"), meter, count:
                if isinstance(self.data, TokenDataset):  # losses stay on the device until the step is read
                    losses.append(pm.forward_backward_tensor(*batch, local=True, **options))
                else:
                    losses.append(pm.forward_backward_tensor(batch, local=isinstance(self.data, DataSource),
                                                             **options))
            if experts is not None:
                experts.add_micro_step()
            samples, tokens = (a + b for a, b in zip((samples, tokens), counted))
            bubbles.append(telem.pipeline_bubble(pm) if measure else None)
        lr = self._apply_lr()
        grad_norm = None
        if self.grad_clip is not None or measure:
            with clock.phase("clip"):
                grad_norm = pm.clip_grad_norm_tensor(self.grad_clip if self.grad_clip else math.inf)
        grads = telem.grad_bytes(pm) if measure else 0
        with clock.phase("optimizer"):
            pm.optimizer_step()
        clock.stop()
        self.step += 1
        recorder.close_mark(mark)
        if self._profile is not None:
            self._profile.after_step(self.step)
        if pm.layout.compile:
            self._compile_s += compile_seconds() - compiled_before
        if not log:
            return None  # nothing read: the host runs on ahead of the device
        losses, grad_norm = read_step(losses, grad_norm)
        step_time, phases = clock.read()  # its events are done: the read waited for the whole step
        bubbles = [None if bubble is None else bubble() for bubble in bubbles]
        if measure and isinstance(self.data, DataSource):
            tokens = dp_total(tokens, pm)  # this rank counted its own rows
        row = {"step": self.step, "rank": self.rank, "loss": sum(losses) / len(losses), "lr": lr,
               "grad_norm": grad_norm, "step_time": step_time,
               **{f"time_{name}": seconds for name, seconds in phases.items()}}
        if self._compile_s:  # the first step (and any new shape): how long of step_time compiled
            row["compile_s"], self._compile_s = self._compile_s, 0.0
        if experts is not None:
            row.update(experts.row())
        if measure:
            self._add_telemetry(row, grads, bubbles, samples, tokens)
        self.history.append(row)
        return row

    @property
    def timeline(self) -> Any:
        """The `Timeline` of the steps `profile_steps` recorded (on rank 0, once they ran), else None."""
        return self._profile.timeline if self._profile is not None else None

    def evaluate(self) -> dict:
        """Evaluate on `eval_data` now; the row (``kind: "eval"``) joins `history` and is returned."""
        if self.eval_data is None:
            raise ValueError("this Trainer has no eval_data; pass Trainer(..., eval_data=..., eval_every=k)")
        start = time.perf_counter()
        result = self.pm.evaluate(self.eval_data, self.eval_batches)
        row = {"step": self.step, "rank": self.rank, "kind": "eval", "eval_loss": result["loss"],
               **{f"eval_{key}": value for key, value in result.items() if key != "loss"},
               "eval_time": time.perf_counter() - start}
        self.history.append(row)
        return row

    def _eval_due(self) -> bool:
        """Every `eval_every` steps and after the last one."""
        return self.eval_every is not None and (self.step % self.eval_every == 0 or self.step == self.steps)

    def _next_batch(self) -> tuple[Any, tuple[int, int]]:
        """(batch, its samples and tokens, counted on the host). Token data: this rank's rows, on
        the device. Other data: the global batch (the model takes its dp share)."""
        pm = self.pm
        if isinstance(self.data, TokenDataset):
            batch = self.data.batch(self.data_position, pm.dp_rank, pm.dp_size)
        elif isinstance(self.data, DataSource):
            if self._data_place is None or self._data_place[0] is not pm:  # a relayout changes it
                self._data_place = (pm, DataPlace.of(pm))
            batch = self.data.local_batch(self.data_position, self._data_place[1])
        else:
            batch = self.data.global_batch(self.data_position)
        counted = _counts(batch, self.data)
        if not isinstance(self.data, BatchList):
            batch = batch_to(batch, pm.device)
        self.data_position += 1
        return batch, counted

    def _experts(self) -> telem.ExpertLoad | None:
        """The token counter of the model's MoE layers (None for a dense model), per model."""
        if self._expert_load is None or self._expert_load[0] is not self.pm:  # a relayout changes it
            from colab_par.parallel.experts import moe_layers

            pm = self.pm
            layers = moe_layers(pm.model_parts)
            pipeline = {}
            if pm.layout.pp > 1:  # the stage of each layer, for rows numbering the whole model's layers
                stages = [sid for part, sid in zip(pm.model_parts, pm.stage_ids) for _ in moe_layers(part)]
                pipeline = dict(stages=stages, pp_group=pm.mesh["pp"].get_group())
            self._expert_load = (pm, telem.ExpertLoad(layers, **pipeline) if layers else None)
        return self._expert_load[1]

    @contextlib.contextmanager
    def _count_flops(self) -> Any:
        """Count this rank's FLOPs of one micro-step once (torch's FlopCounterMode), for models
        with no FLOP formula; the count includes recomputation, so MFU is then hardware FLOPs."""
        if self._flops_per_token or self._measured_flops is not None:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield
        self._measured_flops = float(counter.get_total_flops()) * self.grad_accum

    def _add_telemetry(self, row: dict, grads: int, bubbles: list[float | None], samples: int,
                       tokens: int) -> None:
        started = time.perf_counter()
        world = dist.get_world_size() if dist.is_initialized() else 1
        row["samples_per_s"] = samples / row["step_time"]
        if tokens:
            row["tokens_per_s"] = tokens / row["step_time"]
        if self._flops_per_token:
            row["flops_per_s"] = self._flops_per_token * tokens / world / row["step_time"]
        else:
            row["flops_per_s"] = (self._measured_flops or 0.0) / row["step_time"]
        row["mfu"] = row["flops_per_s"] / self._peak if self._peak else None
        row["bubble"] = sum(bubbles) / len(bubbles) if None not in bubbles else None
        row.update(telem.memory_sample(self.pm, self._activations.bytes, grads))
        row["time_telemetry"] = time.perf_counter() - started

    def _apply_lr(self) -> float:
        factor = self.lr_schedule(self.step) if self.lr_schedule is not None else 1.0
        for group, base in zip(self.pm.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        return self.pm.optimizer.param_groups[0]["lr"]

    # ---- telemetry sinks ------------------------------------------------------------------------
    def _publisher(self) -> telem.Publisher | None:
        header = {"rank": self.rank, "total_steps": self.steps, "run": self._run_id(),
                  "layout": str(self.pm.layout)}
        self._local_dashboard = None
        publisher = telem.Publisher(header, local_sink=self._local_update) if self.telemetry else None
        if publisher is not None and not publisher.on_engine and self.rank == 0:
            from colab_par.views.dashboard import LiveDashboard
            self._local_dashboard = LiveDashboard()
        return publisher

    def _local_update(self, per_rank: list[dict | None]) -> None:
        if self._local_dashboard is not None:
            self._local_dashboard.update(per_rank)

    def _finish_local(self) -> None:
        if self._local_dashboard is not None:
            self._local_dashboard.finish()

    def _run_id(self) -> int:
        """Same on every rank, new for every fit, so the dashboard can tell runs apart."""
        from colab_par.training.checkpoint import shared_random_id
        return shared_random_id()

    # ---- surviving a lost engine ----------------------------------------------------------------
    def _announce_recovery(self) -> None:
        """Tell the notebook how to recover this cell if an engine dies (`Cluster.execute`)."""
        send = telem.engine_publisher()
        if send is not None:
            send({recovery.RECOVERY_KEY: {"ckpt_dir": str(self.ckpt_dir), "max_restarts": self.max_restarts}})

    def _resume(self) -> None:
        """The engines were restarted after one died: go on from the last committed checkpoint,
        or from the start when none was committed before the loss."""
        from colab_par.training.checkpoint import LATEST

        recovery.take_resume_request(self.ckpt_dir)
        if not (Path(self.ckpt_dir) / LATEST).is_file():
            print("colab_par: no checkpoint was committed before the engine was lost; training "
                  "again from step 0")
            return
        meta = self.resume()
        print(f"colab_par: resumed from the checkpoint of step {meta['step']} in {self.ckpt_dir}")

    # ---- checkpoints & history ------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike | None = None) -> None:
        from colab_par.training.checkpoint import save
        save(self.pm, path or self.ckpt_dir, trainer=self)

    def resume(self, path: str | os.PathLike | None = None) -> dict:
        """Continue from the latest checkpoint under `path` (default `ckpt_dir`): the model, the
        optimizer, the loop's state and `history` with its evaluation rows, as that checkpoint saved
        them (`checkpoint.load` alone leaves `history` as it is). Returns the checkpoint's metadata."""
        from colab_par.training.checkpoint import load, saved_history
        path = path or self.ckpt_dir
        if path is None:
            raise ValueError("no checkpoint folder: pass resume(path) or Trainer(..., ckpt_dir=...)")
        meta = load(self.pm, path, trainer=self)
        self.history = saved_history(path) or []
        return meta

    def state_dict(self) -> dict:
        """JSON-able loop state for checkpoints: where training and the data stream stand."""
        schedule = self.lr_schedule
        state = {"step": self.step, "data_position": self.data_position, "seed": self.seed,
                 "grad_accum": self.grad_accum, "base_lrs": self.base_lrs, "data": self.data.describe(),
                 "lr_schedule": asdict(schedule) if isinstance(schedule, WarmupCosine) else repr(schedule)}
        if isinstance(self.data, DataSource):
            state["data_state"] = self.data.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()` (checkpoint.load has checked that the data matches)."""
        self.step, self.data_position = int(state["step"]), int(state["data_position"])
        self.base_lrs = [float(lr) for lr in state["base_lrs"]]
        if isinstance(self.data, DataSource):
            self.data.load_state_dict(state.get("data_state", {}))

    def to_csv(self, path: str | os.PathLike) -> None:
        """Write `history` (one row per log step of this rank) as CSV."""
        columns = list(dict.fromkeys(key for row in self.history for key in row))
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.history)


def telemetry_flops_per_token(pm: Any, seq_len: int) -> float:
    """Model FLOPs per trained token of the whole (unsplit) model."""
    model = pm.model_parts[0]
    model = getattr(model, "module", model)  # DDP keeps the model under .module
    num_params = sum(p.numel() for part in pm.model_parts for p in part.parameters())
    return telem.model_flops_per_token(model, num_params, seq_len)


def read_step(losses: list[torch.Tensor], grad_norm: torch.Tensor | None) -> tuple[list[float], float | None]:
    """The Trainer's one read point of a logged step: its micro-steps' losses and the gradient
    norm (device scalars) come to the host in one copy, the loop's only wait for the device."""
    scalars = losses + ([grad_norm] if grad_norm is not None else [])
    values = torch.stack([value.reshape(()).double() for value in scalars]).tolist()
    return values[:len(losses)], values[len(losses)] if grad_norm is not None else None


def _counts(batch: Any, data: Any) -> tuple[int, int]:
    """(samples, tokens) of one global micro-batch: tokens are the token dataset's windows or the
    unmasked `input_ids` of a dict batch, 0 where there are none (throughput is then samples/s).
    A DataSource's batch is this rank's rows: its tokens are summed over dp at log steps."""
    if isinstance(data, TokenDataset):
        return data.batch_size, data.batch_size * data.seq_len
    if isinstance(data, DataSource):
        return data.batch_size, _counts(batch, None)[1]
    if isinstance(batch, dict) and "input_ids" in batch:
        mask = batch.get("attention_mask")
        return batch_size(batch), int(mask.sum()) if mask is not None else batch["input_ids"].numel()
    return batch_size(batch), 0


def _check_eval(eval_data: Any, eval_every: int | None, eval_batches: int | None) -> None:
    if eval_every is not None:
        _check_positive(eval_every=eval_every)
        if eval_data is None:
            raise ValueError("eval_every is set but eval_data is None; pass eval_data= (held-out batches)")
    if eval_data is not None:
        evaluation.check_data(eval_data, eval_batches)
        if eval_every is None:
            raise ValueError("eval_data is set but eval_every is None; pass eval_every=k to evaluate every "
                             "k steps")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
