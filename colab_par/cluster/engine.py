"""Code that runs inside each ipyparallel engine: device binding, rendezvous, health.

These functions are sent by reference (the engines import colab_par), so they stay small and
free of client state. Each is called through ipyparallel by `colab_par.cluster.Cluster`.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from datetime import timedelta
from typing import Any, Sequence

from colab_par import compat
from colab_par.cluster import direct
from colab_par.cluster.backend import device_for

__all__ = ["host_info", "visible_gpus", "visible_gpu_ids", "bind_device", "socket_interfaces", "enable_stack_dumps",
           "stack_file", "open_rendezvous", "init_process_group", "bound_device", "NCCL_ENVIRONMENT",
           "leave_process_group", "break_connections", "names_built_on_the_group", "user_names", "rank_status",
           "device_report", "before_cell"]

_LISTENER: socket.socket | None = None  # rank 0: the bound rendezvous socket until the store takes it
_STACKS: Any = None  # the open file faulthandler dumps stacks into on SIGUSR1
_ENGINE_SOCKETS: set[int] | None = None  # socket inodes the engine had before it joined a world
_INET = (socket.AF_INET, socket.AF_INET6)
_DRIVER_NODES = ("/dev/nvidiactl", "/dev/dxg")  # the NVIDIA driver's control node; WSL2's GPU node
# Set on an NCCL rank before its group forms, unless the user set them. On a timeout or an NCCL
# error, torch's watchdog then aborts the communicators and leaves the process alive (2,
# CleanUpOnly; torch's default, 3, and 1 tear the process down, losing the engine's variables):
# the rank's pending and later collectives raise, and the cluster re-forms the world. The flight
# recorder keeps the last collectives' states, so `probe` can name what a rank that returned
# from an NCCL call at once (it only enqueues) waits for in a later `.item()` or synchronize.
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_FR_BUFFER_SIZE": "2000"}


def host_info(toward: str = "127.0.0.1") -> dict[str, Any]:
    """Where this engine lives, so the client can derive local ranks, the rendezvous address and
    the backend (from the GPUs this engine sees, not the notebook's host: that may be a login node).

    The address is the one this host reaches `toward` (the controller) from: the network the hosts
    share. What the hostname resolves to is often loopback (Debian maps it to 127.0.1.1) or
    nothing at all on a cluster node.
    """
    gpus = visible_gpus()
    return {"host": socket.gethostname(), "ip": address_toward(toward), "pid": os.getpid(),
            "gpus": gpus, "gpu_ids": visible_gpu_ids(gpus)}


def visible_gpus() -> int:
    """CUDA GPUs this process may use (after CUDA_VISIBLE_DEVICES). torch counts them through NVML
    where it can, without initialising CUDA, so binding a device later is unaffected; a host
    without the NVIDIA driver (no /dev/nvidiactl, nor WSL2's /dev/dxg, through which WSL2's
    driver serves CUDA) answers without asking torch at all."""
    if sys.platform.startswith("linux") and not any(map(os.path.exists, _DRIVER_NODES)):
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable torch CUDA means no GPUs
        return 0


def visible_gpu_ids(count: int) -> list[str]:
    """Names of the `count` GPUs this process sees, so the client can tell engines that share a
    host's GPUs (the same names: each takes its own by local order) from engines each given their
    own by the launcher (srun --gpus-per-task, a CUDA_VISIBLE_DEVICES per engine: different names,
    each engine's one GPU is its cuda:0). NVML's UUIDs where it answers (a GPU confined by cgroups
    is "0" in every task), else CUDA_VISIBLE_DEVICES' entries."""
    if count == 0:
        return []
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    uuids = compat.gpu_uuids()
    if not uuids:
        return (named or [str(i) for i in range(count)])[:count]
    return [_uuid_of(entry, uuids) for entry in named][:count] if named else uuids[:count]


def _uuid_of(entry: str, uuids: list[str]) -> str:
    """NVML's UUID a CUDA_VISIBLE_DEVICES entry names (by index, or by the UUID or its prefix); the
    entry itself where NVML lists no such GPU."""
    if entry.isdigit():
        return uuids[int(entry)] if int(entry) < len(uuids) else entry
    return next((uuid for uuid in uuids if uuid.startswith(entry)), entry)


def address_toward(peer: str) -> str:
    """This host's address on the route to `peer` (no packet is sent: a UDP connect only routes)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))
            return probe.getsockname()[0]
    except OSError:  # no route: fall back to what the name says
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (IPv4, Linux): see `socket_interfaces`."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def socket_interfaces(own_address: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the interface that holds `own_address` (the
    address the world uses on this host). Both backends open their own sockets and otherwise pick
    an interface themselves: gloo the one the hostname resolves to (loopback or nothing on many
    nodes), NCCL the first it likes (a docker bridge, a management network). NCCL matches names
    by prefix unless they start with "=". Empty when no interface holds the address."""
    name = interface_of(own_address)
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"} if name else {}


def bind_device(local_rank: int, local_world: int, backend: str, device_index: int | None = None) -> str:
    """Bind this engine to its device before anything touches CUDA, and share the CPU fairly.

    Called first on a fresh engine: under nccl, `set_device` precedes any allocation, so each
    engine owns exactly one GPU; a gloo world computes on the CPU even on a GPU host (see
    `colab_par.cluster.backend`), and CUDA is left untouched. Each engine gets an equal share of the cores
    instead of every engine spawning a thread per core and thrashing. `device_index`: which of the
    GPUs this engine sees is its own (`backend.device_indices`; its local rank by default).
    """
    import torch

    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    index = local_rank if device_index is None else device_index
    device = device_for(backend, index)
    if device.startswith("cuda"):
        count = torch.cuda.device_count()
        if index >= count:
            raise RuntimeError(f"local rank {local_rank} has no GPU: this engine sees {count}; "
                               f"start at most one engine per GPU")
        torch.cuda.set_device(index)
    return device


def seed_generators(seed: int) -> None:
    """Start torch's and Python's generators from `seed`, so a notebook run repeats (a process
    otherwise draws a fresh seed) and a script exported from it computes the same."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def enable_stack_dumps() -> str:
    """Dump every thread's Python stack to a file on SIGUSR1, so the client can see where a rank
    waits even while its main thread is blocked inside a C++ collective (faulthandler writes from
    the signal handler itself), and on a crash (a segfault in native code), so the client can say
    where the rank died. The file is opened for appending, so the client may truncate it. An engine
    that exits cleanly removes it (a crash leaves it for the client, which removes it once read)."""
    import atexit
    import faulthandler
    import signal

    global _STACKS
    if _STACKS is None:
        path = stack_file(os.getpid())
        _STACKS = open(path, "a")  # noqa: SIM115 - stays open for the engine's lifetime
        faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
        faulthandler.enable(file=_STACKS, all_threads=True)
        atexit.register(_remove_file, path)
    return _STACKS.name


def stack_file(pid: int) -> str:
    """Where the engine of process `pid` on this host writes its stacks (`enable_stack_dumps`)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"colab_par-stacks-{pid}.txt")


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def open_rendezvous(addr: str) -> int:
    """Listen for the world's rendezvous on `addr` only (never on all interfaces) and return the port.

    The socket is bound here and handed to torch's TCPStore (``master_listen_fd``) by
    `init_process_group`, so no other process can take the port in between.
    """
    global _LISTENER
    if _LISTENER is not None:
        _LISTENER.close()
    _LISTENER = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    _LISTENER.bind((addr, 0))
    _LISTENER.listen(128)
    return _LISTENER.getsockname()[1]


def init_process_group(backend: str, addr: str, port: int, rank: int, world: int,
                       timeout_s: float, own_address: str) -> None:
    """Join a fresh torch.distributed world through rank 0's store at addr:port (any old group is
    left first, so this also re-initialises a broken world). Rank 0 serves the store on the socket
    `open_rendezvous` bound; gloo and NCCL talk over the interface holding `own_address` unless
    the user chose one (`socket_interfaces`)."""
    import torch.distributed as dist

    global _LISTENER, _ENGINE_SOCKETS
    leave_process_group([addr])
    if _ENGINE_SOCKETS is None:
        _ENGINE_SOCKETS = set(_socket_fds())
    for name, value in socket_interfaces(own_address).items():
        os.environ.setdefault(name, value)  # never over a value the user set
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": addr,
                       "MASTER_PORT": str(port)})
    if backend == "nccl":
        for name, value in NCCL_ENVIRONMENT.items():
            os.environ.setdefault(name, value)  # read when the NCCL group is built, below
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        if _LISTENER is None or _LISTENER.getsockname()[1] != port:
            raise RuntimeError(f"rank 0 holds no rendezvous socket on port {port}; "
                               "call open_rendezvous first")
        fd, _LISTENER = _LISTENER.detach(), None  # the store owns and closes it from now on
        store = dist.TCPStore(addr, port, world, True, timeout=timeout, master_listen_fd=fd)
    else:
        store = dist.TCPStore(addr, port, world, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=bound_device(backend))


