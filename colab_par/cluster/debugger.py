"""Post-mortem debugging of one rank, from the notebook: the notebook side of the conversation.

Commands come from a list (scripts, tests) or from ``input()``, which in a notebook is the input
box under the cell; each goes to the rank as one short task (`colab_par.cluster.postmortem` runs it in
pdb there) and its output is printed in the cell. The rank is free between commands and no other
rank takes part, so nothing else waits on the person typing.
"""
from __future__ import annotations

import builtins
from typing import Any, Callable, Iterator, Sequence

from colab_par.cluster import postmortem

__all__ = ["session", "split_commands"]

HELP = ("pdb on the frames of that error: p EXPR, pp EXPR, l, ll, w, u, d, a, !STATEMENT; "
        "q ends (nothing can step: the frames have finished)")


def split_commands(text: str) -> list[str]:
    """``"p x; up; p y"`` -> ``["p x", "up", "p y"]`` (pdb's own ``;;`` separator works too)."""
    return [part.strip() for part in text.replace(";;", ";").split(";") if part.strip()]


def session(call: Callable[..., Any], rank: int, commands: Sequence[str] | None = None,
            read: Callable[[str], str] | None = None) -> None:
    """Debug `rank`'s last error through `call(fn, *args)` (runs ``fn(*args)`` on that rank):
    each of `commands`, or lines from `read` until q or the end of input. `read` defaults to the
    ``input`` of the moment: a kernel swaps in its own (the notebook's input box) per cell."""
    opened = call(postmortem.begin)
    error = opened["error"]
    if error is None:
        print(f"colab_par: rank {rank} has no error to debug: its last cell succeeded (which "
              "releases the frames of an earlier error), it never failed, or the error was cleared.")
        return
    headline = f"colab_par: post-mortem of rank {rank}: {error['name']}: {error['value']}"
    if not opened["text"]:
        print(f"{headline}\nIt holds no frame of the cell's code (it was raised before the cell "
              "ran, e.g. a SyntaxError); nothing to inspect.")
        return
    print(f"{headline}\n{HELP}\n{opened['text']}", end="")
    try:
        for line in _lines(commands, read or builtins.input, f"(Pdb rank {rank}) "):
            reply = call(postmortem.command, line)
            print(reply["text"], end="")
            if reply["done"]:
                break
    finally:
        call(postmortem.end)


def _lines(commands: Sequence[str] | None, read: Callable[[str], str], prompt: str) -> Iterator[str]:
    if commands is not None:
        for line in commands:
            print(f"{prompt}{line}")
            yield line
        return
    from IPython.core.error import StdinNotImplementedError

    while True:
        try:
            yield read(prompt)
        except (EOFError, KeyboardInterrupt):
            return
        except StdinNotImplementedError:
            print("colab_par: this frontend cannot ask for input; give the commands instead: "
                  "%colossal debug --rank R --commands \"p x; up; p y\" (or "
                  "cluster.debug(rank, commands=[...]))")
            return
