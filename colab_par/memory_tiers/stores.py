"""Where one chunk of one kind of state lives: a tensor in memory, or a memory-mapped file on disk.

Why memory-mapped files: the optimizer updates a disk chunk in place through a tensor view of the
mapping (`torch.frombuffer`), with no copy of its own. `madvise(MADV_WILLNEED)` starts the kernel's
readahead of the next chunk while the current one updates (asynchronous by itself, so no I/O
thread is needed), and after an update `flush` (msync) writes the dirty range back and
`madvise(MADV_DONTNEED)` drops its pages from this process, so its resident memory really falls.

A file's blocks are reserved when it is made (`posix_fallocate`): a write through a mapping into a
block the disk no longer has kills the process with SIGBUS, so a full disk is refused there, with
the folder and the space, instead (`DiskTierFull`).
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import weakref
import torch

from colab_par.layout.tier_options import DEFAULT_DISK

__all__ = ["MemoryStore", "DiskStore", "RunFolder", "DiskTierFull", "check_disk_room"]


class DiskTierFull(OSError):
    """The disk tier's folder has too little free space for the state placed there."""


_WHAT_TO_DO = ("free space there, name a folder with room ('disk:/path'), or raise the budget so that "
               "less spills to disk")


def _size(count: int) -> str:
    return f"{count / 2 ** 30:.2f} GiB" if count >= 2 ** 30 else f"{count / 2 ** 20:.1f} MiB"


def check_disk_room(folder: str, need: int, rank: int) -> None:
    """Refuse placing `need` more bytes in `folder` before any file is written, if it lacks room
    (the reservation of each file catches ranks that share the disk and race for it)."""
    free = shutil.disk_usage(folder).free
    if need > free:
        raise DiskTierFull(f"rank {rank}: the disk tier's folder {folder} has {_size(free)} free, and this "
                           f"rank's state placed there needs {_size(need)} more: {_WHAT_TO_DO}")


class MemoryStore:
    """A chunk held in memory: on the device, or in pinned host memory for the host tier on CUDA."""

    tier_on_disk = False

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, tier: str, *, pinned: bool = False):
        self.tier = tier
        self.tensor = torch.zeros(numel, dtype=dtype, device=device, pin_memory=pinned)
        self.nbytes = numel * self.tensor.element_size()

    def prefetch(self) -> int:
        return 0

    def evict(self, dirty: bool) -> int:
        return 0

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]


class DiskStore:
    """A chunk in its own file under `folder`, mapped shared; bytes read/written are counted by the
    caller from what `prefetch` / `evict` return."""

    tier_on_disk = True
    tier = "disk"

    def __init__(self, folder: str, name: str, numel: int, dtype: torch.dtype, rank: int = 0):
        self.path = os.path.join(folder, name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = numel * itemsize
        size = max(-(-self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _reserve(descriptor, size)  # reads as zeros, as fresh Adam state starts
            self._map = mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as error:
            os.unlink(self.path)
            if isinstance(error, DiskTierFull):
                raise DiskTierFull(f"rank {rank}: the disk tier's folder {folder} cannot take a {_size(size)} "
                                   f"chunk file ({error}; {_size(shutil.disk_usage(folder).free)} free there): "
                                   f"{_WHAT_TO_DO}") from None
            raise
        finally:
            os.close(descriptor)
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel)
        self._resident = False
        self._written = False  # a fresh (sparse) file holds nothing to read

    def prefetch(self) -> int:
        """Start reading the chunk in; the bytes that will come from the disk tier."""
        self._map.madvise(mmap.MADV_WILLNEED)
        was, self._resident = self._resident, True
        return 0 if was or not self._written else self.nbytes

    def evict(self, dirty: bool) -> int:
        """Write the chunk back (when `dirty`) and drop its pages; the bytes written."""
        if dirty:
            self._map.flush()
            self._written = True
        self._map.madvise(mmap.MADV_DONTNEED)
        self._resident = False
        return self.nbytes if dirty else 0

    def own_view(self, view: torch.Tensor) -> torch.Tensor:
        """`view` (a contiguous piece of this chunk) as a tensor whose storage is exactly its bytes
        of the mapping: DCP's writer copies a tensor whose storage is larger than itself, and keeps
        every tensor of a file until the file is written, so a view would cost its size in memory."""
        if not view.is_contiguous():
            raise ValueError("a view of a chunk's slot is contiguous")
        return torch.frombuffer(self._map, dtype=view.dtype, count=view.numel(),
                                offset=view.storage_offset() * view.element_size()).view(view.shape)

    def close(self) -> None:
        """Unmap (once no view of the chunk is left) and delete the file."""
        self.tensor = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view still exists: the mapping goes with it, the file goes now
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _reserve(descriptor: int, size: int) -> None:
    """Give the file `size` bytes with its blocks allocated (where the system can say so)."""
    if not hasattr(os, "posix_fallocate"):  # macOS: a sparse file
        os.ftruncate(descriptor, size)
        return
    try:
        os.posix_fallocate(descriptor, 0, size)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DiskTierFull(str(error)) from error
        raise


class RunFolder:
    """This run's own subfolder of the disk tier's folder ("tmp": the system's temporary folder),
    removed when `owner` is garbage-collected or the process exits, whichever comes first."""

    def __init__(self, root: str, owner: object, rank: int):
        base = tempfile.gettempdir() if root == DEFAULT_DISK else os.path.expanduser(root)
        try:
            os.makedirs(base, exist_ok=True)
            self.path = tempfile.mkdtemp(prefix=f"colab_par_tiers_rank{rank}_", dir=base)
        except OSError as error:
            raise ValueError(f"rank {rank}: the disk tier's folder {base!r} cannot be written ({error}); "
                             "name a writable folder with 'disk:/path' or use 'disk' for the temporary "
                             "folder") from error
        self._finalizer = weakref.finalize(owner, shutil.rmtree, self.path, True)

    def remove(self) -> None:
        self._finalizer()