def bound_device(backend: str) -> Any:
    """The device an NCCL world's rank is bound to (`bind_device` set it), for
    `init_process_group(device_id=...)`: the communicator forms at once, sub-groups split from it
    instead of each forming lazily at its first collective, and `barrier()` knows its GPU. None
    under gloo, which binds to no device."""
    if backend != "nccl":
        return None
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def leave_process_group(addresses: Sequence[str]) -> None:
    """Leave the world: close the connections to other ranks, then destroy the process groups.

    On a rank whose peers still wait in a collective, closing the connections makes their pending
    operations fail at once instead of at the timeout. Destroying the groups alone does not close
    them while anything (a DeviceMesh, a model, a user variable) still refers to a group.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    break_connections(addresses)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may fail to shut down cleanly; it is gone
        pass


def break_connections(addresses: Sequence[str]) -> None:
    """Make every pending collective of this rank, and of its peers waiting on it, fail now; safe
    from any thread (`colab_par.cluster.probe` calls it from the control thread while the main thread is
    blocked in a collective). gloo: shut down this rank's connections to the world's `addresses`
    (a blocked read returns at once). NCCL: its kernels wait on the GPU, not on a socket, so each
    communicator is aborted instead."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if "nccl" in dist.get_backend():
        for group in compat.process_groups():
            group.abort()
    _close_connections_to(set(addresses), exclude_ports={int(os.environ.get("MASTER_PORT", 0)),
                                                         direct.serving_port()} - {None})


