"""Losing engines of `dp4` loses no step (training/resilience): on a real 4-engine cluster a rank
SIGKILLed mid-step leaves the other three training on at dp 3 of 4 (each step's global batch whole:
one of them takes the lost rank's share with the lost rank's own random stream) while its replacement
starts; the replacement then takes a live peer's state, degraded steps included, and the run's
losses and final parameters equal an uninterrupted run's, on token data and on the user's own labelled
rows (a torch Dataset); with rank 0 lost, TensorBoard's files still hold every step's loss once. Under
`dp2 tp2`, `dp2 pp2` and `dp2 cp2` the whole replica trains on while the lost rank's peer waits. 20 kills at random moments
(random ranks, in the forward or before the optimizer step, also while the others train degraded)
leave the final loss of the uninterrupted run, and no process or staging file behind.
The model draws dropout masks, one stream per dp rank: a replaced rank must go on with its own
stream where the lost engine (or its stand-in) left it (its peers gathered it at the step's end), or
its masks, and so the losses, differ from the uninterrupted run's."""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest
import torch

from colab_par import Cluster
from colab_par.models import GPTConfig
from resilience_cell import degraded_steps, evaluations, final_parameters, run_cell

STEPS = 24
MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch", dropout=0.1)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(n=4, backend="gloo", timeout=120.0, dashboard=False) as started:
        yield started


@pytest.fixture(scope="module")
def references(cluster, tmp_path_factory):
    """The folder of the uninterrupted run of each kind of data and layout, run when first asked for."""
    folders = {}

    def reference(data: str, layout: str = "dp4", steps: int = STEPS, evaluate_every: int | None = None,
                  every: int = 8) -> Path:
        key = (data, layout, steps, evaluate_every, every)
        if key not in folders:
            folder = tmp_path_factory.mktemp(f"reference-{data}-{layout.replace(' ', '-')}-{steps}")
            run_cell(cluster, folder, "uninterrupted", [], layout=layout, steps=steps, every=every, batch=8,
                     model=MODEL, data=data, seed=0, evaluate_every=evaluate_every)
            folders[key] = folder
        return folders[key]
    return reference


def uninterrupted(folder: Path) -> list[float]:
    return json.loads((folder / "uninterrupted.losses").read_text())


@pytest.mark.parametrize("data,killed,logged,evaluate_every", [
    ("tokens", 2, False, None), ("rows", 2, False, 5), ("loader", 1, False, None), ("stream", 0, False, None),
    ("tokens", 0, True, None)])
def test_the_others_train_on_while_a_killed_rank_is_replaced_and_no_step_is_lost(cluster, tmp_path, capsys,
                                                                                  references, data, killed,
                                                                                  logged, evaluate_every,
                                                                                  slow_replacement) -> None:
    """Killed in step 5's forward: the other three go back to step 4 and train on (the first of them
    takes the lost rank's share, and writes step 8's checkpoint with them if they get there) until
    the replacement is ready; it takes that survivor's state at that step. On the user's labelled rows each share holds its own count
    of labels: the loss divides by the count over all four shares, as the whole world's does. Read
    through a DataLoader's worker, the stand-in reads the lost rank's rows through a worker of its
    own (its own rows' worker reading ahead meanwhile) in the loader's shuffled order. From a stream
    whose reader (rank 0) is the one lost, each survivor reads the stream itself from the place
    rank 0 sent with its shares. With
    TensorBoard on and rank 0 (its writer) the one lost, the event files hold every step's loss
    once: rank 0's up to step 4, the first survivor's while degraded, the replacement's after. With
    held-out rows evaluated every 5 steps, step 5's evaluation runs degraded, the first survivor
    scoring the lost rank's share of the held-out rows too."""
    reference = references(data, evaluate_every=evaluate_every)
    generation = cluster.generation
    logs = tmp_path / "tensorboard" if logged else None
    losses, _ = run_cell(cluster, tmp_path, "killed", [[killed, "forward", 5]], layout="dp4", steps=STEPS, every=8,
                         batch=8, model=MODEL, data=data, tensorboard=logs, seed=0, evaluate_every=evaluate_every,
                         hold_at=7)
    others = [rank for rank in range(4) if rank != killed]
    assert_no_step_lost(capsys.readouterr(), tmp_path, reference, losses,
                        rf"rank\(s\) {killed} died; ranks {','.join(map(str, others))} trained on at dp 3 of 4 "
                        rf"\(steps 5\.\.([5-7])\) while the replacement started; replaced the dead engine of rank "
                        rf"{killed}", f"{killed}<-{others[0]}", "dp 3 of 4")
    assert cluster.generation == generation  # the dead engine alone was replaced
    if logged:
        assert logged_losses(logs) == pytest.approx(dict(enumerate(uninterrupted(reference), start=1)), rel=1e-6)


@pytest.mark.parametrize("layout, trained, waited, sources, slow", [
    ("dp2 tp2", "2,3", "0", "0<-2, 1<-3", None), ("dp2 pp2", "0,2", "3", "1<-0, 3<-2", (0, 5, "forward", 2)),
    ("dp2 cp2", "2,3", "0", "0<-2, 1<-3", (2, 5, "backward", 1))])
