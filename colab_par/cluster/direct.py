"""A direct channel from the client to each engine on this host, around ipyparallel's controller.

ipyparallel routes every request client → controller's queue → engine and every reply back the
same way: 2-3 ms of a trivial call's round trip on a loaded 2-core host, twice Monarch's whole
round trip. Here each engine listens on a socket of its own (`serve`, opened at bootstrap), and
runs what comes there in its main thread, in turn with its controller's requests.

Calls and cells from `Cluster` are lean requests (`colab_par.cluster.lean_wire`; the client's end is
`colab_par.cluster.direct_call`): a signed small header and the pickled call, run through the kernel's own
`do_apply` / `do_execute` (namespace, IPython's tracebacks, SIGINT handling), their output still
on ipyparallel's iopub channel and no status messages unless there was output. Ipyparallel's own
messages are served there too (`Channels.apply` / `execute` send those when some targets are on
other hosts): the kernel runs them as its controller's (`compat.engine_shell`), and the client
files them in ipyparallel's books, so the AsyncResult is ipyparallel's. Idle, nothing polls: both
ends wait in zmq.

Engines on other hosts keep ipyparallel's route (the client may not reach them directly).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from colab_par import compat
from colab_par.cluster import lean_wire
from colab_par.cluster.direct_call import Calls

__all__ = ["serve", "serving_port", "Channels"]

_SERVING: dict[str, Any] = {}  # on an engine: the open channel ("url", "port", "stream")
_REPLAYS = lean_wire.ReplayGuard()  # lean calls already run (a signed request is run once)


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
    """One request, in turn with the controller's: a lean one (`_lean_call`), or an ipyparallel
    message. Of those, a call (``apply_request``) runs through ipyparallel's own `do_apply` (the
    user namespace, IPython's traceback on error) between the kernel's own steps, as
    `Kernel.dispatch_shell` takes them, less what no one reads: its debug logging, its waits for
    the output thread (`compat.after_output` keeps the order) and the "busy" status (client and hub
    act on "idle" only, which ends the task's output); anything else (a cell) goes to
    dispatch_shell."""
    if lean_wire.is_lean(frames[1:2]):
        async with lock:
            await _lean_call(kernel, stream, frames[0].bytes, frames[1:])
        return
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
                                lambda: compat.publish_status(kernel, "idle", msg))


@contextlib.contextmanager
def _handling(kernel: Any) -> Iterator[None]:
    """What ipykernel does around a handler: SIGINT raises KeyboardInterrupt, the shell blocks."""
    kernel.pre_handler_hook()
    kernel.shell_is_blocking = True
    try:
        yield
    finally:
        kernel.shell_is_blocking = False
        kernel.post_handler_hook()


def _apply(kernel: Any, stream: Any, idents: list, msg: dict) -> None:
    """`IPythonParallelKernel.apply_request` with ipykernel's SIGINT handling around it."""
    metadata = kernel.init_metadata(msg)
    with _handling(kernel):
        reply, buffers = kernel.do_apply(msg["content"], msg["buffers"], msg["header"]["msg_id"], metadata)
    kernel.session.send(stream, "apply_reply", reply, parent=msg, ident=idents, buffers=buffers,
                        metadata=kernel.finish_metadata(msg, metadata, reply))


async def _lean_call(kernel: Any, stream: Any, ident: bytes, parts: list) -> None:
    """One lean request (`colab_par.cluster.lean_wire`), run as the kernel runs ipyparallel's: a call
    through `do_apply` (user namespace, IPython's traceback), a cell through `do_execute`, SIGINT
    as KeyboardInterrupt around both. Output is published under a parent header with the
    request's id and the client's session, which files it in the client's books; the idle status
    that ends it is sent only when there was some (the reply says which). Unlike
    `execute_request`, a cell's input is not re-broadcast (nothing reads it)."""
    opened = lean_wire.opened(kernel.session.auth, parts, _REPLAYS)
    if opened is None:
        print("colab_par: refused a direct request that was not signed with this cluster's key "
              "(or was sent twice)", file=sys.__stderr__)
        return
    (msg_id, session, kind, *_), payload = opened
    parent = {"header": {"msg_id": msg_id, "session": session, "username": kernel.session.username,
                         "msg_type": "apply_request" if kind == lean_wire.APPLY else "execute_request"},
              "parent_header": {}, "metadata": {}, "content": {}, "buffers": payload}
    kernel.set_parent([ident], parent, channel="shell")
    streams = [sys.stdout, sys.stderr]
    mark = compat.output_mark(kernel.session, streams)
    try:
        with _handling(kernel):
            if kind == lean_wire.APPLY:
                reply, result = kernel.do_apply({}, payload, msg_id, {})
            else:
                kernel.execution_count += 1
                reply, result = await kernel.do_execute(bytes(payload[0]).decode(), False, store_history=True,
                                                        user_expressions={}, allow_stdin=False), []
    except BaseException as exc:  # noqa: BLE001 - outside the user's code (both catch theirs): still answer
        reply, result = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
                         "traceback": traceback.format_exc().splitlines(),
                         "engine_info": kernel.get_engine_info(method=kind)}, []
    ok = reply["status"] == "ok"
    shown = not ok or compat.output_since(mark, kernel.session, streams)
    payload = result if ok else lean_wire.error_payload(reply, time.time())
    # through the stream, not its socket: a send beside the stream can swallow the edge of zmq's
    # descriptor that tells the stream another request is waiting (it would wait unseen)
    stream.send_multipart([ident, *lean_wire.frames(kernel.session.auth, [msg_id, reply["status"],
                                                                                 "1" if shown else "0"], payload)])
    if shown:
        compat.after_output(streams, lambda: compat.publish_status(kernel, "idle", parent))


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
        self._calls = Calls(client)  # the lean route for calls, in the caller's thread

    def connect(self, urls: dict[int, str | None]) -> None:
        """Connect to each engine id's URL (None: that engine keeps ipyparallel's route)."""
        wanted = {engine_id: url for engine_id, url in urls.items() if url}
        if wanted:
            self._in_io_thread(lambda: self._streams.update(
                {engine_id: self._open(url) for engine_id, url in wanted.items()}))
            self._calls.connect(wanted)

    def forget(self, engine_ids: Sequence[int]) -> None:
        """Close the channels of engines that are gone (a replaced rank)."""
        self._calls.forget(engine_ids)
        streams = [self._streams.pop(engine_id) for engine_id in engine_ids if engine_id in self._streams]
        if streams:
            self._in_io_thread(lambda: [stream.close(linger=0) for stream in streams])

    def close(self) -> None:
        self.forget(list(self._streams))

    @property
    def engines(self) -> set[int]:
        return set(self._streams)

    def unanswered(self) -> dict[int, int]:
        """How many lean calls each engine id has not answered yet (ipyparallel's own books,
        `compat.unanswered`, count the rest)."""
        return self._calls.unanswered()

    def apply(self, engine_ids: Sequence[int], fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` on each engine: a `DirectCall` when every one is served here,
        else an ipyparallel AsyncResult (results as a list either way)."""
        from ipyparallel.serialize import PrePickled

        if set(engine_ids) <= self._calls.engines:
            return self._calls.apply(engine_ids, fn, args, kwargs)

        shipped = (PrePickled(fn), [PrePickled(arg) for arg in args],
                   {key: PrePickled(value) for key, value in kwargs.items()})
        return self._submit(engine_ids, getattr(fn, "__name__", "unknown"), lambda socket, ident: (
            self._client.send_apply_request(socket, *shipped, ident=ident, metadata={"label": None})))

    def execute(self, engine_ids: Sequence[int], code: str) -> Any:
        """Run `code` as a cell on each engine: a `DirectCall` when every one is served here,
        else ipyparallel's AsyncResult of `DirectView.execute(silent=False)`'s request."""
        if set(engine_ids) <= self._calls.engines:
            return self._calls.execute(engine_ids, code)
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
