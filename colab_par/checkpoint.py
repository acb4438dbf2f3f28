"""Distributed checkpoints through `torch.distributed.checkpoint` (DCP), committed atomically.

A checkpoint root holds committed versions `step-<n>-<id>/` and a `LATEST` file naming the newest.
A save writes into `.tmp-<id>/`, fsyncs, writes the `COMMITTED` marker, renames the folder into
place and only then replaces `LATEST` (write + fsync + rename): a process killed at any point
leaves the previous version loadable. The marker records every file's size and SHA-256, and a
load checks them before DCP reads anything, so a damaged file is named (with the newest earlier
version that is intact) instead of failing deep inside torch.load; a checkpoint of another model
is refused on one line naming the first parameter whose shape differs. Tensors (model, optimizer)
go through DCP with the original model's FQNs, so a checkpoint saved under one layout loads under
another (DCP reshards). The rest (step, data position, LR schedule, layout, RNG) is JSON — nothing
is ever unpickled except DCP's metadata file, read with an unpickler that admits only DCP's own
metadata classes.
"""
from __future__ import annotations

import base64
import hashlib
import inspect
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from colab_par import compat

__all__ = ["save", "load", "relayout", "latest_checkpoint", "saved_history", "CheckpointError"]

COMMIT_MARKER = "COMMITTED"
LATEST = "LATEST"
META = "meta.json"
FORMAT = 1
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, uncommitted, damaged, or does not fit the model it is loaded into."""


# ---- save ----------------------------------------------------------------------------------------
def save(pm: Any, path: str | os.PathLike, *, trainer: Any = None, keep: int = 2) -> Path:
    """Save `pm` (and the trainer's loop state) under the checkpoint root `path`; call on every rank.

    Returns the committed version folder. The `keep` newest versions are kept.
    """
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the version just written is always kept)")
    _single_part(pm)  # refuse unsupported layouts before any folder is made
    root, rank = Path(path), _rank()
    token = shared_random_id()
    step = int(trainer.step) if trainer is not None else 0
    staging = root / f".tmp-{token:016x}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    _barrier()
    dcp.save(_tensor_state(pm), checkpoint_id=str(staging))
    _write_json(staging / f"rng-rank{rank}.json", _rng_state())
    if trainer is not None:
        _write_json(staging / f"history-rank{rank}.json", trainer.history)
    if rank == 0:
        _write_json(staging / META, {
            "format": FORMAT, "layout": str(pm.layout), "world_size": _world(), "step": step,
            "trainer": trainer.state_dict() if trainer is not None else None})
    _barrier()
    files = _file_digests(staging, sorted(p.name for p in staging.iterdir()))
    final = root / f"step-{step:08d}-{token:016x}"
    if rank == 0:
        _write_json(staging / COMMIT_MARKER, {"step": step, "files": files})
        _fsync_dir(staging)
        os.rename(staging, final)
        _write_text_atomically(root / LATEST, final.name)
        _fsync_dir(root)
        _prune(root, keep)
    _barrier()
    return final


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """The committed version a load of `path` would use (a root or a version folder)."""
    path = Path(path)
    if (path / COMMIT_MARKER).is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"no committed checkpoint under {str(path)!r} (no {LATEST} file); "
                              "pass the folder given to colab_par.save")
    version = path / pointer.read_text().strip()
    if not (version / COMMIT_MARKER).is_file():
        raise CheckpointError(f"{str(version)!r} has no {COMMIT_MARKER} marker: it was never "
                              "committed; refusing to load a partial checkpoint")
    return version


def saved_history(path: str | os.PathLike) -> list[dict] | None:
    """This rank's trainer history as the latest committed version under `path` saved it (None
    when that version has none for this rank)."""
    found = latest_checkpoint(path) / f"history-rank{_rank()}.json"
    return json.loads(found.read_text()) if found.is_file() else None


# ---- load ----------------------------------------------------------------------------------------
def load(pm: Any, path: str | os.PathLike, *, trainer: Any = None) -> dict:
    """Load the latest committed version under `path` into `pm` (any layout); call on every rank.

    Restores the trainer's step, data position and LR bases, and RNG states when the world size
    matches. Returns the checkpoint's metadata (including the layout it was saved under).

    Before any tensor is read, every file is checked against the sizes and SHA-256 sums recorded at
    commit (raising CheckpointError naming the damaged file and the newest earlier intact
    version), and every tensor's global shape against the model's. Versions written before
    checksums were recorded still load, unverified.
    """
    version = latest_checkpoint(path)
    _refuse_damaged(version)
    meta = json.loads((version / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{str(version)!r} has format {meta.get('format')!r}; this colab_par "
                              f"reads format {FORMAT}")
    if trainer is not None:
        _check_resumable(meta, trainer, version)
    state = _tensor_state(pm)
    reader = MetadataOnlyReader(version)
    _refuse_misfit(state, reader.read_metadata(), version)
    dcp.load(state, storage_reader=reader)
    for part in pm.model_parts:
        own = get_model_state_dict(part)
        set_model_state_dict(part, {key: state["model"][key] for key in own})
    set_optimizer_state_dict(_single_part(pm), _local_optimizer(pm), state["optim"], options=_OPTIONS)
    if trainer is not None:
        trainer.load_state_dict(meta["trainer"])
    rng_file = version / f"rng-rank{_rank()}.json"
    if meta["world_size"] == _world() and rng_file.is_file():
        _set_rng_state(json.loads(rng_file.read_text()))
    _barrier()
    return meta


def _check_resumable(meta: dict, trainer: Any, version: Path) -> None:
    """Refuse, before touching any tensor, a checkpoint the trainer cannot continue from."""
    saved = meta.get("trainer")
    if saved is None:
        raise CheckpointError(f"{str(version)!r} was saved without a trainer; load without "
                              "trainer= or resume from a checkpoint that Trainer wrote")
    if saved.get("data") != trainer.data.describe():
        raise CheckpointError(f"{str(version)!r} was trained on data {saved.get('data')} but this "
                              f"trainer has {trainer.data.describe()}; build the same dataset to resume")


# ---- integrity: checksums recorded at commit, verified at load -------------------------------------
def _file_digests(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} for `names` in `folder`; collective: each rank hashes every
    world-th file, so each file is read once in all."""
    rank, world = _rank(), _world()
    mine = {name: _digest(folder / name) for name in names[rank::world]}
    return _merged(mine)


