"""Engines and controller forked from processes that have already imported torch and ipyparallel.

A fresh engine spends most of its start importing torch (about a second) and ipyparallel; the
controller spends a third of a second importing ipyparallel. The warm pool is two long-lived
processes ("zygotes": one with torch for engines, one without for controllers, which then start and
exit light) that pay those imports once, before any cluster is asked for: `%load_ext colab_par`
starts them in the background, and every `Cluster.start` on this host (including `restart` and
automatic recovery) then forks its controller and engines from them in milliseconds. The engine
zygote never touches CUDA (importing torch does not), so each forked engine still binds its own GPU
first; nothing is shared between engines but copy-on-write memory.

ipyparallel stays the engine layer and its launcher the owner of each process: the command it runs
is a tiny proxy (`python -m colab_par.cluster.warm_pool launch ...`, which imports next to nothing) that
hands its stdio, working directory, arguments and environment to the zygote, gets the forked child's
pid, forwards the signals it receives to that child and exits with the child's status. When the
zygote is not running, or was started with a different environment (below), the proxy `exec`s the
ordinary cold command instead, so a start never depends on the pool.
Once it has served a first start, the engine zygote also imports what a first `parallelize` or
`from_pretrained` would (`_IDLE_IMPORTS`), so engines of every later start have it. That is seconds
of CPU beside the user's first cells, so it yields to them (`idle_imports.Yielding`): it begins only
once the processes it serves (its owner, the notebook, and every engine it forked) have been quiet
for `_QUIET_S`, and pauses, between modules and inside one, as soon as they use the CPU again; each
pause doubles the quiet it waits for next (up to `_QUIET_MAX_S`), so a user running cells every few
seconds seldom meets an import that has just begun.
A zygote sleeps in `select` between requests: it costs no CPU while idle (until its idle imports are
made, it reads a few CPU clocks every `idle_imports.WAIT_S`), about 460 MB (engines, with the idle
imports; 240 MB without) and 55 MB (controllers) of memory, shared copy-on-write with what it forks
(`gc.freeze` keeps the collector from touching those pages, and forked processes from spending half a
second tearing torch down at exit).

Environment: a forked process runs with the requester's environment in `os.environ`, so whatever
is read while it runs (MASTER_ADDR, GLOO_*/NCCL_*, CUDA_VISIBLE_DEVICES at its first CUDA call,
HOME, PATH) is as in a fresh start. What a fork cannot change is what its zygote fixed when it
started and imported, so the pool is renewed (the kernel starts a fresh one, a zygote declines a
request) only when one of these differs from what it started with (`_READ_AT_START`): PYTHON*
(search path, hash seed, warnings: read by the interpreter at start), LANG and LC_* (its text
encoding), LD_* (which shared libraries bind), MALLOC_* and GLIBC_TUNABLES (the allocator, set up at
start), OMP_*, GOMP_*, KMP_*, MKL_*, OPENBLAS_* (the thread pools and their CPU binding, fixed when
torch loads those libraries), TORCH*, PYTORCH_*, TRITON_* (torch's, dynamo's, inductor's and
triton's switches, many read into configs at import) and HF_*, TRANSFORMERS_* (read at import by
the idle imports). Never for TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (`_SET_BY_TORCH`): torch
writes them into `os.environ` itself (at `import torch._inductor`, at a first GPU compile) and reads
them only when it compiles, in the forked process, which sees the requester's value: whoever set
them, a fork is as good as a fresh start, and a renewal message never names them.

Opt out with ``COLAB_PAR_WARM_POOL=0`` in the environment.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

from colab_par.cluster import idle_imports
from colab_par.cluster.idle_imports import WAIT_S, Yielding, import_quietly, touched_cuda
from colab_par.compat import CONTROLLER_MAIN_CODE, ENGINE_MAIN_CODE

__all__ = ["WarmPool", "shared_pool", "pool_pids", "prestart", "stop_shared_pool", "enabled", "FORKED_ENV"]

FORKED_ENV = "COLAB_PAR_FORKED_FROM"
"""Set in every forked process to the zygote's pid: how a process (or a test) tells it came warm."""

