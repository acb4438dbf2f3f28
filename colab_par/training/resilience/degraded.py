"""Replicas keep training: when an engine of a data-parallel replica dies, the whole replicas go on
with the same global batch while its replacement starts, so the run neither waits nor loses a step.

Where every dp replica holds a whole copy (no ZeRO, offload, tiers or experts; tp 1d; pp and cp
in any measure; a replica of more than one rank only in a gloo world: its groups get a fresh gloo
backend, which an nccl world's GPU tensors would not reach) and the data is a `TokenDataset` or
any of the user's (`data.sources`). A lost replica's share is its rows of the global batch, read
by its stand-in: from an indexable dataset through DataLoader workers of its own where the user's
loader has workers; from a stream, which rank 0 reads for every rank in a whole world, by every
trainer for itself, from the place in the stream every rank holds (rank 0 sends it with the
shares). A replica is the ranks of one dp index, each at its place (pp, cp, tp); one with a lost
rank is broken, and its live ranks wait with the notebook while the whole replicas train (under dp
alone every survivor is a whole replica). Logs go on: rank 0 passes the degraded rows to
TensorBoard and the loggers, or, where rank 0 does not train, the first rank that does, until the
cell runs again (the rows carry no per-rank memory figures, so nothing is gathered).
The notebook (`Faults.replace_dead_training_on`) leaves a degrade message on each survivor and breaks
their pending collectives (every gloo connection, the replicas' own groups' too); the Trainer's
failed step comes here (`train_on`), which:
1. takes the message (none within `MESSAGE_WAIT_S`: the failure was no lost peer's, re-raised as
   before), joins the survivors' own gloo group (the notebook serves its store; a survivor that
   failed where no step runs, e.g. while coming back from an earlier loss, joins only to say no, and
   one that never comes costs `_JOIN_TIMEOUT_S`) and agrees with them on the last whole step, which
   every survivor's `Keeper` holds with every rank's random stream (gathered before each optimizer
   step). Else `error` is re-raised on all of them: the notebook replaces the engine as before. The
   ranks of broken replicas re-raise it here too, and wait;
2. the whole replicas' ranks form their groups over the same store: all of them (to agree when to
   stop, sum losses and write checkpoints: registered as torch's own groups are, for DCP), and the
   ranks that hold the same parameters (one pp and tp place, every replica and cp place: to sum
   gradients and label counts); each replica's own tp, pp and cp groups
   get a fresh backend in place (`compat.rebind_group`), so DTensor's collectives, the pipeline
   stages and ring attention, which hold the group objects, run on them; then each goes back to the
   last whole step (data position, stream, no gradient: the optimizer has not stepped since);
3. trains whole steps: each lost replica's share is one whole replica's extra micro-steps, each of
   its ranks drawing from the stream of the lost replica's rank at its own place; each share's
   gradient is kept apart, scaled by 1/(dp·cp) as the world's average scales it, the shares added
   and summed over the ranks holding the same parameters (tied pipeline copies then summed over
   the stages): the full world's mean gradient, from the same data and masks. The default loss of
   labelled rows divides by the labels of every share of the full world (counted on the replicas,
   summed over them), as a whole world does. Each step's row says "dp 3 of 4"; the Keeper's live
   state and streams (every rank's of the broken replicas as their stand-ins advanced them) stay
   current, so the replacement and its waiting replica take them; every collective of a step comes
   before its optimizer step, so a rank lost too leaves the others a whole step. Held-out data is
   evaluated when due as the world would, each trainer scoring its shares of every batch and the
   sums added over all trainers (also at the last whole step, where the peer was lost while the
   world evaluated it). A checkpoint due is written by the trainers as the whole world's (`_save`);
4. leaves `fit` with `Rejoin` at the first step boundary after the notebook said the replacement is
   ready (all trainers agree on it), or at the fit's last step; a failure on the way (a save, a
   second lost rank) is left in the record the notebook reads, which names it, and the cell takes
   the replacement's way all the same. The notebook re-forms the world and runs the cell again;
   `recover` hands each rank of a broken replica its place's state from a whole replica, and its
   own stream, degraded steps included.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from dataclasses import replace
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from colab_par import compat
from colab_par.data import TokenDataset
from colab_par.data.sources import DataPlace, IterableSource, MapSource
from colab_par.parallel.grad_norm import total_gradient_norm
from colab_par.parallel.inference.evaluation import evaluate_shares
from colab_par.training import recovery
from colab_par.training.checkpoint import CheckpointError, commit, stage
from colab_par.training.checkpoint_background import wait_for_saves
from colab_par.training.checkpoint_files import rng_state, set_rng_state
from colab_par.training.loggers import RunLogs
from colab_par.training.resilience.rank_copy import local_piece, loop_state
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
    replica = layout.pp * layout.cp * layout.tp
    return (trainer.checkpoints is not None and trainer.checkpoints.on_failure == "restart"
            and replica_key(pm) >= 0 and layout.dp > 1 and layout.dp * replica == world
            and (replica == 1 or "nccl" not in dist.get_backend())
            and layout.ep == 1 and _shares_readable(trainer.data) and not moe_layers(pm.model_parts))


def _shares_readable(data: Any) -> bool:
    """Whether a survivor can read any dp rank's share of `data` itself (module docstring)."""
    return isinstance(data, (TokenDataset, MapSource, IterableSource))


