"""The rooms of `colab_par.cluster` that need no engines, each on its own: this host's processes,
what a crashed rank left in its stack file, the order of ranks by host and the world's addresses."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time

from colab_par.cluster.health import crash_of
from colab_par.cluster.processes import descendant_pids, pid_alive, reap
from colab_par.cluster.state import ClusterState
from colab_par.cluster.world import _ranked_by_host
from colab_par.cluster.launchers import launcher_from

HERE = socket.gethostname()


def _state(**running) -> ClusterState:
    state = ClusterState(requested_n=None, requested_backend=None, launcher=launcher_from("local"), timeout=30.0,
                         interrupt_grace=1.0, dashboard=False, seed=0, persist=False, ipp_options={})
    for name, value in running.items():
        setattr(state, name, value)
    return state


def test_reap_kills_what_ignores_sigterm_and_descendants_are_found_below_children():
    """A child that ignores SIGTERM and its own child: both are descendants of this process, and
    `reap` leaves neither alive (the child's exit status says SIGKILL ended it)."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen(["sleep", "60"])
        print(grandchild.pid, flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= descendant_pids()
        child.send_signal(signal.SIGTERM)  # what a launcher's stop sends first: ignored
        reap({child.pid, grandchild}, grace_s=0.2)
        assert child.wait(timeout=5) == -signal.SIGKILL
        deadline = time.monotonic() + 5.0  # killed, it is a zombie until init reaps it (dead already)
        while pid_alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pid_alive(grandchild)
        assert not {child.pid, grandchild} & descendant_pids()
    finally:
        child.kill()
        child.wait()


def test_a_crash_report_names_the_signal_and_the_crashing_call(tmp_path):
    """faulthandler's report of a real segmentation fault, read back as a dead rank's error says it."""
    dump = tmp_path / "rank0.stacks"
    crashed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import faulthandler, os, signal
        faulthandler.enable(open({str(dump)!r}, "w"))
        def crash_here():
            os.kill(os.getpid(), signal.SIGSEGV)
        crash_here()
        """)], capture_output=True)
    assert crashed.returncode == -signal.SIGSEGV
    state = _state(hosts=[{"host": HERE, "pid": 1}, {"host": HERE + "-elsewhere", "pid": 2}],
                   stack_files=[str(dump), str(dump)])
    report = crash_of(state, 0)
    assert report.startswith("; it crashed:\nFatal Python error: Segmentation fault\n")
    assert "Current thread" in report and "in crash_here" in report
    assert crash_of(state, 1) == ""  # another host's file is not this host's
    dump.write_text("Stack (most recent call first):\n  File 'x', line 1 in f\n")  # a SIGUSR1 dump
    assert crash_of(state, 0) == ""


def test_ranks_follow_hosts_in_registration_order_with_a_hosts_engines_contiguous():
    """Engines 1 and 3 registered on host b, 2 and 4 on host a: b's first engine came first."""
    ids = [1, 2, 3, 4]  # the hub's ids, ascending in registration order
    hosts = [{"host": "b"}, {"host": "a"}, {"host": "b"}, {"host": "a"}]
    ordered, by_host = _ranked_by_host(ids, hosts)
    assert ordered == [1, 3, 2, 4]
    assert [info["host"] for info in by_host] == ["b", "b", "a", "a"]


def test_the_world_talks_over_loopback_on_one_host_and_each_hosts_address_on_several():
    one = _state(hosts=[{"host": HERE, "ip": "10.0.0.1"}] * 2)
    assert one.world_addresses() == ["127.0.0.1"]
    several = _state(hosts=[{"host": HERE, "ip": "10.0.0.1"}, {"host": "b", "ip": "10.0.0.2"},
                            {"host": "b", "ip": "10.0.0.2"}])
    assert several.world_addresses() == ["10.0.0.1", "10.0.0.2"]
