"""Asynchronous checkpoints on real engines: training with them gives the losses of training with
synchronous ones and the same checkpoints bit for bit; a second save waits for the first; a
background write that fails is raised naming the checkpoint while the previous one stays loadable;
the step pauses for far less than a synchronous save takes."""
from __future__ import annotations

import pytest
import torch

from colab_par.training.checkpoint import CheckpointError
from test_train import adamw, build_trainer

LAYOUT, STEPS, EVERY = "dp2 zero3", 6, 2


def local_state(pm) -> dict:
    """This rank's model and optimizer state as plain CPU tensors (its own shards) and values."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    part = pm.model_parts[0]
    state = {**{f"model.{k}": v for k, v in get_model_state_dict(part).items()},
             **{f"optim.{k}": v for k, v in get_optimizer_state_dict(
                 part, pm.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)).items()}}
    return {name: (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
            if isinstance(value, torch.Tensor) else value for name, value in state.items()}


def train(root: str, asynchronous: bool) -> dict:
    from colab_par.training.options import Checkpoints

    trainer = build_trainer(LAYOUT, STEPS, checkpoints=Checkpoints(root, every=EVERY, asynchronous=asynchronous))
    trainer.fit()
    return {"losses": [row["loss"] for row in trainer.history],
            "saves": [(row["step"], row["ckpt_in_flight"]) for row in trainer.history if "ckpt_pause_s" in row],
            "writing": [row["step"] for row in trainer.history if row.get("ckpt_writing")],
            "live": local_state(trainer.pm)}


def loaded(version: str) -> dict:
    from colab_par.training.checkpoint import load

    trainer = build_trainer(LAYOUT, STEPS)
    meta = load(trainer.pm, version, trainer=trainer)
    return {"step": meta["step"], "state": local_state(trainer.pm)}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.fixture(scope="module")
def runs(cluster2, tmp_path_factory):
    roots = {mode: str(tmp_path_factory.mktemp(mode)) for mode in ("sync", "async")}
    return roots, {mode: cluster2.run(train, root, mode == "async") for mode, root in roots.items()}


def test_async_saves_train_as_sync_saves_and_write_the_same_checkpoints(cluster2, runs):
    from pathlib import Path

    roots, results = runs
    assert results["async"][0]["losses"] == results["sync"][0]["losses"]  # bit for bit
    assert [step for step, _ in results["async"][0]["saves"]] == [2, 4, 6]
    # a save's own row goes out with its write running (a DCP write over gloo takes milliseconds);
    # the dashboard shows it
    assert set(results["async"][0]["writing"]) >= {2, 4, 6} and not results["sync"][0]["writing"]
    for step in (4, 6):  # step 4's write ran beside steps 5 and 6
        version = {mode: str(next(Path(root).glob(f"step-{step:08d}-*"))) for mode, root in roots.items()}
        restored = {mode: cluster2.run(loaded, path) for mode, path in version.items()}
        for rank in range(2):
            assert restored["async"][rank]["step"] == step
            assert same_state(restored["async"][rank]["state"], restored["sync"][rank]["state"])
    for rank in range(2):  # the last checkpoint resumes into exactly the trained state
        assert same_state(restored["async"][rank]["state"], results["async"][rank]["live"])


BIG = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256, kernels="torch")


def pause_and_two_in_a_row(root: str) -> dict:
    """A ~3 M-parameter GPT (38 MB of weights and AdamW moments per rank) after one step: a
    synchronous save's time and an asynchronous save's pause (the least of three each), a second asynchronous save at once, and
    one whose state is overwritten as soon as it returns."""
    import time
    from pathlib import Path

    import torch.distributed as dist
    from colab_par import parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig
    from colab_par.training.checkpoint import LATEST, load, save
    from colab_par.training.checkpoint_async import save_async, wait_for_saves
    from colab_par.training.trainer import Trainer

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**BIG)), "dp2", optimizer_fn=adamw)
    trainer = Trainer(pm, SyntheticDataset(vocab_size=256, seq_len=64, batch_size=2, seed=1), steps=1)
    trainer.fit()

    def sync_seconds() -> float:
        dist.barrier()  # both ranks start together: neither times the other's lateness
        start = time.perf_counter()
        save(pm, f"{root}/sync", trainer=trainer)
        return time.perf_counter() - start

    def async_pause() -> float:
        dist.barrier()
        pause = save_async(pm, f"{root}/async", trainer=trainer).pause_s
        wait_for_saves()
        return pause

    async_pause()  # the first allocates the host copies
    times = [(sync_seconds(), async_pause()) for _ in range(3)]
    first = save_async(pm, f"{root}/async", trainer=trainer)
    second = save_async(pm, f"{root}/async", trainer=trainer)
    wait_for_saves()
    latest = (Path(root) / "async" / LATEST).read_text()
    both_committed = first.final.is_dir() and second.final.is_dir()
    before = local_state(pm)
    third = save_async(pm, f"{root}/async", trainer=trainer)
    with torch.no_grad():  # what the next steps do to the state while the save is written
        for value in (*pm.model_parts[0].parameters(), *(t for s in pm.optimizer.state.values()
                                                          for t in s.values())):
            value.zero_()
    wait_for_saves()
    load(pm, third.final)
    return {"sync_s": min(t[0] for t in times), "pause_s": min(t[1] for t in times), "waited": (first.waited, second.waited),
            "latest_is_second": latest == second.final.name, "both_committed": both_committed,
            "saved_as_it_was": same_state(local_state(pm), before)}


def test_async_pause_is_small_and_a_second_save_waits_for_the_first(cluster2, tmp_path):
    results = cluster2.run(pause_and_two_in_a_row, str(tmp_path))
    for result in results:
        assert result["waited"] == (False, True)
        assert result["latest_is_second"] and result["both_committed"]
        assert result["saved_as_it_was"]  # the state the save was called with, not what came after
    print("sync save s, async pause s per rank:", [(r["sync_s"], r["pause_s"]) for r in results])
    assert max(r["pause_s"] for r in results) < 0.5 * min(r["sync_s"] for r in results)


def failed_writes(root: str) -> dict:
    """Step 2 committed; then a save whose DCP write fails (rank 1 may write no more than 4 KiB
    per file: a full disk) and one whose commit fails (something in the way of LATEST)."""
    import resource
    import signal
    from pathlib import Path

    import torch.distributed as dist
    from colab_par.training.checkpoint import latest_checkpoint, load
    from colab_par.training.checkpoint_async import save_async, wait_for_saves
    from colab_par.training.options import Checkpoints

    trainer = build_trainer(LAYOUT, 4, checkpoints=Checkpoints(root, every=2, asynchronous=True))
    trainer.fit(stop_at=2)
    committed, at_step_2 = latest_checkpoint(root), local_state(trainer.pm)
    messages = []
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        trainer.fit()  # saves step 4 in the background; the failure is raised at the fit's end
    except CheckpointError as error:
        messages.append(str(error))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    obstacle = Path(root) / "LATEST.partial"
    if dist.get_rank() == 0:
        obstacle.mkdir()
    dist.barrier()
    save_async(trainer.pm, root, trainer=trainer)
    try:
        save_async(trainer.pm, root, trainer=trainer)  # the next save raises the failure
    except CheckpointError as error:
        messages.append(str(error))
    dist.barrier()
    if dist.get_rank() == 0:
        obstacle.rmdir()
    wait_for_saves()  # raised once: nothing left
    fresh = build_trainer(LAYOUT, 4)
    meta = load(fresh.pm, root, trainer=fresh)
    return {"messages": messages, "committed": str(committed), "loaded_step": meta["step"],
            "loaded_intact": same_state(local_state(fresh.pm), at_step_2)}


def test_a_failed_background_write_is_raised_and_the_previous_checkpoint_loads(cluster2, tmp_path):
    results = cluster2.run(failed_writes, str(tmp_path))
    for result in results:
        assert len(result["messages"]) == 2
        for message in result["messages"]:
            assert "asynchronous save of step 4" in message and str(tmp_path) in message
            assert f"still loads as {result['committed']}" in message
        assert "rank 0" in result["messages"][1]  # the commit that failed on rank 0, on every rank
        assert result["loaded_step"] == 2 and result["loaded_intact"]


def test_async_saves_refuse_state_kept_on_disk(cluster2, tmp_path):
    def fit_on_disk(root: str) -> None:
        from colab_par.training.options import Checkpoints

        build_trainer("dp2 zero1 optimizer@disk", 2,
                      checkpoints=Checkpoints(root, every=1, asynchronous=True)).fit()

    with pytest.raises(Exception, match="save synchronously: Checkpoints"):
        cluster2.run(fit_on_disk, str(tmp_path))
