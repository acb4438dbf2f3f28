"""Tensors of a Hugging Face safetensors directory, read block by block.

`SafetensorsWeights` is the `WeightSource` that `parallelize(..., weights=)` fills a meta-built model
from: each rank asks only for the slices it owns (`read(name, index)` goes through safetensors'
`get_slice`, so only that block leaves the disk). Everything that can be wrong with a directory is
found from the files' headers alone, before a single weight is read: a shard the index names that
is not there (when the source is opened), a tensor the model needs that no file has, a shape that
differs (`check`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open

__all__ = ["SafetensorsWeights", "WeightsError", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}

Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class WeightsError(ValueError):
    """A weights directory that does not fit the model (missing files or tensors, wrong shapes)."""


class SafetensorsWeights:
    """The tensors of `path` (``model.safetensors``, or an index and its shards), by state-dict name.
    `single_file` names another lone file (a PEFT adapter's ``adapter_model.safetensors``).

    File handles open lazily, one per file, and stay open for the many block reads of one load;
    `close()` (or leaving a ``with`` block) releases them.
    """

    def __init__(self, path: str | os.PathLike, *, single_file: str = SINGLE_FILE):
        self.path = Path(path)
        self._file_of = _weight_map(self.path, single_file)
        self._handles: dict[Path, Any] = {}

    # ---- WeightSource ------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `name` (CPU, file dtype), or only its block `index` (one slice per dim)."""
        handle = self._handle(self._file_of[name])
        if index is None:
            return handle.get_tensor(name)
        block = handle.get_slice(name)
        if len(index) != len(block.get_shape()):
            raise ValueError(f"read({name!r}) got {len(index)} slices for a tensor of "
                             f"{len(block.get_shape())} dims; give one slice per dim")
        return block[index] if index else handle.get_tensor(name)

    # ---- validation from headers ----------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._file_of)

    def where(self, name: str) -> Path:
        """The file holding `name` (for messages)."""
        return self._file_of[name]

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype such as "F32") of `name`, from its file's header."""
        block = self._handle(self._file_of[name]).get_slice(name)
        return tuple(block.get_shape()), block.get_dtype()

    def check(self, expected: Expected, optional: Iterable[str] = ()) -> list[str]:
        """Refuse a directory that does not fit `expected` (name -> (shape, dtype)); reads headers only.

        Names in `optional` may be absent (tied aliases, buffers the model computes itself). Returns
        the names the files hold that the model does not use (the caller may warn about them).
        """
        optional = set(optional)
        missing = [name for name in expected if name not in self and name not in optional]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise WeightsError(f"{self.path} lacks {len(missing)} tensor(s) the model needs: {shown}. "
                               "The config and the weights belong to different models (or the "
                               "checkpoint uses other tensor names); point from_pretrained at the "
                               "directory these weights were saved with")
        for name, (shape, dtype) in expected.items():
            if name not in self:
                continue
            found, found_dtype = self.header(name)
            if found != tuple(shape):
                raise WeightsError(f"{name} in {self.where(name)} has shape {list(found)}, but the "
                                   f"model built from {self.path / 'config.json'} expects "
                                   f"{list(shape)}; the config and the weights disagree: fix the config "
                                   "(e.g. hidden_size, vocab_size, num_key_value_heads) or use the "
                                   "weights saved with it")
            if dtype.is_floating_point != (found_dtype in _FLOAT_DTYPES):
                raise WeightsError(f"{name} in {self.where(name)} holds {found_dtype} values, but "
                                   f"the model's tensor is {dtype}; use the weights saved with this config")
        return [name for name in self.names() if name not in expected]

    # ---- handles ------------------------------------------------------------------------------------
    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def close(self) -> None:
        """Release the open files (safe_open handles close when dropped)."""
        self._handles.clear()

    def __enter__(self) -> "SafetensorsWeights":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _weight_map(path: Path, single_file: str = SINGLE_FILE) -> dict[str, Path]:
    """Tensor name -> the file holding it; refuses a directory whose files are not all there."""
    if not path.is_dir():
        raise WeightsError(f"{path} is not a directory; give the local directory of a Hugging Face "
                           "model (config.json plus model.safetensors or its index and shards), e.g. "
                           "one downloaded with huggingface_hub.snapshot_download")
    index_file, single = path / INDEX_FILE, path / single_file
    if index_file.is_file() and single_file == SINGLE_FILE:
        weight_map = json.loads(index_file.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightsError(f"{index_file} has no 'weight_map' (tensor name -> shard file); "
                               "the index is damaged: save the model again")
        files = {shard: path / shard for shard in sorted(set(weight_map.values()))}
        absent = [shard for shard, file in files.items() if not file.is_file()]
        if absent:
            raise WeightsError(f"{index_file} names {len(absent)} shard file(s) that are not in {path}: "
                               f"{', '.join(absent)}; the download or copy is incomplete: fetch the "
                               "missing shards (or the whole directory) again")
        _check_shard_headers(files, weight_map)
        return {name: files[shard] for name, shard in weight_map.items()}
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}
    found = sorted(p.name for p in path.glob("*.safetensors"))
    hint = (f"it holds {', '.join(found)} but no {INDEX_FILE} naming them" if found else
            "it holds no safetensors files (.bin / .pt weights are not read: convert them with "
            "transformers' save_pretrained)")
    raise WeightsError(f"{path} has neither {single_file} nor {INDEX_FILE}: {hint}")


def _check_shard_headers(files: dict[str, Path], weight_map: dict[str, str]) -> None:
    """Every tensor the index places in a shard is in that shard's header."""
    for shard, file in files.items():
        with safe_open(str(file), framework="pt") as handle:
            held = set(handle.keys())
        lost = [name for name, where in weight_map.items() if where == shard and name not in held]
        if lost:
            raise WeightsError(f"{file} lacks {', '.join(lost[:5])}, which {INDEX_FILE} places there; "
                               "the shard does not belong to this index: fetch the directory again")
