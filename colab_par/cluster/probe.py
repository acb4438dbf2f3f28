"""What an engine's main thread waits in, answered while it waits; and the abort that frees it.

An engine runs a cell on its main thread; a collective blocks that thread inside C++ with the GIL
released. ipyparallel already runs a control thread in every engine (for abort and clear
requests), so the notebook asks there: `where` names the main thread's stack and, when it sits
in a torch.distributed collective, the call, its group, the group's sequence number and root;
`abort` makes this rank's pending collectives fail at once so the world can be re-formed; `degrade`
does the same after leaving a message for a Trainer that can train on without a lost dp replica,
and `rejoin` tells it the replacement is ready (`colab_par.training.recovery`). The
requests travel through ipyparallel's controller, so engines on other hosts answer the same way.
Nothing runs on an engine between requests: no thread, no timer, no hook on any collective.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from types import FrameType
from typing import Any

from colab_par import compat
from colab_par.cluster import engine
from colab_par.cluster.deadlock import ROOTED, SYMMETRIC
from colab_par.training import recovery

__all__ = ["WHERE_REQUEST", "ABORT_REQUEST", "DEGRADE_REQUEST", "REJOIN_REQUEST", "ANSWERED", "install", "where",
           "abort", "degrade", "rejoin", "collective_wait", "pending_collective"]

WHERE_REQUEST = "colab_par_where_request"
ABORT_REQUEST = "colab_par_abort_request"
DEGRADE_REQUEST = "colab_par_degrade_request"
REJOIN_REQUEST = "colab_par_rejoin_request"
ANSWERED: Counter[str] = Counter()  # requests this engine answered, by kind: what watching it cost
_C10D_FILE = "torch/distributed/distributed_c10d.py"


def install() -> None:
    """Answer the requests from this engine's control thread (once per engine)."""
    compat.answer_control_requests({WHERE_REQUEST: where, ABORT_REQUEST: abort, DEGRADE_REQUEST: degrade,
                                    REJOIN_REQUEST: rejoin})


def where(content: dict) -> dict[str, Any]:
    """The main thread's stack (faulthandler's format, so `output.where_waiting` reads it as it
    reads a SIGUSR1 dump) and the collective it is blocked in, if any (`collective_wait`)."""
    ANSWERED["where"] += 1
    frame = sys._current_frames().get(threading.main_thread().ident)
    return {"dump": _stack_text(frame), "wait": collective_wait(frame)}


def abort(content: dict) -> dict[str, Any]:
    """Make this rank's pending collectives fail now (`engine.break_connections`)."""
    ANSWERED["abort"] += 1
    engine.break_connections(content["addresses"])
    return {}


def degrade(content: dict) -> dict[str, Any]:
    """A dp replica died: free this rank's pending collectives as `abort` does, then leave the
    message for its Trainer (`recovery.request_degraded`: the survivors, the lost ranks, a store for
    their own group), which catches their failure and trains on. In this order: the survivors'
    group must not be among the connections broken."""
    ANSWERED["degrade"] += 1
    engine.break_connections(content["addresses"])
    recovery.request_degraded(content["degrade"])
    return {}


def rejoin(content: dict) -> dict[str, Any]:
    """The lost ranks' replacements are ready: the Trainer leaves degraded training at a step boundary."""
    ANSWERED["rejoin"] += 1
    recovery.request_rejoin()
    return {}


def collective_wait(frame: FrameType | None) -> dict[str, Any] | None:
    """The collective `frame` (a thread's innermost frame) is blocked in: op, group name, members,
    the group's sequence number on this rank, and the root or peer (global rank); None when the
    thread is not inside one of torch.distributed's collective calls (running Python, or waiting
    in something else, e.g. a `work.wait()` of its own). Under NCCL: the oldest collective this
    rank enqueued that has not finished (`pending_collective`), wherever the thread waits."""
    import torch.distributed as dist

    if frame is None or not dist.is_initialized():
        return None
    if "nccl" in dist.get_backend():
        return pending_collective(compat.flight_record())
    if not frame.f_code.co_filename.replace("\\", "/").endswith(_C10D_FILE):
        return None
    op = frame.f_code.co_name
    if op not in SYMMETRIC and op not in ROOTED:
        return None
    variables = frame.f_locals
    group = variables.get("group")
    if not isinstance(group, dist.ProcessGroup):
        group = dist.group.WORLD
    seq = compat.group_sequence(group)
    if seq is None:
        return None
    return {"op": op, "group": group.group_name, "ranks": dist.get_process_group_ranks(group),
            "seq": seq, "root": _root(variables, group, ROOTED.get(op))}


def pending_collective(record: dict[str, Any]) -> dict[str, Any] | None:
    """The oldest unfinished collective in a flight-recorder dump (`compat.flight_record`), as
    `collective_wait` reports one: op (the backend's name without its prefix; "send"/"recv" with
    the peer as root), group, members, the entry's record id as sequence number; None when every
    recorded collective finished (or the group is gone). Only NCCL retires an entry when its work
    finishes on the device, whether or not anyone waits for it; gloo's stay until waited for."""
    import torch.distributed as dist

    entries = sorted((e for e in record.get("entries", []) if not e.get("retired")
                      and e.get("state") != "completed"), key=lambda e: e["record_id"])
    groups = {group.group_name: group for group in compat.process_groups()}
    for entry in entries:
        group = groups.get(entry["process_group"][0])
        if group is None:
            continue
        op, _, peers = entry["profiling_name"].partition(":")[2].partition(" ")
        root = None
        if op in ("send", "recv"):  # "send 0->1", "recv 1<-0": the group's ranks, the peer second
            root = dist.get_global_rank(group, int(peers.replace("<-", "->").split("->")[1]))
        return {"op": op, "group": group.group_name, "ranks": dist.get_process_group_ranks(group),
                "seq": entry["record_id"], "root": root}
    return None


def _root(variables: dict[str, Any], group: Any, argument: str | None) -> int | None:
    """The global rank a rooted call names by `argument` ("src"/"dst") or by its group rank
    ("group_src"/"group_dst", which torch fills in from the global one)."""
    if argument is None:
        return None
    if isinstance(variables.get(argument), int):
        return variables[argument]
    group_rank = variables.get(f"group_{argument}")
    if isinstance(group_rank, int):
        import torch.distributed as dist

        return dist.get_global_rank(group, group_rank)
    return None


def _stack_text(frame: FrameType | None) -> str:
    lines = [f"Current thread 0x{threading.main_thread().ident:016x} (most recent call first):"]
    while frame is not None:
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}')
        frame = frame.f_back
    return "\n".join(lines)
