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
from typing import Any, Callable

import torch
import torch.distributed as dist

from colab_par.parallel.inference import evaluation as evaluation_data
from colab_par.training import recovery
from colab_par.compat import compile_seconds
from colab_par.training import telemetry as telem
from colab_par.data import BatchList, TokenDataset
from colab_par.data.sources import DataPlace, DataSource, data_source, dp_total
from colab_par.data.eval_rows import EvalRows
from colab_par.data.batch import batch_size, batch_to, check_batch
from colab_par.profiling import recorder
from colab_par.profiling.steps import ProfileSteps, StepProfiler
from colab_par.training.options import Checkpoints, Evaluation, Logs, check_positive, grouped_legacy_options
from colab_par.training.checkpoint import load, save, saved_history
from colab_par.training.checkpoint_async import check_async_supported, save_async, wait_for_saves
from colab_par.training.checkpoint_background import in_flight as checkpoint_writing
from colab_par.training.live_rows import LiveRows
from colab_par.training.resilience.keeper import Keeper
from colab_par.training.resilience.comeback import announce as announce_recovery, come_back
from colab_par.training.resilience.degraded import train_on
from colab_par.training.step_measures import StepMeasures, telemetry_flops_per_token

__all__ = ["Trainer", "WarmupCosine", "Evaluation", "Checkpoints", "Logs", "telemetry_flops_per_token"]


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


