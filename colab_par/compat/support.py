"""The supported version ranges, and the error an entry raises when its private API is missing."""
from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

SUPPORTED = {"torch": "torch>=2.6,<3", "ipyparallel": "ipyparallel>=9", "ipykernel": "ipykernel>=6.9.1,<8",
             "transformers": "transformers>=5.9", "triton": "triton>=3.0"}
"""The ranges pyproject.toml declares; a missing private API names the one it belongs to."""


class CompatError(RuntimeError):
    """An installed package lacks a private API colab_par needs (its version is out of range)."""


def _missing(package: str, what: str) -> CompatError:
    try:
        installed = version(package)
    except PackageNotFoundError:
        installed = "not installed"
    return CompatError(f"{what} is missing from {package} {installed}; colab_par supports "
                       f"{SUPPORTED[package]}: install a version in that range")


@cache
def _torch_private(module: str) -> Any:
    """A private torch module, imported once; a missing one names the supported range."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing("torch", module) from None
