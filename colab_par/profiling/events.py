"""One rank's torch.profiler trace (Chrome trace JSON) reduced to the few lanes a person reads.

Runs on the engine that wrote the trace, so only this compact record travels to the notebook
(`timeline.py` draws it). Pure Python over the trace's complete ("X") events:

- **host lane**: every instant of the recording on the rank's host threads (the thread that runs
  the cell, and autograd's device threads) gets exactly one category, by priority: inside a
  collective call or wait (``c10d::*``, functional collectives, waits) → communication; inside an
  ``Optimizer.*`` event or the Trainer's optimizer phase → optimizer; inside its data phase → data;
  inside any other operator → compute. Time in no operator is a gap: up to the moment the
  collectives this rank had in flight complete in it, the thread waited for them (waiting; for a
  point-to-point receive, a pipeline bubble); the rest is host code between operators (Python,
  framework).
- **communication lanes**: what the backend itself recorded while each collective ran: gloo runs
  collectives on its worker threads (one lane each), point-to-point transfers are spans from post
  to completion (packed into rows where they overlap), NCCL's are kernels on CUDA streams. Each is
  named by the c10d call that issued it, so a reduce-scatter gloo runs as an all-reduce reads as a
  reduce-scatter.
- **device lanes**: CUDA kernels per stream (communication kernels by their collective).
- **phases**: the Trainer's ``colab_par.<phase>`` marks and ``colab_par.step N`` step marks.

Totals are exact; the segments drawn are coarsened to at most `MAX_SEGMENTS` per lane.
"""
from __future__ import annotations

import bisect
import re
from typing import Any, Iterable

__all__ = ["reduce_trace", "collective_kind", "MAIN_CATEGORIES", "COLLECTIVES", "PHASE_PREFIX",
           "STEP_MARK", "SYNC_MARK"]

PHASE_PREFIX = "colab_par."
STEP_MARK = "colab_par.step "  # + the Trainer's step number (history's "step")
SYNC_MARK = "colab_par.sync"  # the barrier every rank leaves together at the start of a recording
PHASES = ("data", "forward_backward", "clip", "optimizer")
MAIN_CATEGORIES = ("compute", "optimizer", "data", "communication", "waiting", "bubble", "host")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv",
               "reduce", "gather", "scatter", "barrier", "send_recv", "other")
P2P = ("send", "recv", "send_recv")
WAKE_SLACK_US = 100.0  # a collective's recorded end may come this long after its waiter resumed
MAX_SEGMENTS = 4000  # per lane: finer than any picture shows

_BACKEND_SPAN = re.compile(r"^(gloo|nccl|ucc|mpi|xccl|hccl):(\w+)$")
_ISSUE_PREFIXES = ("c10d::",)
_CALL_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms")
_KIND_WORDS = (  # first match wins: reduce_scatter before scatter/reduce, all_gather before gather
    ("reducescatter", "reduce_scatter"), ("reduce_scatter", "reduce_scatter"),
    ("allgather", "all_gather"), ("all_gather", "all_gather"),
    ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
    ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
    ("sendrecv", "send_recv"), ("broadcast", "broadcast"), ("barrier", "barrier"),
    ("recv", "recv"), ("send", "send"), ("scatter", "scatter"), ("gather", "gather"),
    ("reduce", "reduce"))


def collective_kind(name: str) -> str:
    """The collective a backend span, c10d call or NCCL kernel name stands for ("other" if none)."""
    folded = name.lower().replace("-", "_")
    for word, kind in _KIND_WORDS:
        if word in folded:
            return kind
    return "other"


