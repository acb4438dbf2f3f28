"""`save_pretrained`: a `ParallelModel` of any layout back to a Hugging Face directory, streamed.

Every rank calls it. The tensors' names, shapes and dtypes are gathered first (small), so the cut
into output shards, and with it the file names ``model-0000i-of-0000N.safetensors``, is known
before any weight moves. Then the tensors go one at a time: each sharded one is gathered
(`full_tensor`, a collective over its own mesh) by the ranks of the pipeline stage holding it, the
stage's first rank sends it to global rank 0 (point to point, in the agreed order), and rank 0
writes a shard file as soon as that shard is complete and drops it. So rank 0 holds at most one
output shard plus one tensor, the other ranks one tensor. Names are those transformers writes for
the family (`family_files.py`): a packed experts tensor is gathered once and written one tensor per
expert and part, as transformers' own save_pretrained writes it.

Rank 0 writes into a hidden sibling directory and renames it into place at the end: a failure
leaves no half directory at `path`. A write error on rank 0 does not stop the stream (the other
ranks would wait on it); it is reported to every rank at the end.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from colab_par import compat
from colab_par.hf_io.family_files import DiskNames, Packed
from colab_par.models.hf_weights import INDEX_FILE, SINGLE_FILE

__all__ = ["save_pretrained", "DEFAULT_MAX_SHARD_BYTES"]

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


@dataclass(frozen=True)
class _Entry:
    """One tensor of the output: where it lives (the global rank that sends it, its pp rank)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sender: int
    pp_rank: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def save_pretrained(pm: Any, path: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    overwrite: bool = False, merged: bool = False, adapter_name: str | None = None) -> Path:
    """Write `pm`'s weights and config as a Hugging Face directory at `path` (a path rank 0 sees).

    Call on every rank; rank 0 writes. One ``model.safetensors`` when everything fits in
    `max_shard_bytes`, else numbered shards plus ``model.safetensors.index.json`` (a tensor larger
    than the limit gets a shard of its own). A tied tensor is written once, under its first name
    (``model.embed_tokens.weight``), as transformers does. An existing non-empty `path` is refused
    unless `overwrite=True`, which replaces it only once the new directory is complete.

    A PEFT model (`pm.adapters`) is written as peft writes an adapter: ``adapter_config.json`` and
    ``adapter_model.safetensors`` under peft's keys, which ``PeftModel.from_pretrained(base, path)``
    loads (`adapter_name`: which adapter, default the one the model runs). `merged=True` writes the
    base model with the adapters merged into its weights instead (W + scale·B·A, one layer at a
    time), a directory transformers loads alone.
    Returns `path` on every rank.
    """
    config = _hf_config(pm)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r}; give a positive number of bytes, "
                         f"e.g. {DEFAULT_MAX_SHARD_BYTES} (2 GiB)")
    local, write_config, single_file = _output(pm, config, merged, adapter_name)
    path, rank = Path(path), dist.get_rank()
    staging = path.parent / f".{path.name}.saving-{uuid.uuid4().hex[:12]}"
    entries = _catalogue(pm, local)
    if single_file == SINGLE_FILE:
        entries, local = _family_layout(pm, entries, local)
    _agree(_start(path, staging, overwrite) if rank == 0 else None, path)
    files = _shard_files(entries, max_shard_bytes if single_file == SINGLE_FILE else None, single_file)
    error = None
    pending: dict[str, torch.Tensor] = {}
    for entry, (file, last_of_file) in zip(entries, files):
        tensor = _gathered(pm, entry, local)
        if rank != 0 or error is not None:
            continue
        pending[entry.name] = tensor.detach().cpu().contiguous()
        if last_of_file:
            error = _write(safetensors.torch.save_file, pending, staging / file, {"format": "pt"})
            pending = {}
    if rank == 0 and error is None:
        error = _commit(staging, path, write_config, entries, files, overwrite)
    if rank == 0 and error is not None:
        shutil.rmtree(staging, ignore_errors=True)
    _agree(error, path)
    return path


# ---- what is written ----------------------------------------------------------------------------
def _hf_config(pm: Any) -> Any:
    config = getattr(_unwrapped(pm.model_parts[0]), "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        raise TypeError(f"save_pretrained writes Hugging Face models, and {type(pm.model).__name__} has "
                        "no transformers config (.config.save_pretrained); save it with "
                        "colab_par.save(pm, path) (a DCP checkpoint any layout can load) instead")
    return config