def test_the_whole_replica_trains_on_while_the_other_waits(cluster, tmp_path, capsys, references, layout, trained,
                                                           waited, sources, slow, slow_replacement) -> None:
    """Rank 1 killed in step 5's forward: its replica is broken, the other one trains on at dp 1 of 2
    over its own tp, pp or cp group, rebound on the survivors' store (the old one's connections were
    broken with the rest; pipeline stages and ring attention hold the group object itself), each of
    its ranks taking the lost replica's share with the stream of that replica's rank at its own place;
    the broken replica's live rank waits. When the cell runs again, the broken replica's ranks take
    the whole one's state by place: the run equals the uninterrupted one, step 5's evaluation (run
    degraded, over the rebound groups) included. Under pp, rank 0 (the whole replica's first stage)
    waits before its second microbatch of step 5, so the loss breaks the whole replica's pipeline
    half-way: its last stage has scored the first microbatch, which the step trained on must not
    take for its own. Under cp, rank 2 waits in step 5's backward, after its last layer's: the loss
    breaks DDP's backward half-way, which the step trained on must not go on with."""
    steps = 12
    reference = references("tokens", layout, steps, evaluate_every=5)
    generation = cluster.generation
    losses, _ = run_cell(cluster, tmp_path, "killed", [[1, "forward", 5]], layout=layout, steps=steps, every=8,
                         batch=8, model=MODEL, seed=0, evaluate_every=5, slow=slow, hold_at=7)
    assert_no_step_lost(capsys.readouterr(), tmp_path, reference, losses,
                        rf"rank\(s\) 1 died; ranks {trained} trained on at dp 1 of 2 \(steps 5\.\.([5-7])\) while the "
                        rf"replacement started; rank\(s\) {waited}, of the lost ranks' replicas, waited; replaced the "
                        r"dead engine of rank 1", sources, "dp 1 of 2")
    assert cluster.generation == generation


def test_a_rank_killed_while_the_world_evaluates_leaves_the_others_to_evaluate_and_train_on(
        cluster, tmp_path, capsys, references, slow_replacement) -> None:
    """Held-out data every 5 steps; rank 0 killed in the forward of step 5's evaluation. The others
    go back to step 5, evaluate it themselves (the first of them scoring the lost rank's share too)
    and train on from step 6; the replacement takes the first one's rows, that evaluation's row
    included (it joined the step's kept state): the evaluations rank 0 holds, the losses and the
    parameters equal the uninterrupted run's."""
    reference = references("tokens", evaluate_every=5)
    losses, _ = run_cell(cluster, tmp_path, "killed", [[0, "forward", 6]], layout="dp4", steps=STEPS, every=8,
                         batch=8, model=MODEL, seed=0, evaluate_every=5, hold_at=7)
    assert_no_step_lost(capsys.readouterr(), tmp_path, reference, losses,
                        r"rank\(s\) 0 died; ranks 1,2,3 trained on at dp 3 of 4 \(steps 6\.\.([67])\) while the "
                        r"replacement started; replaced the dead engine of rank 0", "0<-1", "dp 3 of 4", first=6)


def test_the_survivors_write_the_checkpoint_due_while_they_train_on(cluster, tmp_path, capsys, references,
                                                                    slow_replacement) -> None:
    """Checkpoints every 6 of 12 steps; rank 0 killed in step 6's forward. The others train step 6
    on their own and write its checkpoint over their own group (rank 1, rank 0's stand-in, writes
    the world's files and rank 0's random stream and rows). It is the checkpoint the uninterrupted
    run wrote at step 6: the same tensors and loop state, every rank's stream, intact digests."""
    from colab_par.training.checkpoint import _damage

    reference = references("tokens", steps=12, every=6)
    losses, _ = run_cell(cluster, tmp_path, "killed", [[0, "forward", 6]], layout="dp4", steps=12, every=6,
                         batch=8, model=MODEL, seed=0, hold_at=7)
    assert_no_step_lost(capsys.readouterr(), tmp_path, reference, losses,
                        r"rank\(s\) 0 died; ranks 1,2,3 trained on at dp 3 of 4 \(steps 6\.\.([67])\) while the "
                        r"replacement started; replaced the dead engine of rank 0", "0<-1", "dp 3 of 4", first=6)
    ours, theirs = (next((folder / name).glob("step-00000006-*")) for folder, name in
                    ((tmp_path, "killed"), (reference, "uninterrupted")))
    assert _damage(ours) == [] and json_files(ours) == json_files(theirs)
    torch.testing.assert_close(checkpoint_tensors(ours, tmp_path / "ours.pt"),
                               checkpoint_tensors(theirs, tmp_path / "theirs.pt"), rtol=1e-5, atol=1e-6)
    for rank in range(4):
        assert json_file(ours, f"rng-rank{rank}.json") == json_file(theirs, f"rng-rank{rank}.json")
        history = json_file(ours, f"history-rank{rank}.json")
        assert [row["rank"] for row in history] == [rank] * 6 and [row.get("degraded") for row in history] == [None] * 5 + ["dp 3 of 4"]
        assert [row["loss"] for row in history] == pytest.approx(
            [row["loss"] for row in json_file(theirs, f"history-rank{rank}.json")], rel=1e-6)
    assert json_file(ours, "meta.json")["trainer"] == json_file(theirs, "meta.json")["trainer"]