_TARGETS = {  # what each zygote imports, and what its forked children run
    # an engine's start imports its kernel's debugger (debugpy: its import checks this variable,
    # which the engine sets before it), IPython's store magic and history database, and the
    # bootstrap (`colab_par.cluster.engine_setup`) cloudpickle: each forked engine would import them anew
    "engine": ("import os; os.environ.setdefault('PYDEVD_DISABLE_FILE_VALIDATION', '1'); "
               "import torch.distributed, ipyparallel.engine.app, colab_par.cluster.engine_setup, cloudpickle, "
               "ipykernel.debugger, IPython.extensions.storemagic, sqlite3",
               ENGINE_MAIN_CODE),
    "controller": ("import ipyparallel.controller.app", CONTROLLER_MAIN_CODE),
}
# What an engine imports at its first `parallelize` or `from_pretrained` (torch's compiler and
# pipelining, which `colab_par.parallel` needs; transformers' model base and losses; peft): about
# 2 s, 4 s and 4 s of one core here, paid by every engine of a fresh cluster. The engine zygote
# imports them once it has forked a first start's engines and they (and the notebook) have been
# quiet a while (so that start never waits on them, and they yield to the user's cells:
# `idle_imports.Yielding`; each module on its own, so a later request waits for one at most): the
# engines of every later start (restart, recovery, the next cluster) come with them.
_IDLE_IMPORTS = {"engine": ("colab_par.parallel", "transformers.modeling_utils",
                            "transformers.loss.loss_utils", "peft"),
                 "controller": ()}