def _output(pm: Any, config: Any, merged: bool, adapter_name: str | None) -> tuple[dict[str, Any], Any, str]:
    """What the directory holds: this rank's tensors by output name (a value may be a callable the
    holding stage's ranks compute together, e.g. a merged weight), how its config is written, and
    the name of its one weights file."""
    local = _local_tensors(pm)
    adapters = getattr(pm, "adapters", None)
    if adapters is None:
        if merged or adapter_name is not None:
            raise ValueError(f"merged= and adapter_name= apply to PEFT models, and {type(pm.model).__name__} "
                             "has no adapters; call save_pretrained(pm, path)")
        return local, functools.partial(_write_model_config, config), SINGLE_FILE
    from colab_par.parallel.adapters.files import ADAPTER_WEIGHTS, adapter_state, merged_state

    if merged:
        if adapter_name is not None:
            raise ValueError("merged=True merges the adapters the model runs; drop adapter_name=")
        return merged_state(pm.model_parts, local, adapters), functools.partial(_write_model_config, config), \
            SINGLE_FILE
    name = adapters.adapter_to_save(adapter_name)
    adapter_config = copy.deepcopy(adapters.configs[name])
    adapter_config.inference_mode = True  # as peft records a saved adapter
    return (adapter_state(local, adapters, name),
            lambda staging, entries: adapter_config.save_pretrained(str(staging)), ADAPTER_WEIGHTS)


def _write_model_config(config: Any, staging: Path, entries: list[_Entry]) -> None:
    saved = copy.deepcopy(config)
    saved.dtype = next((e.dtype for e in entries if e.dtype.is_floating_point), torch.float32)
    saved.save_pretrained(staging)


def _unwrapped(part: nn.Module) -> nn.Module:
    return part.module if isinstance(part, DistributedDataParallel) else part


def _local_tensors(pm: Any) -> dict[str, torch.Tensor]:
    """This rank's state (parameters, persistent buffers) by original name; a tied tensor once."""
    seen: set[int] = set()
    local: dict[str, torch.Tensor] = {}
    for part in pm.model_parts:
        for name, tensor in _unwrapped(part).state_dict(keep_vars=True).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                local.setdefault(compat.unwrapped_name(name), tensor)
    return local


def _catalogue(pm: Any, local: dict[str, torch.Tensor]) -> list[_Entry]:
    """Every tensor of the whole model in writing order (stage by stage), known on every rank.

    One rank per pipeline stage (its first: dp, cp and tp rank 0) reports its tensors; a tensor
    tied across stages (under one name or two, as a head tied to the embeddings) is written once,
    from the first stage, under its first name, as transformers writes it."""
    first_of_stage = pm.dp_rank == 0 and pm.cp_rank == 0 and pm.tp_rank == 0
    mine = ([(name, tuple(t.shape), t.dtype) for name, t in local.items()] if first_of_stage else [])
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (dist.get_rank(), pm.pp_rank, mine))
    aliases = pm.tied_names
    entries: dict[str, _Entry] = {}
    for sender, pp_rank, tensors in reports:
        for name, shape, dtype in tensors:
            if not any(alias in entries for alias in aliases.get(name, ())):
                entries[name] = _Entry(name, shape, dtype, sender, pp_rank)
    return list(entries.values())


def _family_layout(pm: Any, entries: list[_Entry],
                   local: dict[str, Any]) -> tuple[list[_Entry], dict[str, Any]]:
    """Entries and tensors under the names transformers writes for this family: renamed, and packed
    experts one tensor per expert (each an `_ExpertPart` of the packed tensor, gathered once)."""
    names = DiskNames(_unwrapped(pm.model_parts[0]))
    out_entries: list[_Entry] = []
    out_local: dict[str, Any] = {}
    gathered = _LastGathered()
    for entry in entries:
        where = names.on_disk(entry.name, entry.shape)
        if where is None:
            model_type = getattr(_hf_config(pm), "model_type", "?")
            raise ValueError(f"transformers stores {entry.name} (model_type {model_type!r}) through a "
                             "conversion the kit does not write (only stacked experts, optionally "
                             "concatenated parts); save with colab_par.save(pm, path) (a DCP checkpoint) "
                             "or pass pm.full_state_dict() to transformers' own save_pretrained")
        if not isinstance(where, Packed):
            out_entries.append(_Entry(where, entry.shape, entry.dtype, entry.sender, entry.pp_rank))
            if entry.name in local:
                out_local[where] = local[entry.name]
            continue
        for expert, keys in enumerate(where.parts):
            for part, key in enumerate(keys):
                shape = list(entry.shape[1:])
                shape[where.dim - 1] //= len(keys)
                out_entries.append(_Entry(key, tuple(shape), entry.dtype, entry.sender, entry.pp_rank))
                if entry.name in local:
                    out_local[key] = _ExpertPart(gathered, local[entry.name], expert, where.dim,
                                                 slice(part * shape[where.dim - 1], (part + 1) * shape[where.dim - 1]),
                                                 tuple(shape), entry.dtype)
    return out_entries, out_local


