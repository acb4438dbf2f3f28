"""The user's own data as the global batches `Trainer` steps through: a torch map-style `Dataset`,
an `IterableDataset`, a `DataLoader` or a Hugging Face `datasets.Dataset`.

One contract for every source, whatever the layout:
- `batch_size` is the GLOBAL batch of one micro-step (rows summed over the dp ranks), as for the
  kit's token datasets; a DataLoader's `batch_size` is read that way, so the same loader gives the
  same training under dp1 and dp8.
- The data is one stream of rows, epoch after epoch. Epoch e visits the N rows in the order
  `torch.randperm(N, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))` when
  shuffling, 0..N-1 otherwise: the same on every rank and for every dp size. Global batch i holds
  stream rows i*B .. i*B+B-1; dp rank k of d takes the k-th of d equal consecutive shares and reads
  (and collates) only those rows.
- A batch is never short. At the end of an epoch the default (`drop_last=False`) wraps: the batch
  that crosses the end holds the epoch's last rows and the next epoch's first, so every row of
  every epoch is trained on exactly once. `drop_last=True` (a DataLoader's own setting is kept)
  skips the N mod B rows that do not fill a batch, a different set each shuffled epoch.
- The position is `Trainer.data_position`, global batches consumed: one number, the same on every
  rank and under every layout, so a checkpoint resumes with exactly the next rows, also after a
  relayout to another dp size.

An IterableDataset cannot be indexed, so rank 0 alone reads it and sends each rank its collated
dp share (one `scatter_object_list` per micro-step). That costs a collective per micro-step and
rank 0's reading time inside every step, but the stream is read once in all rather than once per
rank. Its position adds (pass, rows read in that pass), which rank 0 sends with every share (so
every rank holds it, and a replacement of rank 0 can take it from a live peer) and saves; a resume
opens that pass again and skips those rows (reading them once more), since a plain iterable
cannot seek.
Streams are not shuffled here: one with `set_epoch` (Hugging Face's IterableDataset) is told each
pass's number, so its own seeded shuffle changes per pass.

A DataLoader of a map-style dataset with workers or pinning is read the way it says: its
`num_workers`, `pin_memory`, `prefetch_factor`, `persistent_workers`, `worker_init_fn`, `timeout`
and `multiprocessing_context` drive torch's own DataLoader over the rows above (`data_workers.py`;
the position stays the kit's, exact under resume and relayout), and its `generator` seeds the
shuffle (its `initial_seed()`, in place of the Trainer's `seed`) and the workers. What cannot be
honoured is refused before any work: a stream read by workers or pinned (rank 0 reads it for every
rank), `in_order=False`, samplers that order rows themselves.
"""
from __future__ import annotations

import hashlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from colab_par.compat import tree_flatten
from colab_par.data.workers import LoaderOptions, WorkerReader
from colab_par.data.batch import Batch, check_batch

__all__ = ["DataSource", "MapSource", "IterableSource", "DataPlace", "data_source", "stack_rows",
           "dp_total"]

Collate = Callable[[list[Any]], Batch]


@dataclass(frozen=True)
class DataPlace:
    """Where this rank sits in data parallel: its dp rank of `dp_size`, and the dp rank of every
    world rank in world order (what rank 0 needs to send each rank its share of a stream)."""

    dp_rank: int = 0
    dp_size: int = 1
    dp_rank_of: tuple[int, ...] = (0,)

    @classmethod
    def of(cls, pm: Any) -> "DataPlace":
        """From a ParallelModel's mesh (global ranks laid out over named dims); no communication."""
        if not dist.is_initialized():
            return cls()
        ranks = pm.mesh.mesh.movedim(pm.mesh.mesh_dim_names.index("dp"), 0).reshape(pm.dp_size, -1)
        dp_rank_of = [0] * dist.get_world_size()
        for dp_rank, members in enumerate(ranks.tolist()):
            for rank in members:
                dp_rank_of[rank] = dp_rank
        return cls(pm.dp_rank, pm.dp_size, tuple(dp_rank_of))