_QUIET_S = 2.0  # the processes a zygote serves quiet this long before its idle imports go on
_QUIET_MAX_S = 16.0  # each pause doubles the quiet wanted next (a user at work gets longer), up to this
_READ_AT_START = ("PYTHON", "LANG", "LC_", "LD_", "MALLOC_", "GLIBC_TUNABLES", "OMP_", "GOMP_", "KMP_",
                  "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "TRITON_", "HF_", "TRANSFORMERS_")  # docstring
_SET_BY_TORCH = {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}  # read only while compiling, after a fork
_CONNECT_WAIT_S = 30.0  # how long a proxy waits for a zygote that is still importing
_HEADER = struct.Struct("!I")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# the idle imports' yielding lived here before `idle_imports`: its names as they were then
_MOVED = {"_Yielding": "Yielding", "_Abandoned": "_Abandoned", "_import_quietly": "import_quietly",
          "_cpu_seconds": "cpu_seconds", "_touched_cuda": "touched_cuda", "_BUSY_SHARE": "BUSY_SHARE",
          "_WINDOW_S": "WINDOW_S", "_CHECK_S": "CHECK_S", "_WAIT_S": "WAIT_S"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(idle_imports, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def enabled() -> bool:
    return os.environ.get("COLAB_PAR_WARM_POOL", "1") not in ("0", "false", "no", "")


def cold_command(target: str) -> list[str]:
    """The ordinary command (a fresh interpreter) for `target`, what the proxy falls back to."""
    preload, run = _TARGETS[target]
    return [sys.executable, "-c", f"import gc; gc.disable(); {preload}; gc.enable(); {run}"]


class WarmPool:
    """Two zygotes on this host, one for engines (torch imported) and one for controllers (without
    torch: a controller then starts and exits light), owned by this process: they exit with it."""

    def __init__(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="colab_par-pool-")
        self._processes: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}  # the environment the zygotes started with

    def socket_path(self, target: str) -> str:
        return os.path.join(self._folder, f"{target}.sock")

    @property
    def pids(self) -> set[int]:
        return {process.pid for process in self._processes.values()}

    @property
    def running(self) -> bool:
        return len(self._processes) == len(_TARGETS) and all(
            process.poll() is None for process in self._processes.values())

    def start(self) -> "WarmPool":
        """Start the zygotes that are not running, in the background; each serves once its imports
        are done."""
        if not self._processes:
            self.env = dict(os.environ)
            os.makedirs(self._folder, mode=0o700, exist_ok=True)  # the last stop removed it
        for target in _TARGETS:
            process = self._processes.get(target)
            if process is None or process.poll() is not None:
                # stdin is a pipe nobody writes: its end-of-file tells the zygote its owner is gone
                self._processes[target] = subprocess.Popen(
                    [sys.executable, "-m", "colab_par.cluster.warm_pool", "serve", self.socket_path(target),
                     target], stdin=subprocess.PIPE, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = _CONNECT_WAIT_S) -> bool:
        """True once every zygote accepts requests (its imports are done)."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            if all(os.path.exists(self.socket_path(target)) for target in _TARGETS):
                return True
            time.sleep(0.01)
        return False

    def wait_warm(self, timeout: float = 120.0) -> bool:
        """True once every zygote has also made its idle imports (`_IDLE_IMPORTS`)."""
        deadline = time.monotonic() + timeout
        while self.running:
            if all(os.path.exists(self.socket_path(target) + ".warm") for target in _TARGETS):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return False

    def command(self, target: str) -> list[str]:
        """What a launcher runs to get `target` ("engine" or "controller") forked from its zygote."""
        return [sys.executable, "-m", "colab_par.cluster.warm_pool", "launch", self.socket_path(target),
                str(self._processes[target].pid), target]

    def stop(self) -> None:
        """End the zygotes (processes forked from them are their launchers' and stay)."""
        for process in self._processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self._processes.values():
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stdin.close()
        self._processes = {}
        for target in _TARGETS:
            _remove_files(self.socket_path(target))


_SHARED: WarmPool | None = None


def shared_pool() -> WarmPool | None:
    """This process's zygote, started if it is not running; None when the pool is switched off."""
    global _SHARED
    if not enabled():
        return None
    if _SHARED is not None and _SHARED.running and (changed := _env_changes(dict(os.environ), _SHARED.env)):
        print(f"colab_par: the environment changed since the warm pool started ({', '.join(changed)}); "
              "renewing it", file=sys.stderr)
        stop_shared_pool()
    if _SHARED is None:
        _SHARED = WarmPool()
    return _SHARED.start()


def pool_pids() -> set[int]:
    """The processes of this process's warm pool (none started here): they outlive every cluster."""
    return _SHARED.pids if _SHARED is not None else set()


def prestart() -> None:
    """Start the zygote now, in the background, so the first `Cluster.start` finds it warm."""
    shared_pool()


def stop_shared_pool() -> None:
    global _SHARED
    if _SHARED is not None:
        _SHARED.stop()
        _SHARED = None


atexit.register(stop_shared_pool)


# ---- the zygote ---------------------------------------------------------------------------------
def _serve(path: str, target: str) -> dict[str, Any] | None:
    """Import what `target` needs, then fork one child per request; return, in a forked child
    only, the request it is to run. The zygote itself returns None when its owner is gone (its
    stdin closed) or on SIGTERM."""
    own_env = dict(os.environ)  # what it started with (its imports may set variables of their own)
    gc.disable()  # full collections over torch's growing heap took a fifth of its import
    exec(_TARGETS[target][0])  # noqa: S102 - fixed import lines, the whole point of the zygote
    gc.freeze()  # what was imported stays out of every collection: no copy-on-write, fast exits
    gc.enable()
    return _Zygote(path, target, own_env).serve()


class _Zygote:
    """A zygote whose imports are made: it listens for requests, for signals (through a wake-up
    pipe) and for its owner's end (its stdin), and makes its idle imports while all is quiet."""

    def __init__(self, path: str, target: str, own_env: dict[str, str]) -> None:
        self.path, self.target, self.own_env = path, target, own_env
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the notebook
        self.stopping: list[bool] = []
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.append(True))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path + ".tmp")
        self.listener.listen(64)
        os.rename(path + ".tmp", path)  # the path appears only once requests can be served
        self.children: dict[int, socket.socket] = {}  # pid -> its proxy's connection
        self.idle_imports = list(_IDLE_IMPORTS[target])
        self.served = False  # idle imports wait for a first start: it is never slowed by them
        owner = os.getppid()
        self.yielding = Yielding(lambda: (owner, *self.children), (self.listener, sys.stdin.fileno()),
                                 self.stopping, quiet_s=_QUIET_S, quiet_max_s=_QUIET_MAX_S)
        if not self.idle_imports:
            _mark_warm(path)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "signal")
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "owner")

    def serve(self) -> dict[str, Any] | None:
        """Serve until stopped (None), or return the request a forked child is to run."""
        while not self.stopping:
            waiting = bool(self.idle_imports) and self.served
            ready = self.selector.select(WAIT_S if waiting else None)
            if waiting and not ready and self.yielding.quiet_for() >= self.yielding.quiet_needed:
                self._import_next()
            for key, _ in ready:
                if key.data == "accept":
                    if (request := self._accept()) is not None:  # in the forked child
                        return request
                elif key.data == "signal":
                    os.read(self.wake_read, 4096)
                    _reap(self.children, self.selector)
                elif key.data == "owner":
                    if not os.read(sys.stdin.fileno(), 4096):
                        self.stopping.append(True)
                else:  # a proxy closed its connection: it was killed, so its child goes too
                    self.selector.unregister(key.fileobj)
                    key.fileobj.close()
                    self.children.pop(key.data, None)
                    _forward(key.data, signal.SIGKILL)
        self.listener.close()
        _remove_files(self.path)
        return None

    def _import_next(self) -> None:
        # children that exit meanwhile are reaped at once: a cluster's stop waits on that
        signal.signal(signal.SIGCHLD, lambda *_: _reap(self.children, self.selector))
        import_quietly(self.idle_imports.pop(0), self.yielding)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        if touched_cuda():  # its forks could not use a GPU: later starts go the ordinary way
            self.stopping.append(True)
        if not self.idle_imports:
            _mark_warm(self.path)

    def _accept(self) -> dict[str, Any] | None:
        """Fork a child for the request waiting on the listener (or decline it); the request, in
        that child only."""
        connection, _ = self.listener.accept()
        request = _receive_request(connection)
        if request is None:
            connection.close()
            return None
        if changed := _env_changes(request["env"], self.own_env):
            print(f"colab_par: the environment changed since the warm pool started "
                  f"({', '.join(changed)}); starting {self.target}s the ordinary way, and a "
                  "fresh pool for the next start", file=sys.stderr)
            connection.sendall(_HEADER.pack(0))  # stale: the proxy starts cold instead
            connection.close()
            _close_fds(request["fds"])
            self.stopping.append(True)  # the next pool, started fresh, will match
            return None
        pid = os.fork()
        if pid == 0:
            self._leave(connection)
            return request
        _close_fds(request["fds"])
        self.served = True
        self.yielding.busy()  # a start's own burst of requests goes first
        self.children[pid] = connection
        self.selector.register(connection, selectors.EVENT_READ, pid)
        connection.sendall(_HEADER.pack(pid))
        return None

    def _leave(self, connection: socket.socket) -> None:
        """In a forked child: drop the zygote's signal handlers, sockets and wake-up pipe."""
        os.setsid()
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        self.selector.close()
        for other in (self.listener, *self.children.values(), connection):
            other.close()
        for fd in (self.wake_read, self.wake_write):
            os.close(fd)


