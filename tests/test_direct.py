"""The direct channel (`colab_par.cluster.direct`): `Cluster.run` and cells reach the engines without the
controller's queue, and behave as through it (same namespace, errors, output, interrupts)."""
from __future__ import annotations

import re
import threading
import time

import pytest

from colab_par import EngineError
from colab_par.cluster import engine


def _hub_completed(cluster) -> int:
    """Tasks the controller's hub saw finish on every engine (it sees only what passes its queues)."""
    status = cluster._client.queue_status()
    return sum(status[eid]["completed"] for eid in cluster._state.engine_ids)


def _where_am_i() -> str:
    import os

    return f"{_engine_global('rank')}:{os.getpid()}"


def _engine_global(name: str):
    """A variable of the engine's user namespace (functions of this file are shipped by value,
    with this module's globals, not the engine's)."""
    from IPython import get_ipython

    return get_ipython().user_ns[name]


def _shout(text: str) -> int:
    print(text, "on rank", _engine_global("rank"))
    return len(text)


def _fails() -> None:
    raise ValueError("broken on purpose")


def _nap(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def _break_then_answer() -> str:
    engine.break_connections(["127.0.0.1"])  # what aborting a stuck collective does on each rank
    return "answered"


def test_run_and_cells_bypass_the_controller_queue(cluster2):
    assert cluster2._state.direct.engines == set(cluster2._state.engine_ids)
    before = _hub_completed(cluster2)
    pids = [info["pid"] for info in cluster2._state.hosts]
    assert cluster2.run(_where_am_i) == [f"{r}:{pid}" for r, pid in enumerate(pids)]
    cluster2.execute("direct_cell_value = rank * 10")
    assert cluster2.names(0).count("direct_cell_value") == 1
    assert _hub_completed(cluster2) == before  # none of them went through the hub's queues
    submitted = cluster2.submit(0, _where_am_i)  # ipyparallel's own route still works beside it
    assert submitted.get(timeout=30) == f"0:{pids[0]}"
    deadline = time.monotonic() + 5
    while _hub_completed(cluster2) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _hub_completed(cluster2) == before + 1  # ... and the hub does count that one


def test_direct_and_ipyparallel_share_one_namespace(cluster2):
    cluster2.execute("shared_by_both = rank + 100")
    through_hub = cluster2._client[cluster2._state.engine_ids].apply_sync(_engine_global, "shared_by_both")
    assert through_hub == [100, 101]
    cluster2._client[cluster2._state.engine_ids].execute("set_by_hub = rank * 3", block=True)
    assert cluster2.run(_engine_global, "set_by_hub") == [0, 3]


def test_errors_carry_ipython_tracebacks_as_through_the_hub(cluster2):
    with pytest.raises(EngineError) as direct_error:
        cluster2.run(_fails)
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(direct_error.value))
    assert "ValueError: broken on purpose (ranks 0,1)" in text
    through_hub = cluster2._client[cluster2._state.engine_ids[0]].apply_async(_fails)
    through_hub.wait(30)
    hub_error = through_hub.exception()
    hub_text = re.sub(r"\x1b\[[0-9;]*m", "", hub_error.traceback)
    assert hub_error.ename == "ValueError"
    assert "in _fails()" in hub_text and "in _fails()" in text  # IPython's traceback, both routes
    cluster2.clear_errors()


def test_output_and_published_data_arrive(cluster2):
    result = cluster2._calls.apply([0, 1], _shout, "hello")
    assert result.get(timeout=30) == [5, 5]
    assert result.wait_for_output(10)
    assert result.stdout == ["hello on rank 0\n", "hello on rank 1\n"]


def test_interrupt_stops_a_direct_call_and_the_channel_goes_on(cluster2):
    threading.Timer(0.5, cluster2.interrupt).start()
    started = time.monotonic()
    with pytest.raises(EngineError, match="KeyboardInterrupt"):
        cluster2.run(_nap, 30.0)
    assert time.monotonic() - started < 15
    assert cluster2.run(_nap, 0.0) == ["slept", "slept"]
    cluster2.clear_errors()


def test_breaking_the_worlds_connections_keeps_the_channel(cluster2):
    """Aborting a stuck collective shuts down each rank's new TCP connections to the world's
    address; the client's channel is one of them on one host and must survive it (else the reply
    of the running call is lost)."""
    result = cluster2._calls.apply([0, 1], _break_then_answer)
    assert result.wait(30), "the reply was lost with the connection"
    assert result.get() == ["answered", "answered"]
    cluster2._world.join_world()  # a fresh group for the tests after this one
    assert cluster2.run(_where_am_i)[0].startswith("0:")


