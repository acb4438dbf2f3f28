"""Processes on this host, read from /proc: which are alive, which descend from which, and ending them.

Pure helpers (no cluster): `Cluster.stop` reaps what its start left behind, and the health checks
ask whether an engine's process still runs.
"""
from __future__ import annotations

import os
import signal
import time


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (killed, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        pass  # no /proc entry (or no /proc at all): ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return True


def descendant_pids(root: int | None = None) -> set[int]:
    """Every live process below `root` (default: this process), read from /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and pid_alive(child):
                found.add(child)
                stack.append(child)
    return found


def reap(pids: set[int], grace_s: float) -> None:
    """SIGTERM, wait, SIGKILL: nothing the cluster started survives stop()."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
