"""The files and rank bookkeeping under a checkpoint (`checkpoint.py`): the commit's names, the
digests it records, JSON written durably, pruning, RNG streams as text, and collectives over
any group (an asynchronous save commits on a group of its own: `checkpoint_async.py`)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from colab_par.parallel.rng import ModelStream

__all__ = ["COMMIT_MARKER", "LATEST", "file_digests", "digest", "unique", "gathered", "merged", "rng_state",
           "set_rng_state", "write_json", "write_text_atomically", "fsync_dir", "prune", "shared_random_id",
           "this_rank", "world_size", "barrier"]

COMMIT_MARKER = "COMMITTED"
LATEST = "LATEST"


def file_digests(folder: Path, names: list[str], group: Any = None) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} for `names` in `folder`; collective (on `group`, default the
    default group): each rank hashes every world-th file, so each file is read once in all."""
    rank, world = this_rank(group), world_size(group)
    mine = {name: digest(folder / name) for name in names[rank::world]}
    return merged(mine, group)


def digest(path: Path) -> dict:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def unique(items: Any) -> list:
    return list(dict.fromkeys(items))


def gathered(value: Any, group: Any = None) -> list:
    """`value` from every rank, in rank order (over `group`, default the default group)."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def merged(mine: dict, group: Any = None) -> dict:
    merged: dict = {}
    for part in gathered(mine, group):
        merged.update(part)
    return merged


# ---- small state: RNG, files, ranks -----------------------------------------------------------------
def rng_state(stream: ModelStream) -> dict:
    """The model's stream (parallel/rng.py) as text: one base64 generator state per device kind."""
    names = {"cpu": "torch", "cuda": "cuda"}
    return {names[kind]: base64.b64encode(state.numpy().tobytes()).decode() for kind, state in stream.state().items()}


def set_rng_state(stream: ModelStream, saved: dict) -> None:
    """Continue the saved stream where it drew on the same devices (a CPU run's masks cannot
    continue on a GPU: there dropout draws from the device's generator)."""
    decoded = {kind: torch.frombuffer(bytearray(base64.b64decode(saved[name])), dtype=torch.uint8)
               for kind, name in (("cpu", "torch"), ("cuda", "cuda")) if name in saved}
    if decoded.keys() == stream.state().keys():
        stream.load_state(decoded)


def write_json(path: Path, value: Any) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


def write_text_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(root: Path, keep: int) -> None:
    """Drop versions beyond the newest `keep` and staging folders of saves that died."""
    current = (root / LATEST).read_text().strip()
    versions = sorted((p for p in root.glob("step-*") if (p / COMMIT_MARKER).is_file()),
                      key=lambda p: p.stat().st_mtime)
    stale = [p for p in versions[:-keep] if p.name != current] + list(root.glob(".tmp-*"))
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)


def shared_random_id(group: Any = None) -> int:
    """A random 62-bit id, the same on every rank of `group` (default the default group; drawn
    on its first rank, broadcast)."""
    token = torch.tensor([int.from_bytes(os.urandom(8), "little") >> 2], dtype=torch.int64)
    if dist.is_initialized():
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        token = token.to(device)
        dist.broadcast(token, group=group, group_src=0)
    return int(token.item())


def this_rank(group: Any = None) -> int:
    """This process's rank in `group` (default the default group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group: Any = None) -> int:
    """The ranks of `group` (default the default group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
