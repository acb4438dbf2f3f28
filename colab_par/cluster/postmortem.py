"""Post-mortem debugging of one rank, from the notebook: the engine side.

A failed cell leaves its exception in the engine's IPython (``sys.last_traceback``, what IPython's
own ``%debug`` reads), and with it every frame of the failure and their local variables. The
notebook drives a `pdb.Pdb` over those frames here one command at a time (each a short task on
that rank alone, so no other rank is involved and this one is free between commands); its output
comes back as text. Nothing can step or continue: the frames have finished running.

The frames keep their locals alive (activations, batches): they are released at the next cell
that succeeds on this rank (`install` hooks IPython's ``post_run_cell``), or by `clear`; after an
out-of-memory error at once (the stack stays, the variables go), or the retry would fail again.
"""
from __future__ import annotations

import contextlib
import io
import pdb
import sys
from types import TracebackType
from typing import Any

__all__ = ["install", "last_error", "begin", "command", "end", "clear"]

# Commands that move execution on: meaningless after the fact (the frames are done).
_STEPPING = {"s", "step", "n", "next", "unt", "until", "r", "return", "j", "jump", "run", "restart",
             "debug", "interact", "b", "break", "tbreak", "commands"}
ENDING = {"c", "cont", "continue", "q", "quit", "exit", "EOF"}
# Where a cell's traceback starts before reaching the user's code (IPython running it, or
# ipyparallel applying a function): not worth stepping up into.
_FRAMEWORK = ("/IPython/", "/ipykernel/", "/ipyparallel/", "/asyncio/", "/tornado/")

_SESSION: "_Session | None" = None


def install() -> None:
    """Release the last error's frames once a cell succeeds on this engine (once per engine)."""
    from IPython import get_ipython

    shell = get_ipython()
    if _release_after_success not in shell.events.callbacks["post_run_cell"]:
        shell.events.register("post_run_cell", _release_after_success)


def _release_after_success(result: Any) -> None:
    if result.success:
        clear()
    elif _out_of_memory(result.error_in_exec):
        _drop_locals()


def _out_of_memory(error: BaseException | None) -> bool:
    """A device allocation failed: torch's OutOfMemoryError (or an accelerator error saying so)."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower() \
        and type(error).__name__ in ("AcceleratorError", "RuntimeError")


def _drop_locals() -> None:
    """After an out-of-memory error, release the failed frames' variables (their activations and
    batches hold the very memory a retry needs) and keep the stack, so `where` still shows it."""
    tb = getattr(sys, "last_traceback", None)
    while tb is not None:
        with contextlib.suppress(RuntimeError):  # a frame still running (the framework's) stays
            tb.tb_frame.clear()
            # the traceback's printer read `f_locals`: a dict copied from the frame, which clear()
            # leaves full until the next read syncs it with the (now empty) frame
            tb.tb_frame.f_locals  # noqa: B018
        tb = tb.tb_next


def _user_traceback() -> TracebackType | None:
    """The last error's traceback from its first frame of user code (a cell, a function)."""
    tb = getattr(sys, "last_traceback", None)
    while tb is not None and _is_framework(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _is_framework(filename: str) -> bool:
    return filename == "<string>" or any(part in filename.replace("\\", "/") for part in _FRAMEWORK)


def last_error() -> dict[str, str] | None:
    """The exception this engine keeps for debugging (type and message), or None."""
    value = getattr(sys, "last_value", None)
    if value is None or getattr(sys, "last_traceback", None) is None:
        return None
    return {"name": type(value).__name__, "value": str(value)}


def begin() -> dict[str, Any]:
    """Open a debugger on the frame where the last error was raised (the innermost one).

    Returns ``{"error": None}`` when there is nothing to debug, else the error and where it is.
    """
    global _SESSION
    error = last_error()
    tb = _user_traceback()
    if error is None or tb is None:
        _SESSION = None
        return {"error": error, "text": ""}
    _SESSION = _Session(tb)
    return {"error": error, "text": _SESSION.where()}


def command(line: str) -> dict[str, Any]:
    """Run one pdb command in the open session; its output, and whether the session ended."""
    global _SESSION
    if _SESSION is None:
        return {"text": "*** no debugger is open on this rank (it was released: a cell succeeded "
                        "here, or the error was cleared)\n", "done": True}
    text, done = _SESSION.run(line)
    if done:
        _SESSION = None
    return {"text": text, "done": done}


def end() -> None:
    """Close the session; the error stays for a later one."""
    global _SESSION
    _SESSION = None


def clear() -> bool:
    """Forget the last error and release its frames (and their locals); True if there was one."""
    from IPython import get_ipython

    global _SESSION
    had = getattr(sys, "last_traceback", None) is not None
    _SESSION = None
    error, seen = getattr(sys, "last_value", None), set()
    while error is not None and id(error) not in seen:  # IPython's last result still holds it
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    shell = get_ipython()
    if shell is not None:
        for formatter in (shell.InteractiveTB, getattr(shell, "SyntaxTB", None)):
            if getattr(formatter, "tb", None) is not None:  # IPython's formatter keeps the last one
                formatter.tb = None
    return had


class _Session:
    """A `pdb.Pdb` over a finished traceback, fed one line at a time, its output captured."""

    def __init__(self, tb: TracebackType):
        self.out = io.StringIO()
        self.pdb = _TextPdb(stdin=io.StringIO(), stdout=self.out, nosigint=True, readrc=False)
        self.pdb.reset()
        self.pdb.setup(None, tb)

    def where(self) -> str:
        return self._captured(lambda: self.pdb.print_stack_entry(self.pdb.stack[self.pdb.curindex]))

    def run(self, line: str) -> tuple[str, bool]:
        name = self.pdb.parseline(line.strip())[0]
        if name in ENDING:
            return "", True
        if name in _STEPPING:
            return (f"*** {name}: this is a post-mortem: the frames have finished running, so "
                    "nothing can step, continue or stop again. Inspect them: p, pp, l, ll, w, u, "
                    "d, a, !statement; q ends\n"), False
        return self._captured(lambda: self._onecmd(line)), False

    def _onecmd(self, line: str) -> None:
        self.pdb.cmdqueue.append(line)
        while self.pdb.cmdqueue:  # pdb queues the parts of "a ;; b" here
            self.pdb.onecmd(self.pdb.precmd(self.pdb.cmdqueue.pop(0)))

    def _captured(self, action: Any) -> str:
        self.out.seek(0)
        self.out.truncate()
        with contextlib.redirect_stdout(self.out), contextlib.redirect_stderr(self.out):
            try:
                action()
            except Exception as error:  # noqa: BLE001 - a failing command must not become the last error
                print(f"*** {type(error).__name__}: {error}", file=self.out)
        return self.out.getvalue()


class _TextPdb(pdb.Pdb):
    """pdb naming the engine's cells as its tracebacks do ("Cell In[3]") instead of their temp files."""

    def format_stack_entry(self, frame_lineno: Any, lprefix: str = ": ") -> str:
        text = super().format_stack_entry(frame_lineno, lprefix)
        filename = self.canonic(frame_lineno[0].f_code.co_filename)
        shown = _cell_name(filename)
        return text.replace(filename, shown, 1) if shown else text


def _cell_name(filename: str) -> str | None:
    from IPython import get_ipython

    shell = get_ipython()
    name = shell.compile.format_code_name(filename) if shell is not None else None
    return " ".join(name) if name else None
