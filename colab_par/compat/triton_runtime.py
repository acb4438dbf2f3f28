"""Triton's runtime: whether a kernel was built for the interpreter."""
from __future__ import annotations

from functools import cache
from typing import Any

from colab_par.compat.support import _missing


@cache
def _interpreted_function() -> type:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        raise _missing("triton", "triton.runtime.interpreter.InterpretedFunction") from None
    return InterpretedFunction


def triton_interpreted(function: Any) -> bool:
    """Whether a triton function was built for the interpreter (`TRITON_INTERPRET=1` when triton
    was imported) rather than for compilation (`triton.runtime.interpreter.InterpretedFunction`,
    internal to triton)."""
    return isinstance(function, _interpreted_function())
