"""An ipyparallel client's internals: per-engine futures, engine identities, its sockets and event loop,
its per-request books, and control-channel requests."""
from __future__ import annotations

from typing import Any, Callable

from colab_par.compat.support import _missing


def task_futures(result: Any) -> list[Any]:
    """One future per engine of an AsyncResult (`AsyncResult._children`, undocumented), or of a
    lean direct call (`colab_par.cluster.direct_call.DirectCall.rank_futures`).

    The public API reports a task only once every engine is done; a rank that failed while another
    still waits in a collective is visible only here.
    """
    futures = getattr(result, "rank_futures", None)
    if futures is None:
        futures = getattr(result, "_children", None)
    if futures is None:
        raise _missing("ipyparallel", "AsyncResult._children (per-engine futures)")
    return list(futures)


def failed_at(future: Any, error: Any) -> Any:
    """When an engine's part of a task failed: the lean call's `error.completed`, else the
    reply metadata's (`MessageFuture.output.metadata`, undocumented); None when the reply did not
    say (then that failure sorts after those that did)."""
    completed = getattr(error, "completed", None)
    if completed is None:
        metadata = getattr(getattr(future, "output", None), "metadata", None)
        if not isinstance(metadata, dict):
            raise _missing("ipyparallel", "MessageFuture.output.metadata")
        completed = metadata.get("completed")
    return completed


def engine_idents(client: Any, engine_ids: list[int]) -> tuple[list[bytes], list[int]]:
    """The zmq identities of engines, and their ids (`Client._build_targets`, private)."""
    build = getattr(client, "_build_targets", None)
    if build is None:
        raise _missing("ipyparallel", "Client._build_targets")
    return build(engine_ids)


def mux_stream(client: Any) -> Any:
    """The client's stream to the controller's direct queue (what DirectView sends on; private)."""
    return _client_part(client, "_mux_stream")


def client_context(client: Any) -> Any:
    """The zmq context of an ipyparallel client (`Client._context`, private)."""
    return _client_part(client, "_context")


def client_io_loop(client: Any) -> Any:
    """The event loop of the client's I/O thread, which owns its sockets (`Client._io_loop`)."""
    return _client_part(client, "_io_loop")


def client_reply_handler(client: Any) -> Callable[[list], None]:
    """What the client does with an execute/apply reply from its queues (`Client._dispatch_reply`)."""
    return _client_part(client, "_dispatch_reply")


def client_metadata(client: Any) -> Any:
    """The client's per-request books, filled from iopub (`Client.metadata`, a defaultdict of
    `Metadata` by msg_id: stdout, data, outputs, ...)."""
    return _client_part(client, "metadata")


def output_futures(client: Any) -> dict[str, Any]:
    """Futures the client resolves when an engine's idle status for a msg_id arrives, i.e. all of
    that request's output has (`Client._output_futures`, private)."""
    return _client_part(client, "_output_futures")


def unanswered(client: Any) -> dict[int, int]:
    """How many of this client's requests each engine id has not answered yet
    (`Client._outstanding_dict`, by engine uuid; private)."""
    by_uuid, engines = _client_part(client, "_outstanding_dict"), _client_part(client, "_engines")
    return {engine_id: len(by_uuid.get(uuid, ())) for engine_id, uuid in engines.items()}


def _client_part(client: Any, name: str) -> Any:
    part = getattr(client, name, None)
    if part is None:
        raise _missing("ipyparallel", f"Client.{name}")
    return part


def send_control_requests(client: Any, engine_ids: list[int], request: str, content: dict) -> list[Any]:
    """Send `request` on the control channel to each engine; one future per engine resolving to the
    reply message (`Client._send` on `Client._control_stream`, private: the public control calls
    cover only signal, abort, clear and shutdown)."""
    send, stream = getattr(client, "_send", None), getattr(client, "_control_stream", None)
    build_targets = getattr(client, "_build_targets", None)
    if send is None or stream is None or build_targets is None:
        raise _missing("ipyparallel", "Client._send / _control_stream / _build_targets")
    return [send(stream, request, content=content, ident=ident) for ident in build_targets(engine_ids)[0]]
