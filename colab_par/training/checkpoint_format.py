"""What a checkpoint version holds on disk, and how it is read without running code from it.

torch's own load path is not safe for files written by others: `FileSystemReader` unpickles
`.metadata` freely, and the default load planner reads every non-tensor entry with
`torch.load(weights_only=False)`, so a crafted checkpoint (say an optimizer `lr` whose unpickling
calls `os.system`) runs code on load, and checksums stored beside it cannot tell. Here:

- tensors go through DCP and are read by `torch.load(weights_only=True)` (DCP's tensor path);
- every non-tensor value (optimizer hyper-parameters such as lr, betas, flags; scalar state) is
  JSON in `NON_TENSORS`, tagged so that tuples come back as tuples;
- DCP's `.metadata` is read by an unpickler admitting exactly DCP's metadata classes, torch sizes,
  dtypes and paths; a checkpoint whose metadata lists a non-tensor (pickled) entry is refused
  before anything is read, naming it; and the load planner refuses byte items outright.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from colab_par import compat

__all__ = ["FORMAT", "NON_TENSORS", "CheckpointError", "split_state", "to_json", "from_json",
           "TensorOnlyReader", "TensorOnlyLoadPlanner"]

FORMAT = 2
"""1: optimizer hyper-parameters pickled inside DCP (never read again); 2: they are JSON."""
NON_TENSORS = "non-tensors.json"

_JSON_SCALARS = (type(None), bool, int, float, str)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, uncommitted, damaged, unsafe, or does not fit the model."""


# ---- non-tensor values as JSON -----------------------------------------------------------------------
def split_state(state: dict[str, dict]) -> tuple[dict[str, dict], dict[str, Any]]:
    """`state` ({"model": {...}, "optim": {...}}) as (its tensors, for DCP; every other value,
    keyed "model.<key>" / "optim.<key>" as DCP names entries)."""
    tensors: dict[str, dict] = {part: {} for part in state}
    others: dict[str, Any] = {}
    for part, values in state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[part][key] = value
            else:
                others[f"{part}.{key}"] = value
    return tensors, others


def to_json(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(`values` that JSON holds exactly, encoded; the names, with types, of those it cannot)."""
    encoded, refused = {}, []
    for name, value in values.items():
        try:
            encoded[name] = _encode(value)
        except TypeError:
            refused.append(f"{name} ({type(value).__qualname__})")
    return encoded, refused


def _encode(value: Any) -> Any:
    """None, bool, int, float, str as themselves; a list as a list; a tuple as {"tuple": [...]}.
    Exact types only: a subclass (numpy's float64, an IntEnum) would come back as something else."""
    if type(value) in _JSON_SCALARS:
        return value
    if type(value) is list:
        return [_encode(item) for item in value]
    if type(value) is tuple:
        return {"tuple": [_encode(item) for item in value]}
    raise TypeError(type(value).__qualname__)


def from_json(value: Any, name: str) -> Any:
    """The Python value `_encode` wrote for `name` (a tagged tuple back to a tuple)."""
    if isinstance(value, list):
        return [from_json(item, name) for item in value]
    if isinstance(value, dict):
        if set(value) != {"tuple"} or not isinstance(value["tuple"], list):
            raise CheckpointError(f"{NON_TENSORS} holds {value!r} for {name}, which no colab_par "
                                  "writes; the file was altered")
        return tuple(from_json(item, name) for item in value["tuple"])
    return value


# ---- DCP: tensors only --------------------------------------------------------------------------------
class TensorOnlyReader(dcp.FileSystemReader):
    """A DCP reader whose metadata is unpickled with nothing but DCP's metadata classes, refused
    when it lists a non-tensor entry, and read once (DCP then plans from exactly what was checked)."""

    def __init__(self, path: Any):
        super().__init__(path)
        self._checked: dict[Any, Metadata] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._checked:
            with open(compat.dcp_metadata_path(self, rank), "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{self.path}'s DCP metadata is a {type(metadata).__name__}, "
                                      "not DCP metadata; refusing it")
            _refuse_non_tensor_entries(metadata, self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._checked[rank] = metadata
        self._checked[rank].storage_meta.load_id = self.load_id
        return self._checked[rank]


def _refuse_non_tensor_entries(metadata: Metadata, path: Any) -> None:
    pickled = [key for key, entry in metadata.state_dict_metadata.items()
               if isinstance(entry, BytesStorageMetadata)]
    if pickled:
        more = f" (and {len(pickled) - 1} more)" if len(pickled) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} lists {pickled[0]}{more} as a pickled (non-tensor) entry, which "
            "colab_par never writes: the checkpoint was altered or written by another tool. Refusing "
            "to read it: colab_par reads only tensors and JSON from a checkpoint, since unpickling "
            "can run any code")


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner minus its pickle path: a byte (non-tensor) read is an error, never a
    `torch.load(weights_only=False)`. The reader refuses such entries first; this holds even if
    the files change in between."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                _refuse_byte_read(item)
        return plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        _refuse_byte_read(read_item)


def _refuse_byte_read(item: ReadItem) -> None:
    raise CheckpointError(f"the checkpoint stores {item.dest_index.fqn} as pickled bytes; colab_par "
                          "never unpickles checkpoint data")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits exactly DCP's metadata classes, torch sizes, dtypes and layouts, and paths: names
    matched whole, so no dotted name ("module.os.system") reaches anything else."""

    _ALLOWED = compat.DCP_METADATA_GLOBALS | {
        ("torch", "Size"), ("collections", "OrderedDict"),
        *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
            "ChunkStorageMetadata", "TensorProperties"))}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (module == "torch" and name.isidentifier()
                                               and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which is not checkpoint "
                              "metadata; refusing to unpickle it")