class DataSource(ABC):
    """Global batches of `batch_size` rows, handed out as each rank's dp share (module docstring)."""

    batch_size: int
    collate: Collate
    drop_last: bool

    @abstractmethod
    def local_batch(self, index: int, place: DataPlace) -> Batch:
        """This rank's rows of global batch `index` (0, 1, 2, ... over all epochs), collated."""

    @abstractmethod
    def first_rows(self, count: int) -> list[Any]:
        """The first `count` rows of global batch 0, read for checks before any work."""

    @abstractmethod
    def describe(self) -> dict:
        """A JSON-able fingerprint stored in checkpoints (a resume with other data is refused);
        computed from sizes, settings and a digest of a row or two, never the whole dataset."""

    def state_dict(self) -> dict:
        """Position beyond the batch index (JSON-able; the same meaning under every layout)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`."""

    def close(self) -> None:
        """End of a fit: stop reading ahead (workers that are not persistent exit)."""

    def check(self, pm: Any) -> None:
        """Refuse, before any work, a batch that dp cannot split or the model cannot take."""
        if pm.cp_size > 1:
            raise ValueError("context parallel splits the token sequences of colab_par.data's token "
                             "datasets (TextDataset, SyntheticDataset); rows of your own data go to the "
                             "model whole: use a layout with cp=1")
        share, remainder = divmod(self.batch_size, pm.dp_size)
        if remainder:
            multiple = self.batch_size + pm.dp_size - remainder
            raise ValueError(f"the global batch_size={self.batch_size} does not split over dp={pm.dp_size} "
                             f"ranks; use a multiple of {pm.dp_size} (e.g. {multiple}). batch_size is the "
                             "GLOBAL batch: rows summed over all data-parallel ranks")
        microbatches = pm.layout.microbatches if pm.layout.pp > 1 else 1
        if share % microbatches:
            raise ValueError(f"each dp rank gets {share} rows of the global batch_size={self.batch_size}, "
                             f"which do not split into microbatches={microbatches}; use a batch_size that "
                             f"is a multiple of {pm.dp_size * microbatches}")
        check_model_takes(self.collate(self.first_rows(self.batch_size)), pm)  # one batch, read once
        self.describe()  # fingerprinted before any reading (a stream's is its first row)


class MapSource(DataSource):
    """Rows `dataset[i]` of anything indexable with a length: torch map-style Datasets, Hugging Face
    `datasets.Dataset` (read through its batched `__getitems__`)."""

    def __init__(self, dataset: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 collate_fn: Collate | None = None, drop_last: bool = False,
                 reading: LoaderOptions | None = None):
        _check_batch_size(batch_size)
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.collate, self.drop_last = collate_fn or stack_rows, drop_last
        self.reading = reading if reading is not None and reading.reads_apart else None
        self._readers: dict[DataPlace, WorkerReader] = {}  # one a dp place read (`local_batch`)
        self.length = len(dataset)
        if self.length == 0:
            raise ValueError(f"the dataset ({type(dataset).__name__}) has no rows; give one with at "
                             "least one row (check the split or filter that built it)")
        if drop_last and self.length < batch_size:
            raise ValueError(f"drop_last=True with {self.length} rows and a global batch_size={batch_size} "
                             "gives no batch at all; lower batch_size or use drop_last=False (wrap into "
                             "the next epoch)")
        self._orders: dict[int, torch.Tensor] = {}
        self._description: dict | None = None

    def row_numbers(self, index: int, place: DataPlace) -> list[int]:
        """Dataset row numbers of this rank's share of global batch `index`."""
        share = self.batch_size // place.dp_size
        if self.drop_last:
            epoch, slot = divmod(index, self.length // self.batch_size)
            first = slot * self.batch_size + place.dp_rank * share
            places = [(epoch, first + r) for r in range(share)]
        else:
            first = index * self.batch_size + place.dp_rank * share
            places = [divmod(sample, self.length) for sample in range(first, first + share)]
        epochs = {epoch for epoch, _ in places}
        self._orders = {e: order for e, order in self._orders.items() if e >= min(epochs)}
        return [int(self._order(epoch)[slot]) for epoch, slot in places]

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if self.shuffle:
                generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2 ** 64)
                self._orders[epoch] = torch.randperm(self.length, generator=generator)
            else:
                self._orders[epoch] = torch.arange(self.length)
        return self._orders[epoch]

    def local_batch(self, index: int, place: DataPlace) -> Batch:
        if self.reading is None:
            return self.collate(self._read(self.row_numbers(index, place)))
        return self._reader(place).batch(index, place)

    def _reader(self, place: DataPlace) -> WorkerReader:
        """The workers reading `place`'s shares ahead: one reader a place of the world, so a rank
        that also reads a lost rank's shares (`training/resilience/degraded.py`) keeps both
        streams of batches flowing; readers of another world's places (a relayout) are dropped."""
        if place not in self._readers:
            for other in [other for other in self._readers if other.dp_rank_of != place.dp_rank_of]:
                self._readers.pop(other).close()
            self._readers[place] = WorkerReader(self.dataset, self.row_numbers, self.collate, self.reading)
        return self._readers[place]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()

    def first_rows(self, count: int) -> list[Any]:
        return self._read(self.row_numbers(0, DataPlace())[:count])

    def _read(self, rows: list[int]) -> list[Any]:
        many = getattr(self.dataset, "__getitems__", None)  # one batched read (Hugging Face, Subset)
        return list(many(rows)) if many is not None else [self.dataset[row] for row in rows]

    def describe(self) -> dict:
        if self._description is None:  # (not Hugging Face's own fingerprint: it can be random)
            self._description = {"kind": "map", "dataset": _qualname(self.dataset), "rows": self.length,
                                 "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
                                 "drop_last": self.drop_last, "collate": _qualname(self.collate),
                                 "fingerprint": row_digest(self._read([0, self.length - 1]))}
        return self._description


