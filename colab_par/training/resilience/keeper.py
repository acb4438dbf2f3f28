"""The Trainer's side of in-memory recovery: mark each whole step and take snapshots when due
(`recover.recover` brings a run back from what they keep)."""
from __future__ import annotations

import json
import math
from typing import Any

import torch.distributed as dist

from colab_par.training.checkpoint_files import rng_state
from colab_par.training.resilience import memory, peers
from colab_par.training.resilience.rank_copy import loop_state
from colab_par.training.resilience.recover import replica_key

__all__ = ["Keeper"]


class Keeper:
    """For a Trainer with `Checkpoints(on_failure="restart")`. `snapshot_every`: None (live replicas
    only), K steps, or "auto": K from the measured cost of a snapshot and of a step, so that
    snapshots take at most `memory.SNAPSHOT_BUDGET` of the time."""

    def __init__(self, run: Any, snapshot_every: int | str | None):
        self.run, self.snapshot_every = str(run), snapshot_every
        self.kept = memory.kept_for(self.run)
        self._every = snapshot_every if isinstance(snapshot_every, int) else 1
        self._last: int | None = None  # the step of the newest snapshot ("auto")
        self._stride_known = False
        self._replicas: bool | None = None  # dp peers hold the same state (`recover.replica_key`)
        self._streams: list[dict] | None = None  # every rank's, gathered before this step's optimizer step
        if dist.is_initialized():  # made now, while every rank is here: its making waits for all of them
            peers.host_group()

    def step_begins(self, trainer: Any) -> None:
        """Just before the optimizer step. Its forwards are done, so every rank's random stream is
        final for this step: where dp peers are live replicas of each other, the streams are
        gathered now (a few KB), and a rank lost from here on (before its optimizer step, say) has
        its own stream known to its peers; one lost during the gather leaves the previous step whole
        everywhere. Then this rank's state is in flux until `step_done`."""
        self._streams = self._gathered_streams(trainer)
        self.kept.live = None

    def step_done(self, trainer: Any, step_seconds: float) -> None:
        """The step's row is recorded: this rank's state is whole at `trainer.step`."""
        self.whole(trainer, self._streams)
        if not self._due(trainer.step):
            return
        if not self._stride_known:
            self.kept.stride, self._stride_known = memory.buddy_stride(peers.host_group()), True
        seconds = memory.take_snapshot(self.kept, trainer.pm, trainer)
        self._last = trainer.step
        if self.snapshot_every == "auto":  # the ranks must agree: the largest K any of them needs
            needed = math.ceil(seconds / (memory.SNAPSHOT_BUDGET * max(step_seconds, 1e-9)))
            self._every = max(1, peers.agreed_max(needed, peers.host_group()))

    def whole(self, trainer: Any, streams: list[dict] | None = None) -> None:
        """This rank's state is whole at `trainer.step` (after a step, or a recovery): kept live,
        with every rank's random stream where dp peers are replicas (`streams`, else gathered now:
        call on every rank)."""
        loop = loop_state(trainer.pm, trainer)
        self.kept.live, self.kept.live_loop = trainer, loop  # whole, even if a peer is lost in a gather
        streams = streams if streams is not None else self._gathered_streams(trainer)
        if streams is not None:
            loop["streams"] = streams

    def row_added(self, trainer: Any) -> None:
        """A row (an evaluation's) joined `trainer.history` after its step was kept whole: it is
        part of that step's state, so going back to the step, or a replacement taking it, keeps it."""
        if self.kept.live is trainer:
            self.kept.live_loop["history"] = len(trainer.history)

    def _gathered_streams(self, trainer: Any) -> list[dict] | None:
        """Every rank's random stream as it stands, in rank order, where dp peers are replicas."""
        if self._replicas is None:
            self._replicas = replica_key(trainer.pm) >= 0 and trainer.pm.layout.dp > 1
        if not self._replicas:
            return None
        mine = json.dumps(rng_state(trainer.pm.rng))
        return [json.loads(text) for text in peers.gathered_texts(mine, peers.host_group())]

    def _due(self, step: int) -> bool:
        """Every K-th step; under "auto" the first step, then K steps after the last snapshot."""
        if self.snapshot_every is None:
            return False
        if self.snapshot_every != "auto":
            return step % self._every == 0
        return self._last is None or step - self._last >= self._every

