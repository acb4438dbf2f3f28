"""A direct channel from the client to each engine on this host, around ipyparallel's controller.

ipyparallel routes every request client → controller's queue → engine and every reply back the
same way: 2-3 ms of a trivial call's round trip on a loaded 2-core host, twice Monarch's whole
round trip. Here each engine listens on a socket of its own (`serve`, opened at bootstrap), and
the client sends the very same ipyparallel messages there: the engine's kernel runs them as it
runs its controller's (`compat.engine_shell`: the same handlers, namespace, SIGINT handling,
error replies with IPython's tracebacks, busy/idle status) and its output still travels on
ipyparallel's iopub channel. The client files the requests and replies in ipyparallel's own
books (`Client.send_apply_request` / `send_execute_request` with the engine's identity), so the
AsyncResult is ipyparallel's: stdout, published data, errors and stranded-request handling when
an engine dies are unchanged. Idle, nothing polls: both ends wait in zmq.

Engines on other hosts keep ipyparallel's route (the client may not reach them directly).
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Sequence

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from colab_par import compat

__all__ = ["serve", "serving_port", "Channels"]

_SERVING: dict[str, Any] = {}  # on an engine: the open channel ("url", "port", "stream")


# ---- on the engine --------------------------------------------------------------------------------
def serve(address: str) -> str | None:
    """Listen for direct requests on `address` (an ipyparallel task: it runs in the engine's main
    thread, whose event loop then serves the socket); returns the URL to connect to, the same one
    when asked again, or None where this kernel cannot serve them (the client keeps ipyparallel's
    route)."""
    if "url" in _SERVING:
        return _SERVING["url"]
    kernel = compat.engine_kernel()
    shell = compat.engine_shell(kernel)
    if shell is None:
        return None
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.linger = 0
    port = socket.bind_to_random_port(f"tcp://{address}")
    stream = ZMQStream(socket)
    stream.on_recv(lambda frames: _dispatch(kernel, *shell, stream, frames), copy=False)
    _SERVING.update(url=f"tcp://{address}:{port}", port=port, stream=stream)
    return _SERVING["url"]


async def _dispatch(kernel: Any, lock: Any, dispatch_shell: Callable[[Any, list], Any], stream: Any,
                    frames: list) -> None:
    """One request, in turn with the controller's. A call (``apply_request``) runs through
    ipyparallel's own `do_apply` (the user namespace, IPython's traceback on error) between the
    kernel's own steps, as `Kernel.dispatch_shell` takes them, less what no one reads: its debug
    logging, its waits for the output thread (`compat.after_output` keeps the order) and the
    "busy" status (client and hub act on "idle" only, which ends the task's output); anything
    else (a cell) goes to dispatch_shell."""
    async with lock:
        idents, parts = kernel.session.feed_identities(frames, copy=False)
        if len(parts) < 2 or kernel.session.unpack(parts[1].bytes).get("msg_type") != "apply_request":
            await dispatch_shell(stream, frames)  # verifies the signature (only once: replays are refused)
            return
        msg = kernel.session.deserialize(parts, content=True, copy=False)
        kernel.set_parent(idents, msg, channel="shell")
        try:
            if kernel.should_handle(stream, msg, idents):  # a request aborted meanwhile is answered so
                _apply(kernel, stream, idents, msg)
        finally:  # "idle" ends the task's output for the client: it must follow that output
            compat.after_output([sys.stdout, sys.stderr],
                                lambda: kernel._publish_status("idle", "shell", parent=msg))


def _apply(kernel: Any, stream: Any, idents: list, msg: dict) -> None:
    """`IPythonParallelKernel.apply_request` with ipykernel's SIGINT handling around it."""
    metadata = kernel.init_metadata(msg)
    kernel.pre_handler_hook()
    kernel.shell_is_blocking = True
    try:
        reply, buffers = kernel.do_apply(msg["content"], msg["buffers"], msg["header"]["msg_id"], metadata)
    finally:
        kernel.shell_is_blocking = False
        kernel.post_handler_hook()
    kernel.session.send(stream, "apply_reply", reply, parent=msg, ident=idents, buffers=buffers,
                        metadata=kernel.finish_metadata(msg, metadata, reply))


def serving_port() -> int | None:
    """The port this engine serves direct requests on (its connections are not the world's)."""
    return _SERVING.get("port")


# ---- on the client --------------------------------------------------------------------------------
class Channels:
    """The client's end: one socket per engine that serves direct requests, in the ipyparallel
    client's I/O thread, its replies handed to the client's own reply handler."""

    def __init__(self, client: Any):
        self._client = client
        self._streams: dict[int, ZMQStream] = {}  # engine id -> stream

    def connect(self, urls: dict[int, str | None]) -> None:
        """Connect to each engine id's URL (None: that engine keeps ipyparallel's route)."""
        wanted = {engine_id: url for engine_id, url in urls.items() if url}
        if wanted:
            self._in_io_thread(lambda: self._streams.update(
                {engine_id: self._open(url) for engine_id, url in wanted.items()}))

    def forget(self, engine_ids: Sequence[int]) -> None:
        """Close the channels of engines that are gone (a replaced rank)."""
        streams = [self._streams.pop(engine_id) for engine_id in engine_ids if engine_id in self._streams]
        if streams:
            self._in_io_thread(lambda: [stream.close(linger=0) for stream in streams])

    def close(self) -> None:
        self.forget(list(self._streams))

    @property
    def engines(self) -> set[int]:
        return set(self._streams)

    def apply(self, engine_ids: Sequence[int], fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` on each engine; an ipyparallel AsyncResult (results as a list)."""
        from ipyparallel.serialize import PrePickled

        shipped = (PrePickled(fn), [PrePickled(arg) for arg in args],
                   {key: PrePickled(value) for key, value in kwargs.items()})
        return self._submit(engine_ids, getattr(fn, "__name__", "unknown"), lambda socket, ident: (
            self._client.send_apply_request(socket, *shipped, ident=ident, metadata={"label": None})))

    def execute(self, engine_ids: Sequence[int], code: str) -> Any:
        """Run `code` as a cell on each engine (`DirectView.execute(silent=False)`'s request)."""
        return self._submit(engine_ids, "execute", lambda socket, ident: (
            self._client.send_execute_request(socket, code, silent=False, ident=ident,
                                              metadata={"label": None})))

    def _submit(self, engine_ids: Sequence[int], name: str, send: Callable[[Any, bytes], Any]) -> Any:
        from ipyparallel.client.asyncresult import AsyncResult

        idents, targets = compat.engine_idents(self._client, list(engine_ids))
        futures = [send(self._streams.get(engine_id) or compat.mux_stream(self._client), ident)
                   for engine_id, ident in zip(targets, idents)]
        return AsyncResult(self._client, futures, fname=name, targets=targets, owner=True)

    def _open(self, url: str) -> ZMQStream:
        socket = compat.client_context(self._client).socket(zmq.DEALER)
        socket.linger = 0
        socket.connect(url)
        stream = ZMQStream(socket, compat.client_io_loop(self._client))
        stream.on_recv(compat.client_reply_handler(self._client), copy=False)
        return stream

    def _in_io_thread(self, work: Callable[[], Any]) -> None:
        """zmq sockets belong to one thread: the client's I/O thread owns these."""
        done, failure = threading.Event(), []

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                failure.append(exc)
            finally:
                done.set()

        compat.client_io_loop(self._client).add_callback(run)
        if not done.wait(30.0):
            raise TimeoutError("the ipyparallel client's I/O thread did not answer within 30 s")
        if failure:
            raise failure[0]
