"""The engine zygote's idle imports yield to the user's cells (`colab_par.cluster.warm_pool._Yielding`):
they wait while a process it forked is busy, pause inside an import as soon as it is busy again,
and are all made once it is quiet, leaving no timer or handler to the processes it forks after
them. A real zygote (`warm_pool._serve`, with a light target and a package of slow modules standing
for `_IDLE_IMPORTS`), real proxies and real forked children; the zygote's CPU time is the witness."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from colab_par.cluster import descendant_pids
from colab_par.cluster.warm_pool import _cpu_seconds

MODULES, MODULE_S = 20, 0.1  # the stand-in idle import: 20 modules of 0.1 s of CPU each
QUIET_S = 0.5  # the zygote's `_QUIET_S` in this test
FIRST_BURN_S, SECOND_BURN_S = 1.0, 1.0
GRACE_S = 0.1  # for the zygote to see the child busy (a few ms) and the test's samples (10 ms apart)
IDLE_CPU_S = 0.05  # the zygote's own CPU while it waits (readings every 0.2 s); importing: 0.1 s per 0.1 s

BURN = """
import time
def burn(seconds, log, what):
    start = time.monotonic()
    while time.monotonic() < start + seconds:
        pass
    with open(log, "a") as out:
        out.write(f"{what} {start} {time.monotonic()}\\n")
"""
# forked by the zygote: notes what it inherited of the pauses' timer, burns, burns again at
# SIGUSR1, and otherwise sleeps until killed
CHILD = BURN + """
import signal, sys
log, first, second = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
with open(log, "a") as out:
    out.write(f"alarm {int(signal.getsignal(signal.SIGALRM) == signal.SIG_DFL)} {sum(signal.getitimer(signal.ITIMER_REAL))}\\n")
signal.signal(signal.SIGUSR1, lambda *_: burn(second, log, "burn"))
if first:
    burn(first, log, "burn")
while True:
    signal.pause()
"""
ZYGOTE = """
import sys
from colab_par.cluster import warm_pool
path, package = sys.argv[1], sys.argv[2]
sys.path.insert(0, package)
warm_pool._TARGETS["busy"] = ("pass", {child!r})
warm_pool._IDLE_IMPORTS["busy"] = ("slow_idle_import",)
warm_pool._QUIET_S = {quiet}
warm_pool._main(["serve", path, "busy"])
"""

# the zygote's owner (whose CPU it watches, as it watches the notebook's kernel): a quiet stand-in
# that passes its stdin on and says the zygote's pid, not this process, whose threads left by
# earlier tests of a full run can keep it busy for longer than the test waits
OWNER = "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); sys.exit(p.wait())"


def _slow_package(folder) -> None:
    package = folder / "slow_idle_import"
    package.mkdir()
    (package / "_burn.py").write_text(BURN)
    (package / "__init__.py").write_text("".join(f"from . import m{k}\n" for k in range(MODULES)))
    for k in range(MODULES):
        (package / f"m{k}.py").write_text(
            f"from slow_idle_import._burn import burn\nburn({MODULE_S}, {str(folder / 'log')!r}, 'module')\n")


def _read(log, what: str) -> list[tuple[float, float]]:
    """The `what` lines: burns and modules as (start, end) in CLOCK_MONOTONIC seconds (the same in
    every process); alarms as (SIGALRM's handler is the default, the timer's seconds left)."""
    lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return [(float(a), float(b)) for kind, a, b in lines if kind == what]


def _cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds spent between `start` and `end`, from (when, CPU time) samples."""
    inside = [cpu for when, cpu in samples if start <= when <= end]
    return inside[-1] - inside[0]


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_idle_imports_wait_while_a_forked_child_is_busy_and_are_made_once_it_is_quiet(tmp_path):
    _slow_package(tmp_path)
    log, path = tmp_path / "log", str(tmp_path / "busy.sock")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, sys.executable, "-c",
                              ZYGOTE.format(child=CHILD, quiet=QUIET_S), path, str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    zygote = int(owner.stdout.readline())
    proxies, samples, done = [], [], threading.Event()

    def sample() -> None:  # the zygote's CPU time, every 10 ms
        while not done.wait(0.01) and (cpu := _cpu_seconds(zygote)) is not None:
            samples.append((time.monotonic(), cpu))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        _wait_for(lambda: os.path.exists(path), 60, "the zygote to serve")
        def launch(*burns: float) -> None:
            proxies.append(subprocess.Popen([sys.executable, "-m", "colab_par.cluster.warm_pool", "launch", path,
                                             str(zygote), "busy", str(log), *map(str, burns)]))

        launch(FIRST_BURN_S, SECOND_BURN_S)
        _wait_for(lambda: descendant_pids(zygote), 30, "the forked child")
        (child,) = descendant_pids(zygote)
        _wait_for(lambda: len(_read(log, "module")) >= 3, 30, "the idle import to begin")  # after the first burn
        os.kill(child, signal.SIGUSR1)  # busy again, in the middle of the idle import
        _wait_for(lambda: os.path.exists(path + ".warm"), 60, "the idle imports to be made")
        launch(0, 0)  # forked after the idle imports
        _wait_for(lambda: len(_read(log, "alarm")) == 2, 30, "the second child")
        burns, modules, alarms = _read(log, "burn"), _read(log, "module"), _read(log, "alarm")
    finally:
        done.set()
        sampler.join()
        for proxy in proxies:
            proxy.terminate()  # forwarded to its child
            proxy.wait(10)
        owner.stdin.close()  # its owner's stdin, which it shares, at its end: it exits, and so does the owner
        owner.wait(10)
        owner.stdout.close()
    assert alarms == [(1.0, 0.0), (1.0, 0.0)]  # SIGALRM's default action, no timer armed
    assert len(burns) == 2 and len(modules) == MODULES, (burns, modules)
    (first_start, first_end), (second_start, second_end) = burns
    # nothing imported while the child burned first; the import began only after it was quiet
    assert _cpu_between(samples, first_start, first_end) < IDLE_CPU_S
    assert modules[0][0] >= first_end + 0.8 * QUIET_S, (first_end, modules[0])
    # in the middle of the import, it paused as soon as the child burned again, until it was quiet
    assert modules[0][0] < second_start < modules[-1][0]
    assert _cpu_between(samples, second_start + GRACE_S, second_end) < IDLE_CPU_S
    # and that pause doubled the quiet it waits for
    assert _cpu_between(samples, second_end, second_end + 0.8 * 2 * QUIET_S) < IDLE_CPU_S
