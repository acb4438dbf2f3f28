"""What the notebook sees of a task on the engines: rank 0's output live, other ranks' output when
it differs, errors grouped by rank, broken process groups explained, the dashboard fed.

`Cluster` decides what happens to processes; this module only turns ipyparallel results, engine
stack dumps and published metrics into what a user reads. It never starts or stops anything.
"""
from __future__ import annotations

import linecache
import os
import re
import sys
from typing import Any, Iterable, Sequence

import ipyparallel as ipp

from colab_par import compat
from colab_par.views.remote_view import local_view

__all__ = ["EngineError", "DeadEngineError", "RecoveryError", "RankFailureError", "CollectiveDeadlockError",
           "TaskOutput", "ranks_text", "size_text", "values",
           "grouped", "per_rank_data", "rank_errors", "busy_ranks", "rank_failure", "is_transport_error", "transport_reason",
           "where_waiting"]


class EngineError(RuntimeError):
    """Errors raised on engines, grouped: one traceback per distinct error with the ranks that hit it."""

    def __init__(self, groups: list[tuple[list[int], str, str, str]]):
        self.groups = groups  # (ranks, name, value, traceback text)
        summary = "; ".join(f"{name}: {value} (ranks {ranks_text(ranks)})"
                            for ranks, name, value, _ in groups)
        super().__init__(summary)

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the client-side traceback of the magic itself."""
        lines: list[str] = []
        for ranks, name, value, traceback in self.groups:
            lines.append(f"[ranks {ranks_text(ranks)}] {name}: {value}")
            lines.extend(traceback.rstrip("\n").splitlines())
            lines.append("")
        return lines

    def __str__(self) -> str:
        return "\n".join([super().__str__(), ""] + self._render_traceback_())


class DeadEngineError(EngineError):
    """One or more engines died; the world is broken until a restart."""

    def __init__(self, dead: Sequence[int], detail: str):
        message = (f"rank(s) {ranks_text(dead)} died ({detail}); the process group is broken. "
                   "Run `%colossal restart` (or `cluster.restart()`) to start fresh engines.")
        super().__init__([(list(dead), "DeadEngineError", message, "")])
        self.dead = list(dead)

    def __str__(self) -> str:
        return self.groups[0][2]


class RecoveryError(EngineError):
    """A restartable cell kept losing engines: it was restarted as often as its Trainer allows."""

    def __init__(self, attempts: list[str], max_restarts: int):
        story = "\n".join(f"  {i}. {attempt}" for i, attempt in enumerate(attempts, start=1))
        message = (f"the cell lost an engine {len(attempts)} times; its Trainer allows "
                   f"max_restarts={max_restarts}, so it stops here. What happened:\n{story}")
        super().__init__([([], "RecoveryError", message, "")])
        self.attempts = attempts

    def __str__(self) -> str:
        return self.groups[0][2]


class RankFailureError(EngineError):
    """A task failed on some ranks and broke (or would have hung) the others; the world was repaired.

    `groups` hold the errors that caused it (transport errors of ranks that merely waited are
    consequences and are not shown), `waiting` says where each waiting rank was, `recovery` what
    the cluster did and what that cost.
    """

    def __init__(self, groups: list[tuple[list[int], str, str, str]], waiting: dict[int, str],
                 recovery: str):
        self.waiting, self.recovery = dict(sorted(waiting.items())), recovery
        super().__init__(groups)

    def _render_traceback_(self) -> list[str]:
        lines = super()._render_traceback_()
        if self.waiting:
            failed = sorted({rank for ranks, *_ in self.groups for rank in ranks})
            verb = "was" if len(self.waiting) == 1 else "were"
            lines.append(f"colab_par: {_who(self.waiting)} {verb} still running when {_who(failed)} failed:")
            lines.extend(f"  rank {rank}: {where}" for rank, where in self.waiting.items())
        lines.append(f"colab_par: {self.recovery}")
        return lines


class CollectiveDeadlockError(RankFailureError):
    """Ranks waited in collectives that could never complete (a peer they need had returned from
    the cell, or waits in a different collective); the cell was stopped and the world repaired.

    `stuck`: rank -> why its call cannot complete; `waiting`: where each rank still busy was
    (stuck or running, which was interrupted); `gone`: the ranks that had returned, and how.
    """

    def __init__(self, stuck: dict[int, str], waiting: dict[int, str], gone: dict[int, str],
                 recovery: str):
        self.stuck, self.gone = dict(sorted(stuck.items())), dict(sorted(gone.items()))
        waits = "waits in a collective" if len(stuck) == 1 else "wait in collectives"
        headline = f"the cell can never finish: {_who(stuck)} {waits} that cannot complete"
        super().__init__([(sorted(stuck), "CollectiveDeadlock", headline, "")], waiting, recovery)

    def _render_traceback_(self) -> list[str]:
        ranks, name, value, _ = self.groups[0]
        lines = [f"[ranks {ranks_text(ranks)}] {name}: {value}"]
        for rank in sorted(set(self.waiting) | set(self.stuck) | set(self.gone)):
            if rank in self.gone:
                lines.append(f"  rank {rank}: {self.gone[rank]}")
                continue
            lines.append(f"  rank {rank}: {self.waiting.get(rank, 'position unknown')}"
                         + ("" if rank in self.stuck else " (still running: interrupted)"))
            if rank in self.stuck:
                lines.append(f"          {self.stuck[rank]}")
        lines.append(f"colab_par: {self.recovery}")
        return lines


def size_text(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: "1.50 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:,.0f} {unit}" if unit == "B" else f"{num_bytes:,.2f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:,.2f} TiB"


def ranks_text(ranks: Iterable[int]) -> str:
    """[0, 2] -> "0,2"."""
    return ",".join(str(r) for r in ranks)


def _who(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"


# ---- live output of one task --------------------------------------------------------------------
class TaskOutput:
    """Rank 0's output streamed as it arrives, the dashboard fed with what engines publish."""

    def __init__(self, result: Any, *, stream: bool, dashboard: bool):
        self.result, self.stream, self.use_dashboard = result, stream, dashboard
        self._shown, self._dashboard, self._views_shown = 0, None, 0

    def poll(self) -> None:
        if self.stream:
            self._stream_rank0()
            self._show_rank0_views()
        if self.use_dashboard:
            self._feed_dashboard(final=False)

    def finish(self) -> None:
        """Show what trails the reply (iopub output and published rows can arrive after it) and
        the final frame, also when every row arrived after the last poll (a short or loaded run)."""
        if (self.stream or self.use_dashboard) and self.result.ready():
            self.result.wait_for_output(timeout=5.0)
        if self.stream:
            self._stream_rank0()
            self._show_rank0_views()
        if self.use_dashboard:
            self._feed_dashboard(final=True)

    def _feed_dashboard(self, *, final: bool) -> None:
        data = per_rank_data(self.result.data)
        if self._dashboard is None and any(data):
            from colab_par.views.dashboard import LiveDashboard

            self._dashboard = LiveDashboard()
        if self._dashboard is None:
            return
        if final:
            self._dashboard.finish(data)
        else:
            self._dashboard.update(data)

    def show_other_ranks(self, ranks: list[int], all_output: bool) -> None:
        """Other ranks' output when it differs from rank 0's (or always), prefixed with the rank."""
        outputs = self.result.stdout if isinstance(self.result.stdout, list) else [self.result.stdout]
        first = outputs[0]
        for rank, text in zip(ranks[1:], outputs[1:]):
            if text and (all_output or text != first):
                sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))

    def show_result(self) -> None:
        """The value of the cell's last expression on the first rank, as a notebook shows it: a
        colab_par view (`remote_view`) drawn here, anything else as its text."""
        first = self.result.execute_result[0]
        if first is None:
            return
        view = local_view(first.get("data", {}))
        if view is not None:
            _display(view)
        elif "text/plain" in first.get("data", {}):
            print(first["data"]["text/plain"])

    def _show_rank0_views(self) -> None:
        """colab_par views rank 0 displayed during the task (a Trainer's profile), drawn here."""
        outputs = self.result.outputs
        first = outputs[0] if outputs and isinstance(outputs[0], list) else outputs
        for content in first[self._views_shown:]:
            view = local_view(content.get("data", {}))
            if view is not None:
                _display(view)
        self._views_shown = len(first)

    def _stream_rank0(self) -> None:
        stdout = self.result.stdout
        text = stdout[0] if isinstance(stdout, list) else stdout
        if text and len(text) > self._shown:
            sys.stdout.write(text[self._shown:])
            sys.stdout.flush()
            self._shown = len(text)


