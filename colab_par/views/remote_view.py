"""Pictures of engine state drawn in the notebook: an object shown on an engine travels as data.

A view (`Timeline`, `ShardMap`) displayed on an engine (the value of a ``%%colossal`` cell, or
``display(view)`` in it) sends its compact JSON under `VIEW_MIME` instead of a picture;
`output.TaskOutput` rebuilds rank 0's views in the notebook (`local_view`) and displays them there,
where they draw themselves. Anywhere else a view shows as a PNG (Jupyter) or as text.
"""
from __future__ import annotations

import base64
import importlib
from typing import Any, Callable

__all__ = ["VIEW_MIME", "View", "mimebundle", "local_view", "on_engine", "engine_kernel"]

VIEW_MIME = "application/vnd.colab_par.view+json"
_VIEWS = {"timeline": ("colab_par.profiling.timeline", "Timeline"),
          "shard_map": ("colab_par.shard_map.view", "ShardMap")}


def engine_kernel() -> Any:
    """The ipyparallel engine kernel this process runs, or None (plain Python, a notebook's kernel)."""
    from colab_par import compat

    try:
        from ipykernel.kernelbase import Kernel

        engine = compat.ipp_engine_kernel_class()
    except (ImportError, compat.CompatError):
        return None
    if not Kernel.initialized():
        return None
    kernel = Kernel.instance()
    return kernel if isinstance(kernel, engine) else None


def on_engine() -> bool:
    return engine_kernel() is not None


def mimebundle(kind: str, data: Callable[[], dict[str, Any]], png: Callable[[], bytes], text: str) -> dict:
    """What a view of `kind` shows as: its data on an engine, its PNG elsewhere (both with text)."""
    if kind not in _VIEWS:
        raise ValueError(f"unknown view {kind!r}; one of {', '.join(_VIEWS)}")
    if on_engine():
        return {VIEW_MIME: {"kind": kind, "data": data()}, "text/plain": text}
    return {"image/png": base64.b64encode(png()).decode("ascii"), "text/plain": text}


class View:
    """What a view shares: `kind` (a key of `_VIEWS`), `png()`, `to_json()`; shown as `mimebundle`
    says, and saved as a PNG file."""

    kind = ""

    def png(self) -> bytes:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, path: str) -> None:
        """Write the picture as a PNG file."""
        with open(path, "wb") as handle:
            handle.write(self.png())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        return mimebundle(self.kind, self.to_json, self.png, str(self))


def local_view(bundle: dict[str, Any]) -> Any:
    """The view an engine sent in `bundle` (a display's data), rebuilt here; None if it holds none."""
    sent = bundle.get(VIEW_MIME)
    if not isinstance(sent, dict) or sent.get("kind") not in _VIEWS:
        return None
    module, name = _VIEWS[sent["kind"]]
    return getattr(importlib.import_module(module), name).from_json(sent["data"])