def _remove_files(path: str) -> None:
    """A zygote's socket and marker, and their folder once the other zygote's are gone too."""
    for done in (path, path + ".warm"):
        if os.path.exists(done):
            os.remove(done)
    with contextlib.suppress(OSError):  # not empty: the other zygote still serves from it
        os.rmdir(os.path.dirname(path))


def _mark_warm(path: str) -> None:
    """An empty file beside the socket: this zygote has made all its idle imports."""
    open(path + ".warm", "w").close()  # noqa: SIM115


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Collect exited children and tell each one's proxy how it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            selector.unregister(connection)
            try:
                connection.sendall(_HEADER.pack(status))
            except OSError:
                pass
            connection.close()


def _receive_request(connection: socket.socket) -> dict[str, Any] | None:
    try:
        head, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 3)
        if len(head) < _HEADER.size:
            _close_fds(fds)
            return None
        (size,) = _HEADER.unpack(head)
        body = b""
        while len(body) < size:
            chunk = connection.recv(size - len(body))
            if not chunk:
                _close_fds(fds)
                return None
            body += chunk
    except OSError:
        return None
    return {**json.loads(body), "fds": fds}


def _env_changes(env: dict[str, str], own: dict[str, str]) -> list[str]:
    """The variables read at start or import (module docstring) that differ: a fork from a zygote
    that started with `own` would not match a fresh start under `env`."""
    def kept(values: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in values.items() if k.startswith(_READ_AT_START) and k not in _SET_BY_TORCH}

    env, own = kept(env), kept(own)
    return sorted(k for k in env.keys() | own.keys() if env.get(k) != own.get(k))


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _run_forked(request: dict[str, Any]) -> None:
    """In the forked child: become the process the proxy's command would have started."""
    for target_fd, fd in enumerate(request["fds"]):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[FORKED_ENV] = str(os.getppid())
    sys.argv = ["-c", *request["args"]]
    sys.path[0] = ""  # as under `python -c`: the working directory, whatever it is now
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdio, never closed
    sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
    exec(_TARGETS[request["target"]][1], {"__name__": "__main__"})  # noqa: S102 - fixed entry points


