"""The training cell the resilience tests run on real engines, with kills injected where a test says.

A kills file holds the kills still to come, in order: [rank, where, step] with `where` one of
"forward" (in the step's forward: mid-step), "optimizer" (before the optimizer step: after the
gradients were reduced), "snapshot" (while the in-memory snapshot's bytes are in flight) and
"async save" (in the background write of an asynchronous save). The rank that meets the first one
removes it and SIGKILLs itself (at that step, or later where the run went past it while that rank
was dead: the others train on without a lost dp replica). Rank 0 writes every logged step's loss
to a file, the steps its rows say ran degraded (`degraded_steps`), the final parameters
(`final_parameters`), and each engine that runs the cell its pid. For benchmarks/resilience.py the
cell also writes when the kill came (`.killed_at`), the first degraded forward (`.degraded_at`) and
the first forward of the cell run again after it (`.again_at`)."""
from __future__ import annotations

import json
from pathlib import Path

CELL = r'''
import json, os, signal, time
import torch
import colab_par
import colab_par.training.checkpoint_async as checkpoint_async
import colab_par.training.recovery as recovery
import colab_par.training.resilience.peers as peers
from colab_par.data import SyntheticDataset
from colab_par.models import GPT
from colab_par.training.options import Checkpoints, Evaluation, Logs

with open(CKPT + ".pids", "a") as handle:
    handle.write(f"{os.getpid()}\n")

def die_if(where, step):
    pending = json.loads(open(KILLS).read())
    if pending and pending[0][:2] == [rank, where] and step >= pending[0][2]:
        with open(KILLS + ".next", "w") as handle:
            handle.write(json.dumps(pending[1:]))
        os.replace(KILLS + ".next", KILLS)
        with open(f"{CKPT}.killed_at.{rank}", "w") as handle:  # whole when another rank reads it
            handle.write(repr(time.time()))
        os.replace(f"{CKPT}.killed_at.{rank}", CKPT + ".killed_at")
        os.kill(os.getpid(), signal.SIGKILL)

cell_began = time.time()
def first_forward_after_a_kill(*_):  # when training runs again (benchmarks/resilience.py)
    killed_at = CKPT + ".killed_at"
    if os.path.exists(killed_at) and float(open(killed_at).read()) < cell_began and not os.path.exists(CKPT + ".again_at"):
        with open(CKPT + ".again_at", "w") as handle:
            handle.write(repr(time.time()))

def first_degraded_forward(*_):  # when the survivors train on without the lost rank (benchmarks/resilience.py)
    if recovery.degraded_record() is not None and not os.path.exists(CKPT + ".degraded_at"):
        with open(CKPT + ".degraded_at", "w") as handle:
            handle.write(repr(time.time()))

swap = getattr(peers, "undying_swap", peers._swap)  # the cell may run several times
peers.undying_swap = swap
def swap_that_may_die(outgoing, to, incoming, source, group, tag):
    if tag == 73:  # the snapshot's bytes
        die_if("snapshot", trainer.step)
    return swap(outgoing, to, incoming, source, group, tag)
peers._swap = swap_that_may_die

commit = getattr(checkpoint_async, "undying_commit", checkpoint_async.commit)
checkpoint_async.undying_commit = commit
def commit_that_may_die(staged, group):
    die_if("async save", staged.step)
    return commit(staged, group)
checkpoint_async.commit = commit_that_may_die

if SEED is not None:  # the model's initial weights, else the engines' seeded streams as they stand
    torch.manual_seed(SEED)
model = GPT(config)
model.layers["0"].register_forward_pre_hook(lambda *_: die_if("forward", trainer.step + 1))
calls_in_step = {}
def slow_if_asked(where):  # SLOW = (rank, step, "forward" or "backward", n): the n-th such call waits
    if SLOW is not None and (rank, trainer.step + 1, where) == tuple(SLOW[:3]) and recovery.degraded_record() is None:
        calls_in_step[where] = calls_in_step.get(where, 0) + 1
        if calls_in_step[where] == SLOW[3]:
            recovery._ARRIVED.wait(5.0)  # for the notebook's degrade request (a peer was lost)
model.layers["0"].register_forward_pre_hook(lambda *_: slow_if_asked("forward"))
model.layers["0"].register_full_backward_pre_hook(lambda *_: slow_if_asked("backward"))
def hold_if_asked(*_):  # HOLD: a degraded step from this one on waits for the replacement to be ready
    if HOLD is not None and trainer.step + 1 >= HOLD and recovery.degraded_record() is not None:
        deadline = time.monotonic() + 60
        while not recovery.rejoin_requested() and time.monotonic() < deadline:
            time.sleep(0.01)
model.layers["0"].register_forward_pre_hook(hold_if_asked)
model.register_forward_pre_hook(first_forward_after_a_kill)
model.register_forward_pre_hook(first_degraded_forward)
pm = colab_par.parallelize(model, LAYOUT)
pm.optimizer.register_step_pre_hook(lambda *_: die_if("optimizer", trainer.step + 1))

class Rows(torch.utils.data.Dataset):
    """Learnable rows of the user's own kind: each token 3 past the one before; the first 1-7
    labels of a row (its prompt) are not scored, so the dp shares hold different label counts."""
    def __len__(self):
        return 96
    def __getitem__(self, i):
        start = int(torch.randint(config.vocab_size, (1,), generator=torch.Generator().manual_seed(i)))
        tokens = (start + 3 * torch.arange(config.seq_len + 1)) % config.vocab_size
        labels = tokens[1:].clone()
        labels[:1 + i % 7] = -100
        return {"tokens": tokens[:-1], "labels": labels}

class Stream(torch.utils.data.IterableDataset):
    """The same rows as a stream, which rank 0 reads for every rank."""
    def __iter__(self):
        rows = Rows()
        return (rows[i] for i in range(len(rows)))

data = {"tokens": lambda: SyntheticDataset(vocab_size=config.vocab_size, seq_len=config.seq_len, batch_size=BATCH),
        "rows": Rows, "stream": Stream,
        "loader": lambda: torch.utils.data.DataLoader(Rows(), batch_size=BATCH, shuffle=True, num_workers=1)}[DATA]()
held_out = SyntheticDataset(vocab_size=config.vocab_size, seq_len=config.seq_len, batch_size=BATCH, seed=1) \
    if DATA == "tokens" else torch.utils.data.Subset(Rows(), range(2 * BATCH))
evaluation = None if EVAL_EVERY is None else Evaluation(held_out, every=EVAL_EVERY, batches=2 if DATA == "tokens" else None)
trainer = colab_par.Trainer(pm, data, batch_size=BATCH if DATA in ("rows", "stream") else None, steps=STEPS,
                            evaluation=evaluation,
                            checkpoints=Checkpoints(CKPT, every=EVERY, on_failure="restart", max_restarts=MAX_RESTARTS,
                                                    asynchronous=ASYNC, snapshot_every=SNAPSHOT),
                            logs=Logs(telemetry=False, tensorboard=TENSORBOARD))
started = time.perf_counter()
trainer.fit()
seconds = time.perf_counter() - started
params = pm.full_state_dict()  # every rank takes part; rank 0 holds them
if rank == 0:
    with open(CKPT + ".losses", "w") as handle:
        handle.write(json.dumps([row["loss"] for row in trainer.history if row.get("kind") != "eval"]))
    with open(CKPT + ".evals", "w") as handle:
        handle.write(json.dumps([[row["step"], row["eval_loss"]] for row in trainer.history if row.get("kind") == "eval"]))
    with open(CKPT + ".degraded", "w") as handle:
        handle.write(json.dumps({row["step"]: row["degraded"] for row in trainer.history if "degraded" in row}))
    torch.save(params, CKPT + ".params.pt")
    with open(CKPT + ".seconds", "w") as handle:
        handle.write(repr(seconds))
'''


