"""The direct channel (`colab_par.direct`): `Cluster.run` and cells reach the engines without the
controller's queue, and behave as through it (same namespace, errors, output, interrupts)."""
from __future__ import annotations

import re
import threading
import time

import pytest

from colab_par import EngineError, engine


def _hub_completed(cluster) -> int:
    """Tasks the controller's hub saw finish on every engine (it sees only what passes its queues)."""
    status = cluster._client.queue_status()
    return sum(status[eid]["completed"] for eid in cluster._engine_ids)


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
    assert cluster2._direct.engines == set(cluster2._engine_ids)
    before = _hub_completed(cluster2)
    pids = [info["pid"] for info in cluster2._hosts]
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
    through_hub = cluster2._client[cluster2._engine_ids].apply_sync(_engine_global, "shared_by_both")
    assert through_hub == [100, 101]
    cluster2._client[cluster2._engine_ids].execute("set_by_hub = rank * 3", block=True)
    assert cluster2.run(_engine_global, "set_by_hub") == [0, 3]


def test_errors_carry_ipython_tracebacks_as_through_the_hub(cluster2):
    with pytest.raises(EngineError) as direct_error:
        cluster2.run(_fails)
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(direct_error.value))
    assert "ValueError: broken on purpose (ranks 0,1)" in text
    through_hub = cluster2._client[cluster2._engine_ids[0]].apply_async(_fails)
    through_hub.wait(30)
    hub_error = through_hub.exception()
    hub_text = re.sub(r"\x1b\[[0-9;]*m", "", hub_error.traceback)
    assert hub_error.ename == "ValueError"
    assert "in _fails()" in hub_text and "in _fails()" in text  # IPython's traceback, both routes
    cluster2.clear_errors()


def test_output_and_published_data_arrive(cluster2):
    result = cluster2._apply([0, 1], _shout, "hello")
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
    result = cluster2._apply([0, 1], _break_then_answer)
    assert result.wait(30), "the reply was lost with the connection"
    assert result.get() == ["answered", "answered"]
    cluster2._join_world()  # a fresh group for the tests after this one
    assert cluster2.run(_where_am_i)[0].startswith("0:")