def _batches(data: Any, position: int, shares: list[int], place: DataPlace) -> dict[int, tuple[Any, Any]]:
    """{dp rank: (its batch at `position`, its targets: None for the user's rows)} for `shares`."""
    if isinstance(data, TokenDataset):
        return {share: data.batch(position, share, place.dp_size) for share in shares}
    if isinstance(data, IterableSource):
        every = data.shares_read_here(position, place.dp_size)
        return {share: (every[share], None) for share in shares}
    return {share: (data.local_batch(position, replace(place, dp_rank=share)), None) for share in shares}


_PLACE_DIMS = ("pp", "cp", "tp")  # a rank's place in its replica, outermost first (as `replica_key`)


def _replicas(pm: Any) -> list[list[int]]:
    """The world's ranks as [dp replica][place: pp, cp, tp]."""
    names = pm.mesh.mesh_dim_names
    order = [names.index(name) for name in ("dp", *_PLACE_DIMS)]
    return pm.mesh.mesh.permute(*order).reshape(pm.layout.dp, -1).tolist()


class _Survivors:
    """The survivors' own gloo groups (the broken world's stay as they are until the world
    re-forms): `everyone` alive, then, once they agreed to train on, the whole replicas' (`train`)."""

    def __init__(self, message: dict[str, Any], rank: int, replicas: list[list[int]]):
        self.ranks, self.lost, self.replicas = list(message["survivors"]), list(message["lost"]), replicas
        self.full, self.world = len(replicas), message["world"]  # dp and ranks of the whole world
        broken = {index for index, members in enumerate(replicas) if set(members) & set(self.lost)}
        self.whole = [index for index in range(self.full) if index not in broken]
        self.broken = sorted(broken)
        self.trainers = [member for index in self.whole for member in replicas[index]]
        self.rank, self.message = rank, message
        self.store = dist.PrefixStore("degraded", dist.TCPStore(message["host"], message["port"], is_master=False,
                                                                timeout=timedelta(seconds=_JOIN_TIMEOUT_S)))
        index = self.ranks.index(rank)
        self.store.set(f"joined/{index}", "1")  # one that failed elsewhere never comes: wait for it briefly
        self.store.wait([f"joined/{i}" for i in range(len(self.ranks))], timedelta(seconds=_JOIN_TIMEOUT_S))
        self.timeout = timedelta(seconds=message["timeout_s"])  # of every survivors' group
        self.everyone: Any = self._group("everyone", index, len(self.ranks))
        self.team: Any = None  # the whole replicas' ranks, all of them (registered: checkpoints use it too)
        self.peers: Any = None  # the whole replicas' ranks at this rank's pp and tp place, any cp place

    def _group(self, name: str, rank: int, size: int) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore(name, self.store), rank, size, self.timeout)

    def train(self, pm: Any) -> None:
        """This rank (of a whole replica) joins the trainers' groups (module docstring, 2)."""
        replica = next(index for index in self.whole if self.rank in self.replicas[index])
        self.place = self.replicas[replica].index(self.rank)
        self.shares = [replica, *(lost for i, lost in enumerate(self.broken)
                                  if self.whole[i % len(self.whole)] == replica)]
        self.team = compat.registered_gloo_group(dist.PrefixStore("team", self.store), self.trainers,
                                                 f"colab_par-trainers-{self.message['port']}", self.timeout)
        cp, tp = pm.layout.cp, pm.layout.tp
        kin = (self.place // (cp * tp), self.place % tp)  # (pp, tp) place: its ranks hold the same parameters
        peers = [self.replicas[index][place] for index in self.whole for place in range(len(self.replicas[index]))
                 if (place // (cp * tp), place % tp) == kin]
        self.peers = self._group(f"peers{kin}", peers.index(self.rank), len(peers))
        for dim in _PLACE_DIMS:
            if pm.mesh[dim].size() > 1:
                group = pm.mesh[dim].get_group()
                ranks = dist.get_process_group_ranks(group)
                compat.rebind_group(group, dist.PrefixStore(f"{dim}{ranks}", self.store), self.timeout)

    def rank_of(self, share: int) -> int:
        """The rank at this rank's place in dp replica `share`."""
        return self.replicas[share][self.place]

    def close(self) -> None:
        self.everyone = self.team = self.peers = None  # their connections close (rebound groups: with the world)


def _sum(group: Any, tensor: torch.Tensor) -> torch.Tensor:
    group.allreduce([tensor]).wait()
    return tensor


def _most(group: Any, value: int) -> int:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    tensor = torch.tensor([value], dtype=torch.int64)
    group.allreduce([tensor], options).wait()
    return int(tensor)


def _texts(group: Any, text: str) -> list[str]:
    """`text` from every rank of `group` (padded UTF-8 bytes, nothing unpickled)."""
    mine = text.encode()
    size = _most(group, len(mine))
    padded = torch.zeros(size + 8, dtype=torch.uint8)
    padded[:8] = torch.tensor([len(mine)], dtype=torch.int64).view(torch.uint8)
    padded[8:8 + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else padded[:0]
    everyone = [torch.empty_like(padded) for _ in range(group.size())]
    group.allgather([everyone], [padded]).wait()
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
        survivors = _Survivors(message, trainer.rank, _replicas(trainer.pm))
    except RuntimeError:  # a survivor did not join within _JOIN_TIMEOUT_S: none trains on
        raise error from None
    stand_in = None
    try:
        streams = _agreed_streams(trainer, keeper.kept, survivors, willing=sinks is not None)
        if streams is None or trainer.rank not in survivors.trainers:
            raise error  # no whole step every survivor holds with every stream, or a broken replica: wait
        survivors.train(trainer.pm)
        _go_back(trainer, keeper.kept)
        stand_in = _stand_in_logs(trainer, survivors)
        first, dp = trainer.step + 1, f"dp {len(survivors.whole)} of {survivors.full}"
        record = {"steps": None, "dp": len(survivors.whole), "of": survivors.full, "ranks": survivors.trainers}
        recovery.record_degraded(record)
        if _evaluation_missed(trainer):  # the peer was lost while the world evaluated
            _evaluate(trainer, survivors)
            sinks.refresh()
        try:
            while trainer.step < stop_at and not _most(survivors.team, int(recovery.rejoin_requested())):
                row = _degraded_step(trainer, survivors, streams, dp)
                record["steps"] = [first, trainer.step]
                recovery.record_degraded(dict(record))  # told even if a later step fails
                evaluated = trainer._eval_due()
                if evaluated:
                    _evaluate(trainer, survivors)
                if trainer._save_due(stop_at):
                    _save(trainer, survivors, streams)
                sinks.after_step(row, False)
                if evaluated:
                    sinks.refresh()
                if stand_in is not None:
                    stand_in.pass_on(trainer.history)
        except Exception as failure:  # the notebook says why they stopped (the replacement takes over)
            said = f"{type(failure).__name__}: {failure}".splitlines()[0][:300]
            recovery.record_degraded({**record, "stopped": said})
            raise
        trained = f"trained steps {first}..{trainer.step}" if trainer.step >= first else "trained no step"
        raise Rejoin(f"rank {trainer.rank} {trained} at {dp} while rank(s) {', '.join(map(str, survivors.lost))} "
                     "were replaced; the cell runs again with them")
    finally:
        survivors.close()  # nothing waits on its groups any more
        if stand_in is not None:
            stand_in.end(trainer.history)


class _StandInLogs:
    """Rank 0's TensorBoard and loggers, on the first trainer where rank 0 does not train (its rows
    up to the last whole step are in the files: each was flushed as written). Opened at the first
    degraded row, so a writer that waits for a fresh second (`TensorBoardLogger`) never holds up
    the first step."""

    def __init__(self, trainer: Any):
        self.logs = RunLogs.build(trainer.logs.tensorboard, trainer.logs.loggers, 0)
        self.whole, self.step, self.opened = len(trainer.history), trainer.step, False

    def pass_on(self, history: list[dict]) -> None:
        if self.logs is not None and not self.opened:
            self.logs.open(history[:self.whole], self.step)
            self.opened = True
        if self.opened:
            self.logs.pass_on(history)

    def end(self, history: list[dict]) -> None:
        if self.opened:
            self.logs.end(history, close=True)


def _stand_in_logs(trainer: Any, survivors: _Survivors) -> _StandInLogs | None:
    """`_StandInLogs` on the first trainer where rank 0 does not train, None elsewhere."""
    if 0 in survivors.trainers or trainer.rank != survivors.trainers[0]:
        return None
    return _StandInLogs(trainer)


def _agreed_streams(trainer: Any, kept: Any, survivors: _Survivors, willing: bool) -> list[dict] | None:
    """Every rank's stream at the last whole step, when every survivor is `willing` and holds that
    same step with every stream (`Keeper.step_done` gathered them), and a whole replica is left;
    else None (on all alike)."""
    loop = kept.live_loop if kept.live is trainer else None
    streams = loop.get("streams") if loop is not None else None
    whole = willing and streams is not None and len(streams) == survivors.world
    said = [json.loads(text) for text in _texts(survivors.everyone, json.dumps([kept.live_step if whole else -1]))]
    if not whole or not survivors.whole or any(row != said[0] for row in said):
        return None
    return list(streams)


def _go_back(trainer: Any, kept: Any) -> None:
    """Back to the last whole step: the data position, the stream and the rows it had then; no
    gradient (the failed step's backward may have begun; the optimizer has not stepped since), and
    nothing of that step's half-done backward or pipeline schedule (`_forget_interrupted_step`)."""
    loop = kept.live_loop
    trainer.load_state_dict(loop["trainer"])
    trainer.history = trainer.history[:loop["history"]]
    set_rng_state(trainer.pm.rng, loop["rng"])
    _forget_interrupted_step(trainer.pm)


def _forget_interrupted_step(pm: Any) -> None:
    """Make the next step start clean after one the lost peer broke half-way (no gradient is
    kept): DDP's reducer then expected the rest of that backward, and torch's pipeline schedule
    kept the losses of the microbatches it had run."""
    for part in pm.model_parts:
        if isinstance(part, DistributedDataParallel):
            compat.reset_ddp_reducer(part)
    if pm._runner is not None:
        pm._runner.start_afresh()
    pm.optimizer.zero_grad(set_to_none=True)


def _save(trainer: Any, survivors: _Survivors, streams: list[dict]) -> None:
    """The Trainer's checkpoint, as the whole world would write it: the whole replicas' ranks hold
    every tensor (DCP over their group writes each once), the first of them the world's files, and
    each also the files of the ranks it stands in for (their random streams, their rows). Written
    synchronously, also where the Trainer saves asynchronously: a background write needs its own
    group, which the re-formed world gives. A save the lost engine took part in cannot commit any
    more: its failure is printed, as on the way back, and this one replaces it."""
    try:
        wait_for_saves()
    except CheckpointError as error:
        print(f"colab_par: {error}")
    staged = stage(trainer.pm, trainer.ckpt_dir, trainer=trainer, group=survivors.team)
    for share in survivors.shares[1:]:
        rank = survivors.rank_of(share)
        staged.files[f"rng-rank{rank}.json"] = streams[rank]
        staged.files[f"history-rank{rank}.json"] = [{**row, "rank": rank} for row in trainer.history]
    commit(staged, survivors.team)


def _evaluation_missed(trainer: Any) -> bool:
    """Whether the last whole step's evaluation was due but its row is not in the history."""
    return trainer.step > 0 and trainer._eval_due() and not any(
        row.get("kind") == "eval" and row["step"] == trainer.step for row in trainer.history)


def _evaluate(trainer: Any, survivors: _Survivors) -> None:
    """The Trainer's evaluation row, each trainer scoring its shares of every held-out batch (the
    lost replica's with its own), summed over all trainers: the whole world's result."""
    trainer.evaluate_by(lambda: evaluate_shares(trainer.pm, trainer.eval_data, trainer.evaluation.batches,
                                                survivors.shares, lambda totals: _sum(survivors.team, totals)))


def _degraded_step(trainer: Any, survivors: _Survivors, streams: list[dict], dp: str) -> dict | None:
    """One whole optimizer step of the full world's global batch on the whole replicas (module
    docstring, 3)."""
    pm, began, kept = trainer.pm, time.perf_counter(), trainer._keeper.kept
    place = DataPlace.of(pm)
    streams[trainer.rank] = rng_state(pm.rng)
    params = [p for part in pm.model_parts for p in part.parameters() if p.requires_grad]
    grads: dict[int, list[torch.Tensor | None]] = {share: [None] * len(params) for share in survivors.shares}
    losses = []
    for _ in range(trainer.grad_accum):
        total = torch.zeros((), dtype=torch.float64, device=pm.device)
        batches = _batches(trainer.data, trainer.data_position, survivors.shares, place)
        labels = _labels_total(pm, [batch for batch, targets in batches.values() if targets is None], survivors)
        for share in survivors.shares:  # each share's gradient apart, accumulated as its own ranks would
            set_rng_state(pm.rng, streams[survivors.rank_of(share)])
            for param, grad in zip(params, grads[share]):
                param.grad = grad
            total += pm.forward_backward_share(*batches[share], 1.0 / trainer.grad_accum, labels)
            grads[share], streams[survivors.rank_of(share)] = [param.grad for param in params], rng_state(pm.rng)
        trainer.data_position += 1
        losses.append(total)
    set_rng_state(pm.rng, streams[trainer.rank])
    _sum_gradients(params, grads, survivors, 1.0 / (survivors.full * pm.layout.cp))
    if pm._runner is not None:
        pm._runner.sync_tied_gradients()  # over the replica's rebound pp group
    lr = trainer._apply_lr()
    grad_norm = _clip(pm, params, trainer.grad_clip) if trainer.grad_clip is not None else None
    logged = trainer._live.logged(trainer.step + 1, trainer.steps)
    summed = _sum(survivors.team, torch.stack(losses)).div_(survivors.world).tolist() if logged else []
    mine = {str(survivors.rank_of(share)): streams[survivors.rank_of(share)] for share in survivors.shares}
    for text in _texts(survivors.team, json.dumps(mine)):  # final for this step (as `Keeper.step_begins`)
        for rank, stream in json.loads(text).items():
            streams[int(rank)] = stream
    kept.live = None  # in flux until the step's row
    pm.optimizer_step()
    trainer.step += 1
    row = None
    if logged:  # no collective after the optimizer step: a rank lost now leaves this step whole here
        row = {"step": trainer.step, "rank": trainer.rank, "loss": sum(summed) / len(summed), "lr": lr,
               "grad_norm": grad_norm, "step_time": time.perf_counter() - began, "degraded": dp}
        trainer.history.append(row)
    kept.live, kept.live_loop = trainer, {**loop_state(pm, trainer), "streams": list(streams)}  # whole, with its row
    return row


def _labels_total(pm: Any, batches: list[Any], survivors: _Survivors) -> torch.Tensor | None:
    """The labels the default loss counts in every share of the full world (`batches`: this
    replica's shares of the user's rows), or None where it counts none (the same on every trainer:
    one loss, one kind of batch)."""
    counts = [pm.share_labels(batch) for batch in batches]
    if not counts or counts[0] is None:
        return None
    return _sum(survivors.peers, torch.stack(counts).sum().cpu()).to(pm.device)


def _sum_gradients(params: list[torch.Tensor], grads: dict[int, list[torch.Tensor | None]],
                   survivors: _Survivors, scale: float) -> None:
    """Each parameter's gradient: its shares' gradients times `scale` (1/(dp·cp), as the whole
    world's gradient average scales a rank's), added, then summed over `survivors.peers` (the whole
    replicas' ranks that hold the same parameters) in one flat all-reduce of the local pieces."""
    mine = []
    for i, param in enumerate(params):
        pieces = [share[i] for share in grads.values() if share[i] is not None]
        param.grad = None
        if pieces:
            param.grad = pieces[0].mul(scale)
            for piece in pieces[1:]:
                param.grad.add_(piece.mul(scale))
            mine.append(local_piece(param.grad))
    if mine:
        flat = _sum(survivors.peers, torch.cat([grad.reshape(-1) for grad in mine]))
        offset = 0
        for grad in mine:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _clip(pm: Any, params: list[torch.Tensor], max_norm: float) -> float:
    """The gradients' 2-norm (every peer holds the same pieces; tp pieces and pipeline stages add
    over the replica's rebound groups, a tied tensor counted once), clipped to `max_norm`."""
    copies = pm._runner.duplicate_copies() if pm._runner is not None else set()
    grads = [(param, param.grad) for param in params if param.grad is not None]
    counted = [(param, grad) for param, grad in grads if id(param) not in copies]
    total = float(total_gradient_norm(counted, {}, pm.device, pm.mesh["pp"].get_group() if pm.layout.pp > 1 else None))
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for _, grad in grads:
            grad.mul_(scale)
    return total