def run_cell(cluster, folder: Path, name: str, kills: list, *, layout: str, steps: int = 8, every: int = 4,
             snapshot_every=None, asynchronous: bool = False, batch: int = 4,
             max_restarts: int = 3, model=None, data: str = "tokens",
             tensorboard: Path | None = None, seed: int | None = None,
             evaluate_every: int | None = None, slow: tuple | None = None,
             hold_at: int | None = None) -> tuple[list[float], set[int]]:
    """(rank 0's loss at every step, the pid of every engine that ran the cell); the notebook's
    messages go to the test's capsys. `model`: a GPTConfig (default a 2-layer GPT of width 32);
    `data`: "tokens" (a SyntheticDataset), "rows" (the user's own labelled rows, a torch Dataset),
    "loader" (those rows through a shuffling DataLoader with a worker process) or "stream" (those
    rows as an IterableDataset);
    `tensorboard`: a folder for the Trainer's TensorBoard logs; `seed`: seeds the model's initial
    weights (else they come from the engines' streams: restart the cluster for equal runs);
    `evaluate_every`: the Trainer evaluates held-out data (2 global batches of the same kind) every
    so many steps (`evaluations`); `slow`: (rank, step, "forward" or "backward", n) that rank's n-th
    such call of its first layer in that step (its n-th microbatch's) waits for the notebook's
    degrade request (at most 5 s), so a peer lost meanwhile finds the others half-way through the
    step (a pipeline's microbatches, DDP's backward);
    `hold_at`: survivors training on without a lost rank wait in that step's forward (and any
    later one's) until the replacement is ready, so that step is their last (else they train on
    until it is ready, possibly to the end)."""
    from colab_par.models import GPTConfig

    kills_file, ckpt = folder / f"{name}.kills", folder / name
    kills_file.write_text(json.dumps(kills))
    config = model or GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
    cluster.execute(CELL, namespace=dict(config=config, CKPT=str(ckpt), KILLS=str(kills_file), LAYOUT=layout,
                                         STEPS=steps, EVERY=every, SNAPSHOT=snapshot_every, ASYNC=asynchronous,
                                         BATCH=batch, MAX_RESTARTS=max_restarts, DATA=data, SEED=seed,
                                         EVAL_EVERY=evaluate_every, SLOW=slow, HOLD=hold_at,
                                         TENSORBOARD=None if tensorboard is None else str(tensorboard)))
    assert json.loads(kills_file.read_text()) == [], "a kill was never reached"
    pids = {int(line) for line in Path(f"{ckpt}.pids").read_text().split()}
    return json.loads(Path(f"{ckpt}.losses").read_text()), pids


def degraded_steps(folder: Path, name: str) -> dict[int, str]:
    """{step: "dp 3 of 4"} for each of rank 0's rows that ran degraded, in the run `name`."""
    return {int(step): said for step, said in json.loads((folder / f"{name}.degraded").read_text()).items()}


def final_parameters(folder: Path, name: str) -> dict:
    """The run's final parameters (whole tensors, on the CPU)."""
    import torch

    return torch.load(folder / f"{name}.params.pt")


def evaluations(folder: Path, name: str) -> dict[int, float]:
    """{step: held-out loss} of rank 0's evaluation rows in the run `name` (a step evaluated twice
    fails)."""
    rows = json.loads((folder / f"{name}.evals").read_text())
    assert len({step for step, _ in rows}) == len(rows), rows
    return {step: loss for step, loss in rows}
