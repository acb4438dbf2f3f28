"""A fresh worker process whose Triton runs in interpreter mode.

Triton 3.x decides at import time whether kernels are compiled or interpreted, and importing
torch.distributed already imports triton; so a process cannot switch to the interpreter later.
Tests (and CPU users who want to exercise the real Triton code) run functions in a spawned worker
that had TRITON_INTERPRET=1 in its environment from the start.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable

__all__ = ["InterpreterProcess"]


class InterpreterProcess:
    """``with InterpreterProcess() as worker: worker.run(fn, *args)``: fn runs where Triton is interpreted.

    fn and its arguments are pickled by reference (module-level functions); every call has a finite
    timeout so a crashed worker surfaces as an error instead of a hang.
    """

    def __init__(self, timeout: float = 600.0):
        self.timeout = timeout
        self._pool: Any = None

    def __enter__(self) -> "InterpreterProcess":
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned worker only at its start
        try:
            self._pool = multiprocessing.get_context("spawn").Pool(1)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
        return self

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._pool is None:
            raise RuntimeError("InterpreterProcess is not started; use it as `with InterpreterProcess() as w:`")
        return self._pool.apply_async(fn, args, kwargs).get(self.timeout)

    def __exit__(self, *exc_info: object) -> None:
        self._pool.terminate()
        self._pool.join()
        self._pool = None
