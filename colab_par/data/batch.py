"""Batches beyond (tokens, targets): how a batch is sliced over ranks, fed to the model and scored.

A batch is whatever the model takes, as one object:
- a tuple or list ``(*inputs, target)``: the model is called as ``model(*inputs)``, the last element
  is the target (images and labels: ``(images, labels)``);
- a dict of named tensors: the model is called with the keys its ``forward`` accepts
  (``input_ids``, ``attention_mask``, ``labels``, ...), Hugging Face style.
Data parallel slices every tensor in it along dim 0 (the batch dimension). The loss is
``loss_fn(outputs, batch)``; without one, the model's own ``outputs.loss`` (Hugging Face models
given ``labels``), else cross-entropy of the outputs (or ``outputs.logits``) against the target.
With `labels` in a dict batch the default loss is the mean over counted labels (-100 ignored), and
ranks may hold different numbers of them (padded or masked-LM batches): `LabelMean` scores each
piece with the model's own per-token loss (transformers' causal or masked LM loss, which knows
whether it shifts the labels) given the count over all ranks as `num_items_in_batch`, exactly as
one process would. A user's `loss_fn` is averaged over ranks (and pipeline microbatches) as it is.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from colab_par.compat import tree_flatten, tree_map
from colab_par.models.hf import hf_token_loss, is_hf_model, shifts_labels

__all__ = ["Batch", "BatchLossFn", "check_batch", "batch_size", "slice_batch", "batch_to", "call_model",
           "default_batch_loss", "default_loss", "labels_of", "counted_labels", "label_count", "LabelMean"]

Batch = Any  # tuple/list (*inputs, target) or dict of tensors
BatchLossFn = Callable[[Any, Batch], torch.Tensor]


def check_batch(batch: Batch) -> None:
    """Refuse what the kit cannot slice over ranks, before any work."""
    if isinstance(batch, dict):
        if not any(isinstance(v, torch.Tensor) for v in batch.values()):
            raise TypeError("the batch dict holds no tensor; give e.g. {'input_ids': ..., 'labels': ...}")
        return
    if isinstance(batch, (tuple, list)):
        if len(batch) < 2:
            raise TypeError(f"a tuple batch is (*inputs, target); got {len(batch)} element(s). "
                            "Add the target, or pass a dict batch and loss_fn(outputs, batch)")
        return
    raise TypeError(f"a batch is a tuple (*inputs, target) or a dict of tensors, not "
                    f"{type(batch).__name__}")


def batch_size(batch: Batch) -> int:
    """The batch dimension shared by every tensor of the batch."""
    sizes = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim()}
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors disagree on the batch dimension (dim 0): {sorted(sizes)}; "
                         "every tensor in a batch needs the same first dimension")
    return sizes.pop()


def slice_batch(batch: Batch, parts: int, index: int) -> Batch:
    """This rank's equal share along dim 0 of every tensor (non-tensors are kept whole)."""
    size = batch_size(batch)
    if size % parts:
        raise ValueError(f"global batch of {size} samples does not split over {parts} ranks; "
                         f"use a batch size that is a multiple of {parts}")
    step = size // parts
    return tree_map(lambda t: t[index * step:(index + 1) * step]
                    if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """`batch` on `device`. Host tensors go to a GPU through pinned memory without waiting: a plain
    ``.to("cuda")`` from pageable memory waits until the device has run everything queued before it."""
    device = torch.device(device)

    def moved(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    return tree_map(moved, batch)


def call_model(model: nn.Module, batch: Batch) -> Any:
    """The model's outputs for `batch` (see the module docstring for the calling convention)."""
    if isinstance(batch, dict):
        return model(**{k: v for k, v in batch.items() if k in forward_keywords(model)})
    return model(*batch[:-1])


def default_batch_loss(outputs: Any, batch: Batch) -> torch.Tensor:
    """outputs.loss when the model computed one, else cross-entropy against the target."""
    loss = getattr(outputs, "loss", None)
    if loss is not None:
        return loss
    logits = getattr(outputs, "logits", outputs)
    target = batch.get("labels") if isinstance(batch, dict) else batch[-1]
    if not isinstance(logits, torch.Tensor) or target is None:
        raise ValueError("no default loss for this batch: the model returned no `.loss` and the batch "
                         "has no target; pass parallelize(..., loss_fn=lambda outputs, batch: ...)")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def labels_of(batch: Batch) -> torch.Tensor | None:
    """A dict batch's `labels` (what the default loss averages over), else None."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    return labels if isinstance(labels, torch.Tensor) else None


def counted_labels(labels: torch.Tensor, shifted: bool) -> int:
    """Labels a loss averages over: not -100 (ignored), after a causal LM's shift by one."""
    return int(label_count(labels, shifted))


def label_count(labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    """`counted_labels` as a tensor where the labels are (not read: no wait for the device)."""
    return ((labels[..., 1:] if shifted else labels) != -100).sum()


def default_loss(model: nn.Module) -> BatchLossFn:
    """The loss `parallelize` scores batches with when the user gives none: `LabelMean` for a
    model whose per-token loss it can average exactly over ranks (transformers' language models
    and models that are not transformers'), else the model's own ``outputs.loss`` (a transformers
    classifier's, which each rank computes on its equal share of samples)."""
    if is_hf_model(model) and hf_token_loss(model) is None:
        return default_batch_loss
    return LabelMean(model)


class LabelMean:
    """The default loss of labelled dict batches: `default_batch_loss` until `items` is set, then
    the model's own per-token loss (cross-entropy for a model that is not transformers') summed
    over this piece's labels and divided by `items`, which the model sets every step to the labels
    counted over all dp ranks / (ranks × microbatches): the average over ranks and microbatches is
    then the mean over all labels, as in one process. -100 is ignored; whether labels are shifted
    (position t predicts label t+1) is the loss's own business, and `shifts` says which labels
    it counts."""

    def __init__(self, model: nn.Module):
        self.loss = hf_token_loss(model) or _summed_cross_entropy
        self.shifts = shifts_labels(model)
        self.items: float | torch.Tensor | None = None  # a tensor on the device while training

    def __call__(self, outputs: Any, batch: Batch) -> torch.Tensor:
        labels = labels_of(batch)
        if labels is None or self.items is None:
            return default_batch_loss(outputs, batch)
        logits = getattr(outputs, "logits", outputs).contiguous()
        return self.loss(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=self.items)


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                          num_items_in_batch: float) -> torch.Tensor:
    """Cross-entropy summed over the labels (-100 ignored) / `num_items_in_batch`, unshifted, in
    the signature of transformers' language-model losses."""
    total = F.cross_entropy(logits.reshape(-1, vocab_size).float(), labels.reshape(-1).to(logits.device),
                            ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def forward_keywords(model: nn.Module) -> set[str] | _Everything:
    forward = getattr(model, "module", model).forward  # DDP wraps the user's module
    params = inspect.signature(forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return _Everything()
    return set(params)


class _Everything:
    """A forward taking **kwargs accepts every key."""

    def __contains__(self, key: object) -> bool:
        return True