def _close_connections_to(addresses: set[str], exclude_ports: set[int]) -> None:
    """Shut down the TCP connections this engine opened since it first joined a world (the gloo
    pairs) to peers at `addresses`; the store's and the client's direct channel's
    (`exclude_ports`) and ipyparallel's are kept.

    Only this process's own sockets are looked at (never the namespace-wide /proc/net/tcp, which
    on a busy host holds many thousands of rows and took seconds to read)."""
    for inode, fd in _socket_fds().items():
        if inode in (_ENGINE_SOCKETS or ()):
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as connection:
                if connection.type != socket.SOCK_STREAM or connection.family not in _INET:
                    continue
                remote_ip, remote_port = connection.getpeername()[:2]  # OSError unless connected
                local_port = connection.getsockname()[1]
                if (remote_ip.removeprefix("::ffff:") in addresses
                        and not exclude_ports & {local_port, remote_port}):
                    connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, or closed meanwhile


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor (empty where there is no /proc)."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(name)
    return found


def names_built_on_the_group() -> list[str]:
    """Engine variables holding (a few attributes deep) a process group, DeviceMesh or DTensor:
    they belong to a world that was torn down and must be rebuilt."""
    import types

    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    # nothing can hold an object of a module never imported, and importing DTensor's here would
    # cost the first repair of a session a second
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    mesh = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    kinds = tuple(kind for kind in (dist.ProcessGroup, mesh, dtensor) if kind is not None)
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
    seen: set[int] = set()

    def holds(value: Any, depth: int) -> bool:
        if isinstance(value, kinds):
            return True
        if depth == 0 or id(value) in seen or isinstance(value, skip + (str, bytes, torch.Tensor)):
            return False
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            return (dtensor is not None and any(isinstance(p, dtensor) for p in value.parameters())
                    or any(holds(v, depth - 1) for v in vars(value).values()))
        if isinstance(value, dict):
            children = list(value.values())[:50]
        elif isinstance(value, (list, tuple, set)):
            children = list(value)[:50]
        else:
            children = list(getattr(value, "__dict__", {}).values())
        return any(holds(child, depth - 1) for child in children)

    shell = get_ipython()
    seen.update({id(shell), id(shell.user_ns)})  # a walk through the shell would reach every name
    return sorted(name for name, value in list(shell.user_ns.items())
                  if not name.startswith("_") and name not in shell.user_ns_hidden
                  and not isinstance(value, skip) and holds(value, 4))


def user_names() -> list[str]:
    """The variables of this engine's interactive namespace (IPython's own names left out)."""
    from IPython import get_ipython

    shell = get_ipython()
    return sorted(name for name in shell.user_ns
                  if not name.startswith("_") and name not in shell.user_ns_hidden)


def rank_status() -> dict[str, Any]:
    """Health of this engine: identity, device and the memory it holds right now."""
    import resource

    import torch
    import torch.distributed as dist

    info = host_info()
    info["rank"] = dist.get_rank() if dist.is_initialized() else None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        info["device"] = f"cuda:{device}"
        info["memory_bytes"] = torch.cuda.memory_allocated(device)
    else:
        info["device"] = "cpu"
        info["memory_bytes"] = _rss_bytes() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return info


def device_report() -> dict[str, Any]:
    """Where this engine computes, as torch sees it (checked by `backend.device_problems`)."""
    import torch
    import torch.distributed as dist

    from colab_par.parallel.mesh import default_device

    cuda = torch.cuda.is_initialized()
    return {"backend": dist.get_backend() if dist.is_initialized() else None,
            "cuda_initialized": cuda, "current_device": torch.cuda.current_device() if cuda else None,
            "default_device": str(default_device()),
            "nccl_socket_ifname": os.environ.get("NCCL_SOCKET_IFNAME")}


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def before_cell(blob: bytes, number: int | None) -> None:
    """Before a cell: unpickle the shipped notebook names (a `ship.payload`) into the engine's
    interactive namespace in one piece, and number the cell as the notebook numbers it, so its
    tracebacks and `%colossal debug` say ``Cell In[7]`` where the notebook shows [7] (IPython
    names a cell by its shell's execution count when compiling it).

    One cloudpickle payload keeps the objects' identities consistent (a class and the ``__class__``
    cell its methods' ``super()`` uses are the same object), which per-name pushes do not.
    """
    from IPython import get_ipython

    from colab_par.cluster.ship import unpack

    shell = get_ipython()
    shell.user_ns.update(unpack(blob))
    if number is not None:
        shell.execution_count = number
