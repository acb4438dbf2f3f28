"""Engines that outlive the kernel: the record of a persisted cluster, and the running ones listed.

`Cluster(persist=True)` leaves its controller and engines running when the kernel exits (they run
in sessions of their own, so a kernel killed with its process group does not take them along).
What a new kernel needs to join them is in two small files in ipyparallel's profile folder
(``<profile>/security``, private to the user): ipyparallel's own cluster file (its launchers, the
controller's connection files next to it), and this module's record of the kit's bookkeeping
(rank -> engine, hosts, devices, backend, stack files, the processes and when each started, the
options), written with permissions 0600. Engine variables, the process group, every layout and
model stay in the engines' memory; nothing of them is written.

Processes are named by pid and start time together, so a recycled pid is never taken (or
killed) for one of ours.
"""
from __future__ import annotations

import glob
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import psutil

__all__ = ["RECORD_GLOB", "default_profile_dir", "record_path", "write_record", "remove_record",
           "find_record", "running_clusters", "process_times", "live_pids"]

RECORD_GLOB = "colab_par-cluster-*.json"


def default_profile_dir() -> str:
    """The profile folder ipyparallel uses when none is named (this kernel's IPython profile)."""
    import ipyparallel as ipp

    return ipp.Cluster(shutdown_atexit=False).profile_dir


def record_path(profile_dir: str, cluster_id: str) -> Path:
    return Path(profile_dir) / "security" / f"colab_par-cluster-{cluster_id}.json"


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a record), readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=".colab_par-", suffix=".json")
    try:
        os.fchmod(handle, 0o600)
        with os.fdopen(handle, "w") as out:
            json.dump(record, out, indent=1)
        os.replace(staging, path)
    except BaseException:
        if os.path.exists(staging):
            os.remove(staging)
        raise


def remove_record(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def process_times(pids: Iterable[int]) -> dict[str, float]:
    """pid -> start time (psutil's create_time), for the live ones of `pids`."""
    times = {}
    for pid in pids:
        try:
            times[str(pid)] = psutil.Process(pid).create_time()
        except psutil.Error:
            pass
    return times


def live_pids(times: dict[str, float]) -> set[int]:
    """The processes of a `process_times` map still running (same pid, same start time)."""
    return {int(pid) for pid, started in times.items() if _alive(int(pid), started)}


def _alive(pid: int, started: float) -> bool:
    try:
        process = psutil.Process(pid)
        return (abs(process.create_time() - started) < 0.01
                and process.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD))
    except psutil.Error:
        return False


def _records(profile_dir: str) -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for name in glob.glob(str(Path(profile_dir) / "security" / RECORD_GLOB)):
        try:
            with open(name) as handle:
                found.append((Path(name), json.load(handle)))
        except (OSError, ValueError):
            continue  # being replaced right now, or not ours to read
    return found


def running_clusters(profile_dir: str | None = None) -> list[dict[str, Any]]:
    """Persisted clusters this host runs, newest first: id, age, engines (alive of all), memory of
    their processes on this host (resident), and who started them. Records of clusters whose
    controller is gone are removed, with whatever of their engines still runs on this host
    (without a controller nothing can reach them)."""
    profile_dir = profile_dir or default_profile_dir()
    running, here = [], socket.gethostname()
    for path, record in _records(profile_dir):
        if record.get("host") != here:  # a home folder shared with other machines: theirs
            continue
        controller = record.get("controller")
        if controller is None or not _alive(controller["pid"], controller["started"]):
            _clean(path, record)
            continue
        pids = live_pids(record["pids"])
        engines = [info["pid"] for info in record["hosts"] if info.get("local")]
        memory = sum(_rss(pid) for pid in pids)
        running.append({"id": record["cluster_id"], "age_s": time.time() - record["created"],
                        "engines": len(record["ids"]),
                        "engines_alive": sum(pid in pids for pid in engines)
                        + sum(not info.get("local") for info in record["hosts"]),
                        "backend": record["backend"], "launcher": record["launcher"]["name"],
                        "memory_bytes": memory, "started_by_pid": record["kernel_pid"],
                        "record": str(path)})
    return sorted(running, key=lambda row: row["age_s"])


def find_record(cluster_id: str | None, profile_dir: str | None = None) -> tuple[Path, dict[str, Any]]:
    """The record of running cluster `cluster_id`, or of the newest one when None."""
    profile_dir = profile_dir or default_profile_dir()
    running = running_clusters(profile_dir)
    if not running:
        raise LookupError("no persisted cluster is running (in "
                          f"{Path(profile_dir) / 'security'}); start one with "
                          "`%colossal start --persist` (or Cluster(persist=True).start())")
    chosen = running[0] if cluster_id is None else next((r for r in running if r["id"] == cluster_id), None)
    if chosen is None:
        raise LookupError(f"no running persisted cluster has id {cluster_id!r}; running: "
                          + ", ".join(r["id"] for r in running))
    path = Path(chosen["record"])
    with open(path) as handle:
        return path, json.load(handle)


def _clean(path: Path, record: dict[str, Any]) -> None:
    """A dead cluster: end its orphaned processes on this host, remove its files."""
    for pid in live_pids(record.get("pids", {})):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    security = path.parent
    cluster_id = record.get("cluster_id", "")
    leftovers = [record.get("ipp_cluster_file", ""), *glob.glob(str(security / f"ipcontroller-{cluster_id}-*.json"))]
    for name in leftovers:
        if name and Path(name).parent == security:
            remove_record(Path(name))
    remove_record(path)


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0
