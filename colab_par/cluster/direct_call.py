"""The client's end of lean direct calls (`colab_par.cluster.lean_wire`): one socket per engine, used and
read in the caller's own thread, and the result object the cluster waits on.

The request is packed once (ipyparallel's `pack_apply_message`) for every engine; replies are
collected with a `zmq.Poller` by whichever thread waits (under a lock, zmq sockets being one
thread's at a time): no I/O-thread hops, no JSON. What the call prints or publishes still travels
on ipyparallel's iopub channel under the call's id, into the client's own books
(`Client.metadata`), so `stdout`, `data` and errors read as from an ipyparallel AsyncResult; an
engine that published nothing says so in its reply, and then no output is waited for.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import threading
import time
import uuid
from typing import Any, Callable, Sequence

import ipyparallel as ipp
import zmq
from ipyparallel.serialize import deserialize_object, pack_apply_message

from colab_par import compat
from colab_par.cluster import lean_wire

__all__ = ["Calls", "DirectCall"]

_COPY_BELOW = 1 << 16  # bytes: zmq copies small frames faster than it tracks them


class Calls:
    """Lean call sockets to the engines of this host, keyed by engine id."""

    def __init__(self, client: Any):
        self._client = client
        self._auth = client.session.auth
        self._sockets: dict[int, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._lock = threading.Lock()  # one thread at a time on the sockets and the books below
        self._pending: dict[str, tuple["DirectCall", int]] = {}  # msg_id -> (call, its index)

    @property
    def engines(self) -> set[int]:
        return set(self._sockets)

    def connect(self, urls: dict[int, str]) -> None:
        with self._lock:
            for engine_id, url in urls.items():
                socket = compat.client_context(self._client).socket(zmq.DEALER)
                socket.linger = 0
                socket.connect(url)
                self._sockets[engine_id] = socket
                self._poller.register(socket, zmq.POLLIN)

    def forget(self, engine_ids: Sequence[int]) -> None:
        """Close the sockets of engines that are gone; their unanswered calls fail (EngineError)."""
        with self._lock:
            for engine_id in engine_ids:
                socket = self._sockets.pop(engine_id, None)
                if socket is not None:
                    self._poller.unregister(socket)
                    socket.close(linger=0)
            for msg_id, (call, index) in list(self._pending.items()):
                if call.engine_ids[index] in engine_ids:
                    del self._pending[msg_id]
                    call.settle_lost(index)

    def unanswered(self) -> dict[int, int]:
        """How many calls each engine id has not answered yet (replies that came are filed first:
        the one waiting for them may be gone, e.g. a cell abandoned after a rank died)."""
        self.pump(0.0)
        with self._lock:
            counts: dict[int, int] = {}
            for call, index in self._pending.values():
                counts[call.engine_ids[index]] = counts.get(call.engine_ids[index], 0) + 1
            return counts

    def apply(self, engine_ids: Sequence[int], fn: Callable[..., Any], args: tuple, kwargs: dict) -> "DirectCall":
        """Send ``fn(*args, **kwargs)`` to each engine (all of them served here); its DirectCall."""
        session = self._client.session
        payload = pack_apply_message(fn, args, kwargs, buffer_threshold=session.buffer_threshold,
                                     item_threshold=session.item_threshold)
        return self._send(engine_ids, lean_wire.APPLY, payload, getattr(fn, "__name__", "unknown"))

    def execute(self, engine_ids: Sequence[int], code: str) -> "DirectCall":
        """Run `code` as a cell on each engine (all of them served here); its DirectCall."""
        return self._send(engine_ids, lean_wire.EXECUTE, [code.encode()], "execute")

    def _send(self, engine_ids: Sequence[int], kind: str, payload: list, name: str) -> "DirectCall":
        copy = all(len(memoryview(part).cast("B")) < _COPY_BELOW for part in payload)
        session = self._client.session.session
        msg_ids = [uuid.uuid4().hex for _ in engine_ids]
        call = DirectCall(self, list(engine_ids), msg_ids, name)
        with self._lock:
            for index, (engine_id, msg_id) in enumerate(zip(engine_ids, msg_ids)):
                self._pending[msg_id] = (call, index)
                self._sockets[engine_id].send_multipart(
                    lean_wire.frames(self._auth, [msg_id, session, kind], payload), copy=copy)
        return call

    def pump(self, timeout: float) -> None:
        """File the replies that came, waiting up to `timeout` seconds for one (in this thread)."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            return
        try:
            ready = self._poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            for socket, _ in ready:
                while True:
                    try:
                        parts = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._file(parts)
        finally:
            self._lock.release()

    def close(self) -> None:
        self.forget(list(self._sockets))

    def _file(self, parts: list) -> None:
        opened = lean_wire.opened(self._auth, parts)
        if opened is None:
            return  # not signed with the cluster's key: not an engine's reply
        (msg_id, status, shown, *_), payload = opened
        owner = self._pending.pop(msg_id, None)
        if owner is not None:
            call, index = owner
            call.settle(index, status, shown == "1", payload)


