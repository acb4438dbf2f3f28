"""In-memory recovery on a real 2-engine cluster (training/resilience): a SIGKILLed engine of
`dp2 zero3` or `tp2` comes back from its buddy's in-memory snapshot, losing only the steps since
(named); a kill while the snapshot's bytes are in flight leaves every rank the snapshot before; a
kill during an asynchronous save leaves the previous checkpoint loadable and the next save commits.
A replaced rank 0 of `dp2` on a stream takes its place in the stream from its live peer. Each run
ends with every step's loss equal to an uninterrupted run's (same global batches). The zero3 and
tp2 layouts' dp peers are no whole copies, so the survivors wait for the replacement (they do not
train on degraded, as `dp4` does in test_resilience_dp4.py). Every run seeds the model's weights,
so the engines need no restart between runs."""
from __future__ import annotations

import re

import pytest

from colab_par import Cluster
from colab_par.training.options import Checkpoints
from resilience_cell import degraded_steps, run_cell


@pytest.fixture(scope="module")
def cluster():
    with Cluster(n=2, backend="gloo", timeout=120.0, dashboard=False) as started:
        yield started


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """Each layout's losses without a kill (the model seeded as in every run here)."""
    folder, losses = tmp_path_factory.mktemp("reference"), {}

    def of(layout: str, data: str = "tokens") -> list[float]:
        if (layout, data) not in losses:
            losses[layout, data] = run_cell(cluster, folder, f"{layout.replace(' ', '-')}-{data}", [], layout=layout,
                                            data=data, seed=0)[0]
        return losses[layout, data]
    return of


def killed_run(cluster, tmp_path, capsys, kills, **options) -> tuple[list[float], str]:
    generation = cluster.generation
    losses, _ = run_cell(cluster, tmp_path, "killed", kills, seed=0, **options)
    assert cluster.generation == generation  # the dead engine alone was replaced
    said = capsys.readouterr()
    assert "train on" not in said.err and not degraded_steps(tmp_path, "killed"), said.err  # zero3, tp: today's way
    return losses, said.out


@pytest.mark.parametrize("layout, kill, said", [
    # killed in step 8's forward: step 7 was done after the snapshot of step 6
    ("dp2 zero3", [1, "forward", 8], "resumed at step 6 from in-memory snapshots (ranks 1<-0), "
                                     "1 step(s) lost: 7..7, trained again"),
    # rank 0 killed before its optimizer step 6; rank 1 finished step 6, then its snapshot failed
    ("tp2", [0, "optimizer", 6], "resumed at step 4 from in-memory snapshots (ranks 0<-1), "
                                 "2 step(s) lost: 5..6, trained again"),
])
def test_a_lost_shard_comes_back_from_its_buddys_snapshot(cluster, tmp_path, capsys, uninterrupted, layout, kill,
                                                          said) -> None:
    losses, out = killed_run(cluster, tmp_path, capsys, [kill], layout=layout, snapshot_every=2)
    assert said in out, out
    assert losses == pytest.approx(uninterrupted(layout), rel=1e-6) and len(losses) == 8


def test_a_lost_rank_0_of_a_stream_takes_its_place_in_the_stream_from_a_live_replica(cluster, tmp_path, capsys,
                                                                                    uninterrupted,
                                                                                    slow_replacement) -> None:
    """dp2 on a stream (an IterableDataset, which rank 0 reads for every rank): rank 0 killed in
    step 5's forward. Rank 1 trains on, reading the stream itself from the place rank 0 sent with
    its shares, until the replacement takes rank 1's live state, that place included: it reads on
    from there, so every loss equals the uninterrupted run's. Were rank 1's place its own (nothing
    read), both would read the stream again from its first row."""
    losses, _ = run_cell(cluster, tmp_path, "killed", [[0, "forward", 5]], layout="dp2", data="stream", seed=0,
                         hold_at=6)
    out = capsys.readouterr().out
    assert re.search(r"resumed at step [4-6] from live replicas \(ranks 0<-1\), no step lost", out), out
    assert losses == pytest.approx(uninterrupted("dp2", "stream"), rel=1e-6) and len(losses) == 8