def _display(view: Any) -> None:
    """In IPython: the view's picture; in plain Python: its text."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(view)
        return
    if get_ipython() is None:
        print(view)
    else:
        display(view)


def per_rank_data(data: Any) -> list[dict[str, Any] | None]:
    """What each rank published during a task (`AsyncResult.data`), None where nothing."""
    if isinstance(data, list):
        return [d or None for d in data]
    return [data or None]


# ---- errors ------------------------------------------------------------------------------------
def values(result: Any, engine_ids: list[int]) -> list[Any]:
    """Results of a list-targeted view (always a list, rank order), or the grouped errors."""
    try:
        return result.get()
    except ipp.error.CompositeError as exc:
        raise grouped(exc.elist, engine_ids) from None
    except ipp.error.RemoteError as exc:
        raise grouped([(exc.ename, exc.evalue, exc.traceback, exc.engine_info)], engine_ids) from None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL_NUMBER = re.compile(r"In\s*\[\d+\]")


def grouped(elist: list[tuple], engine_ids: list[int]) -> EngineError:
    """One group per distinct error; engines' own cell counters do not make errors distinct."""
    errors = []
    for name, value, traceback, info in elist:
        engine_id = (info or {}).get("engine_id")
        rank = engine_ids.index(engine_id) if engine_id in engine_ids else -1
        errors.append((rank, name, value, traceback))
    return EngineError(_groups(errors))


