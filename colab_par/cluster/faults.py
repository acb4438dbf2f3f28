"""Faults and recovery: replacing dead engines, freeing ranks left waiting, re-forming the world.

When a rank fails (or dies) while others still run, or ranks wait in collectives that can never
complete, the busy ranks are located (their stacks), freed (abort, interrupt, at worst a restart)
and the process group re-formed; what was done and what it cost is said in words.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

from colab_par import compat
from colab_par.cluster import engine, probe
from colab_par.training import recovery
from colab_par.cluster.calls import Calls
from colab_par.cluster.health import dead_ranks
from colab_par.cluster.lifecycle import Lifecycle
from colab_par.cluster.persistence import save_record
from colab_par.cluster.state import ClusterState
from colab_par.cluster.world import World, served_store
from colab_par.cluster.output import (CollectiveDeadlockError, busy_ranks, is_transport_error, rank_errors, rank_failure,
                              ranks_text, where_waiting)

# Once every rank broke its connections, pending collectives fail at once; a rank still busy this
# long after that (or after an interrupt) is stuck, and only a restart frees it.
_ABORT_WAIT_S = 2.0


class Faults:
    """Recovers one cluster (`state`) from dead engines, failed ranks and stuck collectives."""

    def __init__(self, state: ClusterState, calls: Calls, world: World, lifecycle: Lifecycle):
        self.state, self.calls, self.world, self.lifecycle = state, calls, world, lifecycle

    # ---- losing one engine, not the session -----------------------------------------------------
    def replace_dead(self) -> str:
        """Fresh engines for the dead ranks only, in their places; see `Cluster.replace_dead`."""
        state = self.state
        state.require_running()
        dead = dead_ranks(state)
        if not dead:
            return "no engine is dead; nothing to replace (restart() gives every rank a fresh engine)"
        if state.launcher.cannot_replace:
            raise RuntimeError(f"replacing one engine needs a launcher that can start one where it ran "
                               f"(local, SSH); under {state.launcher.name} {state.launcher.cannot_replace}. Use "
                               "restart(): fresh engines for every rank, engine variables gone")
        started = time.monotonic()
        survivors = [rank for rank in range(state.n) if rank not in dead]
        if not self._settle(survivors):
            self.lifecycle.restart()
            return (f"rank(s) {ranks_text(dead)} died and the others stayed busy after an abort and an "
                    "interrupt, so every engine was restarted: all engine variables are gone")
        self._start_in_place(dead)
        return self._join_replaced(dead, survivors, started)

    def replace_dead_training_on(self, dead: list[int]) -> str:
        """`replace_dead` while the survivors, still running a Trainer's cell whose dp replicas are
        whole copies, train on without the dead ranks (`training/resilience/degraded.py`): a degrade
        request (their own group's store, served here) frees their pending collectives; the fresh
        engines start meanwhile; a rejoin request then stops the survivors at a step boundary,
        and the world re-forms once they are idle. Says what happened, in words."""
        state, calls = self.state, self.calls
        started = time.monotonic()
        survivors = [rank for rank in range(state.n) if rank not in dead]
        host = state.notebook_address()
        store = served_store(host, state.timeout)
        message = {"survivors": survivors, "lost": dead, "world": state.n, "host": host, "port": store.port,
                   "timeout_s": state.timeout}
        calls.answers(calls.request(survivors, probe.DEGRADE_REQUEST,
                                    {"degrade": message, "addresses": state.world_addresses()}), _ABORT_WAIT_S)
        self._start_in_place(dead)
        calls.answers(calls.request(survivors, probe.REJOIN_REQUEST), _ABORT_WAIT_S)
        deadline = time.monotonic() + state.timeout + _ABORT_WAIT_S  # a step, or joining their group, at most
        while time.monotonic() < deadline and not dead_ranks(state) and calls.idle_ranks(survivors) != set(survivors):
            time.sleep(0.05)
        del store  # the survivors' group is gone
        also = dead_ranks(state)  # survivors that died meanwhile: replaced too
        alive = [rank for rank in survivors if rank not in also]
        if not self._settle(alive):
            self.lifecycle.restart()
            return (f"rank(s) {ranks_text(dead + also)} died and the others stayed busy after an abort and an "
                    "interrupt, so every engine was restarted: all engine variables are gone")
        said = _trained_on(self._records(alive), dead, survivors)
        if also:
            self._start_in_place(also)
            said += f"; rank(s) {ranks_text(also)} died meanwhile"
        return f"{said}; {self._join_replaced(sorted(dead + also), alive, started)}"

    def _records(self, ranks: list[int]) -> list[Any]:
        """What each of `ranks` (those alive and idle) trained degraded (`recovery.degraded_record`)."""
        idle = sorted(self.calls.idle_ranks(ranks))
        if not idle:
            return []
        return self.state.client[[self.state.engine_ids[r] for r in idle]].apply_sync(recovery.degraded_record)

    def _start_in_place(self, dead: list[int]) -> None:
        """Fresh engines in the places of `dead` (on their hosts): started, prepared and bound, not
        yet in the world."""
        state = self.state
        fresh = self.lifecycle.start_engines([state.hosts[rank] for rank in dead])
        state.direct.forget([state.engine_ids[rank] for rank in dead])
        self.lifecycle.remove_stack_files(dead)  # what they said of their end was read: DeadEngineError
        prepared = self.world.prepare(fresh)
        for rank in dead:  # each rank an engine that runs on its host
            engine_id = next(e for e in fresh if prepared[e]["host"]["host"] == state.hosts[rank]["host"])
            fresh.remove(engine_id)
            state.engine_ids[rank], state.hosts[rank] = engine_id, prepared[engine_id]["host"]
            state.stack_files[rank] = prepared[engine_id]["stack_file"]
        self.world.bind(dead)

    def _join_replaced(self, dead: list[int], survivors: list[int], started: float) -> str:
        """The world re-formed with the fresh engines of `dead` (`_start_in_place`) in their places."""
        state = self.state
        if survivors:
            self.world.seed(survivors)
        held = sorted(set().union(*state.client[[state.engine_ids[r] for r in survivors]].apply_sync(
            engine.user_names)) - {"rank", "world_size", "local_rank", "device"}) if survivors else []
        stale = self._stale_names(survivors)
        self.world.join_world(identify=dead)
        if state.persist:
            save_record(state)
        places = ", ".join(f"rank {r} on {state.hosts[r]['host']} ({state.devices[r]})" for r in dead)
        lost = (f"; it lacks {_listed(held)}, which the other ranks hold: re-run the cells that "
                "define them" if held else "")
        return (f"replaced the dead engine of {places}; the process group was re-formed with a fresh "
                f"store in {time.monotonic() - started:.1f}s. The variables of rank(s) "
                f"{ranks_text(dead)} are gone{lost}. On the other ranks, "
                f"{_kept_text(stale, 'engine variables')}.")

    def _settle(self, ranks: list[int]) -> bool:
        """Free `ranks` still running a task (waiting on a dead peer): abort their collectives,
        then interrupt them; False when one stays busy."""
        calls = self.calls
        busy = [rank for rank in ranks if rank not in calls.idle_ranks(ranks)]
        if busy:
            calls.answers(calls.request(busy, probe.ABORT_REQUEST, {"addresses": self.state.world_addresses()}),
                          _ABORT_WAIT_S)
        for last in (False, True):
            deadline = time.monotonic() + _ABORT_WAIT_S
            while busy and time.monotonic() < deadline:
                time.sleep(0.05)
                busy = [rank for rank in busy if rank not in calls.idle_ranks(busy)]
            if not busy or last:
                return not busy
            calls.interrupt(busy)
        return False

    def _stale_names(self, ranks: list[int]) -> list[str]:
        """Engine variables on `ranks` built on the current process group (`engine.names_built_on_the_group`)."""
        if not ranks:
            return []
        view = self.state.client[[self.state.engine_ids[r] for r in ranks]]
        return sorted(set().union(*view.apply_sync(engine.names_built_on_the_group)))

    # ---- a task some ranks can never finish -----------------------------------------------------
    def recover_from_rank_failure(self, result: Any, ranks: list[int], cell: str | None,
                                  source: str | None) -> Exception:
        """Some ranks failed while others still run, most likely waiting for them in a collective."""
        errors = rank_errors(result, ranks)  # the causes (the others' errors come from freeing them)
        return self._stop_and_repair(result, ranks, cell, source, lambda waiting, repaired: rank_failure(
            errors or rank_errors(result, ranks), waiting, repaired))

    def recover_from_deadlock(self, result: Any, ranks: list[int], stuck: dict[int, str],
                              gone: dict[int, str], cell: str | None, source: str | None) -> Exception:
        """Ranks wait in collectives that can never complete (`TaskWatch`)."""
        return self._stop_and_repair(result, ranks, cell, source, lambda waiting, repaired:
                                     CollectiveDeadlockError(stuck, waiting, gone, repaired))

    def repair_if_broken(self, result: Any, ranks: list[int]) -> None:
        """A task that ended in transport errors (a collective timed out, a peer left) leaves a
        broken group behind: re-initialise it now and say so, instead of failing the next cell."""
        errors = rank_errors(result, ranks)
        if any(is_transport_error(name, value) for name, value, _ in errors.values()):
            raise rank_failure(errors, {}, self._rejoin_and_report(time.monotonic()))

    def _stop_and_repair(self, result: Any, ranks: list[int], cell: str | None, source: str | None,
                         failure: Callable[[dict[int, str], str], Exception]) -> Exception:
        """Busy ranks that can never finish (they wait on a rank that failed, or in collectives that
        can never complete): record where each is, free them and re-form the world
        (`_free_and_rejoin`); `failure(waiting, repaired)` is the error that says so."""
        started = time.monotonic()
        waiting = self._where(busy_ranks(result, ranks), cell, source)
        return failure(waiting, self._free_and_rejoin(result, ranks, started))

    def _free_and_rejoin(self, result: Any, ranks: list[int], started: float) -> str:
        """Make every pending collective fail now (each rank breaks its own connections, from its
        control thread: `probe.abort`), interrupt what still runs Python, then re-initialise the
        world; a rank still busy after all that is stuck where nothing reaches it, and only fresh
        engines free it. Returns what was done, and what it cost, in words."""
        calls = self.calls
        calls.answers(calls.request(range(self.state.n), probe.ABORT_REQUEST,
                                    {"addresses": self.state.world_addresses()}), _ABORT_WAIT_S)
        result.wait(_ABORT_WAIT_S)
        if not result.ready():
            calls.interrupt(busy_ranks(result, ranks))
            result.wait(_ABORT_WAIT_S)
        if not result.ready():
            stuck = busy_ranks(result, ranks)
            calls.signal(signal.SIGKILL, stuck)  # stuck in C++: a polite shutdown would wait for them
            self.lifecycle.restart()
            return (f"rank(s) {ranks_text(stuck)} stayed busy after the group was aborted and an "
                    "interrupt, so the engines and the process group were restarted: every engine "
                    "variable is gone; re-run the cells that set them up.")
        return self._rejoin_and_report(started)

    def _rejoin_and_report(self, started: float) -> str:
        self.world.join_world()
        kept = _kept_text(self._stale_names(list(range(self.state.n))), "engine variables")
        return (f"the process group was torn down and re-initialised with a fresh store in "
                f"{time.monotonic() - started:.1f}s; {kept}.")

    # ---- where busy ranks are -------------------------------------------------------------------
    def _where(self, ranks: list[int], cell: str | None, source: str | None = None) -> dict[int, str]:
        """Where each busy rank is (`source`: the file of the function `run` shipped, whose code
        reaches the engines without its file name): asked from the engine's control thread; for a
        rank that cannot answer (its main thread holds the GIL), from the stack dump its SIGUSR1
        handler writes, on this host."""
        answers = self.calls.answers(self.calls.request(ranks, probe.WHERE_REQUEST), 1.0)
        found = {rank: where_waiting(answer["dump"], cell, source) for rank, answer in answers.items()}
        return {**found, **self._dumped_stacks([r for r in ranks if r not in found], cell, source)}

    def _dumped_stacks(self, ranks: list[int], cell: str | None, source: str | None) -> dict[int, str]:
        state = self.state
        local = [r for r in ranks if state.is_local(state.hosts[r])]
        for rank in local:
            os.truncate(state.stack_files[rank], 0)
        self.calls.signal(signal.SIGUSR1, ranks)
        dumps: dict[int, str] = {}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and len(dumps) < len(local):
            time.sleep(0.05)
            for rank in local:
                with open(state.stack_files[rank]) as dump:
                    text = dump.read()
                if compat.ENGINE_MAIN_FILE in text:  # the main thread's dump is complete
                    dumps[rank] = text
        remote = {r: f"on {state.hosts[r]['host']}: it did not answer, and SIGUSR1 asked it to dump its "
                     f"stacks to {state.stack_files[r]} there" for r in ranks if r not in local}
        return {**{r: where_waiting(dumps.get(r, ""), cell, source) for r in local}, **remote}


def _trained_on(records: list[Any], dead: list[int], survivors: list[int]) -> str:
    """What the survivors did while the dead ranks' replacements started, in words."""
    done = next((record for record in records if record), None)
    if done is None:
        return (f"rank(s) {ranks_text(dead)} died; ranks {ranks_text(survivors)} could not train on without "
                "them (no dp replica was left whole, or no whole step every rank held with every random stream) "
                "and waited for the replacement")
    trainers = done.get("ranks", survivors)
    waited = [rank for rank in survivors if rank not in trainers]
    waiting = f"; rank(s) {ranks_text(waited)}, of the lost ranks' replicas, waited" if waited else ""
    stops = [record["stopped"] for record in records if record and record.get("stopped")]
    stopped = f"; they stopped early on {stops[0]}" if stops else ""
    if done["steps"] is None:
        return (f"rank(s) {ranks_text(dead)} died; ranks {ranks_text(trainers)} began to train on at dp "
                f"{done['dp']} of {done['of']} but finished no step before the replacement was ready (or "
                f"another rank was lost){stopped}{waiting}")
    first, last = done["steps"]
    return (f"rank(s) {ranks_text(dead)} died; ranks {ranks_text(trainers)} trained on at dp {done['dp']} of "
            f"{done['of']} (steps {first}..{last}) while the replacement started{stopped}{waiting}")


def _kept_text(stale: list[str], what: str) -> str:
    """`what` are kept, naming those of them that hold the old process group."""
    if not stale:
        return f"{what} are kept (none of them held the old group)"
    return (f"{what} are kept, but {', '.join(stale)} {'holds' if len(stale) == 1 else 'hold'} the old "
            "group and must be rebuilt (a ParallelModel, its optimizer and Trainer, DTensors, "
            "DeviceMesh and DDP/FSDP modules all live on one process group)")


def _listed(names: list[str], most: int = 12) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