def test_snapshots_at_a_measured_cadence_bring_a_lost_rank_back(cluster, tmp_path, capsys, uninterrupted) -> None:
    """snapshot_every="auto": the first after step 1, then every K steps, K the largest any rank
    measured to keep snapshots within 3 % of its step (the ranks must agree, or they deadlock)."""
    losses, out = killed_run(cluster, tmp_path, capsys, [[1, "forward", 6]], layout="dp2 zero3",
                             snapshot_every="auto")
    assert re.search(r"resumed at step [1-5] from in-memory snapshots \(ranks 1<-0\)", out), out
    assert losses == pytest.approx(uninterrupted("dp2 zero3"), rel=1e-6)


def test_a_kill_while_the_snapshot_is_copied_leaves_the_one_before(cluster, tmp_path, capsys, uninterrupted) -> None:
    losses, out = killed_run(cluster, tmp_path, capsys, [[1, "snapshot", 4]], layout="dp2 zero3", snapshot_every=2)
    assert "resumed at step 2 from in-memory snapshots (ranks 1<-0), 2 step(s) lost: 3..4" in out, out
    assert losses == pytest.approx(uninterrupted("dp2 zero3"), rel=1e-6)


def test_a_kill_during_an_asynchronous_save_keeps_the_previous_checkpoint(cluster, tmp_path, capsys,
                                                                          uninterrupted) -> None:
    losses, out = killed_run(cluster, tmp_path, capsys, [[1, "async save", 4]], layout="dp2 zero3", every=2,
                             asynchronous=True)
    assert "resumed from the checkpoint of step 2" in out, out  # step 4's write never committed
    assert losses == pytest.approx(uninterrupted("dp2 zero3"), rel=1e-6)
    root = tmp_path / "killed"
    committed = sorted(path.name for path in root.glob("step-*"))
    assert re.fullmatch(r"step-00000008-\w+", (root / "LATEST").read_text().strip())  # later saves committed
    assert [name[:13] for name in committed] == ["step-00000006", "step-00000008"]  # the newest two kept
    assert not list(root.glob(".tmp-*"))  # no staging left behind


def test_snapshot_options_are_checked() -> None:
    with pytest.raises(ValueError, match="snapshot_every= keeps state for recovery: pass on_failure='restart'"):
        Checkpoints("somewhere", every=2, snapshot_every=2)
    with pytest.raises(ValueError, match=r"snapshot_every=0 must be a positive integer \(steps\) or 'auto'"):
        Checkpoints("somewhere", every=2, on_failure="restart", snapshot_every=0)
    assert Checkpoints("somewhere", every=2, on_failure="restart", snapshot_every="auto").snapshot_every == "auto"


def test_plans_from_what_each_rank_keeps() -> None:
    from colab_par.training.resilience.recover import replica_plan, snapshot_plan

    # rows: [live step, own snapshots x2, held snapshots x2, replica key]; rank 1 is the new engine
    dp4 = [[5, -1, -1, -1, -1, 0], [-1, -1, -1, -1, -1, 0], [6, -1, -1, -1, -1, 0], [6, -1, -1, -1, -1, 0]]
    assert replica_plan(dp4) == (6, {0: 2, 1: 2, 2: 2, 3: 3})  # the newest step; rank 0 behind takes it too
    dp2_tp2 = [[4, -1, -1, -1, -1, 0], [4, -1, -1, -1, -1, 1], [4, -1, -1, -1, -1, 0], [-1, -1, -1, -1, -1, 1]]
    assert replica_plan(dp2_tp2) == (4, {0: 0, 2: 2, 1: 1, 3: 1})  # a peer in the same tp place
    assert replica_plan([[4, -1, -1, -1, -1, 0], [-1, -1, -1, -1, -1, 1]]) is None  # tp2: no peer holds rank 1's
    assert replica_plan([[4, -1, -1, -1, -1, -1], [-1, -1, -1, -1, -1, -1]]) is None  # zero3: peers differ
    # snapshots every 2 steps, stride 1: rank r's copy is held by rank r + 1
    ring = [[7, 6, 4, 6, 4, -1], [-1, -1, -1, -1, -1, -1], [7, 6, 4, 6, 4, -1], [7, 6, 4, 4, -1, -1]]
    assert snapshot_plan(ring, 1) == (6, {0: 0, 1: 2, 2: 2, 3: 3})
    ring[2][3:5] = [4, -1]  # rank 2 never received rank 1's newest copy
    assert snapshot_plan(ring, 1) == (4, {0: 0, 1: 2, 2: 2, 3: 3})
    ring[2] = [-1] * 6  # two neighbours lost: rank 1's copy died with rank 2
    assert snapshot_plan(ring, 1) is None


