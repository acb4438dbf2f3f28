"""Replicas keep training: when an engine of a data-parallel replica dies, the survivors go on with
the same global batch while its replacement starts, so the run neither waits nor loses a step.

Only where every dp rank holds a whole copy and dp is the only parallel dimension (no ZeRO, offload,
tiers, experts, tp, pp or cp), the data is a `TokenDataset` or the user's indexable dataset read in
the engine's own process (`MapSource`: a lost rank's share is its rows of the global batch, read by
its stand-in; a stream, which rank 0 reads for everyone, or a DataLoader's workers, which read ahead
for their own rank, take the replacement's way). Logs go on: rank 0 passes the degraded rows to
TensorBoard and the loggers, or, where rank 0 was lost, the first survivor does until the
replacement takes over (the rows carry no per-rank memory figures, so nothing is gathered).
The notebook (`Faults.replace_dead_training_on`) leaves a degrade message on each survivor and breaks
their pending collectives; the Trainer's failed step comes here (`train_on`), which:
1. takes the message (none within `MESSAGE_WAIT_S`: the failure was no lost peer's, re-raised as
   before), joins the survivors' own gloo group (the notebook serves its store; a survivor that
   failed where no step runs, e.g. while coming back from an earlier loss, joins only to say no, and
   one that never comes costs `_JOIN_TIMEOUT_S`) and agrees with them on the last whole step, which
   every survivor's `Keeper` holds with every rank's random stream (gathered before each optimizer
   step). Else `error` is re-raised on all of them: the notebook replaces the engine as before;
2. goes back to it (data position, stream, no gradient: the optimizer has not stepped since);
3. trains whole steps: each lost rank's share is one survivor's extra micro-steps, drawn from the
   lost rank's own stream; each share's gradient is kept apart, scaled by 1/dp as DDP scales it, the
   shares added and summed over the survivors: the full world's mean gradient, from the same data
   and masks. The default loss of labelled rows divides by the labels of every share of the full
   world (counted on the survivors, summed over them), as a whole world does. Each step's row says
   "dp 3 of 4"; the Keeper's live state and streams (the lost ranks' as their stand-ins advanced
   them) stay current, so the replacement takes them; every collective of a step comes before its
   optimizer step, so a survivor lost too leaves the others a whole step;
4. leaves `fit` with `Rejoin` at the first step boundary after the notebook said the replacement is
   ready (all survivors agree on it), or before a step whose end saves or evaluates (those need the
   whole world). The notebook re-forms the world and runs the cell again; `recover` hands the
   replacement a survivor's state and its own stream, degraded steps included.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from colab_par.data import TokenDataset
from colab_par.data.sources import DataPlace, MapSource
from colab_par.training import recovery
from colab_par.training.checkpoint_files import rng_state, set_rng_state
from colab_par.training.loggers import RunLogs
from colab_par.training.resilience.rank_copy import loop_state
from colab_par.training.resilience.recover import replica_key

__all__ = ["Rejoin", "degradable", "train_on"]

MESSAGE_WAIT_S = 5.0  # a failed step waits this long for the notebook's degrade message
_JOIN_TIMEOUT_S = 30.0  # every survivor joins the survivors' group within this, or none trains on


class Rejoin(Exception):
    """The survivors stopped training degraded at a step boundary: the lost ranks' replacements
    join and the cell runs again (the notebook does both)."""


def degradable(trainer: Any) -> bool:
    """Whether `trainer` can train on without a lost dp replica (module docstring)."""
    from colab_par.parallel.experts import moe_layers

    pm, layout = trainer.pm, trainer.pm.layout
    world = dist.get_world_size() if dist.is_initialized() else 1
    return (trainer.checkpoints is not None and trainer.checkpoints.on_failure == "restart"
            and replica_key(pm) >= 0 and layout.dp > 1 and layout.dp == world
            and layout.tp == layout.pp == layout.cp == layout.ep == 1 and _shares_readable(trainer.data)
            and not moe_layers(pm.model_parts))


def _shares_readable(data: Any) -> bool:
    """Whether a survivor can read any dp rank's share of `data` itself (module docstring)."""
    return isinstance(data, TokenDataset) or (isinstance(data, MapSource) and data.reading is None)


def _share(data: Any, position: int, share: int, dp: int) -> tuple[Any, torch.Tensor | None]:
    """(dp rank `share`'s batch at `position`, its targets: None for the user's rows)."""
    if isinstance(data, TokenDataset):
        return data.batch(position, share, dp)
    return data.local_batch(position, DataPlace(share, dp, tuple(range(dp)))), None