# ---- the proxy a launcher runs ------------------------------------------------------------------
def _launch(path: str, zygote: int, target: str, args: list[str]) -> int:
    """Have the zygote fork `target`, then stand for it: forward signals, exit with its status.
    Falls back to exec'ing the cold command when no zygote answers or it declines."""
    connection = _connect(path, zygote)
    if connection is not None:
        body = json.dumps({"target": target, "args": args, "cwd": os.getcwd(),
                           "env": dict(os.environ)}).encode()
        try:
            socket.send_fds(connection, [_HEADER.pack(len(body))], [0, 1, 2])
            connection.sendall(body)
            reply = _read_exactly(connection, _HEADER.size)
        except OSError:
            reply = b""
        pid = _HEADER.unpack(reply)[0] if len(reply) == _HEADER.size else 0
        if pid:
            for signum in _FORWARDED:
                signal.signal(signum, lambda signum, _, pid=pid: _forward(pid, signum))
            status = _read_exactly(connection, _HEADER.size)
            if len(status) < _HEADER.size:  # the zygote went first (its pool was renewed or
                return _stand_until_gone(pid)  # stopped): stand for the child until it ends
            code = os.waitstatus_to_exitcode(_HEADER.unpack(status)[0])
            if code < 0:  # the child died of a signal: so does its stand-in
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code
        connection.close()
    command = cold_command(target)
    os.execv(command[0], command + args)
    return 1  # not reached


def _stand_until_gone(pid: int) -> int:
    """Wait for a child whose exit status nobody can tell this proxy any more (it is no longer the
    zygote's child to reap): its launcher sees it end when it ends, never before."""
    while _alive(pid):
        time.sleep(0.05)
    return 1  # how it ended is unknown: not reported as a clean exit


def _connect(path: str, zygote: int) -> socket.socket | None:
    """The zygote's socket, waiting while it (process `zygote`) is still importing."""
    deadline = time.monotonic() + _CONNECT_WAIT_S
    while True:
        if os.path.exists(path):
            try:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                connection.connect(path)
                return connection
            except OSError:
                connection.close()
                return None
        if not _alive(zygote) or time.monotonic() > deadline:
            return None
        time.sleep(0.005)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        try:
            chunk = connection.recv(size - len(data))
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    return data


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _main(argv: list[str]) -> int:
    role, path, *rest = argv
    if role == "launch":
        return _launch(path, int(rest[0]), rest[1], rest[2:])
    request = _serve(path, rest[0])
    if request is None:  # the zygote ends without tearing down what it imported (nanobind-based
        sys.stderr.flush()  # modules such as triton's report "leaks" at interpreter exit)
        os._exit(0)
    _run_forked(request)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