def reduce_trace(trace: dict[str, Any], *, host_thread: int, rank: int, host: str,
                 path: str | None = None) -> dict[str, Any]:
    """The compact, JSON-able record of one rank's recording (see the module docstring); times in
    microseconds from the recording's first event, `start_us` on the trace's own clock."""
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e
              and e.get("cat") not in ("Trace", "python_function")]
    if not events:
        return _empty(rank, host, path)
    t0 = min(float(e["ts"]) for e in events)
    t1 = max(float(e["ts"]) + float(e["dur"]) for e in events)
    span = lambda e: (float(e["ts"]) - t0, float(e["ts"]) + float(e["dur"]) - t0)  # noqa: E731

    host_threads = {host_thread} | {e["tid"] for e in events
                                    if e["name"].startswith("autograd::engine::evaluate_function")}
    phases, steps, sync, spans, issues, kernels, host_ops = [], [], None, [], [], [], []
    for e in events:
        name, (start, end) = e["name"], span(e)
        if name.startswith(STEP_MARK) and name[len(STEP_MARK):].isdigit():
            steps.append([int(name[len(STEP_MARK):]), start, end])
        elif name.startswith(PHASE_PREFIX) and name[len(PHASE_PREFIX):] in PHASES:
            phases.append([start, end, name[len(PHASE_PREFIX):]])
        elif name == SYNC_MARK:
            sync = end
        elif match := _BACKEND_SPAN.match(name):
            spans.append({"start": start, "end": end, "kind": collective_kind(name), "tid": e["tid"],
                          "backend": match[1]})
        elif e.get("cat") == "kernel":
            kernels.append((start, end, e.get("tid"), name))
        elif e["tid"] in host_threads:
            if name.startswith(_ISSUE_PREFIXES):
                issues.append((start, collective_kind(name)))
            host_ops.append((start, end, _host_category(name, e.get("cat"))))
    if any("nccl" in name.lower() for *_, name in kernels):  # NCCL's work is its kernels
        spans = [span for span in spans if span["backend"] != "nccl"]
    _name_by_issuer(spans, issues)

    collectives = [(s["start"], s["end"], s["kind"]) for s in spans]
    collectives += [(start, end, collective_kind(name)) for start, end, _, name in kernels
                    if "nccl" in name.lower()]
    main = _host_lane(host_ops, phases, collectives, t1 - t0)
    lanes = [{"name": "phases", "kind": "phase", "segments": sorted(phases)}] if phases else []
    lanes.append({"name": "host", "kind": "main", "segments": _coarse(main, t1 - t0)})
    lanes += _communication_lanes(spans, host_threads, t1 - t0)
    lanes += _device_lanes(kernels, t1 - t0)
    return {"rank": rank, "host": host, "trace": path, "start_us": t0, "span_us": t1 - t0,
            "sync_us": sync, "steps": sorted(steps), "lanes": lanes,
            "totals": _totals(main, 0.0, t1 - t0),
            "step_totals": {str(n): _totals(main, start, end) for n, start, end in steps},
            "collectives": _collective_totals(collectives),
            "comm_busy_us": _length(_union([(s, e) for s, e, _ in collectives])),
            "comm_hidden_us": _hidden(collectives, main)}


def _empty(rank: int, host: str, path: str | None) -> dict[str, Any]:
    return {"rank": rank, "host": host, "trace": path, "start_us": 0.0, "span_us": 0.0, "sync_us": None,
            "steps": [], "lanes": [], "totals": {}, "step_totals": {}, "collectives": {},
            "comm_busy_us": 0.0, "comm_hidden_us": 0.0}


def _host_category(name: str, cat: str | None) -> str | None:
    """What a host-thread event means for the host lane; None for containers (annotations such as
    ``DistributedDataParallel.forward`` or ``FSDP::pre_forward`` wrap operators and gaps alike)."""
    lowered = name.lower()
    if name.startswith(_CALL_PREFIXES) or ("wait" in lowered and ("c10d" in lowered or "fsdp" in lowered)):
        return "communication"
    if name.startswith("Optimizer."):
        return "optimizer"
    if cat == "cuda_runtime" and "synchronize" in lowered:
        return "waiting"
    if cat in ("cpu_op", "cuda_runtime"):
        return "compute"
    return None


def _name_by_issuer(spans: list[dict], issues: list[tuple[float, str]]) -> None:
    """Name each backend span by the c10d call that issued it: the earliest unmatched call of a
    compatible kind issued before the span began (a process group runs its work in issue order)."""
    issues = sorted(issues)
    used = [False] * len(issues)
    for span in sorted(spans, key=lambda s: s["start"]):
        for i, (issued, kind) in enumerate(issues):
            if issued > span["start"]:
                break
            if not used[i] and (kind == span["kind"] or (span["kind"] == "all_reduce"
                                                         and kind == "reduce_scatter")):
                used[i], span["kind"] = True, kind
                break


_PRIORITY = {"communication": 0, "optimizer": 1, "data": 2, "compute": 3, "waiting": 4}


def _host_lane(ops: list[tuple[float, float, str | None]], phases: list, collectives: list,
               length: float) -> list[list]:
    """The host threads' time from 0 to `length`, each instant in one category (module docstring)."""
    marks = [(start, end, category) for start, end, category in ops if category is not None]
    marks += [(start, end, name) for start, end, name in phases if name in ("data", "optimizer")]
    points = []
    for start, end, category in marks:
        points += [(start, 1, category), (end, -1, category)]
    points.sort(key=lambda p: (p[0], p[1]))
    open_count = dict.fromkeys(_PRIORITY, 0)
    pieces, now = [], 0.0
    for time, step, category in points:
        if time > now:
            pieces.append([now, time, _top(open_count)])
            now = time
        open_count[category] += step
    if length > now:
        pieces.append([now, length, None])
    ends = sorted((end, kind, start) for start, end, kind in collectives)
    end_times = [end for end, _, _ in ends]
    lane: list[list] = []
    for start, end, category in pieces:
        for piece in ([[start, end, category]] if category is not None
                      else _gap_pieces(start, end, ends, end_times)):
            if lane and lane[-1][2] == piece[2] and abs(lane[-1][1] - piece[0]) < 1e-9:
                lane[-1][1] = piece[1]
            elif piece[1] > piece[0]:
                lane.append(piece)
    return lane


def _top(open_count: dict[str, int]) -> str | None:
    live = [category for category, count in open_count.items() if count > 0]
    return min(live, key=_PRIORITY.__getitem__) if live else None


