"""DCP checkpoints on real engines: resume gives the uninterrupted losses, a checkpoint moves to
another layout (and a live model re-lays itself out), commits are atomic, loading unpickles
nothing but DCP metadata."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from colab_par.checkpoint import (COMMIT_MARKER, LATEST, CheckpointError, MetadataOnlyReader,
                                  latest_checkpoint)
from test_train import DATA, build_trainer

STEPS, SAVE_AT = 6, 3


def train_and_save(layout: str, ckpt_dir: str | None) -> list[float]:
    """Train all STEPS (checkpointing every SAVE_AT steps when ckpt_dir is given)."""
    trainer = build_trainer(layout, STEPS, ckpt_dir=ckpt_dir, ckpt_every=SAVE_AT if ckpt_dir else None)
    trainer.fit(stop_at=SAVE_AT if ckpt_dir else None)
    return [row["loss"] for row in trainer.history]


def resume(layout: str, ckpt_dir: str) -> dict:
    from colab_par import load

    trainer = build_trainer(layout, STEPS)
    meta = load(trainer.pm, ckpt_dir, trainer=trainer)
    position = (trainer.step, trainer.data_position)
    trainer.fit()
    return {"losses": [row["loss"] for row in trainer.history], "meta": meta, "position": position}


def relayout_midway(first: str, second: str) -> dict:
    from colab_par.checkpoint import relayout

    trainer = build_trainer(first, STEPS)
    trainer.fit(stop_at=SAVE_AT)
    old = trainer.pm
    new = relayout(old, second, trainer=trainer)
    trainer.fit()
    return {"losses": [row["loss"] for row in trainer.history], "layout": str(new.layout),
            "repointed": trainer.pm is new and new is not old}


def resume_with_other_data(ckpt_dir: str) -> str:
    from colab_par import load
    from colab_par.data import SyntheticDataset

    trainer = build_trainer("dp2 zero3", STEPS)
    trainer.data = SyntheticDataset(**{**DATA, "seed": DATA["seed"] + 1})
    before = {k: v.clone() for k, v in trainer.pm.full_state_dict().items()}
    try:
        load(trainer.pm, ckpt_dir, trainer=trainer)
    except CheckpointError as error:
        after = trainer.pm.full_state_dict()
        untouched = all(torch.equal(before[k], after[k]) for k in before)
        return f"{error} untouched={untouched} step={trainer.step}"
    return "loaded"


@pytest.fixture(scope="module")
def saved(cluster2, tmp_path_factory):
    """Uninterrupted losses, and a dp2·zero3 checkpoint written at step SAVE_AT of the same run."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    uninterrupted = cluster2.run(train_and_save, "dp2 zero3", None)[0]
    first_half = cluster2.run(train_and_save, "dp2 zero3", ckpt)[0]
    assert first_half == uninterrupted[:SAVE_AT]
    return ckpt, uninterrupted


def test_resume_gives_the_uninterrupted_losses(cluster2, saved):
    ckpt, uninterrupted = saved
    result = cluster2.run(resume, "dp2 zero3", ckpt)[0]
    assert result["position"] == (SAVE_AT, SAVE_AT)
    assert result["meta"]["layout"] == "dp2 zero3" and result["meta"]["step"] == SAVE_AT
    assert result["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-6)


def test_resume_with_other_data_is_refused_before_loading(cluster2, saved):
    ckpt, _ = saved
    message = cluster2.run(resume_with_other_data, ckpt)[0]
    assert "build the same dataset to resume" in message
    assert message.endswith("untouched=True step=0")


@pytest.mark.parametrize("layout", ["tp2", "pp2 gpipe mb2", "dp2", "dp2 zero1"])
def test_checkpoint_loads_under_another_layout(cluster2, saved, layout):
    ckpt, uninterrupted = saved
    result = cluster2.run(resume, layout, ckpt)[0]
    assert result["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5)


@pytest.mark.parametrize("first,second", [("dp2 zero3", "tp2"), ("dp2 zero1", "pp2 gpipe mb2")])
def test_live_relayout_continues_with_the_same_losses(cluster2, saved, first, second):
    _, uninterrupted = saved
    result = cluster2.run(relayout_midway, first, second)[0]
    assert result["layout"] == second and result["repointed"]
    assert result["losses"] == pytest.approx(uninterrupted, rel=1e-5)


def test_commits_are_atomic_and_pruned(cluster2, saved, tmp_path):
    ckpt, _ = saved
    root = tmp_path / "root"
    stale = root / ".tmp-deadbeef"  # what a save killed before its commit leaves behind
    stale.mkdir(parents=True)
    cluster2.run(train_and_save, "dp2 zero3", str(root))  # three saves of step 3; keep=2
    cluster2.run(train_and_save, "dp2 zero3", str(root))
    cluster2.run(train_and_save, "dp2 zero3", str(root))
    versions = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert len(versions) == 2 and not stale.exists()
    newest = latest_checkpoint(root)
    assert (root / LATEST).read_text() == newest.name and newest.name in versions
    assert json.loads((newest / "meta.json").read_text())["trainer"]["data_position"] == SAVE_AT
    assert sorted(p.name for p in newest.glob("rng-rank*.json")) == ["rng-rank0.json", "rng-rank1.json"]
    (newest / COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointError, match="never committed"):
        latest_checkpoint(root)
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        latest_checkpoint(tmp_path / "empty")


class _Boom:
    """Unpickling this runs os.system: exactly what a checkpoint must never do."""

    def __reduce__(self):
        return (os.system, ("touch boom",))


def test_metadata_is_read_without_unpickling_arbitrary_objects(saved, tmp_path, monkeypatch):
    ckpt, _ = saved
    metadata = MetadataOnlyReader(latest_checkpoint(ckpt)).read_metadata()
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(_Boom()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        MetadataOnlyReader(evil).read_metadata()
    assert not (tmp_path / "boom").exists()
