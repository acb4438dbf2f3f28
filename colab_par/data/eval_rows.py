"""A user's held-out dataset (torch Dataset, DataLoader, Hugging Face `datasets.Dataset`) read once
whole for evaluation, each data-parallel rank reading and collating only its share.

Global batch i holds rows iB .. iB+B-1 in the dataset's own order (a mean does not depend on
order, so nothing is shuffled) and dp rank k of d reads the k-th of d equal shares, as training
reads its data (`data_sources.py`). The last batch is filled up to B with copies of the first rows
whose labels are set to -100 (a dict's `labels`, or the targets of an ``(inputs, targets)`` token
pair): every rank then runs the same forwards on the same shapes (FSDP gathers its parameters in
every forward; pipeline stages split a batch into equal microbatches) and no row counts twice.
A loss that counts samples (a custom `loss_fn`, unlabelled rows) has nothing to mask, so such a
dataset must fill whole batches.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from colab_par.data.sources import DataPlace, MapSource
from colab_par.data.workers import LoaderOptions
from colab_par.data.batch import Batch, LabelMean

__all__ = ["EvalRows", "eval_rows", "maskable", "token_pair"]


class EvalRows:
    """Every row of `dataset` once, in global batches of `batch_size` (module docstring)."""

    def __init__(self, dataset: Any, batch_size: int, collate_fn: Any = None, reading: LoaderOptions | None = None):
        """`reading`: a DataLoader's workers, pinning and prefetch, which read the rows when given."""
        self.source = MapSource(dataset, batch_size, shuffle=False, collate_fn=collate_fn, reading=reading)
        self.rows, self.batch_size = self.source.length, batch_size
        self.count = math.ceil(self.rows / batch_size)

    def check(self, pm: Any) -> None:
        """Refuse, before any work, what training would refuse, and a last batch that cannot be
        filled without counting rows twice."""
        self.source.check(pm)
        if self.rows % self.batch_size and not maskable(self.source.collate(self.source.first_rows(1)), pm):
            fits = [b for b in range(pm.dp_size, self.rows + 1, pm.dp_size) if self.rows % b == 0]
            example = ([b for b in fits if b <= self.batch_size] or fits or [self.rows])[-1]
            raise ValueError(f"the {self.rows} evaluation rows do not fill whole global batches of "
                             f"{self.batch_size}, and their loss counts samples, so a filled-up last "
                             "batch would count rows twice; use a batch size that divides the rows "
                             f"(e.g. {example}), or rows with labels")

    def local_batch(self, index: int, place: DataPlace) -> Batch:
        """This rank's share of global batch `index`, rows past the end masked."""
        batch = self.source.local_batch(index, place)
        share = self.batch_size // place.dp_size
        first = index * self.batch_size + place.dp_rank * share
        past_end = torch.arange(first, first + share) >= self.rows
        return _masked(batch, past_end) if bool(past_end.any()) else batch

    def close(self) -> None:
        """End of an evaluation pass: workers that are not persistent exit."""
        self.source.close()


def eval_rows(data: Any, batch_size: int | None) -> EvalRows:
    """`data` (a DataLoader, or an indexable dataset with a length) as EvalRows; a DataLoader
    brings its batch size (the global batch) and collate function."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if (isinstance(dataset, (IterableDataset, str, bytes, Mapping))
            or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))):
        raise TypeError(f"evaluation data is read whole every time, so it needs a length: give a torch "
                        f"Dataset, a DataLoader over one, a Hugging Face datasets.Dataset, a colab_par.data "
                        f"dataset or a list of global batches, not a {type(dataset).__name__} (a stream "
                        "can be read once into a list of rows first)")
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            raise ValueError("this DataLoader has a batch_sampler (or batch_size=None); build it with "
                             "batch_size=<global batch>")
        if batch_size is not None and batch_size != data.batch_size:
            raise ValueError(f"batch_size={batch_size} but the DataLoader's is {data.batch_size}; leave "
                             "batch_size out (the loader's batch_size is the global batch)")
        return EvalRows(dataset, data.batch_size, data.collate_fn, LoaderOptions.of(data))
    if batch_size is None:
        raise ValueError(f"a {type(data).__name__} has rows, not batches: pass batch_size= (the GLOBAL "
                         "batch, rows over all data-parallel ranks), or a DataLoader that has one")
    return EvalRows(dataset, batch_size)


def maskable(batch: Batch, pm: Any) -> bool:
    """Whether evaluation counts this batch's loss by labels or target tokens (which -100 masks)."""
    if isinstance(batch, dict):
        return isinstance(batch.get("labels"), torch.Tensor) and isinstance(pm.batch_loss_fn, LabelMean)
    return token_pair(batch) and pm.parallelize_options.get("loss_fn") is None


def token_pair(batch: Any) -> bool:
    """Exactly two integer tensors of one shape: ``(inputs, targets)`` token batches."""
    return (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool
                    for t in batch)
            and batch[0].shape == batch[1].shape and batch[0].dim() >= 2)


def _masked(batch: Batch, rows: torch.Tensor) -> Batch:
    if isinstance(batch, dict):
        labels = batch["labels"].clone()
        labels[rows] = -100
        return {**batch, "labels": labels}
    targets = batch[1].clone()
    targets[rows] = -100
    return type(batch)((batch[0], targets)) if isinstance(batch, tuple) else [batch[0], targets]