class DirectCall:
    """One direct call on several engines: what the cluster reads of an ipyparallel AsyncResult
    (ready/wait/get, stdout, data, outputs, wait_for_output) and each rank's own future
    (`rank_futures`: a value, or an ipyparallel RemoteError with its `completed` time)."""

    def __init__(self, calls: Calls, engine_ids: list[int], msg_ids: list[str], name: str):
        self._calls, self.engine_ids, self.msg_ids, self.name = calls, engine_ids, msg_ids, name
        self.rank_futures = [concurrent.futures.Future() for _ in engine_ids]
        books, self._client_outputs = compat.client_metadata(calls._client), compat.output_futures(calls._client)
        self._metadata = [books[msg_id] for msg_id in msg_ids]  # iopub output lands here
        self._outputs = [concurrent.futures.Future() for _ in engine_ids]  # done: all output arrived
        for msg_id, future in zip(msg_ids, self._outputs):
            self._client_outputs[msg_id] = future  # the engine's idle status resolves it
            future.add_done_callback(lambda _, msg_id=msg_id: self._client_outputs.pop(msg_id, None))

    # ---- filled by Calls (under its lock) --------------------------------------------------------
    def settle(self, index: int, status: str, shown: bool, payload: list) -> None:
        if status == "ok":
            try:
                value = deserialize_object(payload)[0] if payload else None  # a cell returns nothing
            except Exception as exc:  # noqa: BLE001 - the rank's answer, not the waiting thread's failure
                value = ipp.error.RemoteError(type(exc).__name__, f"the result came back but cannot be "
                                              f"unpickled in this process: {exc}", "",
                                              {"engine_id": self.engine_ids[index]})
                value.completed = datetime.datetime.now(datetime.timezone.utc)
        else:
            content = lean_wire.error_from(payload)
            value = ipp.error.unwrap_exception(content)
            value.completed = datetime.datetime.fromtimestamp(content["completed"], datetime.timezone.utc)
        if not shown:
            self._no_more_output(index)
        self.rank_futures[index].set_result(value)

    def settle_lost(self, index: int) -> None:
        error = ipp.error.RemoteError("EngineError", f"engine {self.engine_ids[index]} died during the "
                                      "call", "", {"engine_id": self.engine_ids[index]})
        error.completed = datetime.datetime.now(datetime.timezone.utc)
        self._no_more_output(index)
        self.rank_futures[index].set_result(error)

    def _no_more_output(self, index: int) -> None:
        """No output will come (none was published, or the engine is gone): the client's books
        drop the entry (so silent calls leave none behind); this call keeps what it holds."""
        compat.client_metadata(self._calls._client).pop(self.msg_ids[index], None)
        if not self._outputs[index].done():
            self._outputs[index].set_result(None)

    # ---- what the cluster reads ------------------------------------------------------------------
    def ready(self) -> bool:
        if not all(future.done() for future in self.rank_futures):
            self._calls.pump(0.0)
        return all(future.done() for future in self.rank_futures)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while not self.ready():
            left = 0.1 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            self._calls.pump(min(left, 0.1))
        return True

    def successful(self) -> bool:
        if not self.ready():
            raise ipp.error.TimeoutError("the call has not finished yet")
        return not any(isinstance(future.result(), ipp.error.RemoteError) for future in self.rank_futures)

    def get(self, timeout: float | None = None) -> list[Any]:
        if not self.wait(timeout):
            raise ipp.error.TimeoutError(f"{self.name} did not finish within {timeout} s")
        results = [future.result() for future in self.rank_futures]
        return ipp.error.collect_exceptions(results, self.name)

    def wait_for_output(self, timeout: float | None = None) -> bool:
        done, _ = concurrent.futures.wait(self._outputs, timeout=timeout)
        return len(done) == len(self._outputs)

    @property
    def stdout(self) -> list[str]:
        return [md["stdout"] for md in self._metadata]

    @property
    def stderr(self) -> list[str]:
        return [md["stderr"] for md in self._metadata]

    @property
    def data(self) -> list[dict[str, Any]]:
        return [md["data"] for md in self._metadata]

    @property
    def outputs(self) -> list[list[dict[str, Any]]]:
        return [md["outputs"] for md in self._metadata]

    @property
    def execute_result(self) -> list[Any]:
        return [md["execute_result"] for md in self._metadata]
