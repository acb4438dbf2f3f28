"""GRPO on a ParallelModel, colocated: the engines that train also generate. Build it on every
engine with the same arguments; each step then runs on every rank:

1. the step's `prompts_per_step` prompts (`prompts.py`: seeded, the same on every rank), each
   repeated `group_size` times, completions sampled by `generate_rollout` (each row from its own
   generator seeded from `seed + step` and the row; under pure data parallel each rank decodes
   its own rows and they are gathered), scored by the reward functions on every rank, group-relative advantages (`rollout.py`);
2. this rank's data-parallel share of the rows; with `iterations > 1` the sampling policy's
   log-probabilities once, without gradient (later iterations are off-policy: importance
   ratios); with `loss.beta > 0` the reference's (`reference.py`: with LoRA the base with the
   adapters switched off, with full weights a frozen sharded copy of the weights GRPO started
   from); on log steps the trainer-generator mismatch of the sampled tokens' log-probabilities
   (`mismatch.py`);
3. `iterations` optimizer steps on the whole rollout, each one forward and backward of the GRPO
   loss through `pm.forward_backward_tensor` (dapo's token count is the whole rollout's; under
   pipeline parallel the last stage scores each microbatch's rows, scaled so the runner's mean is
   the rank's loss), the gradient norm clipped to `grad_clip`;
4. one row in `history` (on `logs.every` steps and the last; `step` counts the steps done, as
   the Trainer's rows): the loss, rewards (mean, mean group std, each function's mean and std),
   the share of groups with equal rewards, completion lengths and truncation, clip ratios, KL,
   entropy, gradient norm, the mismatch (`mismatch/...`), the time spent sampling (`rollout_s`)
   and training (`train_s`), and on rank 0 a few prompts with their best and worst completions
   (`samples`, `samples.py`); live to the dashboard (a reward plot and a table of the samples join
   it) and to TensorBoard and the loggers as the Trainer's rows (`training/live_rows.py`).

`save_checkpoint` / `resume` (or `colab_par.save(pm, path, trainer=grpo)`) keep the model, the
optimizer, the reference policy's frozen copy (full weights with `beta > 0`), the step, seed and
`history`: the prompts, sampling seeds and so every later row follow
from the step and seed, so a resumed run goes on exactly as an uninterrupted one.

Every rank takes the same path (the same prompts, completions and rewards), so an error (a reward
function that raises, names its row in `rewards.py`) raises on every rank and nothing waits.
Layouts: dp, ZeRO 1-3, tensor parallel (1d, with or without sequence parallel), pipeline parallel
(every schedule, colab_par's GPT: its stages take the padding mask and positions as keywords) and
their products, memory tiers, LoRA or full weights. Refused for now, before any work: context
parallel and tensor grids (they split sequences or batches another way), a Hugging Face model
under pipeline parallel (its stages take token ids only).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colab_par.layout import Layout
from colab_par.models.gpt import GPT
from colab_par.models.hf import is_hf_model, shifts_labels
from colab_par.parallel.inference.state import bare_module
from colab_par.training.checkpoint import load, save, saved_history
from colab_par.training.grpo.logprobs import (TOKEN_MEASURES, RolloutLoss, forward_logps,
                                              loss_installed, policy_batch, trailing_positions, vocab_size)
from colab_par.training.grpo.mismatch import LogpMismatch, logp_mismatch, mismatch_over_ranks
from colab_par.training.grpo.objective import completion_mask
from colab_par.training.grpo.options import GrpoLossOptions
from colab_par.training.grpo.prompts import PromptDraw, PromptRows
from colab_par.training.grpo.reference import ReferencePolicy, reference_policy
from colab_par.training.grpo.rollout import Completions, Rollout, RolloutPlan, reward_functions, sample_rollout
from colab_par.training.grpo.samples import rollout_samples
from colab_par.training.live_rows import LiveRows
from colab_par.training.options import Logs
from colab_par.views.rows import SAMPLES_COLUMN

__all__ = ["GRPO", "SUPPORTED_LAYOUTS"]

SUPPORTED_LAYOUTS = ("dp, zero1/2/3, offload, memory tiers, 1d tp with or without sp, pp (every schedule, "
                     "colab_par's GPT), ep, bf16 and recompute, and their products (e.g. 'dp2 zero3', 'pp2', "
                     "'dp2 tp2')")


class GRPO:
    """The GRPO loop (module docstring). `rewards`: a function ``(prompts, completions, **columns)
    -> list[float]``, a list of them, or a dict function -> weight; `prompts`: see `prompts.py`;
    `completions`: sampling and decoding (`Completions`); `loss`: TRL's loss settings
    (`GrpoLossOptions`, with `scale_rewards`; its `max_completion_length` is taken from here);
    `logs`: the Trainer's `Logs` (rows every `every` steps, live with `telemetry`, `tensorboard`,
    `loggers`; GRPO's rows always hold their timings, `telemetry` adds no measures)."""

    def __init__(self, pm: Any, prompts: Any, rewards: Any, *, group_size: int, max_completion_length: int,
                 steps: int, prompts_per_step: int = 1, completions: Completions = Completions(),
                 loss: GrpoLossOptions = GrpoLossOptions(), iterations: int = 1, seed: int = 0,
                 grad_clip: float | None = None, logs: Logs = Logs()):
        check_layout(pm.layout)
        model = bare_module(pm.model)
        check_model(model, pm.layout)
        for name, value, least in (("group_size", group_size, 2), ("max_completion_length", max_completion_length, 1),
                                   ("steps", steps, 1), ("prompts_per_step", prompts_per_step, 1),
                                   ("iterations", iterations, 1), ("seed", seed, 0)):
            _check_whole(name, value, least)
        _check_types(completions, loss, grad_clip, logs)
        self.loss = _with_length(loss, max_completion_length)
        if prompts_per_step * group_size % pm.dp_size:
            raise ValueError(f"prompts_per_step * group_size = {prompts_per_step * group_size} completions do not "
                             f"split over {pm.dp_size} data-parallel ranks; make it a multiple of {pm.dp_size}")
        pieces = pm.dp_size * (pm.layout.microbatches if pm.layout.pp > 1 else 1)
        if prompts_per_step * group_size % pieces:
            raise ValueError(f"prompts_per_step * group_size = {prompts_per_step * group_size} completions do not "
                             f"split into {pm.layout.microbatches} pipeline microbatches on each of {pm.dp_size} "
                             f"data-parallel ranks; make it a multiple of {pieces}, or set the layout's "
                             "microbatches to a divisor of a rank's completions")
        self.prompts = PromptRows(prompts)
        functions, weights = reward_functions(rewards)
        eos, pad = _special_ids(model, completions)
        self.plan = RolloutPlan(group_size=group_size, max_completion_length=max_completion_length,
                                completions=completions, eos=eos, pad=pad, mask_truncated=self.loss.mask_truncated,
                                scale_rewards=self.loss.scale_rewards, functions=functions, weights=weights)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.live = LiveRows(logs, self.rank)
        self.pm, self.steps, self.prompts_per_step = pm, steps, prompts_per_step
        self.reference: ReferencePolicy | None = reference_policy(pm) if self.loss.beta > 0 else None
        self.iterations, self.seed, self.grad_clip = iterations, seed, grad_clip
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.last_rollout: Rollout | None = None  # what the policy wrote last: prompts, completions, rewards

    def fit(self) -> list[dict[str, Any]]:
        """Steps until `steps`; returns their rows (they join `history`)."""
        first = len(self.history)
        header = {"total_steps": self.steps, "layout": str(self.pm.layout)}
        with self.live.fit(self.history, self.step, header, torch.device(self.pm.device)) as sinks:
            while self.step < self.steps:
                sinks.after_step(self.train_step(), self.step >= self.steps)
        return self.history[first:]

    def train_step(self) -> dict[str, Any] | None:
        """One rollout and its `iterations` optimizer steps; returns the step's row on log steps."""
        started = time.perf_counter()
        prompts, columns = self.prompts.take(self.step, self.prompts_per_step, self.seed)
        rollout = sample_rollout(self.pm, self.plan, prompts, columns, self.seed + self.step)
        return self.step_on(rollout, time.perf_counter() - started)

    def step_on(self, rollout: Rollout, rollout_s: float, **extra: float) -> dict[str, Any] | None:
        """Train on a sampled `rollout` (`train_on`) and count the step; on log steps its row, with
        `rollout_s` (what sampling it took) and the `extra` columns (separate generators add theirs)."""
        self.last_rollout = rollout
        started = time.perf_counter()
        logged = self.live.logged(self.step + 1, self.steps)
        trained = self.train_on(rollout, measure=logged)
        self.step += 1
        if not logged:
            return None
        row = {"step": self.step, "rank": self.rank, **trained, **_rollout_row(rollout, self.plan.eos),
               "rollout_s": rollout_s, "train_s": time.perf_counter() - started, **extra}
        if self.rank == 0:  # the same rollout on every rank: one table is enough
            row[SAMPLES_COLUMN] = rollout_samples(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                                  rollout.scores.total, self.plan.group_size, self.plan.eos,
                                                  self.plan.completions.decode)
        self.history.append(row)
        return row

    def train_on(self, rollout: Rollout, measure: bool = True) -> dict[str, float]:
        """`iterations` optimizer steps on `rollout` (the whole batch, identical on every rank), its
        missing log-probabilities computed first; the means over the steps of the loss, gradient
        norm and token measures (over every rank's unmasked tokens), and with `measure` the
        trainer-generator mismatch (from the old log-probabilities, else the first step's forward)."""
        pm, temperature = self.pm, self.plan.completions.temperature
        rows = rollout.rows(pm.dp_size, pm.dp_rank).to(pm.device)
        if rows.old_logps is None and self.iterations > 1:
            rows = dataclasses.replace(rows, old_logps=forward_logps(pm, rows, temperature))
        measure = measure and rows.sampling_logps is not None
        mismatch = self._mismatch(logp_mismatch(rows.old_logps, rows.sampling_logps, rows.mask), ("dp",)) \
            if measure and rows.old_logps is not None else {}
        if rows.ref_logps is None and self.reference is not None:
            rows = dataclasses.replace(rows, ref_logps=self.reference.logps(pm, rows, temperature))
        microbatches = pm.layout.microbatches if pm.layout.pp > 1 else 1
        loss = RolloutLoss(rows, self.loss, temperature, int(rollout.mask.sum()), pm.dp_size, vocab_size(pm.model),
                           microbatches, trailing_positions(pm, rows))
        steps = []
        loss.measuring_mismatch = measure and rows.old_logps is None
        with loss_installed(pm, loss):
            for _ in range(self.iterations):
                value = pm.forward_backward_tensor(policy_batch(pm, rows), local=True)
                if loss.measuring_mismatch:  # the policy that sampled is the one just scored: only now
                    mismatch, loss.measuring_mismatch = self._mismatch(loss.mismatch(rows), ("dp", "pp")), False
                norm = pm.clip_grad_norm_tensor(self.grad_clip or math.inf)
                pm.optimizer_step()
                steps.append(_step_measures(loss.measures(value.device), value, norm))
        return {**self._means(torch.stack(steps), has_kl=rows.ref_logps is not None), **mismatch}

    def _mismatch(self, mine: LogpMismatch, dims: tuple[str, ...]) -> dict[str, float]:
        """How far the training forward's log-probabilities of the sampled tokens are from those
        generation sampled them with, at the same weights: `mine` over the ranks of `dims` (the
        pipeline's too when only its last stage scored)."""
        for dim in dims:
            if self.pm.mesh[dim].size() > 1:
                mine = mismatch_over_ranks(mine, self.pm.mesh[dim].get_group())
        return mine.row()

    # ---- checkpoints ------------------------------------------------------------------------------
    @property
    def data(self) -> PromptDraw:
        """What `checkpoint.load` checks a resumed loop's data by: the prompts and their draw."""
        return PromptDraw(self.prompts, self.prompts_per_step)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able loop state for `checkpoint.save`: the prompts' order and the sampling seeds
        follow from the step and seed."""
        return {"step": self.step, "seed": self.seed, "data": self.data.describe()}

    def checkpoint_tensors(self, pm: Any) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors `checkpoint.save` / `load` keep besides the model's: the reference policy's
        frozen copy (full weights, `beta > 0`), laid out as `pm` (rebuilt first when a relayout
        loads into another model; loading then fills it with the saved copy)."""
        if self.reference is None or self.reference.nbytes == 0:
            return {}
        if pm is not self.pm:
            self.reference = reference_policy(pm)
        return {"reference": self.reference.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` (`checkpoint.load` has checked the prompts match)."""
        self.step, self.seed = int(state["step"]), int(state["seed"])

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save the model, optimizer, loop state and `history` under `path`; call on every rank."""
        save(self.pm, path, trainer=self)

    def resume(self, path: str | os.PathLike) -> dict:
        """Continue from the latest checkpoint under `path`: the model, optimizer, step, seed and
        `history` as it saved them. Returns the checkpoint's metadata."""
        meta = load(self.pm, path, trainer=self)
        self.history = saved_history(path) or []
        return meta

    def _means(self, steps: torch.Tensor, has_kl: bool) -> dict[str, float]:
        """Columns loss, grad_norm (the same on every rank), then each token measure times this
        rank's tokens, then its tokens: summed over the dp ranks and the pipeline's stages (only
        the last scored any), averaged over the steps."""
        weighted = steps[:, 2:].clone()
        for dim, size in (("dp", self.pm.dp_size), ("pp", self.pm.layout.pp)):
            if size > 1:
                dist.all_reduce(weighted, group=self.pm.mesh[dim].get_group())
        means = torch.cat([steps[:, :2], weighted[:, :-1] / weighted[:, -1:].clamp(min=1)], dim=1).mean(dim=0)
        row = dict(zip(("loss", "grad_norm", *TOKEN_MEASURES), means.tolist()))
        if not has_kl:
            del row["kl"]
        return row


def _step_measures(measures: torch.Tensor, value: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """One optimizer step's loss, gradient norm, token measures weighted by tokens, tokens."""
    scalars = [value.double().reshape(1), norm.double().to(measures.device).reshape(1)]
    return torch.cat([*scalars, measures])


def _rollout_row(rollout: Rollout, eos: list[int]) -> dict[str, float]:
    """What the rollout's rewards and completions were, as TRL logs them."""
    scores = rollout.scores
    row = {"reward": torch.nanmean(scores.total).item(), "reward_std": torch.nanmean(rollout.group_std).item()}
    for name in scores.names:
        row[f"reward/{name}"], row[f"reward_std/{name}"] = scores.means[name], scores.stds[name]
    ended = completion_mask(rollout.completion_ids, eos)
    truncated = ~torch.isin(rollout.completion_ids, torch.tensor(eos)).any(dim=1)
    row.update(zero_std_fraction=rollout.zero_std_fraction, completion_length=ended.sum(dim=1).double().mean().item(),
               truncated_fraction=truncated.double().mean().item())
    return row


# ---- checks before any work ------------------------------------------------------------------------------
def check_layout(layout: Layout) -> None:
    refused = {"cp": layout.cp > 1, f"tp {layout.tp_mode}": layout.tp_mode != "1d"}
    named = [name for name, on in refused.items() if on]
    if named:
        raise ValueError(f"GRPO does not train under {', '.join(named)} yet (layout '{layout}'): context parallel "
                         f"and tensor grids split rows another way. Supported: {SUPPORTED_LAYOUTS}; relayout first")


def check_model(model: nn.Module, layout: Layout) -> None:
    if not (isinstance(model, GPT) or (is_hf_model(model) and shifts_labels(model))):
        raise ValueError(f"GRPO scores completions with colab_par's GPT or a Hugging Face causal LM (or LoRA on "
                         f"one); {type(model).__name__} is neither")
    if isinstance(model, GPT):
        return
    if layout.pp > 1:
        raise ValueError(f"GRPO under pipeline parallel trains colab_par's GPT, whose stages take the padding "
                         f"mask and positions of left-padded prompts; {type(model).__name__}'s stages take token "
                         f"ids only. Use a layout without pp for it (e.g. 'dp2 zero3'; layout '{layout}')")
    if layout.sequence_parallel:
        raise ValueError(f"GRPO under sequence parallel trains colab_par's GPT, whose generation cache takes tp "
                         f"tokens per step; {type(model).__name__} generates without 'sp' only. Use a layout "
                         f"without it (e.g. 'tp2'; layout '{layout}')")


def _check_whole(name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        why = " (an advantage compares a completion with the others of its prompt)" if name == "group_size" else ""
        raise ValueError(f"{name}={value!r} must be a whole number >= {least}{why}")


def _check_types(completions: Any, loss: Any, grad_clip: Any, logs: Any) -> None:
    if not isinstance(completions, Completions):
        raise TypeError(f"completions={completions!r} must be a Completions, e.g. Completions(temperature=0.8)")
    if not isinstance(loss, GrpoLossOptions):
        raise TypeError(f"loss={loss!r} must be a GrpoLossOptions, e.g. GrpoLossOptions(loss_type='dapo')")
    if grad_clip is not None and (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float))
                                  or not math.isfinite(grad_clip) or grad_clip <= 0):
        raise ValueError(f"grad_clip={grad_clip!r} must be a number > 0 (e.g. 1.0), or None for no clipping")
    if not isinstance(logs, Logs):
        raise TypeError(f"logs={logs!r} must be a Logs, e.g. Logs(every=1, tensorboard='runs/grpo')")
    if logs.profile_steps is not None:
        raise ValueError(f"logs.profile_steps={logs.profile_steps!r}: the step profiler does not mark a GRPO "
                         "step's rollout and training apart yet; leave profile_steps out")


def _with_length(loss: GrpoLossOptions, max_completion_length: int) -> GrpoLossOptions:
    if loss.max_completion_length not in (None, max_completion_length):
        raise ValueError(f"loss.max_completion_length={loss.max_completion_length} differs from "
                         f"max_completion_length={max_completion_length}: leave it out of GrpoLossOptions")
    return dataclasses.replace(loss, max_completion_length=max_completion_length)


def _special_ids(model: nn.Module, completions: Completions) -> tuple[list[int], int]:
    """(end-of-sequence ids, padding id): the given ones, else a Hugging Face model's own."""
    settings = getattr(model, "generation_config", None) or getattr(model, "config", None)
    eos = completions.eos_token_id if completions.eos_token_id is not None else getattr(settings, "eos_token_id", None)
    if eos is None or eos == []:
        raise ValueError(f"{type(model).__name__} names no end-of-sequence token: pass "
                         "Completions(eos_token_id=...), the id that ends a completion")
    eos = [eos] if isinstance(eos, int) else list(eos)
    pad = completions.pad_token_id if completions.pad_token_id is not None else getattr(settings, "pad_token_id", None)
    return eos, eos[0] if pad is None else pad