class IterableSource(DataSource):
    """Rows of a stream (torch IterableDataset, Hugging Face IterableDataset, any re-iterable):
    rank 0 reads and scatters each rank's collated share (module docstring)."""

    def __init__(self, dataset: Any, batch_size: int, *, collate_fn: Collate | None = None,
                 drop_last: bool = False):
        _check_batch_size(batch_size)
        self.dataset, self.batch_size = dataset, batch_size
        self.collate, self.drop_last = collate_fn or stack_rows, drop_last
        self.epoch, self.offset, self.batches = 0, 0, 0  # pass, rows read in it, global batches handed out
        self._rows: Iterator[Any] | None = None  # rank 0's open pass
        self._description: dict | None = None

    def local_batch(self, index: int, place: DataPlace) -> Batch:
        self._next_batch(index)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world == 1:
            return self._read_shares(1)[0]
        outgoing, failure = None, None
        if rank == 0:
            try:
                shares = self._read_shares(place.dp_size)
                outgoing = [(shares[dp_rank], self.epoch, self.offset) for dp_rank in place.dp_rank_of]
            except Exception as error:  # every rank waits on this scatter: tell them, then raise
                failure, outgoing = error, [_ReadFailure(f"{type(error).__name__}: {error}")] * world
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, outgoing, src=0)
        if failure is not None:
            raise failure
        if isinstance(mine[0], _ReadFailure):
            raise RuntimeError(f"rank 0, which reads the stream for every rank, failed: {mine[0].message}")
        share, self.epoch, self.offset = mine[0]  # every rank keeps rank 0's place: any can hand it on
        return share

    def shares_read_here(self, index: int, dp_size: int) -> list[Batch]:
        """Every dp share of global batch `index`, read by this rank alone from the place it holds,
        no collective: for the ranks that train on without a lost peer
        (`training/resilience/degraded.py`), each reading the stream itself."""
        self._next_batch(index)
        return self._read_shares(dp_size)

    def _next_batch(self, index: int) -> None:
        if index != self.batches:
            raise RuntimeError(f"a stream is read in order: batch {index} was asked for after "
                               f"{self.batches} batches; resume through Trainer.load_state_dict (a "
                               "checkpoint) rather than by setting data_position")
        self.batches += 1

    def _read_shares(self, dp_size: int) -> list[Batch]:
        rows: list[Any] = []
        while len(rows) < self.batch_size:
            if self._rows is None:
                self._rows = self._open(self.epoch, skip=self.offset)
            row = next(self._rows, _END)
            if row is not _END:
                rows.append(row)
                self.offset += 1
                continue
            if self.offset == 0:
                raise ValueError(f"pass {self.epoch} of the stream gave no rows; a stream must give "
                                 "the same rows on every pass (an IterableDataset, not a one-shot generator)")
            if self.drop_last and self.offset < self.batch_size:
                raise ValueError(f"pass {self.epoch} of the stream gave {self.offset} rows, fewer than one "
                                 f"batch of {self.batch_size}, and drop_last=True drops them all; use "
                                 "drop_last=False (wrap into the next pass) or a smaller batch_size")
            if self.drop_last:
                rows.clear()
            self.epoch, self.offset, self._rows = self.epoch + 1, 0, None
        share = self.batch_size // dp_size
        return [self.collate(rows[k * share:(k + 1) * share]) for k in range(dp_size)]

    def _open(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        rows = iter(self.dataset)
        for read in range(skip):
            if next(rows, _END) is _END:
                raise ValueError(f"pass {epoch} of the stream ended after {read} rows, but the "
                                 f"checkpoint had read {skip}: the stream changed since it was saved")
        return rows

    def first_rows(self, count: int) -> list[Any]:
        first = [row for _, row in zip(range(count), self._open(0))]
        if not first:
            raise ValueError(f"the stream ({type(self.dataset).__name__}) gave no rows; give one that "
                             "yields at least one row per pass")
        return first

    def describe(self) -> dict:
        if self._description is None:
            self._description = {"kind": "iterable", "dataset": _qualname(self.dataset),
                                 "batch_size": self.batch_size, "drop_last": self.drop_last,
                                 "collate": _qualname(self.collate),
                                 "fingerprint": row_digest(self.first_rows(1))}
        return self._description

    def state_dict(self) -> dict:
        """The place in the stream: rank 0's, which it sends every rank with its share, so a
        replacement of rank 0 that takes a live peer's state reads on from there."""
        return {"pass": self.epoch, "rows_read": self.offset, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        if not {"pass", "rows_read", "batches"} <= set(state):
            raise ValueError(f"the saved state {state} holds no place in a stream; resume from a "
                             "checkpoint that a Trainer on this stream wrote")
        place = (int(state["pass"]), int(state["rows_read"]), int(state["batches"]))
        if place != (self.epoch, self.offset, self.batches):  # (a relayout keeps the open pass)
            (self.epoch, self.offset, self.batches), self._rows = place, None


_END = object()


@dataclass(frozen=True)
class _ReadFailure:
    """What rank 0 scatters instead of shares when reading the stream failed."""

    message: str


def data_source(data: Any, batch_size: int | None = None, *, shuffle: bool = True, seed: int = 0,
                collate_fn: Collate | None = None, drop_last: bool = False) -> DataSource:
    """`data` (a DataSource, DataLoader, IterableDataset, or anything indexable with a length) as a
    DataSource of global batches of `batch_size` rows. A DataLoader brings its own batch size,
    collate function, order (shuffle or not), drop_last and reading settings (workers, pinning,
    prefetch); `seed` seeds the shuffle, unless the DataLoader has a `generator`."""
    if isinstance(data, DataSource):
        return data
    if isinstance(data, DataLoader):
        return _from_loader(data, batch_size, seed)
    streamed = isinstance(data, IterableDataset)
    indexed = not streamed and hasattr(data, "__getitem__") and hasattr(data, "__len__")
    if isinstance(data, (str, bytes, Mapping)) or not (streamed or indexed or hasattr(data, "__iter__")):
        raise TypeError(f"{type(data).__name__} is not data to train on: give a torch Dataset (with "
                        "__getitem__ and __len__), an IterableDataset, a DataLoader, a Hugging Face "
                        "datasets.Dataset (datasets.Dataset.from_dict(columns) for a dict of columns), "
                        "a colab_par.data dataset (TextDataset, SyntheticDataset) or a list of global "
                        "batches")
    if batch_size is None:
        raise ValueError(f"a {type(data).__name__} has rows, not batches: pass batch_size= (the GLOBAL "
                         "batch, rows over all data-parallel ranks), or a DataLoader that has one")
    if indexed:
        return MapSource(data, batch_size, shuffle=shuffle, seed=seed, collate_fn=collate_fn,
                         drop_last=drop_last)
    return IterableSource(data, batch_size, collate_fn=collate_fn, drop_last=drop_last)


def _from_loader(loader: DataLoader, batch_size: int | None, seed: int) -> DataSource:
    if loader.batch_size is None:
        raise ValueError("this DataLoader has a batch_sampler (or batch_size=None), which sets batches "
                         "that colab_par cannot split over ranks by position: build it with "
                         "batch_size=<global batch> and shuffle=True/False instead")
    if batch_size is not None and batch_size != loader.batch_size:
        raise ValueError(f"batch_size={batch_size} but the DataLoader's is {loader.batch_size}; leave "
                         "batch_size out (the loader's batch_size is the global batch)")
    if not loader.in_order:
        raise ValueError("in_order=False lets workers hand batches back in any order, so the position a "
                         "checkpoint saves would not say which rows were trained on; build the loader "
                         "with in_order=True (the default)")
    reading = LoaderOptions.of(loader)
    if isinstance(loader.dataset, IterableDataset):
        if reading.reads_apart:
            raise ValueError(f"this DataLoader reads a stream with num_workers={loader.num_workers}, "
                             f"pin_memory={loader.pin_memory}: colab_par reads a stream on rank 0 alone "
                             "and sends each rank its rows, in order, so that a checkpoint knows the place "
                             "in it; build the loader with num_workers=0 and pin_memory=False, or give a "
                             "map-style Dataset (__getitem__ and __len__), whose rows workers can read")
        return IterableSource(loader.dataset, loader.batch_size, collate_fn=loader.collate_fn,
                              drop_last=loader.drop_last)
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) and not sampler.replacement and sampler.num_samples == len(
            loader.dataset):
        shuffle = True
    elif isinstance(sampler, SequentialSampler):
        shuffle = False
    else:
        raise ValueError(f"the DataLoader's sampler ({type(sampler).__name__}) is not one colab_par can "
                         "split over ranks: it orders rows itself (seeded, the same on every rank), so "
                         "build the loader with shuffle=True or False and no sampler (no "
                         "DistributedSampler either: the global batch is split over dp here)")
    if shuffle and loader.generator is not None:  # the loader's own seed orders its rows
        seed = loader.generator.initial_seed()
    return MapSource(loader.dataset, loader.batch_size, shuffle=shuffle, seed=seed,
                     collate_fn=loader.collate_fn, drop_last=loader.drop_last, reading=reading)


# ---- collating and checking rows ------------------------------------------------------------------
def stack_rows(rows: list[Any]) -> Batch:
    """Rows (dicts of columns, or tuples) as one batch: each column stacked into a tensor along a
    new first dim. Lists of numbers become tensors; text and ragged columns are refused with the
    way out (a collate_fn that pads, or packing with `colab_par.data.pack_text`)."""
    first = rows[0]
    if isinstance(first, Mapping):
        return {key: _stack([row[key] for row in rows], f"column {key!r}") for key in first}
    if isinstance(first, tuple):
        return tuple(_stack([row[i] for row in rows], f"element {i} of the rows") for i in range(len(first)))
    return _stack(rows, "the rows")


def _stack(values: list[Any], name: str) -> torch.Tensor:
    if _holds_text(values[0]):
        raise TypeError(f"{name} holds text ({values[0]!r:.60}), which a model cannot take: tokenize it "
                        "first (colab_par.data.pack_text(dataset, tokenizer, seq_len), or dataset.map "
                        "with your tokenizer) or remove the column (dataset.remove_columns)")
    try:
        tensors = [torch.as_tensor(value) for value in values]
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{name} cannot become a tensor ({error}); give rows of numbers or tensors, "
                        "or a collate_fn that builds the batch") from None
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"{name} has rows of different shapes {sorted(shapes)[:3]}: pack them to one "
                         "length (colab_par.data.pack_text) or give a collate_fn that pads (e.g. "
                         "transformers.DataCollatorWithPadding(tokenizer))")
    return torch.stack(tensors)