def _groups(errors: list[tuple[int, str, str, str]]) -> list[tuple[list[int], str, str, str]]:
    groups: dict[tuple[str, str, str], tuple[list[int], str]] = {}
    for rank, name, value, traceback in errors:
        key = (name, str(value), _CELL_NUMBER.sub("In[]", _ANSI.sub("", traceback or "")))
        groups.setdefault(key, ([], traceback or ""))[0].append(rank)
    return [(sorted(ranks), name, value, shown) for (name, value, _), (ranks, shown) in groups.items()]


def rank_errors(result: Any, ranks: list[int]) -> dict[int, tuple[str, str, str]]:
    """(name, value, traceback) of the ranks whose part of `result` already failed, first failure first.

    Reads ipyparallel's per-engine futures (`compat.task_futures`): its public API only reports
    a task once every engine is done, which is exactly what a rank waiting in a collective prevents.
    """
    finished = []
    for order, (rank, future) in enumerate(zip(ranks, compat.task_futures(result))):
        reply = future.result() if future.done() else None
        if isinstance(reply, ipp.error.RemoteError):
            completed = compat.failed_at(future, reply)
            finished.append((completed is None, str(completed or ""), order, rank,
                             (reply.ename, str(reply.evalue), reply.traceback or "")))
    return {rank: error for *_, rank, error in sorted(finished, key=lambda f: f[:3])}


def busy_ranks(result: Any, ranks: list[int]) -> list[int]:
    """The ranks whose part of `result` is still running."""
    return [rank for rank, future in zip(ranks, compat.task_futures(result)) if not future.done()]