class _LastGathered:
    """The last packed tensor gathered whole, kept while its experts' parts are written."""

    def __init__(self) -> None:
        self.source: Any = None
        self.full: torch.Tensor | None = None

    def __call__(self, source: Any) -> torch.Tensor:
        if source is not self.source:
            self.full = None  # the last one goes before the next is gathered
            self.full, self.source = _whole(source), source
        return self.full


@dataclass(frozen=True)
class _ExpertPart:
    """One expert's part (rows `rows` along the packed dim `dim`) of a packed tensor, as transformers'
    reversed conversion (split the experts, chunk the parts) writes it."""
    gathered: _LastGathered
    source: Any
    expert: int
    dim: int
    rows: slice
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __call__(self) -> torch.Tensor:
        return self.gathered(self.source)[self.expert].narrow(self.dim - 1, self.rows.start,
                                                              self.rows.stop - self.rows.start).detach().clone()


def _shard_files(entries: list[_Entry], max_shard_bytes: int | None,
                 single_file: str = SINGLE_FILE) -> list[tuple[str, bool]]:
    """Per entry: its output file and whether it is that file's last tensor. Shards fill greedily
    in writing order (`max_shard_bytes` None: one file, `single_file`)."""
    shard_of, size, shard = [], 0, 0
    for entry in entries:
        if max_shard_bytes is not None and size and size + entry.nbytes > max_shard_bytes:
            shard, size = shard + 1, 0
        shard_of.append(shard)
        size += entry.nbytes
    count = shard + 1
    names = ([single_file] if count == 1 else
             [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
    return [(names[s], i + 1 == len(shard_of) or shard_of[i + 1] != s) for i, s in enumerate(shard_of)]


# ---- moving one tensor ------------------------------------------------------------------------------
def _gathered(pm: Any, entry: _Entry, local: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The full tensor on global rank 0 (None elsewhere). Ranks of the holding stage gather it
    together; the stage's first rank sends it to rank 0 when that is another rank."""
    rank, full = dist.get_rank(), None
    if pm.pp_rank == entry.pp_rank:
        tensor = local[entry.name]
        full = _whole(tensor)
        if rank == entry.sender and rank != 0:
            dist.send(full.detach().contiguous(), dst=0)
    if rank != 0 or entry.sender == 0:
        return full if rank == 0 else None
    received = torch.empty(entry.shape, dtype=entry.dtype, device=pm.device)
    dist.recv(received, src=entry.sender)
    return received


def _whole(tensor: Any) -> torch.Tensor:
    """A local tensor whole: computed (a callable), gathered (a DTensor, a collective), or itself."""
    return tensor() if callable(tensor) else tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# ---- rank 0's file work ------------------------------------------------------------------------------
def _start(path: Path, staging: Path, overwrite: bool) -> Exception | None:
    """Refuse a non-empty `path` (unless `overwrite`), then make the staging directory."""
    if path.exists() and not path.is_dir():
        return FileExistsError(f"{path} is a file; give a directory path for save_pretrained")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        return FileExistsError(f"{path} exists and is not empty; pass overwrite=True to replace it "
                               "(the old directory goes only once the new one is complete), or "
                               "choose another path")
    return _write(lambda: staging.mkdir(parents=True))


def _commit(staging: Path, path: Path, write_config: Any, entries: list[_Entry],
            files: list[tuple[str, bool]], overwrite: bool) -> Exception | None:
    """Index and config into the staging directory, then swap it into place."""
    def commit() -> None:
        if len({file for file, _ in files}) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries),
                                  "total_parameters": sum(_numel(e.shape) for e in entries)},
                     "weight_map": {e.name: file for e, (file, _) in zip(entries, files)}}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        write_config(staging, entries)
        _fsync_tree(staging)
        replaced = path.parent / f".{path.name}.replaced-{uuid.uuid4().hex[:12]}"
        if overwrite and path.is_dir():
            os.rename(path, replaced)
        os.rename(staging, path)
        shutil.rmtree(replaced, ignore_errors=True)

    return _write(commit)


def _write(action: Any, *args: Any) -> Exception | None:
    """Run a file action on rank 0; its error is kept, not raised, so the stream keeps going."""
    try:
        action(*args)
    except Exception as error:  # noqa: BLE001 - reported to every rank by _agree
        return error
    return None


def _agree(error: Exception | None, path: Path) -> None:
    """Rank 0's outcome on every rank: all raise together, or all go on."""
    box = [None if error is None else (type(error).__name__, str(error))]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return
    if error is not None:
        raise error
    kind, message = box[0]
    raise RuntimeError(f"save_pretrained to {path} failed on rank 0 ({kind}: {message}); nothing "
                       "was written there")


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
