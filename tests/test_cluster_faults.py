"""Interrupts, stuck collectives and dead engines, each on a cluster of its own."""
from __future__ import annotations

import _thread
import os
import re
import signal
import threading
import time

import pytest

from colab_par import Cluster
from colab_par.cluster import DeadEngineError


def ranks_alive():
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


@pytest.fixture
def fresh():
    cluster = Cluster(n=2, timeout=60.0, interrupt_grace=4.0, dashboard=False).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def sigint_raises():
    """`_thread.interrupt_main()` does nothing while SIGINT is ignored, which is how any process
    started in the background inherits it: install the handler the interrupt tests rely on."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupt_after(seconds):
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return timer


@pytest.mark.usefixtures("sigint_raises")
def test_interrupt_stops_every_engine_and_keeps_them(fresh):
    generation = fresh.generation
    _interrupt_after(1.0)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        fresh.execute("import time\nfor _ in range(600):\n    time.sleep(0.1)")
    assert time.monotonic() - started < 4.0  # no restart was needed
    assert fresh.generation == generation
    assert fresh.run(ranks_alive) == [2.0, 2.0]


@pytest.mark.usefixtures("sigint_raises")
def test_stuck_collective_restarts_engines_and_group(fresh, capsys):
    generation = fresh.generation
    _interrupt_after(1.0)
    with pytest.raises(KeyboardInterrupt):
        # rank 1 waits in a C++ barrier that SIGINT cannot break; rank 0 never joins it.
        fresh.execute("import time, torch.distributed as dist\n"
                      "if rank == 1:\n    dist.barrier()\nelse:\n    time.sleep(600)")
    assert "restarting engines" in capsys.readouterr().err
    assert fresh.generation == generation + 1
    assert fresh.run(ranks_alive) == [2.0, 2.0]


def test_killed_engine_is_reported_quickly_and_restart_recovers(fresh):
    victim = fresh.status()[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(DeadEngineError, match=r"rank\(s\) 1 died.*%colossal restart"):
        fresh.execute("print('hello')")
    assert time.monotonic() - started < 15.0
    assert [row["alive"] for row in fresh.status()] == [True, False]
    fresh.restart()
    assert fresh.run(ranks_alive) == [2.0, 2.0]


def test_a_crashed_engine_is_reported_with_its_signal_and_stack(fresh):
    with pytest.raises(DeadEngineError) as died:
        fresh.execute("import ctypes\nif rank == 1:\n    ctypes.string_at(0)  # reads address 0\n"
                      "import torch.distributed as dist\ndist.barrier()")
    report = str(died.value)
    assert re.search(r"rank\(s\) 1 died \(rank 1: pid \d+ on .*; it crashed:\nFatal Python error: "
                     r"Segmentation fault", report), report
    assert re.search(r'string_at\n  File ".*", line 3 in <module>', report), report  # the cell's line


def test_engine_dying_mid_cell_fails_the_cell(fresh):
    pid = fresh.status()[1]["pid"]
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(DeadEngineError, match=r"rank\(s\) 1 died"):
        fresh.execute("import torch.distributed as dist\ndist.barrier()\nif rank == 0: dist.barrier()")
    assert time.monotonic() - started < 15.0