def rank_failure(errors: dict[int, tuple[str, str, str]], waiting: dict[int, str],
                 recovery: str) -> RankFailureError:
    """The error to show: the causes (transport errors of ranks that only waited left out, or
    explained in a sentence when they are all there is)."""
    causes = {r: e for r, e in errors.items()
              if not is_transport_error(*e[:2]) and e[0] != "KeyboardInterrupt"}  # ours, to free them
    if not causes:  # the group broke by itself: a time-out is the cause, lost connections follow
        broken = {r: transport_reason(e[1]) for r, e in errors.items() if is_transport_error(*e[:2])}
        timed_out = {r: reason for r, reason in broken.items() if reason.startswith("timed out")}
        causes = {r: ("BrokenProcessGroup", reason, "") for r, reason in (timed_out or broken).items()}
    return RankFailureError(_groups([(r, *e) for r, e in causes.items()]), waiting, recovery)


_TRANSPORT = re.compile(r"gloo/transport|Connection closed by peer|Connection reset by peer|"
                        r"Broken pipe|NCCL (error|communicator)|ProcessGroup\w* is (aborted|destroyed)|"
                        r"Timed out waiting \d+ms|default process group has not been initialized",
                        re.IGNORECASE)


def is_transport_error(name: str, value: str) -> bool:
    """True for errors of the communication layer (gloo/NCCL/store), which mean a broken group."""
    return (name in ("DistBackendError", "DistNetworkError", "DistStoreError")
            or bool(_TRANSPORT.search(value)))


def transport_reason(value: str) -> str:
    """A transport error in words, without the backend's internals."""
    if re.search(r"timed? ?out|timeout", value, re.IGNORECASE):
        return ("timed out in a collective (its process group's timeout): another rank never joined "
                "it, or called a different one")
    if re.search(r"closed by peer|reset by peer|broken pipe", value, re.IGNORECASE):
        return "lost the connection to another rank (that rank failed or left the group)"
    if "not been initialized" in value:
        return "found no process group (it had been destroyed)"
    return "the communication backend failed (the process group is unusable)"


# ---- where a waiting rank is --------------------------------------------------------------------
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_FRAMEWORK = ("/IPython/", "/ipykernel/", "/ipyparallel/", "/tornado/", "/asyncio/")


_SHIPPED = "<dynamic-code>"  # cloudpickle's file name for code it pickles by value


def where_waiting(dump: str, cell: str | None, source: str | None = None) -> str:
    """Where a rank's main thread is, from a faulthandler dump: the innermost call (e.g. the
    collective) and the line of the cell (or of the function run on the engines) that made it.
    Code cloudpickle shipped by value is named "<dynamic-code>" there (cloudpickle >= 3.1.3 drops
    its file name): `source`, the shipped function's file, stands in for it."""
    main = next((block for block in dump.split("\n\n") if compat.ENGINE_MAIN_FILE in block), "")
    frames = [(source if m["file"] == _SHIPPED and source else m["file"], int(m["line"]), m["func"])
              for m in map(_FRAME.match, main.splitlines()) if m]
    user = []
    for frame in frames:  # innermost first; the user's code ends where the engine's own begins
        if frame[0] == "<string>" or any(part in frame[0] for part in _FRAMEWORK):
            break
        user.append(frame)
    if not user:
        return "no stack dump (the rank did not answer SIGUSR1)" if not main else "between tasks"
    innermost, top = user[0], user[-1]
    anchor = next(frame for frame in user if frame[0] == top[0])
    if top[2] == "<module>" and cell is not None:
        lines = cell.splitlines()
        text = lines[anchor[1] - 1].strip() if anchor[1] <= len(lines) else ""
        at = f"cell line {anchor[1]}: {text}"
    else:
        text = linecache.getline(anchor[0], anchor[1]).strip()
        at = f"{anchor[0]}:{anchor[1]} in {anchor[2]}" + (f": {text}" if text else "")
    if innermost is anchor:
        return at
    return f"in {innermost[2]} ({os.path.basename(innermost[0])}:{innermost[1]}) at {at}"