def _gap_pieces(start: float, end: float, ends: list[tuple[float, str, float]],
                end_times: list[float]) -> list[list]:
    """A gap in the host threads' operators: waiting for the collectives in flight that complete
    in it (the thread resumes when the last of them does; a receive makes it a pipeline bubble),
    then host code between operators (Python, framework) up to the next operator."""
    lo = bisect.bisect_right(end_times, start)
    hi = bisect.bisect_right(end_times, end + WAKE_SLACK_US)
    awaited = [(done, kind) for done, kind, began in ends[lo:hi] if began < end]
    if not awaited:
        return [[start, end, "host"]]
    resumed = min(end, max(done for done, _ in awaited))
    waited = "bubble" if {kind for _, kind in awaited} & {"recv", "send_recv"} else "waiting"
    return [[start, resumed, waited], [resumed, end, "host"]]


def _communication_lanes(spans: list[dict], host_threads: set, length: float) -> list[dict]:
    """One lane per backend thread (spans posted on a host thread: point-to-point), each split into
    rows where its spans overlap."""
    by_thread: dict[Any, list[dict]] = {}
    for span in sorted(spans, key=lambda s: s["start"]):
        by_thread.setdefault(span["tid"], []).append(span)
    lanes, workers = [], 0
    for tid, members in by_thread.items():
        if tid in host_threads:
            label = "p2p" if all(s["kind"] in P2P for s in members) else "async"
        else:
            workers += 1
            label = f"comm thread {workers}"
        for row, segments in enumerate(_rows([[s["start"], s["end"], s["kind"]] for s in members])):
            name = label if row == 0 else f"{label} ({row + 1})"
            lanes.append({"name": name, "kind": "comm", "segments": _coarse(segments, length)})
    return lanes


def _device_lanes(kernels: list[tuple], length: float) -> list[dict]:
    by_stream: dict[Any, list[list]] = {}
    for start, end, stream, name in sorted(kernels, key=lambda k: k[0]):
        kind = collective_kind(name) if "nccl" in name.lower() else "compute"
        by_stream.setdefault(stream, []).append([start, end, kind])
    return [{"name": f"stream {stream}", "kind": "device", "segments": _coarse(_merge(segments), length)}
            for stream, segments in by_stream.items()]


def _rows(segments: list[list]) -> list[list[list]]:
    """Greedy interval packing: each segment goes to the first row free at its start."""
    rows: list[list[list]] = []
    for segment in segments:
        row = next((r for r in rows if r[-1][1] <= segment[0]), None)
        if row is None:
            rows.append([segment])
        else:
            row.append(segment)
    return rows


def _merge(segments: list[list]) -> list[list]:
    merged: list[list] = []
    for start, end, label in segments:
        if merged and merged[-1][2] == label and start <= merged[-1][1] + 1e-9:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, label])
    return merged


def _coarse(segments: list[list], length: float) -> list[list]:
    """At most `MAX_SEGMENTS`: above that, each of as many equal bins shows the label that covers
    most of it (what a picture of that width shows anyway). Times rounded to 0.1 µs."""
    if len(segments) > MAX_SEGMENTS and length > 0:
        width = length / MAX_SEGMENTS
        cover: list[dict[str, float]] = [{} for _ in range(MAX_SEGMENTS)]
        for start, end, label in segments:
            first, last = int(start // width), min(int(end // width), MAX_SEGMENTS - 1)
            for b in range(first, last + 1):
                overlap = min(end, (b + 1) * width) - max(start, b * width)
                if overlap > 0:
                    cover[b][label] = cover[b].get(label, 0.0) + overlap
        segments = _merge([[b * width, (b + 1) * width, max(c, key=c.__getitem__)]
                           for b, c in enumerate(cover) if c])
    return [[round(start, 1), round(end, 1), label] for start, end, label in segments]


def _totals(lane: list[list], start: float, end: float) -> dict[str, float]:
    totals = dict.fromkeys(MAIN_CATEGORIES, 0.0)
    for s, e, category in lane:
        overlap = min(e, end) - max(s, start)
        if overlap > 0:
            totals[category] += overlap
    return {category: round(value, 1) for category, value in totals.items()}


def _collective_totals(collectives: list[tuple]) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for start, end, kind in collectives:
        entry = totals.setdefault(kind, {"count": 0, "us": 0.0})
        entry["count"] += 1
        entry["us"] = round(entry["us"] + end - start, 1)
    return totals


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    union: list[list[float]] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return [(s, e) for s, e in union]


def _length(intervals: list[tuple[float, float]]) -> float:
    return round(sum(e - s for s, e in intervals), 1)


def _hidden(collectives: list[tuple], lane: list[list]) -> float:
    """Time some collective ran while the host threads did other work (compute, optimizer, data,
    host code): communication overlapped, not waited for."""
    comm = _union([(s, e) for s, e, _ in collectives])
    busy = _union([(s, e) for s, e, c in lane if c in ("compute", "optimizer", "data", "host")])
    total, j = 0.0, 0
    for s, e in comm:
        while j < len(busy) and busy[j][1] <= s:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < e:
            total += min(e, busy[k][1]) - max(s, busy[k][0])
            k += 1
    return round(total, 1)
