"""An engine's kernel internals (ipykernel, ipyparallel's engine kernel): its shell lock and dispatch,
status and output publication, and answers on the control channel."""
from __future__ import annotations

from typing import Any, Callable

from colab_par.compat.support import _missing


def ipp_engine_kernel_class() -> type:
    """The kernel class of an ipyparallel engine (`ipyparallel.engine.kernel`, undocumented)."""
    try:
        from ipyparallel.engine.kernel import IPythonParallelKernel
    except ImportError:
        raise _missing("ipyparallel", "ipyparallel.engine.kernel.IPythonParallelKernel") from None
    return IPythonParallelKernel


def engine_kernel() -> Any:
    """The running engine's kernel (`ipykernel.kernelbase.Kernel.instance()`)."""
    from ipykernel.kernelbase import Kernel

    return Kernel.instance()


def engine_shell(kernel: Any) -> tuple[Any, Callable[[Any, list], Any]] | None:
    """An engine's shell lock and dispatch for requests from another socket (`colab_par.cluster.direct`),
    or None where this ipykernel lacks what they need (before 7.0, or a kernel with subshells): a
    documented fallback, the client then keeps ipyparallel's route (slower, not wrong).

    Holding the lock (`Kernel._main_asyncio_lock`, undocumented) runs one request at a time with
    those from the controller. ``dispatch(stream, frames)`` then runs a request exactly as the
    kernel runs one from its controller (`Kernel.dispatch_shell`: SIGINT handling, busy/idle
    status, aborts), with `stream` as the kernel's shell stream while it runs: the stream
    dispatch_shell replies on."""
    lock = getattr(kernel, "_main_asyncio_lock", None)
    if (getattr(kernel, "_supports_kernel_subshells", True) or lock is None
            or not hasattr(kernel, "dispatch_shell") or not hasattr(kernel, "shell_stream")):
        return None

    async def dispatch(stream: Any, frames: list) -> None:
        own, kernel.shell_stream = kernel.shell_stream, stream
        try:
            await kernel.dispatch_shell(frames)
        finally:
            kernel.shell_stream = own

    return lock, dispatch


def after_output(streams: list[Any], then: Callable[[], None]) -> None:
    """Call `then` (a publication, e.g. the idle status that ends a task's output) after the
    pending output of ipykernel's `streams` is published, without waiting for it here: both are
    queued on the streams' output thread (`OutStream._flush`, `pub_thread.schedule`,
    undocumented), where a flush queues its message again, so `then` runs there after the flush.
    `OutStream.flush` would wait for that thread instead: a thread round trip per stream. Where
    those internals are missing it does exactly that (a documented fallback: slower, same order)."""
    schedule = getattr(getattr(streams[0], "pub_thread", None), "schedule", None)
    if schedule is None or not all(hasattr(stream, "_flush") for stream in streams):
        for stream in streams:
            stream.flush()
        then()
        return

    def flush_then() -> None:
        for stream in streams:
            stream._flush()
        then()

    schedule(flush_then)


def publish_status(kernel: Any, status: str, parent: dict) -> None:
    """Publish the engine's execution state ("busy"/"idle") on iopub for the shell request `parent`
    (`Kernel._publish_status`, private in ipykernel): "idle" tells the client that request's
    output is complete."""
    publish = getattr(kernel, "_publish_status", None)
    if publish is None:
        raise _missing("ipykernel", "Kernel._publish_status")
    publish(status, "shell", parent=parent)


def output_mark(session: Any, streams: list[Any]) -> tuple[int, list[Any]]:
    """Where an engine's publishing stands (`output_since` compares): the messages its session
    has made (`Session.message_count`, which every message's id counts) and the buffers its
    output streams write into (`OutStream._buffers`, replaced at each flush; private)."""
    return getattr(session, "message_count", -1), [getattr(stream, "_buffers", None) for stream in streams]


def output_since(mark: tuple[int, list[Any]], session: Any, streams: list[Any]) -> bool:
    """Whether anything was (or is about to be) published since `mark`: a message made (data,
    display, an error), text written and waiting in a stream, or a stream flushed meanwhile.
    Unknown internals answer True (then the caller waits for the output, as always)."""
    count, buffers = mark
    if count < 0 or getattr(session, "message_count", -1) != count:
        return True
    for stream, before in zip(streams, buffers):
        now = getattr(stream, "_buffers", None)
        if before is None or now is not before or getattr(stream, "_flush_pending", True) or any(
                buffer.tell() for buffer in list(now.values())):
            return True
    return False


def answer_control_requests(answers: dict[str, Callable[[dict], dict]]) -> None:
    """On an engine: answer each control-channel request type with ``answers[type](content)``.

    ipykernel's control thread (`Kernel.control_handlers`, undocumented) runs the answer while the
    main thread is busy with a task, which is the point: it can say where that thread waits.
    """
    from ipykernel.kernelbase import Kernel

    kernel = Kernel.instance()
    handlers = getattr(kernel, "control_handlers", None)
    if handlers is None or getattr(kernel, "control_thread", None) is None:
        raise _missing("ipykernel", "an engine kernel with a control thread (Kernel.control_handlers)")

    def handler(answer: Callable[[dict], dict], reply_type: str) -> Callable[..., None]:
        def handle(stream: Any, idents: Any, parent: dict) -> None:
            try:
                content = {"status": "ok", **answer(parent["content"])}
            except Exception as exc:  # noqa: BLE001 - the asker gets the error, the engine goes on
                content = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            kernel.session.send(stream, reply_type, content, parent, ident=idents)
        return handle

    for request, answer in answers.items():
        handlers[request] = handler(answer, request.removesuffix("_request") + "_reply")