def checkpoint_tensors(version: Path, out: Path) -> dict:
    """Every tensor a DCP checkpoint holds, read in this process (no world)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(version, out)
    return torch.load(out)


def json_file(version: Path, name: str):
    return json.loads((version / name).read_text())


def json_files(version: Path) -> list[str]:
    """The names of a checkpoint's JSON files (DCP names its data files by the writers' ranks)."""
    return sorted(path.name for path in version.glob("*.json"))


def rows_kept_after_an_evaluation(folder: str) -> tuple[int, int]:
    """(the rows of the step kept whole, the rows in the history) after a fit whose last step
    evaluates."""
    import colab_par
    from colab_par.data import SyntheticDataset
    from colab_par.models import GPT
    from colab_par.training.options import Checkpoints, Evaluation, Logs

    pm = colab_par.parallelize(GPT(MODEL), "dp4")
    held_out = SyntheticDataset(vocab_size=MODEL.vocab_size, seq_len=MODEL.seq_len, batch_size=8, seed=1)
    trainer = colab_par.Trainer(pm, SyntheticDataset(vocab_size=MODEL.vocab_size, seq_len=MODEL.seq_len, batch_size=8),
                                steps=2, evaluation=Evaluation(held_out, every=2, batches=1),
                                checkpoints=Checkpoints(folder, every=2, on_failure="restart"), logs=Logs(telemetry=False))
    trainer.fit()
    return trainer._keeper.kept.live_loop["history"], len(trainer.history)


def test_an_evaluation_row_belongs_to_its_steps_kept_state(cluster, tmp_path) -> None:
    """The evaluation after a step joins that step's kept state: survivors going back to the step,
    and a replacement taking a peer's rows, keep it (and do not evaluate the step again)."""
    assert cluster.run(rows_kept_after_an_evaluation, str(tmp_path)) == [(3, 3)] * 4


def assert_no_step_lost(said, folder: Path, reference: Path, losses: list[float], trained: str, sources: str,
                        dp: str, first: int = 5) -> None:
    """The killed run in `folder` trained on from step `first` as the notebook's words (`trained`,
    whose group is the last degraded step) and its rows (`dp`) say, the replaced ranks took their
    state from live replicas (`sources`), and its losses, evaluations and final parameters equal the
    uninterrupted run's in `reference`."""
    import torch

    found = re.search(trained, said.err)
    assert found, said.err
    last = int(found.group(1))
    assert f"resumed at step {last} from live replicas (ranks {sources}), no step lost" in said.out, said.out
    assert degraded_steps(folder, "killed") == {step: dp for step in range(first, last + 1)}
    expected = uninterrupted(reference)
    assert losses == pytest.approx(expected, rel=1e-6) and len(losses) == len(expected)
    expected_evaluations = evaluations(reference, "uninterrupted")
    assert evaluations(folder, "killed") == pytest.approx(expected_evaluations, rel=1e-6)  # as the losses
    torch.testing.assert_close(final_parameters(folder, "killed"), final_parameters(reference, "uninterrupted"),
                               rtol=1e-5, atol=1e-6)


def logged_losses(folder: Path) -> dict[int, float]:
    """{step: loss} as TensorBoard reads the folder's event files (purge steps applied); a step
    logged twice fails."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    points = events.Scalars("train/loss")
    steps = [point.step for point in points]
    assert len(steps) == len(set(steps)), steps
    return {point.step: point.value for point in points}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie is gone but for its entry
    except FileNotFoundError:
        return False


def test_twenty_kills_at_random_moments_end_as_the_uninterrupted_run(cluster, tmp_path, references) -> None:
    draw = random.Random(20261129)
    moments = sorted(draw.sample(range(2, 2 * STEPS + 2), 20))  # (step, forward or before the optimizer)
    kills = [[draw.randrange(4), ("forward", "optimizer")[moment % 2], moment // 2] for moment in moments]
    losses, pids = run_cell(cluster, tmp_path, "killed", kills, layout="dp4", steps=STEPS, every=8, batch=8,
                            max_restarts=len(kills), model=MODEL, seed=0)
    assert len(losses) == STEPS and losses[-1] == pytest.approx(uninterrupted(references("tokens"))[-1], rel=1e-6)
    live = {row["pid"] for row in cluster.status()}
    assert len(pids - live) == len(kills)  # every killed engine ran the cell ...
    assert not [pid for pid in pids - live if _alive(pid)]  # ... and is gone
    root = tmp_path / "killed"
    assert not list(root.glob(".tmp-*")) and len(list(root.glob("step-*"))) <= 2, os.listdir(root)
