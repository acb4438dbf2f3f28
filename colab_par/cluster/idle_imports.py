"""The engine zygote's idle imports (`warm_pool._IDLE_IMPORTS`), made so that they yield to the
user's cells.

They cost seconds of CPU beside the user's first cells, so they go on only while the processes
the zygote serves (its owner, the notebook, and every engine it forked) are quiet, read from their
CPU time, and pause, between modules and inside one, as soon as those use the CPU again. Lowering
the zygote's priority instead would not do: forked engines inherit its niceness and cannot raise it
back without privileges. Imports only the standard library: `warm_pool`'s proxy imports this too.
"""
from __future__ import annotations

import collections
import gc
import importlib
import os
import select
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterable

__all__ = ["Yielding", "import_quietly", "cpu_seconds", "touched_cuda", "WAIT_S"]

BUSY_SHARE = 0.03  # more CPU than this share of one core over `WINDOW_S` is busy (2 idle engines:
WINDOW_S = 0.1  # ~1 %, at most 1.5 ms in any 0.1 s), so a cell is seen within its first few ms
CHECK_S = 0.002  # an idle import under way reads their CPU time (a few system calls) this often
WAIT_S = 0.2  # how often it reads it while waiting for quiet


def import_quietly(module: str, yielding: Yielding) -> None:
    """Import `module` for the zygote's future children, pausing whenever the processes it serves
    are busy; one that fails to import is left to the engine that needs it, which then raises the
    error where its user sees it."""
    gc.disable()
    try:
        with yielding:
            importlib.import_module(module)
    except (Exception, _Abandoned):  # noqa: BLE001 - an optional package missing or broken is not the pool's concern
        pass
    finally:
        gc.freeze()
        gc.enable()


def touched_cuda() -> bool:
    """Whether what this process imported initialised CUDA (its forks could then not use a GPU)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


class _Abandoned(BaseException):
    """Raised inside a paused idle import when the zygote is to stop: a BaseException, so that no
    module's `except Exception` around an optional import swallows it."""


class Yielding:
    """Whether the processes a zygote serves (its owner and the processes it forked) have been
    quiet, from their CPU time; and, entered around an idle import, a pause wherever that import
    is (between modules or inside one: a timer interrupts it every `CHECK_S`; the process CPU
    timers would count in scheduler ticks, 4-10 ms) for as long as they are busy. A pause ends
    when a request waits on the `interrupting` listener (a start waits on this import anyway: it
    goes on at full speed) and abandons the import when the zygote is stopping or its owner is gone
    (the `interrupting` stdin at its end). Forked children inherit neither the timer (fork never
    does) nor the handler (the zygote forks only between imports, with SIGALRM's restored).

    `quiet_s` is the quiet wanted before a first import; each pause doubles it (cells that come
    often are met less), up to `quiet_max_s`."""

    def __init__(self, pids: Callable[[], Iterable[int]], interrupting: tuple[socket.socket, int],
                 stopping: list[bool], *, quiet_s: float, quiet_max_s: float) -> None:
        self._pids, self._interrupting, self._stopping = pids, interrupting, stopping
        self._cpu: dict[int, float] = {}  # pid -> its CPU time at the last reading
        self._spent = 0.0  # CPU seconds they spent since the zygote started (those alive at each reading)
        self._history = collections.deque([(time.monotonic(), 0.0)])  # (when, spent), `WINDOW_S` back
        self._busy_at = self._history[0][0]
        self._hurry = False  # a request waits: this import goes on without pauses
        self.quiet_needed, self._quiet_max_s = quiet_s, quiet_max_s
        self._previous: Any = signal.SIG_DFL

    def busy(self) -> None:
        self._busy_at = time.monotonic()

    def __enter__(self) -> None:
        self._hurry = False
        self._previous = signal.signal(signal.SIGALRM, self._pause)
        signal.siginterrupt(signal.SIGALRM, False)  # system calls of the imported code restart
        signal.setitimer(signal.ITIMER_REAL, CHECK_S, CHECK_S)

    def __exit__(self, *_: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)  # first: no SIGALRM can then meet the default action
        signal.signal(signal.SIGALRM, self._previous)

    def quiet_for(self) -> float:
        """Seconds since they last spent more than `BUSY_SHARE` of a core over `WINDOW_S`."""
        now = time.monotonic()
        if now - self._history[-1][0] >= CHECK_S:
            cpu = {pid: spent for pid in self._pids() if (spent := cpu_seconds(pid)) is not None}
            self._spent += sum(spent - self._cpu.get(pid, 0.0) for pid, spent in cpu.items())
            self._cpu = cpu
            self._history.append((now, self._spent))
            while len(self._history) > 2 and self._history[1][0] <= now - WINDOW_S:
                self._history.popleft()
            then, spent_then = self._history[0]  # the last reading at least `WINDOW_S` back
            if self._spent - spent_then > BUSY_SHARE * max(now - then, WINDOW_S):
                self._busy_at = now
        return now - self._busy_at

    def _pause(self, *_: object) -> None:
        """SIGALRM's handler during an idle import: wait here while they are busy."""
        paused = False
        while not self._stopping and not self._hurry and self.quiet_for() < self.quiet_needed:
            if not paused:
                signal.setitimer(signal.ITIMER_REAL, 0)  # no wake-ups while paused
                paused = True
                self.quiet_needed = min(2 * self.quiet_needed, self._quiet_max_s)
            readable, _, _ = select.select(self._interrupting, [], [], WAIT_S)
            for ready in readable:
                if ready is self._interrupting[0]:
                    self._hurry = True
                elif not os.read(ready, 4096):
                    self._stopping.append(True)  # the owner is gone (its end of the pipe closed)
        if self._stopping:
            raise _Abandoned
        if paused:
            signal.setitimer(signal.ITIMER_REAL, CHECK_S, CHECK_S)


def cpu_seconds(pid: int) -> float | None:
    """CPU time of process `pid` (all its threads), to the nanosecond (/proc counts in 10 ms
    ticks), None once it is gone: Linux's clock id for a process's CPU-time clock, the one
    `clock_getcpuclockid(3)` returns."""
    try:
        return time.clock_gettime((~pid << 3) | 2)  # CPUCLOCK_SCHED of the process `pid`
    except OSError:
        return None