class _Survivors:
    """The survivors' own gloo group (the broken world's stays as it is until the world re-forms)."""

    def __init__(self, message: dict[str, Any], rank: int):
        self.ranks, self.lost, self.full = list(message["survivors"]), list(message["lost"]), message["world"]
        self.index = self.ranks.index(rank)
        store = dist.PrefixStore("degraded", dist.TCPStore(message["host"], message["port"], is_master=False,
                                                           timeout=timedelta(seconds=_JOIN_TIMEOUT_S)))
        store.set(f"joined/{self.index}", "1")  # one that failed elsewhere never comes: wait for it briefly
        store.wait([f"joined/{i}" for i in range(len(self.ranks))], timedelta(seconds=_JOIN_TIMEOUT_S))
        self.group: Any = dist.ProcessGroupGloo(store, self.index, len(self.ranks),
                                                timedelta(seconds=message["timeout_s"]))

    def stand_ins(self, rank: int) -> list[int]:
        """The lost ranks whose shares `rank` takes (each lost rank one survivor, in turn)."""
        return [lost for i, lost in enumerate(self.lost) if self.ranks[i % len(self.ranks)] == rank]

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([tensor]).wait()
        return tensor

    def most(self, value: int) -> int:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        tensor = torch.tensor([value], dtype=torch.int64)
        self.group.allreduce([tensor], options).wait()
        return int(tensor)

    def texts(self, text: str) -> list[str]:
        """`text` from every survivor (padded UTF-8 bytes, nothing unpickled)."""
        mine = text.encode()
        size = self.most(len(mine))
        padded = torch.zeros(size + 8, dtype=torch.uint8)
        padded[:8] = torch.tensor([len(mine)], dtype=torch.int64).view(torch.uint8)
        padded[8:8 + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else padded[:0]
        everyone = [torch.empty_like(padded) for _ in self.ranks]
        self.group.allgather([everyone], [padded]).wait()
        return [bytes(row[8:8 + int(row[:8].view(torch.int64))].numpy()).decode() for row in everyone]


def train_on(trainer: Any, error: BaseException, stop_at: int, sinks: Any) -> NoReturn:
    """`trainer`'s step (or its save, evaluation) failed with `error`: train on degraded if a dp peer
    was lost (module docstring), ending in `Rejoin`; else raise `error`. Call from the except block.
    `sinks` None: the fit had not begun (its recovery failed); this rank joins the survivors only to
    say it holds no whole step, so none of them waits for it."""
    keeper = trainer._keeper
    if keeper is None or not degradable(trainer) or not isinstance(error, RuntimeError):
        raise error
    message = recovery.take_degrade_request(MESSAGE_WAIT_S)
    if message is None or trainer.rank not in message["survivors"]:
        raise error
    try:
        survivors = _Survivors(message, trainer.rank)
    except RuntimeError:  # a survivor did not join within _JOIN_TIMEOUT_S: none trains on
        raise error from None
    stand_in = None
    try:
        streams = _agreed_streams(trainer, keeper.kept, survivors, willing=sinks is not None)
        if streams is None:
            raise error  # no whole step every survivor holds with every stream: the replicas' way back
        _go_back(trainer, keeper.kept)
        stand_in = _stand_in_logs(trainer, survivors)
        first = trainer.step + 1
        record = {"steps": None, "dp": len(survivors.ranks), "of": survivors.full}
        recovery.record_degraded(record)
        while trainer.step < stop_at and not survivors.most(int(recovery.rejoin_requested())):
            if _needs_everyone(trainer, trainer.step + 1, stop_at):
                break
            row = _degraded_step(trainer, survivors, streams)
            recovery.record_degraded({**record, "steps": [first, trainer.step]})  # told even if a later step fails
            sinks.after_step(row, False)
            if stand_in is not None:
                stand_in.pass_on(trainer.history)
        trained = f"trained steps {first}..{trainer.step}" if trainer.step >= first else "trained no step"
        raise Rejoin(f"rank {trainer.rank} {trained} at dp {len(survivors.ranks)} of {survivors.full} while rank(s) "
                     f"{', '.join(map(str, survivors.lost))} were replaced; the cell runs again with them")
    finally:
        survivors.group = None  # its connections close: nothing waits on them any more
        if stand_in is not None:
            stand_in.end(trainer.history, close=True)


def _stand_in_logs(trainer: Any, survivors: _Survivors) -> RunLogs | None:
    """Rank 0's TensorBoard and loggers, opened on the first survivor where rank 0 was lost (its
    rows up to the last whole step are in the files: each was flushed as written), None elsewhere."""
    if 0 not in survivors.lost or trainer.rank != survivors.ranks[0]:
        return None
    logs = RunLogs.build(trainer.logs.tensorboard, trainer.logs.loggers, 0)
    if logs is not None:
        logs.open(trainer.history, trainer.step)
    return logs


def _agreed_streams(trainer: Any, kept: Any, survivors: _Survivors, willing: bool) -> list[dict] | None:
    """Every rank's stream at the last whole step, when every survivor is `willing` and holds that
    same step with every stream (`Keeper.step_done` gathered them); else None (on all alike)."""
    loop = kept.live_loop if kept.live is trainer else None
    streams = loop.get("streams") if loop is not None else None
    whole = willing and streams is not None and len(streams) == survivors.full
    said = [json.loads(text) for text in survivors.texts(json.dumps([kept.live_step if whole else -1]))]
    if not whole or any(row != said[0] for row in said):
        return None
    return list(streams)


def _go_back(trainer: Any, kept: Any) -> None:
    """Back to the last whole step: the data position, the stream and the rows it had then; no
    gradient (the failed step's backward may have begun; the optimizer has not stepped since)."""
    loop = kept.live_loop
    trainer.load_state_dict(loop["trainer"])
    trainer.history = trainer.history[:loop["history"]]
    set_rng_state(trainer.pm.rng, loop["rng"])
    trainer.pm.optimizer.zero_grad(set_to_none=True)


def _needs_everyone(trainer: Any, step: int, stop_at: int) -> bool:
    """Whether `step`'s end saves a checkpoint or evaluates: the whole world does those."""
    saves, evaluation = trainer.checkpoints.every, trainer.evaluation
    return bool((saves and step % saves == 0) or step == stop_at
                or (evaluation is not None and evaluation.every and (step % evaluation.every == 0
                                                                     or step == trainer.steps)))


def _degraded_step(trainer: Any, survivors: _Survivors, streams: list[dict]) -> dict | None:
    """One whole optimizer step of the full world's global batch on the survivors (module docstring)."""
    pm, began, kept = trainer.pm, time.perf_counter(), trainer._keeper.kept
    shares = [trainer.rank, *survivors.stand_ins(trainer.rank)]  # dp ranks: dp is the only dimension
    streams[trainer.rank] = rng_state(pm.rng)
    params = [p for part in pm.model_parts for p in part.parameters() if p.requires_grad]
    grads: dict[int, list[torch.Tensor | None]] = {share: [None] * len(params) for share in shares}
    losses = []
    for _ in range(trainer.grad_accum):
        total = torch.zeros((), dtype=torch.float64, device=pm.device)
        batches = {share: _share(trainer.data, trainer.data_position, share, survivors.full) for share in shares}
        labels = _labels_total(pm, [batch for batch, targets in batches.values() if targets is None], survivors)
        for share in shares:  # each share's gradient apart, accumulated as its own rank would
            set_rng_state(pm.rng, streams[share])
            for param, grad in zip(params, grads[share]):
                param.grad = grad
            total += pm.forward_backward_share(*batches[share], 1.0 / trainer.grad_accum, labels)
            grads[share], streams[share] = [param.grad for param in params], rng_state(pm.rng)
        trainer.data_position += 1
        losses.append(total)
    set_rng_state(pm.rng, streams[trainer.rank])
    _sum_gradients(params, grads, survivors)
    lr = trainer._apply_lr()
    grad_norm = _clip(params, trainer.grad_clip) if trainer.grad_clip is not None else None
    logged = trainer._live.logged(trainer.step + 1, trainer.steps)
    summed = survivors.sum_(torch.stack(losses)).div_(survivors.full).tolist() if logged else []
    mine = {str(share): streams[share] for share in shares}  # final for this step (as `Keeper.step_begins`)
    for text in survivors.texts(json.dumps(mine)):
        for share, stream in json.loads(text).items():
            streams[int(share)] = stream
    kept.live = None  # in flux until the step's row
    pm.optimizer_step()
    trainer.step += 1
    row = None
    if logged:  # no collective after the optimizer step: a survivor lost now leaves this step whole here
        row = {"step": trainer.step, "rank": trainer.rank, "loss": sum(summed) / len(summed), "lr": lr,
               "grad_norm": grad_norm, "step_time": time.perf_counter() - began,
               "degraded": f"dp {len(survivors.ranks)} of {survivors.full}"}
        trainer.history.append(row)
    kept.live, kept.live_loop = trainer, {**loop_state(pm, trainer), "streams": list(streams)}  # whole, with its row
    return row


def _labels_total(pm: Any, batches: list[Any], survivors: _Survivors) -> torch.Tensor | None:
    """The labels the default loss counts in every share of the full world (`batches`: this
    survivor's shares of the user's rows), or None where it counts none (the same on every survivor:
    one loss, one kind of batch)."""
    counts = [pm.share_labels(batch) for batch in batches]
    if not counts or counts[0] is None:
        return None
    return survivors.sum_(torch.stack(counts).sum().cpu()).to(pm.device)


def _sum_gradients(params: list[torch.Tensor], grads: dict[int, list[torch.Tensor | None]],
                   survivors: _Survivors) -> None:
    """Each parameter's gradient: its shares' gradients times 1/dp (as DDP scales a rank's before
    adding), added, then summed over the survivors in one flat all-reduce."""
    scale, mine = 1.0 / survivors.full, []
    for i, param in enumerate(params):
        pieces = [share[i] for share in grads.values() if share[i] is not None]
        param.grad = None
        if pieces:
            param.grad = pieces[0].mul(scale)
            for piece in pieces[1:]:
                param.grad.add_(piece.mul(scale))
            mine.append(param.grad)
    if mine:
        flat = survivors.sum_(torch.cat([grad.reshape(-1) for grad in mine]))
        offset = 0
        for grad in mine:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _clip(params: list[torch.Tensor], max_norm: float) -> float:
    """The gradients' 2-norm (every survivor holds them whole), clipped to `max_norm`."""
    grads = [param.grad for param in params if param.grad is not None]
    total = float(torch.nn.utils.get_total_norm(grads).double())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return total