class Trainer:
    """Train `pm` on `data` for `steps` optimizer steps: ``Trainer(pm, data, steps=200).fit()``.

    `data` is a `TokenDataset` (its `batch_size` is the global batch of ONE micro-step, so a step
    sees `batch_size * grad_accum` sequences), for any other model a `BatchList` of global
    batches (a plain list is wrapped in one), or the user's own data: a torch Dataset,
    IterableDataset, DataLoader or Hugging Face `datasets.Dataset` with `batch_size=` the GLOBAL
    batch (a DataLoader's own batch_size is read as global), shuffled with `seed` (or the
    DataLoader's `generator`), each rank reading only its rows (`colab_par.data.sources`; the
    position is saved in checkpoints). `lr_schedule(step) -> factor` multiplies each param group's
    initial LR; `grad_clip` clips the global norm across all shards; `seed` seeds the model's
    streams (one per mesh role, `pm.rng`) and the data order.

    The optional parts are one small value each (`colab_par.training.options`):
    - `evaluation=Evaluation(held_out, every=50)`: a row with ``kind: "eval"``, `eval_loss`,
      `eval_perplexity` (language models) and the units counted joins `history`, the dashboard
      and checkpoints every `every` steps and after the last; `evaluate()` does it on demand;
    - `checkpoints=Checkpoints("ckpt", every=100, on_failure="restart")` (or just a folder): saved
      at the end of every `fit` and every `every` steps; with "restart" a lost engine costs the
      steps since the last one, not the run;
    - `logs=Logs(every=10, tensorboard="runs/a", profile_steps=(10, 12))`: rows (with telemetry),
      TensorBoard files, more loggers, torch.profiler steps shown as a per-rank `timeline`.
    """

    def __init__(self, pm: Any, data: Any, *, steps: int, batch_size: int | None = None,
                 lr_schedule: Callable[[int], float] | None = None, grad_clip: float | None = None,
                 grad_accum: int = 1, seed: int = 0, evaluation: Evaluation | None = None,
                 checkpoints: Checkpoints | str | os.PathLike | None = None, logs: Logs | None = None,
                 **flat_options: Any):
        if flat_options:  # the 0.1 spelling (ckpt_dir=, log_every=, ...), with a warning
            groups = grouped_legacy_options(flat_options, dict(evaluation=evaluation, checkpoints=checkpoints,
                                                               logs=logs))
            evaluation, checkpoints, logs = groups["evaluation"], groups["checkpoints"], groups["logs"]
        if isinstance(checkpoints, (str, os.PathLike)):
            checkpoints = Checkpoints(checkpoints)
        logs = logs if logs is not None else Logs()
        check_positive(steps=steps, grad_accum=grad_accum)
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip={grad_clip!r} must be a positive float or None (no clipping)")
        data = _training_data(data, batch_size, seed, pm)
        eval_data = None
        if evaluation is not None:
            eval_data = held_out_data(evaluation, batch_size or getattr(data, "batch_size", None))
            if isinstance(eval_data, EvalRows):
                eval_data.check(pm)
        self.pm, self.data, self.steps = pm, data, steps
        self.lr_schedule, self.grad_clip, self.grad_accum, self.seed = lr_schedule, grad_clip, grad_accum, seed
        self.evaluation, self.checkpoints, self.logs = evaluation, checkpoints, logs
        self.eval_data = eval_data
        self._profile = StepProfiler(ProfileSteps.of(logs.profile_steps)) if logs.profile_steps is not None else None
        self.step, self.data_position = 0, 0
        self.history: list[dict] = []
        self._live = LiveRows(logs, dist.get_rank() if dist.is_initialized() else 0)
        self._data_place: tuple[Any, DataPlace] | None = None  # (pm, where it reads data)
        self._expert_load: tuple[Any, telem.ExpertLoad | None] | None = None  # (pm, its MoE layers' load)
        self.base_lrs = [group.get("initial_lr", group["lr"]) for group in pm.optimizer.param_groups]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        pm.rng.seed(seed)  # one stream per mesh role (parallel/rng.py)
        self._measures = StepMeasures(pm, data.seq_len if isinstance(data, TokenDataset) else None, grad_accum,
                                      logs.telemetry)
        self._compile_s = 0.0  # torch.compile's seconds since the last row (layout "compile")
        self._keeper = None  # what this engine keeps in memory to recover a lost peer (training/resilience)
        if checkpoints is not None and checkpoints.on_failure == "restart":
            self._keeper = Keeper(checkpoints.dir, checkpoints.snapshot_every)
            announce_recovery(self)

    @property
    def ckpt_dir(self) -> str | os.PathLike | None:
        return self.checkpoints.dir if self.checkpoints is not None else None

    # ---- running --------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> list[dict]:
        """Train until step `stop_at` (default: `steps`); returns the rows recorded in this call."""
        stop_at = self.steps if stop_at is None else min(stop_at, self.steps)
        if self.checkpoints is not None and self.checkpoints.on_failure == "restart" and \
                recovery.resume_requested(self.ckpt_dir):
            come_back(self, stop_at)
        asynchronous = self.checkpoints is not None and self.checkpoints.asynchronous
        if asynchronous:
            check_async_supported(self.pm)  # before any step
        first = len(self.history)
        header = {"total_steps": self.steps, "layout": str(self.pm.layout)}
        try:
            with self._live.fit(self.history, self.step, header, torch.device(self.pm.device)) as sinks:
                while self.step < stop_at:
                    began = time.perf_counter()
                    try:
                        row = self.train_step()
                        if self._keeper is not None:
                            self._keeper.step_done(self, time.perf_counter() - began)
                        evaluated = self._eval_due()
                        if evaluated:
                            self.evaluate()
                        if self._save_due(stop_at):
                            self._save_in_fit(row)  # before the row goes out: it carries the save's pause
                    except Exception as error:  # noqa: BLE001 - a lost dp replica: train on without it, else re-raised
                        train_on(self, error, stop_at, sinks)
                    if asynchronous and row is not None and checkpoint_writing():
                        row["ckpt_writing"] = True  # the dashboard shows the save in flight
                    sinks.after_step(row, self.step >= stop_at)
                    if evaluated:
                        sinks.refresh()
            if asynchronous:
                wait_for_saves()  # an asynchronous save's failure fails the fit
        finally:
            if isinstance(self.data, DataSource):
                self.data.close()
        return self.history[first:]

    def train_step(self) -> dict | None:
        """One optimizer step (with `grad_accum` micro-steps); returns its row on log steps."""
        pm, log = self.pm, self._live.logged(self.step + 1, self.steps)
        measure = self.logs.telemetry and log
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
            meter = self._measures.activations.measure() if measure and micro == 0 else contextlib.nullcontext()
            count = self._measures.count_flops() if measure and micro == 0 else contextlib.nullcontext()
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
        if self._keeper is not None:
            self._keeper.step_begins(self)  # from here to the step's row this rank is no peer's source
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
            self._measures.add_to(row, pm, grads, bubbles, samples, tokens)
        self.history.append(row)
        return row

    @property
    def timeline(self) -> Any:
        """The `Timeline` of the steps `profile_steps` recorded (on rank 0, once they ran), else None."""
        return self._profile.timeline if self._profile is not None else None

    def evaluate(self) -> dict:
        """Evaluate on `eval_data` now; the row (``kind: "eval"``) joins `history` and is returned."""
        return self.evaluate_by(lambda: self.pm.evaluate(self.eval_data, self.evaluation.batches))

    def evaluate_by(self, score: Callable[[], dict]) -> dict:
        """`evaluate` with the result of `score()` (an `inference.evaluate` result: survivors that
        train on without a lost replica score its shares too)."""
        if self.evaluation is None:
            raise ValueError("this Trainer has no held-out data; pass Trainer(..., evaluation=Evaluation(held_out, "
                             "every=k))")
        start = time.perf_counter()
        result = score()
        row = {"step": self.step, "rank": self.rank, "kind": "eval", "eval_loss": result["loss"],
               **{f"eval_{key}": value for key, value in result.items() if key != "loss"},
               "eval_time": time.perf_counter() - start}
        self.history.append(row)
        if self._keeper is not None:
            self._keeper.row_added(self)
        return row

    def _eval_due(self) -> bool:
        """Every `evaluation.every` steps and after the last one."""
        every = self.evaluation.every if self.evaluation is not None else None
        return every is not None and (self.step % every == 0 or self.step == self.steps)

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

    def _apply_lr(self) -> float:
        factor = self.lr_schedule(self.step) if self.lr_schedule is not None else 1.0
        for group, base in zip(self.pm.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        return self.pm.optimizer.param_groups[0]["lr"]

    # ---- checkpoints & history ------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike | None = None) -> None:
        save(self.pm, path or self.ckpt_dir, trainer=self)

    def _save_due(self, stop_at: int) -> bool:
        """Every `checkpoints.every` steps and at the fit's last step."""
        every = self.checkpoints.every if self.checkpoints is not None else None
        return self.checkpoints is not None and ((every and self.step % every == 0) or self.step == stop_at)

    def _save_in_fit(self, row: dict | None) -> None:
        """Save as `checkpoints` asks. An asynchronous save's logged step carries in its row what
        the save held the step (`ckpt_pause_s`) and whether the previous save was still in flight
        (`ckpt_in_flight`); the checkpoint's history has that row as it was when the save began.
        Every row logged while a write runs in the background says so (`ckpt_writing`)."""
        if not self.checkpoints.asynchronous:
            self.save_checkpoint()
            return
        started = save_async(self.pm, self.ckpt_dir, trainer=self)
        if row is not None:
            row.update(ckpt_pause_s=started.pause_s, ckpt_in_flight=started.waited)

    def resume(self, path: str | os.PathLike | None = None) -> dict:
        """Continue from the latest checkpoint under `path` (default `checkpoints.dir`): the model, the
        optimizer, the loop's state and `history` with its evaluation rows, as that checkpoint saved
        them (`checkpoint.load` alone leaves `history` as it is). Returns the checkpoint's metadata."""
        path = path or self.ckpt_dir
        if path is None:
            raise ValueError("no checkpoint folder: pass resume(path) or Trainer(..., checkpoints='<folder>')")
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


def held_out_data(evaluation: Evaluation, batch_size: int | None) -> Any:
    """The held-out data of `evaluation` as the evaluation reads it, checked before any step."""
    data = evaluation_data.eval_data(evaluation.data, batch_size)
    evaluation_data.check_data(data, evaluation.batches)
    return data


def _training_data(data: Any, batch_size: int | None, seed: int, pm: Any) -> Any:
    """The Trainer's data as one of the kinds its loop reads, checked against `pm` before any step."""
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
    return data
