"""A map-style source's batches read by torch DataLoader worker processes, in exactly the order
the source defines, so a user's `num_workers`, `pin_memory`, `prefetch_factor`,
`persistent_workers`, `worker_init_fn`, `timeout`, `multiprocessing_context` and `generator` (the
workers' base seed) work as torch documents them.

The source decides which rows each rank reads for each global batch (a pure function of the batch
index and the dp place, `data_sources.MapSource.row_numbers`); a batch sampler hands those row
lists to torch's own DataLoader, starting from the batch asked for. The kit keeps the position
(global batches consumed): batches the workers read ahead and the loop did not take are dropped
when the position moves elsewhere (a resume, a relayout, an evaluation pass) and reading starts
again there, so the position saved in a checkpoint is exact whatever was prefetched. A worker that
raises fails the step with torch's report of it: the original exception type and message with the
worker's traceback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, Sampler

__all__ = ["LoaderOptions", "WorkerReader"]

Rows = Callable[[int, Any], list[int]]  # (global batch index, DataPlace) -> dataset row numbers


@dataclass(frozen=True)
class LoaderOptions:
    """A DataLoader's reading settings (everything but what it reads and in which order)."""

    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    worker_init_fn: Callable[[int], None] | None = None
    timeout: float = 0
    multiprocessing_context: Any = None
    generator: Any = None
    pin_memory_device: str = ""

    @classmethod
    def of(cls, loader: DataLoader) -> "LoaderOptions":
        return cls(loader.num_workers, loader.pin_memory, loader.prefetch_factor, loader.persistent_workers,
                   loader.worker_init_fn, loader.timeout, loader.multiprocessing_context, loader.generator,
                   loader.pin_memory_device)

    @property
    def reads_apart(self) -> bool:
        """True when a DataLoader must read (workers or pinning); else rows are read in place."""
        return self.num_workers > 0 or self.pin_memory


class _FromIndex(Sampler[list[int]]):
    """This rank's row lists of global batches start, start+1, ... (endless: epochs wrap)."""

    def __init__(self, rows: Rows):
        self.rows, self.start, self.place = rows, 0, None

    def __iter__(self) -> Iterator[list[int]]:
        index = self.start
        while True:
            yield self.rows(index, self.place)
            index += 1


class WorkerReader:
    """Batches `index` of `place` through one DataLoader over `dataset` (module docstring)."""

    def __init__(self, dataset: Any, rows: Rows, collate: Callable, options: LoaderOptions):
        self._order = _FromIndex(rows)
        self._options = options
        self._loader = DataLoader(dataset, batch_sampler=self._order, collate_fn=collate,
                                  num_workers=options.num_workers, pin_memory=options.pin_memory,
                                  prefetch_factor=options.prefetch_factor,
                                  persistent_workers=options.persistent_workers,
                                  worker_init_fn=options.worker_init_fn, timeout=options.timeout,
                                  multiprocessing_context=options.multiprocessing_context,
                                  generator=options.generator, pin_memory_device=options.pin_memory_device)
        self._batches: Iterator[Any] | None = None
        self._next: tuple[int, Any] | None = None  # (index, place) the open iterator gives next

    def batch(self, index: int, place: Any) -> Any:
        if self._batches is None or self._next != (index, place):
            self._batches = None  # (a loader without persistent workers shuts its workers down)
            self._order.start, self._order.place = index, place
            self._batches = iter(self._loader)
        try:
            batch = next(self._batches)
        except BaseException:
            self._batches = None
            raise
        self._next = (index + 1, place)
        return batch

    def close(self) -> None:
        """Stop reading ahead; workers that are persistent stay for the next batch asked for."""
        self._batches, self._next = None, None
