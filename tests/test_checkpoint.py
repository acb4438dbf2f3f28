"""DCP checkpoints on real engines: resume gives the uninterrupted losses, a checkpoint moves to
another layout (and a live model re-lays itself out), commits are atomic, optimizer settings come
back exactly, and a load reads only tensors and JSON: a payload planted in a checkpoint never runs."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from fractions import Fraction

import pytest
import torch

from colab_par.training.checkpoint import COMMIT_MARKER, LATEST, CheckpointError, latest_checkpoint, load
from colab_par.training.checkpoint_format import TensorOnlyReader
from colab_par.cluster import EngineError
from colab_par.layout import Layout
from test_train import CONFIG, DATA, MODEL_SEED, build_trainer

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
    from colab_par.training.checkpoint import relayout

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
    assert result["losses"] == uninterrupted[SAVE_AT:]  # bit for bit


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


@pytest.mark.parametrize("first,second", [("dp2 zero3", "tp2"), ("dp2 zero1", "pp2 gpipe mb2"),
                                          ("dp2 zero1 optimizer@disk", "dp2 zero3")])
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


# ---- nothing but tensors and JSON is read ---------------------------------------------------------
class _Boom:
    """Unpickling this runs a shell command: exactly what a checkpoint must never do."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _recommit(version) -> None:
    """Record every file's size and SHA-256 as a commit does, so an altered version is "intact"."""
    record = json.loads((version / COMMIT_MARKER).read_text())
    record["files"] = {path.name: {"bytes": path.stat().st_size,
                                   "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
                       for path in sorted(version.iterdir()) if path.name != COMMIT_MARKER}
    (version / COMMIT_MARKER).write_text(json.dumps(record))


def save_then_plant(layout: str, root: str, marker: str) -> None:
    """On the engines: the kit saves a model under `layout`; then its DCP files are rewritten with
    DCP's own writer the way format 1 stored them (the flattened optimizer state, hyper-parameters
    included), every optimizer lr a payload that creates `marker`."""
    import torch.distributed.checkpoint as dcp

    from colab_par.training import checkpoint
    from colab_par import save

    pm = build_trainer(layout, STEPS).pm
    version = save(pm, root)
    state = checkpoint.rank_state(pm)
    for key in state["optim"]:
        if key.startswith("param_groups.") and key.endswith(".lr"):
            state["optim"][key] = _Boom(f"touch {marker}")
    dcp.save(state, checkpoint_id=str(version))


def load_fresh(layout: str, root: str) -> None:
    load(build_trainer(layout, STEPS).pm, root)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the control load, one process
@pytest.mark.parametrize("layout", ["dp2", "dp2 zero1", "dp2 zero3", "tp2", "pp2 gpipe mb2"])
def test_a_payload_planted_in_a_checkpoint_never_runs(cluster2, tmp_path, layout):
    root, marker = tmp_path / "root", tmp_path / "payload-ran"
    cluster2.run(save_then_plant, layout, str(root), str(marker))
    version = latest_checkpoint(root)
    _recommit(version)
    with pytest.raises(EngineError) as info:
        cluster2.run(load_fresh, layout, str(root))
    first = _first_line(info.value)
    assert first.startswith(f"CheckpointError: checkpoint {version} lists optim.param_groups.")
    assert ".lr (and " in first and "as a pickled (non-tensor) entry" in first
    assert not marker.exists()
    # The planted checkpoint is live: torch's default load planner runs the payload.
    import torch.distributed.checkpoint as dcp

    planted = next(key for key, entry in dcp.FileSystemReader(str(version)).read_metadata()
                   .state_dict_metadata.items() if key.endswith(".lr"))
    dcp.load({"optim": {planted[len("optim."):]: 0.0}}, checkpoint_id=str(version), no_dist=True)
    assert marker.exists()


def test_metadata_is_read_without_unpickling_arbitrary_objects(saved, tmp_path, monkeypatch):
    ckpt, _ = saved
    metadata = TensorOnlyReader(latest_checkpoint(ckpt)).read_metadata()
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)
    evil = tmp_path / "evil"
    evil.mkdir()
    monkeypatch.chdir(tmp_path)
    (evil / ".metadata").write_bytes(pickle.dumps(_Boom("touch boom")))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        TensorOnlyReader(evil).read_metadata()
    # A dotted name under an admitted module (protocol 4) must not reach os.system either.
    module, name = b"torch.distributed.checkpoint.metadata", b"os.system"
    dotted = (b"\x80\x04" + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module
              + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name + pickle.STACK_GLOBAL
              + pickle.SHORT_BINUNICODE + b"\x0atouch boom" + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    (evil / ".metadata").write_bytes(dotted)
    with pytest.raises(CheckpointError, match="metadata.os.system"):
        TensorOnlyReader(evil).read_metadata()
    assert not (tmp_path / "boom").exists()


def optimizer_with_settings(params):
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05,
                             amsgrad=True, foreach=False)