def _holds_text(value: Any) -> bool:
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return isinstance(value, (str, bytes))


def check_model_takes(batch: Batch, pm: Any) -> None:
    """Refuse a collated batch the model cannot be called with (keys its forward lacks or needs,
    values that are not tensors, no labels for a forward that scores them), before any work."""
    check_batch(batch)
    if pm.layout.pp > 1:
        return  # pipeline stages take what their split gives them; the runner checks its batch
    model = pm.model_parts[0]
    forward = getattr(model, "module", model).forward  # DDP keeps the user's module under .module
    params = {name: p for name, p in inspect.signature(forward).parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())
    required = [name for name, p in params.items() if p.default is p.empty]
    if isinstance(batch, dict):
        called = set(batch) if takes_any else set(batch) & set(params)  # what call_model passes
        if params and not set(batch) & set(params):
            raise ValueError(f"the rows have keys {sorted(batch)} but the model's forward takes "
                             f"{sorted(params)}: rename or map the columns to the forward's arguments")
        missing = [name for name in required if name not in batch]
        if missing:
            raise ValueError(f"the model's forward needs {missing}, which the rows (keys {sorted(batch)}) "
                             "lack; add those columns or map the rows to them")
        for key in sorted(called):
            if not isinstance(batch[key], torch.Tensor):
                raise TypeError(f"the batch's {key!r} is a {type(batch[key]).__name__}, not a tensor; "
                                "give rows of numbers or tensors (a Hugging Face dataset in a DataLoader: "
                                ".with_format('torch')), or a collate_fn that returns tensors")
        custom_loss = pm.parallelize_options.get("loss_fn") is not None
        if "labels" in params and "labels" not in batch and not custom_loss:
            raise ValueError(f"the model scores `labels` but the rows (keys {sorted(batch)}) have none: "
                             "add a labels column (pack_text gives labels = input_ids) or pass "
                             "parallelize(..., loss_fn=lambda outputs, batch: ...)")
        return
    inputs = batch[:-1]
    for i, value in enumerate(batch):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"element {i} of the batch is a {type(value).__name__}, not a tensor; give "
                            "rows of numbers or tensors, or a collate_fn that returns tensors")
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(inputs) < len(required) or (len(inputs) > len(positional) and not any(
            p.kind is p.VAR_POSITIONAL for p in inspect.signature(forward).parameters.values())):
        raise ValueError(f"a tuple row is (*inputs, target): {len(inputs)} input(s) for a forward taking "
                         f"{[p.name for p in positional]} ({len(required)} required); change the rows or "
                         "give dict rows keyed by the forward's argument names")


# ---- small shared helpers -------------------------------------------------------------------------
def row_digest(rows: list[Any]) -> str:
    """A short SHA-256 of rows' structure and values (tensors by their bytes)."""
    sha = hashlib.sha256()
    leaves, spec = tree_flatten(rows)
    sha.update(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            flat = leaf.detach().cpu().contiguous().reshape(-1)
            sha.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            sha.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        else:
            sha.update(repr(leaf).encode())
    return sha.hexdigest()[:16]


def dp_total(count: int, pm: Any) -> int:
    """The sum of a per-rank count over the dp ranks (one tiny all-reduce; none without dp)."""
    if pm.dp_size == 1:
        return count
    total = torch.tensor(float(count), dtype=torch.float64, device=pm.device)
    dist.all_reduce(total, group=pm.mesh["dp"].get_group())
    return int(total.item())


def _check_batch_size(batch_size: Any) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer: the GLOBAL batch, "
                         "rows over all data-parallel ranks")


def _qualname(value: Any) -> str:
    kind = value if inspect.isfunction(value) or inspect.isclass(value) else type(value)
    return f"{kind.__module__}.{kind.__qualname__}"
