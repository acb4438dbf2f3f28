"""Evaluation of a ParallelModel on held-out data: the mean loss over all ranks (and perplexity for
language models), under every layout, leaving training state as it was
(`inference.training_state_kept`).

Each batch is scored exactly as training scores it (the same forward, the same loss: dp slices,
context-parallel sequence shares, pipeline stages through torch's forward-only schedule), with
no gradients. The mean is over the units the loss averages, weighted by how many each piece holds:
- token batches ``(inputs, targets)``: target tokens (those not -100);
- dict batches with ``labels`` scored by the default loss: the labels that loss counts (not -100,
  after a causal LM's shift), each piece's loss being transformers' own summed per-token loss;
- any other batch: samples.
So the result is the sum over every piece of every rank of (its mean loss × its units), divided by
all units: the loss of all the data at once, not a mean of per-batch means (a short last batch
counts by its size). Perplexity, exp(loss), is reported for language models: token batches under
the model's own or the default loss, and labelled batches scored by a transformers LM loss.
A mixture of experts' load-balancing loss is left out under every layout: it regularizes training
and depends on how a batch is split (ranks, microbatches), so the held-out loss and perplexity are
the data's alone, as Megatron's and torchtitan's validation report them (transformers' own model
adds it to its loss where ``output_router_logits`` is on, in eval mode too).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from colab_par.data import BatchList, TokenDataset
from colab_par.data.sources import DataPlace
from colab_par.data.eval_rows import EvalRows, eval_rows, token_pair
from colab_par.parallel.inference.state import bare_module, training_state_kept
from colab_par.models.hf import hf_token_loss
from colab_par.data.batch import (LabelMean, batch_size, batch_to, call_model, check_batch, counted_labels,
                                      labels_of, slice_batch)

__all__ = ["evaluate", "evaluate_shares", "check_data", "eval_data"]


def evaluate(pm: Any, data: Any, num_batches: int | None = None,
             batch_size: int | None = None) -> dict[str, float]:
    """Mean loss of `data` (see the module docstring); call it on every rank.

    `data`: a `TokenDataset` (global batches 0..num_batches-1, each rank reading only its rows), a
    `BatchList` or a list of global batches (the first `num_batches`, default all), or the user's
    own rows, all of them once (`eval_rows.py`): a torch Dataset or Hugging Face
    `datasets.Dataset` in global batches of `batch_size`, or a DataLoader (its batch size is the
    global batch). A batch that is exactly two integer tensors of one shape is a token pair
    ``(inputs, targets)``, scored like ``train_step(inputs, targets)``; any other batch like
    ``train_step(batch)``. Returns ``{"loss", "perplexity" (language models), <unit>: count,
    "batches"}`` where the unit is "tokens", "labels" or "samples".
    """
    return evaluate_shares(pm, eval_data(data, batch_size), num_batches, [pm.dp_rank], dist.all_reduce)


def evaluate_shares(pm: Any, data: Any, num_batches: int | None, shares: list[int],
                    sum_over: Callable[[torch.Tensor], Any]) -> dict[str, float]:
    """`evaluate`, this rank scoring the dp shares `shares` of every batch (its own in a whole
    world; a lost replica's too where survivors train on without it), and `sum_over` adding a
    tensor in place over the ranks that score every share once (every rank of a whole world)."""
    if isinstance(data, EvalRows):
        data.check(pm)
    pieces = [piece for share in shares for piece in _pieces(pm, data, num_batches, share)]  # refused before work
    totals = torch.zeros(2, dtype=torch.float64, device=pm.device)
    units, language = set(), True
    try:
        with training_state_kept(pm), _summed_labels(pm.batch_loss_fn):
            for kind, piece in pieces:
                total, count, unit, is_language = (_token_sums(pm, *piece) if kind == "tokens"
                                                   else _batch_sums(pm, *piece))
                totals += torch.tensor([total, count], dtype=torch.float64, device=pm.device)
                units.add(unit)
                language &= is_language
            if len(units) > 1:
                raise ValueError(f"the batches mix units ({', '.join(sorted(units))}); evaluate data of one "
                                 "kind at a time")
            if pm.tp_rank != 0 or pm.pp_rank != 0:
                totals.zero_()  # tensor-parallel ranks repeat their group's sums; pipeline ranks all hold them
            sum_over(totals)
    finally:
        if isinstance(data, EvalRows):
            data.close()
    batches = len(pieces) // len(shares)
    total, count = totals.tolist()
    if count == 0:
        raise ValueError("the data holds no scored units (every target is -100); nothing to evaluate")
    loss = total / count
    result = {"loss": loss, units.pop(): int(count), "batches": batches}
    if language:
        result["perplexity"] = math.exp(loss) if loss < 700 else math.inf
    return result


def eval_data(data: Any, batch_size: int | None) -> Any:
    """The kit's own batches as they are; the user's rows (a Dataset, DataLoader, Hugging Face
    dataset) as `EvalRows` in global batches of `batch_size`."""
    if isinstance(data, (TokenDataset, BatchList, list, tuple, EvalRows)):
        return data
    return eval_rows(data, batch_size)


def check_data(data: Any, num_batches: int | None) -> int | None:
    """Refuse evaluation data that cannot be read, before any work; how many global batches it
    gives (None: a list's length)."""
    if num_batches is not None and (not isinstance(num_batches, int) or isinstance(num_batches, bool)
                                    or num_batches < 1):
        raise ValueError(f"num_batches={num_batches!r} must be a whole number >= 1, or None")
    if isinstance(data, TokenDataset):
        if num_batches is None:
            raise ValueError(f"{type(data).__name__} never ends; pass the number of global batches to "
                             "evaluate (num_batches=, or the Trainer's Evaluation(batches=))")
        return num_batches
    if isinstance(data, BatchList):
        if (num_batches or data.count) is None:
            raise ValueError(f"BatchList {data.name!r} is a function of the batch index with no end; pass the "
                             "number of global batches (num_batches=, or the Trainer's Evaluation(batches=))")
        return num_batches or data.count
    if isinstance(data, (list, tuple)):
        if not data:
            raise ValueError("no batches to evaluate; give a list of global batches")
        if num_batches is not None and num_batches > len(data):
            raise ValueError(f"num_batches={num_batches} but the list holds {len(data)} batches")
        return num_batches or len(data)
    if isinstance(data, EvalRows):
        if num_batches is not None and num_batches > data.count:
            raise ValueError(f"num_batches={num_batches} but the {data.rows} rows make {data.count} global "
                             f"batches of {data.batch_size}")
        return num_batches or data.count
    raise TypeError(f"evaluation data is a TokenDataset, a BatchList or a list of global batches, not "
                    f"{type(data).__name__}")


def _pieces(pm: Any, data: Any, num_batches: int | None, share: int) -> Iterator[tuple[str, Any]]:
    """("tokens", (inputs, targets, local)) or ("batch", (batch, local)) per global batch: its dp
    share `share`, local (already sliced) but where it is this rank's own and the model slices it."""
    count = check_data(data, num_batches)
    if isinstance(data, TokenDataset):
        return (("tokens", (*data.batch(i, share, pm.dp_size), True)) for i in range(count))
    if isinstance(data, EvalRows):
        place = replace(DataPlace.of(pm), dp_rank=share)
        return (_piece(data.local_batch(i, place), True) for i in range(count))
    batches = ([data.global_batch(i) for i in range(count)] if isinstance(data, BatchList)
               else list(data[:count]))
    pieces = []
    for batch in batches:
        if not token_pair(batch):
            check_batch(batch)
        own = share == pm.dp_rank or pm.dp_size == 1
        pieces.append(_piece(batch if own else slice_batch(batch, pm.dp_size, share), not own))
    return iter(pieces)


def _piece(batch: Any, local: bool) -> tuple[str, Any]:
    return ("tokens", (batch[0], batch[1], local)) if token_pair(batch) else ("batch", (batch, local))


def _token_sums(pm: Any, inputs: torch.Tensor, targets: torch.Tensor,
                local: bool) -> tuple[float, int, str, bool]:
    inputs = pm._dp_slice(inputs, local).to(pm.device)
    targets = pm._dp_slice(targets, local).to(pm.device)
    language = pm.parallelize_options.get("loss_fn") is None  # the model's own or the default cross-entropy
    if pm._runner is not None:
        return pm._runner.evaluate(inputs, targets, _times_units(pm.loss_fn, _scored_tokens)), \
            _scored_tokens(targets), "tokens", language
    loss, scored = pm._token_loss(inputs, targets, bare_module(pm.model))
    count = _scored_tokens(scored)
    return (loss.double().item() * count if count else 0.0), count, "tokens", language


def _batch_sums(pm: Any, batch: Any, local: bool) -> tuple[float, int, str, bool]:
    if pm.cp_size > 1:
        raise ValueError("context parallel splits token sequences; evaluate (inputs, targets) token batches "
                         "under it, or use cp=1")
    if pm.dp_size > 1 and not local:
        batch = slice_batch(batch, pm.dp_size, pm.dp_rank)
    batch = batch_to(batch, pm.device)
    loss_fn, labels = pm.batch_loss_fn, labels_of(batch)
    if isinstance(loss_fn, LabelMean) and labels is not None:  # `_summed_labels`: the loss is a sum
        score, count, unit = loss_fn, counted_labels(labels, loss_fn.shifts), "labels"
        language = hf_token_loss(bare_module(pm.model_parts[0])) is not None
        inputs = {k: v for k, v in batch.items() if k != "labels"}
    else:
        score, count, unit, language = _times_units(loss_fn, batch_size), batch_size(batch), "samples", False
        inputs = batch
    if pm._runner is not None:
        return pm._runner.evaluate_batch(batch, score), count, unit, language
    with pm._autocast():
        total = score(call_model(bare_module(pm.model), inputs), batch)
    return float(total.double().item()), count, unit, language


def _times_units(loss_fn: Callable[[Any, Any], torch.Tensor],
                 units: Callable[[Any], int]) -> Callable[[Any, Any], torch.Tensor]:
    """A mean loss turned into a sum: ``loss_fn(outputs, target) × units(target)`` (0 with none)."""
    def summed(outputs: Any, target: Any) -> torch.Tensor:
        count = units(target)
        loss = loss_fn(outputs, target).double()
        return loss * count if count else torch.zeros_like(loss)
    return summed


def _scored_tokens(targets: torch.Tensor) -> int:
    return int((targets != -100).sum())


@contextlib.contextmanager
def _summed_labels(loss_fn: Any) -> Iterator[None]:
    """`LabelMean` divides its summed per-label loss by `items`; 1 makes it the sum itself."""
    if not isinstance(loss_fn, LabelMean):
        yield
        return
    saved, loss_fn.items = loss_fn.items, 1.0
    try:
        yield
    finally:
        loss_fn.items = saved