def _build_with_settings(layout: str):
    from colab_par import parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig
    from colab_par.training.trainer import Trainer, WarmupCosine

    torch.manual_seed(MODEL_SEED)
    pm = parallelize(GPT(GPTConfig(**CONFIG)), layout, optimizer_fn=optimizer_with_settings)
    return Trainer(pm, SyntheticDataset(**DATA), steps=STEPS, lr_schedule=WarmupCosine(4, STEPS))


def hyper_parameters(optimizer) -> list[list]:
    """Each param group's settings with their types: what users see (ZeroRedundancyOptimizer's own
    groups, copied onto its inner optimizer's at every step) and what steps (the inner ones)."""
    groups = list(optimizer.param_groups) + list(getattr(optimizer, "optim", optimizer).param_groups)
    return [sorted((key, type(value).__name__, value) for key, value in group.items() if key != "params")
            for group in groups]


def save_with_settings(layout: str, root: str) -> list[list]:
    from colab_par import save

    trainer = _build_with_settings(layout)
    trainer.fit(stop_at=2)  # the schedule has moved lr off its base
    save(trainer.pm, root, trainer=trainer)
    return hyper_parameters(trainer.pm.optimizer)


def load_with_scrambled_settings(layout: str, root: str) -> list[list]:
    pm = _build_with_settings(layout).pm
    for optimizer in (pm.optimizer, getattr(pm.optimizer, "optim", pm.optimizer)):
        for group in optimizer.param_groups:
            group.update(lr=0.5, betas=(0.1, 0.2), eps=1.0, weight_decay=0.0, foreach=None)
    load(pm, root)
    return hyper_parameters(pm.optimizer)


def test_optimizer_settings_come_back_exactly(cluster2, tmp_path):
    saved = cluster2.run(save_with_settings, "dp2 zero1", str(tmp_path))[0]
    lr = dict((key, value) for key, _, value in saved[0])["lr"]
    assert lr != 3e-3 and ("betas", "tuple", (0.8, 0.95)) in saved[0]
    assert ("amsgrad", "bool", True) in saved[0] and ("foreach", "bool", False) in saved[0]
    for layout in ("dp2 zero1", "tp2"):
        restored = cluster2.run(load_with_scrambled_settings, layout, str(tmp_path))
        assert restored[0] == restored[1] == saved


def set_unsavable_lr(layout: str, root: str) -> None:
    """Rank 1 alone holds an lr JSON cannot keep exactly: every rank must refuse, none may hang."""
    import torch.distributed as dist

    from colab_par import save

    pm = build_trainer(layout, STEPS).pm
    if dist.get_rank() == 1:
        getattr(pm.optimizer, "optim", pm.optimizer).param_groups[0]["lr"] = Fraction(1, 1000)
    save(pm, root)


def test_a_setting_json_cannot_hold_is_refused_before_any_folder(cluster2, tmp_path):
    with pytest.raises(EngineError) as info:
        cluster2.run(set_unsavable_lr, "dp2 zero1", str(tmp_path / "root"))
    first = _first_line(info.value)
    assert first.startswith("CheckpointError: cannot save optim.param_groups.")
    assert ".lr (Fraction)" in first and "never as a pickle" in first
    assert not (tmp_path / "root").exists()


def save_fresh(layout: str, root: str) -> None:
    from colab_par import save

    save(build_trainer(layout, STEPS).pm, root)


def test_a_folder_rank_0_cannot_create_fails_on_every_rank(cluster2, tmp_path):
    """Rank 0 alone makes the folder; its failure must reach rank 1, which would otherwise wait at
    a barrier for a folder that never comes."""
    (tmp_path / "blocker").write_text("a file where the checkpoint's parent folder should be")
    with pytest.raises(EngineError) as info:
        cluster2.run(save_fresh, "dp2", str(tmp_path / "blocker" / "root"))
    first = _first_line(info.value)
    assert first.startswith(f"CheckpointError: rank 0 cannot create the checkpoint folder {tmp_path}/blocker/root")
    assert "NotADirectoryError" in first or "FileExistsError" in first


def test_a_format_1_checkpoint_is_refused_with_the_reason(saved, tmp_path):
    ckpt, _ = saved
    old = tmp_path / "old"
    shutil.copytree(latest_checkpoint(ckpt), old)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    _recommit(old)
    with pytest.raises(CheckpointError, match="has format 1 .*stores optimizer settings as pickles; "
                                              "this colab_par reads format 2 only"):
        load(None, old)


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
    assert result["losses"] == uninterrupted[SAVE_AT:]  # bit for bit


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


def test_a_commit_record_without_checksums_is_refused(cluster2, saved, tmp_path):
    """Every format-2 commit records its checksums: a record without them was altered."""
    ckpt, _ = saved
    version = tmp_path / "unverified"
    shutil.copytree(latest_checkpoint(ckpt), version)
    (version / COMMIT_MARKER).write_text(json.dumps({"step": SAVE_AT}))
    with pytest.raises(EngineError) as info:
        cluster2.run(resume, "dp2 zero3", str(version))
    assert f"checkpoint {version} is damaged: its COMMITTED record lists no file checksums" in \
        _first_line(info.value)


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