def _digest(path: Path) -> dict:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def _damage(version: Path) -> list[str] | None:
    """What differs from the commit record (same list on every rank); None if it has no checksums."""
    try:
        recorded = json.loads((version / COMMIT_MARKER).read_text()).get("files")
    except ValueError:
        return [f"its {COMMIT_MARKER} record is not valid JSON"]
    if recorded is None:
        return None
    present = [name for name in sorted(recorded) if (version / name).is_file()]
    found = _file_digests(version, present)
    problems = []
    for name, expected in sorted(recorded.items()):
        actual = found.get(name)
        if actual is None:
            problems.append(f"{name} is missing")
        elif actual["bytes"] != expected["bytes"]:
            problems.append(f"{name} is {actual['bytes']} bytes but {expected['bytes']} were committed")
        elif actual["sha256"] != expected["sha256"]:
            problems.append(f"{name} does not match the SHA-256 recorded at commit")
    return problems


def _refuse_damaged(version: Path) -> None:
    problems = _damage(version)
    if not problems:
        return
    more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
    raise CheckpointError(f"checkpoint {version} is damaged: {problems[0]}{more}; "
                          f"{_earlier_intact(version)}")


def _earlier_intact(version: Path) -> str:
    """Where to go instead: the newest earlier committed version whose files all check out."""
    committed = sorted((p for p in version.parent.glob("step-*")
                        if p != version and (p / COMMIT_MARKER).is_file()),
                       key=lambda p: (p / COMMIT_MARKER).stat().st_mtime, reverse=True)
    for earlier in committed:
        problems = _damage(earlier)
        if problems is None:
            return (f"the earlier checkpoint {earlier} predates checksums and cannot be verified; "
                    "load that path to try it")
        if not problems:
            return f"the earlier checkpoint {earlier} is intact: load that path instead"
    return f"no earlier committed checkpoint under {version.parent} is intact"


# ---- fit: the checkpoint's tensors against the model's, before DCP reads them -----------------------
def _refuse_misfit(state: dict[str, dict], metadata: Any, version: Path) -> None:
    """Compare global shapes and names with the checkpoint's metadata; one line on every rank.

    Each rank checks the tensors it holds; the model names of all ranks together (pipeline stages
    hold only theirs) decide which checkpoint tensors this model lacks."""
    saved = metadata.state_dict_metadata
    mismatched, missing = [], []
    local = [("model", key, value) for key, value in state["model"].items()]
    local += [("optim", key, value) for key, value in state["optim"].items()]
    for prefix, key, value in local:
        entry = saved.get(f"{prefix}.{key}")
        shown = key if prefix == "model" else f"optimizer {key}"
        if entry is None:
            missing.append(shown)
        elif isinstance(value, torch.Tensor) and hasattr(entry, "size") and \
                list(entry.size) != list(value.shape):
            mismatched.append(f"{shown} is {list(entry.size)} in the checkpoint but "
                              f"{list(value.shape)} here")
    gathered = _gathered((mismatched, missing, list(state["model"])))
    mismatched = sorted(_unique(m for rank in gathered for m in rank[0]),
                        key=lambda reason: reason.startswith("optimizer "))  # parameters first
    missing = _unique(m for rank in gathered for m in rank[1])
    ours = {f"model.{key}" for rank in gathered for key in rank[2]}
    unexpected = [key[len("model."):] for key in saved if key.startswith("model.") and key not in ours]
    reasons = (mismatched + [f"{key} is not in the checkpoint" for key in missing]
               + [f"the checkpoint has {key}, which this model lacks" for key in unexpected])
    if not reasons:
        return
    counts = [f"{n} {what}" for n, what in ((len(mismatched), "mismatched"), (len(missing), "missing"),
                                            (len(unexpected), "unexpected")) if n]
    raise CheckpointError(f"checkpoint {version} does not fit this model: {reasons[0]} "
                          f"({', '.join(counts)} in all); build the model it was saved from")


