"""Per-token log-probabilities of completions from the policy's own forward, and the GRPO loss as
the ParallelModel's batch loss while a rollout trains.

The model sees each row as prompt + completion, with the positions and padding mask generation
used (positions counted over real tokens; colab_par's GPT masks left padding through a
`KVCache`, which attends exactly as generation's cache does, a Hugging Face causal LM through its
2D attention mask). Token j of a completion is scored by the logits at position
prompt_length + j - 1, divided by the sampling temperature (TRL's convention), through
log_softmax. Under sequence parallel the GPT's rows are lengthened to a multiple of tp by
repeating their last token (`trailing`): causal attention keeps them out of every earlier
position, and their logits are dropped. Training goes through `pm.forward_backward_tensor`, so
data parallel, ZeRO, tensor parallel, recompute and memory tiers work as for any batch: `loss_installed` swaps
`pm.batch_loss_fn` (and the pipeline runner's, which scores on the last stage) for the rollout's
GRPO loss while it trains and puts the model's back after.

Under pipeline parallel the last stage scores one microbatch of the rank's rows at a time: the
batch then carries each row's index (`ROW_INDEX`, sliced with its microbatch; only the loss reads
it), and `RolloutLoss` scales each microbatch's share so that the runner's mean over microbatches
is the rank's loss. Forward-only log-probabilities go through the runner's forward pass and are
broadcast from the last stage, so every rank of the pipeline holds them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from colab_par.data.batch import call_model
from colab_par.models.gpt import KVCache
from colab_par.models.hf import is_hf_model
from colab_par.parallel.adapters.model import is_auxiliary_wrapper, is_tuner_layer
from colab_par.parallel.inference.state import bare_module, training_state_kept
from colab_par.parallel.pipeline import stage_owner
from colab_par.training.grpo.mismatch import LogpMismatch, combined, logp_mismatch
from colab_par.training.grpo.objective import GrpoLoss, grpo_loss
from colab_par.training.grpo.options import GrpoLossOptions
from colab_par.training.grpo.rollout import Rollout

__all__ = ["policy_inputs", "policy_batch", "trailing_positions", "completion_logps", "forward_logps",
           "adapters_disabled", "RolloutLoss", "loss_installed", "TOKEN_MEASURES", "ROW_INDEX"]

TOKEN_MEASURES = ("clip_low", "clip_high", "clip_region", "kl", "entropy")  # means over unmasked tokens
ROW_INDEX = "grpo_row_index"  # a pipeline batch's row numbers: which rows a microbatch's loss scores


def policy_inputs(model: nn.Module, rows: Rollout, trailing: int = 0) -> dict[str, Any]:
    """What `model`'s forward takes for `rows` (prompts + completions), as generation fed them;
    a fresh dict per forward (the GPT's padding mask is a cache that one forward fills).
    `trailing` (the GPT only): positions after the completions, repeating their last token."""
    model = bare_module(model)
    tokens = torch.cat([rows.prompt_ids, rows.completion_ids], dim=1)
    keep = torch.cat([rows.prompt_mask, torch.ones_like(rows.completion_ids, dtype=torch.bool)], dim=1)
    if trailing:
        tokens, keep = torch.cat([tokens, tokens[:, -1:].expand(-1, trailing)], dim=1), F.pad(keep, (0, trailing),
                                                                                              value=True)
    positions = (keep.long().cumsum(dim=-1) - 1).masked_fill(~keep, 0)
    if is_hf_model(model):
        inputs: dict[str, Any] = {"input_ids": tokens, "attention_mask": keep.long(), "position_ids": positions,
                                  "use_cache": False}
        if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
            inputs["logits_to_keep"] = rows.completion_ids.shape[1] + 1  # only the positions scored
        return inputs
    padded = not bool(rows.prompt_mask.all())
    return {"tokens": tokens, "positions": positions, **({"cache": KVCache(keep)} if padded else {})}


def policy_batch(pm: Any, rows: Rollout) -> dict[str, Any]:
    """What `pm.forward_backward_tensor` trains `rows` on: `policy_inputs`, and under pipeline
    parallel each row's index, which the runner slices with its microbatch for the loss (the
    stages take only the model's own inputs; without a pipeline the model would be given it)."""
    inputs = policy_inputs(pm.model, rows, trailing_positions(pm, rows))
    if pm.layout.pp > 1:
        inputs[ROW_INDEX] = torch.arange(rows.completion_ids.shape[0], device=rows.completion_ids.device)
    return inputs


def trailing_positions(pm: Any, rows: Rollout) -> int:
    """How many positions `policy_batch` appends to each row: sequence parallel splits the GPT's
    sequence into tp equal pieces."""
    if not pm.layout.sequence_parallel:
        return 0
    return -(rows.prompt_ids.shape[1] + rows.completion_ids.shape[1]) % pm.layout.tp


def completion_logps(outputs: Any, completion_ids: torch.Tensor, temperature: float,
                     vocab_size: int, trailing: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log-probabilities (rows, tokens), the logits they come from (at least float32)
    divided by the temperature (rows, tokens, vocab)) of the completions, from the model's outputs
    (whose last `trailing` positions follow the completions)."""
    logits = getattr(outputs, "logits", outputs)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"the model returned logits over {logits.shape[-1]} tokens, its vocabulary has "
                         f"{vocab_size}: a tensor-parallel plan left the output head's logits split by "
                         "vocabulary; gather them (style 'colwise_gather_output', or "
                         "ColwiseParallel(output_layouts=Replicate()))")
    length, end = completion_ids.shape[1], logits.shape[1] - 1 - trailing
    scores = logits[:, end - length:end]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature
    logps = scores.log_softmax(dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    return logps, scores


def forward_logps(pm: Any, rows: Rollout, temperature: float) -> torch.Tensor:
    """`completion_logps` of `rows` without gradient, training state kept (no dropout, RNG
    untouched, FSDP resharded after): the sampling or reference policy's log-probabilities. Under
    pipeline parallel, through the runner's forward pass, on every rank of the pipeline."""
    model = bare_module(pm.model)
    if pm.layout.pp > 1:
        with training_state_kept(pm):
            return _pipeline_logps(pm, rows, temperature)
    with training_state_kept(pm), pm._autocast():
        outputs = call_model(model, policy_batch(pm, rows))
        return completion_logps(outputs, rows.completion_ids, temperature, vocab_size(model),
                                trailing_positions(pm, rows))[0]


def _pipeline_logps(pm: Any, rows: Rollout, temperature: float) -> torch.Tensor:
    """`forward_logps` through the pipeline: the last stage keeps each microbatch's values by its
    first row, then sends them to every pp rank."""
    runner, vocab, pieces = pm._runner, vocab_size(pm.model), {}

    def keep(outputs: Any, microbatch: dict[str, Any]) -> torch.Tensor:
        index = microbatch[ROW_INDEX]
        logps = completion_logps(outputs, rows.completion_ids[index], temperature, vocab)[0]
        pieces[int(index[0])] = logps  # keyed: torch's shape inference scores a first microbatch too
        return logps.new_zeros(())

    runner.evaluate_batch(policy_batch(pm, rows), keep)
    logps = (torch.cat([pieces[start] for start in sorted(pieces)]).float() if pieces
             else torch.empty(rows.completion_ids.shape, device=pm.device))
    last = stage_owner(pm.layout, pm.layout.pp * pm.layout.virtual_stages - 1)
    dist.broadcast(logps, group=runner.pp_group, group_src=last)
    return logps


def vocab_size(model: nn.Module) -> int:
    return bare_module(model).config.vocab_size


@contextlib.contextmanager
def adapters_disabled(*models: nn.Module) -> Iterator[None]:
    """The base model alone: every peft tuner layer and trained copy of a module in `models` (a
    rank's pipeline stages: `*pm.model_parts`) switched off, as peft's
    `PeftModel.disable_adapter()` does, and back on after (which parameters train is kept as it
    was: peft's switch also sets requires_grad)."""
    modules = [module for model in models for module in model.modules()]
    switched = [module for module in modules if is_tuner_layer(module) or is_auxiliary_wrapper(module)]
    trains = [(p, p.requires_grad) for model in models for p in model.parameters()]
    was_disabled = [module.disable_adapters for module in switched]
    for module in switched:
        module.enable_adapters(False)
    try:
        yield
    finally:
        for module, disabled in zip(switched, was_disabled):
            module.enable_adapters(not disabled)
        for p, requires_grad in trains:
            p.requires_grad_(requires_grad)


class RolloutLoss:
    """`pm.batch_loss_fn` while this rank's `rows` train: the GRPO loss of the model's outputs.
    `num_items_in_batch` is the unmasked tokens of the whole rollout (dapo). Gradients are averaged
    over data-parallel ranks and over a pipeline's `microbatches`, so each call's share of the
    objective is scaled to make those averages the objective (objective.py's notes): grpo and
    dr_grpo are means over equal shares of rows already; dapo's sum over the global token count is
    multiplied by the dp size and the microbatches; bnpo is each rank's own token mean (as TRL's
    bnpo is per process), so a microbatch's sum is divided by the rank's tokens, times the
    microbatches. `measures()` gives the calls' token measures since it was last asked; while
    `measuring_mismatch` is set (the first forward, at the weights that sampled), each call also
    compares its log-probabilities with the rows' sampling ones (`mismatch()`), free of a forward
    of its own."""

    def __init__(self, rows: Rollout, options: GrpoLossOptions, temperature: float, num_items_in_batch: int,
                 dp_size: int, vocab: int, microbatches: int = 1, trailing: int = 0):
        self.rows, self.temperature, self.vocab, self.trailing = rows, temperature, vocab, trailing
        if options.loss_type == "bnpo":  # this rank's token mean, over its microbatches
            options, num_items_in_batch = dataclasses.replace(options, loss_type="dapo"), rows.mask.sum()
            self.scale = microbatches
        else:
            self.scale = dp_size * microbatches if options.loss_type == "dapo" else 1
        self.options, self.num_items_in_batch = options, num_items_in_batch
        self._scored: dict[int, GrpoLoss] = {}  # by first row: torch's shape inference scores one twice
        self.measuring_mismatch = False
        self._mismatches: dict[int, LogpMismatch] = {}

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        index = batch.get(ROW_INDEX) if isinstance(batch, dict) else None
        rows = self.rows if index is None else _picked(self.rows, index)
        logps, scores = completion_logps(outputs, rows.completion_ids, self.temperature, self.vocab, self.trailing)
        old = rows.old_logps if rows.old_logps is not None else logps.detach()
        scored = grpo_loss(logps, old, rows.advantages, rows.mask, self.options, ref_logps=rows.ref_logps,
                           num_items_in_batch=self.num_items_in_batch, logits=scores)
        self._scored[0 if index is None else int(index[0])] = scored
        if self.measuring_mismatch and rows.sampling_logps is not None:
            self._mismatches[0 if index is None else int(index[0])] = logp_mismatch(logps, rows.sampling_logps,
                                                                                    rows.mask)
        return scored.loss * self.scale

    def mismatch(self, empty: Rollout) -> LogpMismatch:
        """This rank's calls' mismatch since measuring began (none scored here: no tokens, from the
        shapes of `empty`'s rows)."""
        mine = combined(list(self._mismatches.values()))
        self._mismatches.clear()
        if mine is None:
            nothing = empty.mask[:0]
            return logp_mismatch(nothing.float(), nothing.float(), nothing)
        return mine

    def measures(self, device: torch.device) -> torch.Tensor:
        """(each of `TOKEN_MEASURES` times its tokens, summed; the tokens), float64, over the calls
        since the last `measures()`: zeros on a pipeline stage that scores nothing."""
        total = torch.zeros(len(TOKEN_MEASURES) + 1, dtype=torch.float64, device=device)
        for scored in self._scored.values():
            tokens = scored.tokens.double()
            values = [getattr(scored, name) for name in TOKEN_MEASURES]
            total += torch.stack([*(torch.zeros_like(tokens) if v is None else v.double() * tokens for v in values),
                                  tokens]).to(device)
        self._scored.clear()
        return total


def _picked(rows: Rollout, index: torch.Tensor) -> Rollout:
    """The rows `index` of what the loss reads of `rows`."""
    return dataclasses.replace(rows, **{name: getattr(rows, name)[index] for name in
                                        ("prompt_ids", "prompt_mask", "completion_ids", "mask", "advantages",
                                         "old_logps", "ref_logps", "sampling_logps")
                                        if getattr(rows, name) is not None})


@contextlib.contextmanager
def loss_installed(pm: Any, loss: RolloutLoss) -> Iterator[RolloutLoss]:
    """`pm` scores dict batches with `loss` inside (its pipeline runner too, which scores on the last
    stage), with its own loss again after."""
    runner = getattr(pm, "_runner", None)
    own, staged = pm.batch_loss_fn, getattr(runner, "batch_loss_fn", None)
    pm.batch_loss_fn = loss
    if runner is not None:
        runner.batch_loss_fn = loss
    try:
        yield loss
    finally:
        pm.batch_loss_fn = own
        if runner is not None:
            runner.batch_loss_fn = staged
