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
from colab_par.cluster import EngineError
from colab_par.layout import Layout
from test_train import CONFIG, DATA, build_trainer

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
    assert Layout.parse(result["layout"]) == Layout.parse(second) and result["repointed"]
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


# ---- errors a user can act on ----------------------------------------------------------------------
def _two_versions(cluster2, root) -> tuple:
    """Two committed saves under `root`: (newest, the earlier one)."""
    cluster2.run(train_and_save, "dp2 zero3", str(root))
    earlier = latest_checkpoint(root)
    cluster2.run(train_and_save, "dp2 zero3", str(root))
    newest = latest_checkpoint(root)
    assert newest != earlier and earlier.is_dir()
    return newest, earlier


def _first_line(error: EngineError) -> str:
    assert [ranks for ranks, *_ in error.groups] == [[0, 1]]  # one message, every rank
    return str(error).splitlines()[0]


def test_truncated_file_is_named_with_the_intact_earlier_checkpoint(cluster2, saved, tmp_path):
    _, uninterrupted = saved
    newest, earlier = _two_versions(cluster2, tmp_path / "root")
    damaged = newest / "__1_0.distcp"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(EngineError) as info:
        cluster2.run(resume, "dp2 zero3", str(tmp_path / "root"))
    first = _first_line(info.value)
    assert first.startswith("CheckpointError: ")
    assert (f"checkpoint {newest} is damaged: __1_0.distcp is {size // 2} bytes but {size} were "
            "committed") in first
    assert f"the earlier checkpoint {earlier} is intact: load that path instead" in first
    result = cluster2.run(resume, "dp2 zero3", str(earlier))[0]  # the advice works
    assert result["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-6)


def test_corrupt_newest_without_an_intact_earlier_one_says_so(cluster2, tmp_path):
    newest, earlier = _two_versions(cluster2, tmp_path / "root")
    (earlier / "__0_0.distcp").unlink()
    damaged = newest / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the checksum sees it
    damaged.write_bytes(bytes(data))
    with pytest.raises(EngineError) as info:
        cluster2.run(resume, "dp2 zero3", str(tmp_path / "root"))
    first = _first_line(info.value)
    assert f"checkpoint {newest} is damaged: __0_0.distcp does not match the SHA-256" in first
    assert f"no earlier committed checkpoint under {tmp_path / 'root'} is intact" in first


def test_checkpoint_without_checksums_still_loads(cluster2, saved, tmp_path):
    """Versions committed before checksums were recorded load as before (unverified)."""
    _, uninterrupted = saved
    root = tmp_path / "old"
    cluster2.run(train_and_save, "dp2 zero3", str(root))
    marker = latest_checkpoint(root) / COMMIT_MARKER
    marker.write_text(json.dumps({"step": SAVE_AT}))  # the commit record of an older colab_par
    result = cluster2.run(resume, "dp2 zero3", str(root))[0]
    assert result["losses"] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-6)


def load_into_other_model(ckpt_dir: str, sizes: dict) -> None:
    from colab_par import load, parallelize
    from colab_par.models.gpt import GPT, GPTConfig

    load(parallelize(GPT(GPTConfig(**{**CONFIG, **sizes})), "dp2"), ckpt_dir)


def _reference_difference(sizes: dict) -> tuple[str, list[int], list[int]]:
    """The first parameter whose shape differs between the saved GPT and one with `sizes`."""
    from colab_par.models.gpt import GPT, GPTConfig

    saved = GPT(GPTConfig(**CONFIG)).state_dict()
    other = GPT(GPTConfig(**{**CONFIG, **sizes})).state_dict()
    return next((key, list(saved[key].shape), list(value.shape)) for key, value in other.items()
                if key in saved and saved[key].shape != value.shape)


def test_checkpoint_of_another_model_is_refused_on_one_line(cluster2, saved):
    ckpt, _ = saved
    version = latest_checkpoint(ckpt)
    with pytest.raises(EngineError) as info:
        cluster2.run(load_into_other_model, ckpt, {"d_model": 64})
    first = _first_line(info.value)
    key, theirs, ours = _reference_difference({"d_model": 64})
    assert first.startswith(f"CheckpointError: checkpoint {version} does not fit this model: "
                            f"{key} is {theirs} in the checkpoint but {ours} here (")
    assert "Traceback" not in first and "torch.distributed.checkpoint" not in first

    with pytest.raises(EngineError) as info:  # more layers: names a parameter the checkpoint lacks
        cluster2.run(load_into_other_model, ckpt, {"n_layer": 3})
    assert "does not fit this model: layers.2.attention" in _first_line(info.value)
    assert "is not in the checkpoint" in _first_line(info.value)