def _unique(items: Any) -> list:
    return list(dict.fromkeys(items))


def _gathered(value: Any) -> list:
    """`value` from every rank, in rank order."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * _world()
    dist.all_gather_object(values, value)
    return values


def _merged(mine: dict) -> dict:
    merged: dict = {}
    for part in _gathered(mine):
        merged.update(part)
    return merged


# ---- relayout ------------------------------------------------------------------------------------
def relayout(pm: Any, layout: Any, *, trainer: Any = None,
             model_factory: Callable[[], torch.nn.Module] | None = None,
             scratch_dir: str | os.PathLike | None = None) -> Any:
    """Move a live model to another layout without restarting engines: save through DCP, rebuild,
    parallelize with `layout`, load (DCP reshards). Returns the new ParallelModel and re-points
    `trainer` at it. `scratch_dir` must be visible to every rank (default: the system temp dir,
    fine while all engines share a host)."""
    from colab_par.layout import Layout
    from colab_par.parallel import parallelize

    new_layout = Layout.parse(layout)
    factory = model_factory or _default_factory(pm)
    new_layout.validate(_world(), getattr(factory, "config", None))
    base = Path(scratch_dir) if scratch_dir is not None else Path(tempfile.gettempdir())
    scratch = base / f"colab_par-relayout-{shared_random_id():016x}"
    try:
        save(pm, scratch, trainer=trainer, keep=1)
        optimizer_fn = getattr(pm, "optimizer_fn", None) or _same_optimizer(pm.optimizer)
        options = getattr(pm, "parallelize_options", {})  # the same loss_fn, blocks, tp_plan
        new_pm = parallelize(factory, new_layout, **{**options, "optimizer_fn": optimizer_fn})
        load(new_pm, scratch, trainer=trainer)
    finally:
        _barrier()
        if _rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if trainer is not None:
        trainer.pm = new_pm
    return new_pm


def _same_optimizer(optimizer: torch.optim.Optimizer) -> Callable:
    """An optimizer_fn building the live optimizer's class with its defaults (the checkpoint then
    restores per-group settings and state)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the real one
    accepted = inspect.signature(type(inner).__init__).parameters
    settings = {key: value for key, value in inner.defaults.items() if key in accepted}
    return lambda params: type(inner)(params, **settings)


def _default_factory(pm: Any) -> Callable[[], torch.nn.Module]:
    factory = getattr(pm, "model_factory", None)
    if factory is None:
        raise CheckpointError("relayout needs to rebuild the model but it was not built from a "
                              "config; pass model_factory=lambda: MyModel(...)")
    return factory


# ---- tensor state ----------------------------------------------------------------------------------
def _tensor_state(pm: Any) -> dict[str, dict]:
    model: dict[str, Any] = {}
    for part in pm.model_parts:
        model.update(get_model_state_dict(part))
    return {"model": model, "optim": get_optimizer_state_dict(_single_part(pm), _local_optimizer(pm),
                                                              options=_OPTIONS)}


def _local_optimizer(pm: Any) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state. ZeRO-1 keeps each parameter's state on one rank in
    an inner optimizer over the parameters it owns: every rank saves its own FQNs, and the union
    is the full state, which DCP reshards into any layout."""
    return pm.optimizer.optim if isinstance(pm.optimizer, ZeroRedundancyOptimizer) else pm.optimizer


def _single_part(pm: Any) -> torch.nn.Module:
    parts = list(pm.model_parts)
    if len(parts) != 1:
        raise CheckpointError(f"this rank holds {len(parts)} pipeline stages under one optimizer; "
                              "checkpoints support one stage per rank (virtual_stages=1) for now")
    return parts[0]


class MetadataOnlyReader(dcp.FileSystemReader):
    """DCP reader whose metadata unpickler admits only DCP's metadata classes and plain values."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        with open(compat.dcp_metadata_path(self, rank), "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch sizes/dtypes/layouts and paths; nothing callable."""

    _ALLOWED = compat.DCP_METADATA_GLOBALS | {("torch", "Size"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or module == "torch.distributed.checkpoint.metadata" or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which is not checkpoint "
                              "metadata; refusing to unpickle it")


# ---- small state: RNG, files, ranks -----------------------------------------------------------------
def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])),
                                                  dtype=torch.uint8))


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_text_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    """Drop versions beyond the newest `keep` and staging folders of saves that died."""
    current = (root / LATEST).read_text().strip()
    versions = sorted((p for p in root.glob("step-*") if (p / COMMIT_MARKER).is_file()),
                      key=lambda p: p.stat().st_mtime)
    stale = [p for p in versions[:-keep] if p.name != current] + list(root.glob(".tmp-*"))
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)


def shared_random_id() -> int:
    """A random 62-bit id, the same on every rank (drawn on rank 0, broadcast)."""
    token = torch.tensor([int.from_bytes(os.urandom(8), "little") >> 2], dtype=torch.int64)
    if dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        token = token.to(device)
        dist.broadcast(token, src=0)
    return int(token.item())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