def _publish_rank() -> int:
    from ipyparallel.engine.datapub import publish_data

    publish_data({"published_by": _engine_global("rank")})
    return 0


def _nothing() -> None:
    return None


def test_a_silent_call_needs_no_output_and_published_data_arrives(cluster2):
    quiet = cluster2._calls.apply([0, 1], _nothing)
    assert quiet.get(timeout=30) == [None, None]
    assert quiet.wait_for_output(0)  # the replies said nothing was published: no status to wait for
    published = cluster2._calls.apply([0, 1], _publish_rank)
    assert published.get(timeout=30) == [0, 0]
    assert published.wait_for_output(10)
    assert published.data == [{"published_by": 0}, {"published_by": 1}]


def _what_counts_as_output() -> dict[str, bool]:
    """`compat.output_since` around each kind of publication, on an engine (ipykernel's streams)."""
    import sys

    from IPython import get_ipython
    from IPython.display import display
    from ipyparallel.engine.datapub import publish_data

    from colab_par import compat

    session = get_ipython().kernel.session
    streams = [sys.stdout, sys.stderr]
    acts = {"nothing": lambda: None, "print": lambda: print("x"),
            "stderr": lambda: print("x", file=sys.stderr), "print then flush": lambda: (print("x"), sys.stdout.flush()),
            "publish_data": lambda: publish_data({"x": 1}), "display": lambda: display("x")}
    seen = {}
    for name, act in acts.items():
        sys.stdout.flush(), sys.stderr.flush()
        mark = compat.output_mark(session, streams)
        act()
        seen[name] = compat.output_since(mark, session, streams)
    return seen


def test_output_is_detected_on_the_engine(cluster2):
    """The lean reply says whether output follows; a miss would cut a call's output short, and
    unknown internals must answer True (then the call waits for its output as before)."""
    seen = cluster2.run(_what_counts_as_output)[0]
    assert seen == {"nothing": False, "print": True, "stderr": True, "print then flush": True,
                    "publish_data": True, "display": True}


def _request(auth, msg_id: str, session: str, fn, *args) -> list:
    from ipyparallel.serialize import pack_apply_message

    from colab_par.cluster import lean_wire

    return lean_wire.frames(auth, [msg_id, session, lean_wire.APPLY], pack_apply_message(fn, args, {}))


def test_requests_without_the_key_or_sent_twice_are_refused(cluster2):
    """Whoever reaches the port but lacks the cluster's key runs nothing; a captured request sent
    again does not run twice. Requests are served in order, so the last reply comes after the
    engine dealt with the others."""
    import hmac

    import zmq
    from ipyparallel.serialize import deserialize_object

    from colab_par.cluster import direct, lean_wire

    url = cluster2._client[[cluster2._state.engine_ids[0]]].apply_sync(direct.serve, "127.0.0.1")[0]
    auth, session = cluster2._client.session.auth, cluster2._client.session.session
    assert auth is not None  # ipyparallel's clusters are signed
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(url)
    try:
        forged = hmac.HMAC(b"not-the-key", digestmod="sha256")
        socket.send_multipart(_request(forged, "forged", session, exec, "lean_forged = 1"))
        counted = _request(auth, "counted", session, exec, "lean_count = globals().get('lean_count', 0) + 1")
        socket.send_multipart(counted)
        socket.send_multipart(counted)  # the same frames again
        socket.send_multipart(_request(auth, "read", session, eval, "(globals().get('lean_forged'), lean_count)"))
        replies = {}
        while "read" not in replies:
            assert socket.poll(30_000), "the engine did not answer"
            (msg_id, status, _), payload = lean_wire.opened(auth, socket.recv_multipart())
            replies[msg_id] = (status, deserialize_object(payload)[0] if status == "ok" else None)
        assert replies == {"counted": ("ok", None), "read": ("ok", (None, 1))}
    finally:
        socket.close()


def test_calls_from_several_threads_get_their_own_replies(cluster2):
    """Whichever thread waits files every reply that came, each into its own call."""
    from colab_par.cluster.ship import ship_by_value

    ship_by_value(_engine_global_plus)  # as Cluster.run does: this file is not on the engines' path
    results: dict[int, list] = {}

    def caller(offset: int) -> None:
        results[offset] = [cluster2._calls.apply([0, 1], _engine_global_plus, "rank", offset + i).get(timeout=30)
                           for i in range(20)]

    threads = [threading.Thread(target=caller, args=(offset,)) for offset in (0, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for offset in (0, 1000):
        assert results[offset] == [[offset + i, offset + i + 1] for i in range(20)]


def _engine_global_plus(name: str, plus: int) -> int:
    return _engine_global(name) + plus
