"""Parameters on disk (`params@disk`: CPU ranks, zero0): each trainable parameter's storage is a
view of its chunk's memory-mapped file (from when the tiers are applied, so chunks follow the
parameters' order), so the kernel pages the values in wherever forward or backward reads them,
and these hooks keep only the chunks in use in this process's memory.

A module's forward pre-hook starts reading its parameters' chunks (MADV_WILLNEED). A chunk whose
parameters have all passed this forward is dropped, and again once they all have their gradient
(MADV_DONTNEED: the pages of a shared mapping stay in the file, nothing is lost or written);
backward faults back in what autograd reads. The optimizer step writes the updated values through
the same mapping and writes the chunk back (`ChunkStores.stream`). Correctness never depends on
the hooks: a page dropped too early is read again on its next use. Generation, which runs
forwards only, holds the pages (`held`) for a whole call: every token's forward would otherwise
page the whole model in again.

The first parameter read of each forward also hands glibc's freed heap back (`trim_host_heap`).
Why: on an engine that ran other work the heap holds large free holes, and glibc serves big
blocks from them whatever its mmap threshold; once freed (the previous step's gradients, DDP's
first bucket generation replaced at the second forward) they stay resident, and measured on a
50 M GPT under dp2 that kept up to the parameters' own bytes resident, erasing the saving. After
the wrapper's own pre-forward work (DDP's bucket rebuild), before this forward allocates.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Any, Iterator, Protocol

from torch import nn

from colab_par.memory_tiers.host_heap import trim_host_heap

__all__ = ["PagedParameters", "ParameterHome"]


class ParameterHome(Protocol):
    def parameter_pages(self, param: nn.Parameter) -> "tuple[int, int, Any] | None":
        """(chunk index, parameters in the chunk, its disk store), or None before placement."""


class PagedParameters:
    """The hooks above over `modules`' parameters that `home` (the optimizer) placed on disk."""

    def __init__(self, home: ParameterHome, modules: list[nn.Module], params: list[nn.Parameter]):
        me = weakref.ref(self)  # autograd and modules hold the hooks; they must not keep this alive
        self._home = weakref.ref(home)
        self.read = 0  # bytes asked of the disk tier since the last `take_read`
        self._passed: dict[int, set[int]] = defaultdict(set)  # chunk -> parameters past this forward
        self._finished: dict[int, set[int]] = defaultdict(set)  # chunk -> parameters with their gradient
        self._heap_to_trim = False  # a forward started and has read no parameter yet
        self._holding: dict[int, Any] | None = None  # inside `held`: chunk index -> its store, as read
        trainable = {id(p) for p in params}

        def call(name: str, *args: Any) -> None:
            pages = me()
            if pages is not None:
                getattr(pages, name)(*args)

        self._hooks = [m.register_forward_pre_hook(lambda *_: call("_new_forward")) for m in modules]
        for module in modules:
            for sub in module.modules():
                own = [p for p in sub.parameters(recurse=False) if id(p) in trainable]
                if own:
                    self._hooks.append(sub.register_forward_pre_hook(lambda *_, own=own: call("_read", own)))
                    self._hooks.append(sub.register_forward_hook(lambda *_, own=own: call("_passed_forward", own)))
        self._hooks += [p.register_post_accumulate_grad_hook(lambda p: call("_has_gradient", p)) for p in params]

    def take_read(self) -> int:
        read, self.read = self.read, 0
        return read

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Forwards inside read each chunk in once and drop nothing; every chunk read is dropped
        on the way out (forward-only work: no gradient will be written through the pages)."""
        self._holding, self._passed = {}, defaultdict(set)
        try:
            yield
        finally:
            stores, self._holding = self._holding, None
            for store in stores.values():
                store.evict(dirty=False)

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _where(self, param: nn.Parameter) -> "tuple[int, int, Any] | None":
        home = self._home()
        return None if home is None else home.parameter_pages(param)

    def _new_forward(self) -> None:
        self._passed.clear()
        self._heap_to_trim = True

    def _read(self, params: list[nn.Parameter]) -> None:
        if self._heap_to_trim:
            self._heap_to_trim = False
            trim_host_heap()
        started = set()
        for param in params:
            where = self._where(param)
            if where is None or where[0] in started:
                continue
            started.add(where[0])
            if self._holding is not None:
                if where[0] in self._holding:
                    continue  # read in by an earlier forward of this call, still resident
                self._holding[where[0]] = where[2]
            self.read += where[2].prefetch()

    def _passed_forward(self, params: list[nn.Parameter]) -> None:
        if self._holding is not None:
            return
        for param in params:
            dropped = self._mark(self._passed, param)
            if dropped is not None:
                self.read += dropped.nbytes  # backward reads the chunk back

    def _has_gradient(self, param: nn.Parameter) -> None:
        self._mark(self._finished, param)

    def _mark(self, marks: dict[int, set[int]], param: nn.Parameter) -> Any:
        """Mark `param`; the store dropped when that completes its chunk, else None."""
        where = self._where(param)
        if where is None:
            return None
        index, size, store = where
        marks[index].add(id(param))
        if len(marks[index]) < size:
            return None
        store.evict(dirty=False)  # every parameter of the chunk is done with for now
        marks[index].clear()
        return store