def test_a_copy_crosses_as_json_and_bytes_whatever_its_dtypes() -> None:
    import torch

    from colab_par.training.resilience.rank_copy import RankCopy, from_bytes, to_bytes

    tensors = {"optim.step": torch.tensor(3.0), "model.mask": torch.tensor([True, False, True]),
               "model.w": torch.randn(3, 5), "model.h": torch.randn(7, dtype=torch.bfloat16),
               "optim.count": torch.arange(5, dtype=torch.int64)}  # unaligned offsets after the bools
    copy = RankCopy(3, "dp2 zero3", 2, tensors, {"trainer": {"step": 3}, "history": [{"loss": 1.5}]})
    header, payload = to_bytes(copy)
    assert isinstance(header, bytes) and payload.dtype == torch.uint8
    back = from_bytes(header, payload)
    assert (back.step, back.layout, back.world_size, back.values) == (3, "dp2 zero3", 2, copy.values)
    assert back.tensors.keys() == tensors.keys()
    assert all(torch.equal(back.tensors[name], tensor) and back.tensors[name].dtype == tensor.dtype
               for name, tensor in tensors.items())


def test_a_degrade_message_is_taken_once_and_only_while_fresh(monkeypatch) -> None:
    """The Trainer tells a lost peer from its own error by the notebook's degrade message: none within
    the wait, none stale, none left over from an episode that ended (`request_resume` clears it)."""
    from colab_par.training import recovery

    assert recovery.take_degrade_request(0.01) is None  # no message: the failure was no lost peer's
    recovery.request_degraded({"survivors": [0, 1, 3], "lost": [2]})
    recovery.request_rejoin()
    assert recovery.rejoin_requested()
    assert recovery.take_degrade_request(0.01)["lost"] == [2]
    assert recovery.take_degrade_request(0.01) is None  # taken once
    recovery.record_degraded({"steps": [5, 7], "dp": 3, "of": 4})
    assert recovery.degraded_record() == {"steps": [5, 7], "dp": 3, "of": 4}
    recovery.request_degraded({"survivors": [0], "lost": [1]})
    assert not recovery.rejoin_requested() and recovery.degraded_record() is None  # a new episode
    recovery.request_resume("somewhere")  # the episode ended: nothing of it is left
    assert recovery.take_degrade_request(0.01) is None
    recovery.take_resume_request("somewhere")
    recovery.request_degraded({"survivors": [0], "lost": [1]})
    monkeypatch.setattr(recovery, "DEGRADE_FRESH_S", 0.0)  # a message older than that is stale
    assert recovery.take_degrade_request(0.01) is None


def test_the_notebook_says_why_the_survivors_stopped_early() -> None:
    """A survivor's degraded training that fails on anything (a save, a second lost rank) ends the
    episode as a rejoin would: the notebook names the failure instead of passing over it."""
    from colab_par.cluster.faults import _trained_on

    trained = {"steps": [5, 6], "dp": 3, "of": 4, "ranks": [0, 1, 3]}
    said = _trained_on([trained, {**trained, "stopped": "CheckpointError: the disk is full"}, None], [2], [0, 1, 3])
    assert said == ("rank(s) 2 died; ranks 0,1,3 trained on at dp 3 of 4 (steps 5..6) while the replacement "
                    "started; they stopped early on CheckpointError: the disk is full")
