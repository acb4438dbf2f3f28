"""Distributed checkpoints through `torch.distributed.checkpoint` (DCP), committed atomically.

A checkpoint root holds committed versions `step-<n>-<id>/` and a `LATEST` file naming the newest.
A save writes into `.tmp-<id>/`, fsyncs, writes the `COMMITTED` marker, renames the folder into
place and only then replaces `LATEST` (write + fsync + rename): a process killed at any point
leaves the previous version loadable. The marker records every file's size and SHA-256, and a
load checks them before DCP reads anything, so a damaged file is named (with the newest earlier
version that is intact) instead of failing deep inside torch.load; a checkpoint of another model
is refused on one line naming the first parameter whose shape differs. Tensors (model, optimizer)
go through DCP with the original model's FQNs, so a checkpoint saved under one layout loads under
another (DCP reshards); a rank's several pipeline stages (interleaved, ZB-V) name their optimizer
state through one module (`stages_as_one`), and a tied tensor saved under one of its names loads
where a layout wants another (`checkpoint_ties.py`). Everything else (optimizer hyper-parameters,
step, data position, LR schedule, layout, RNG) is JSON: a load reads tensors and JSON only and
never runs code from the checkpoint (`checkpoint_format.py` says how).
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from colab_par.training.checkpoint_files import (COMMIT_MARKER, LATEST, barrier as _barrier,
                                                file_digests as _file_digests, fsync_dir as _fsync_dir,
                                                gathered as _gathered, prune as _prune,
                                                rng_state as _rng_state, set_rng_state as _set_rng_state,
                                                shared_random_id, this_rank as _rank, unique as _unique,
                                                world_size as _world, write_json as _write_json,
                                                write_text_atomically as _write_text_atomically)
from colab_par.training.checkpoint_format import (FORMAT, NON_TENSORS, CheckpointError, TensorOnlyReader, from_json,
                                         split_state, to_json)
from colab_par.training.checkpoint_background import wait_for_saves
from colab_par.training.checkpoint_ties import read_through_aliases, tied_sources
from colab_par.training.checkpoint_pages import PagedLoadPlanner, PagedSavePlanner, disk_pages, drop_pages
from colab_par.parallel.pipeline.stages import stages_as_one

__all__ = ["save", "stage", "commit", "StagedSave", "load", "rank_state", "install_state", "relayout", "latest_checkpoint", "saved_history", "CheckpointError"]

META = "meta.json"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# ---- save ----------------------------------------------------------------------------------------
def save(pm: Any, path: str | os.PathLike, *, trainer: Any = None, keep: int = 2) -> Path:
    """Save `pm` (and the trainer's loop state) under the checkpoint root `path`; call on every rank.

    Returns the committed version folder. The `keep` newest versions are kept. An asynchronous
    save still writing (`checkpoint_async.save_async`) is waited for first.
    """
    wait_for_saves()
    return commit(stage(pm, path, trainer=trainer, keep=keep))


@dataclass
class StagedSave:
    """A save between its two halves: this rank's tensors and JSON files as of the step it was
    called at, and the staging folder every rank sees. `commit` writes it; an asynchronous save
    does so on another thread, with `tensors` copied to host memory first."""

    tensors: dict[str, dict]
    files: dict[str, Any]  # this rank's JSON files: name -> value
    pages: dict[int, Any]  # the memory tiers' disk chunks among `tensors` (checkpoint_pages.py)
    root: Path
    staging: Path
    final: Path
    step: int
    keep: int


def stage(pm: Any, path: str | os.PathLike, *, trainer: Any = None, keep: int = 2,
          to_host: Callable[[dict], dict] | None = None, group: Any = None) -> StagedSave:
    """The first half of a save, collective on `group` (default: the default group; the
    survivors' own where a lost replica's stand-ins save, whose ranks hold every tensor): gather
    the state, refuse what JSON cannot hold, and (`to_host`) copy the tensors where training will
    not change them. The staging folder is made by `commit` (off the training thread when the
    save is asynchronous). The group's first rank writes the world's files."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the version just written is always kept)")
    pages = disk_pages(local_optimizer(pm))
    tensors, non_tensors = _savable_state(pm, trainer, group)
    root, rank = Path(path), _rank()
    token = shared_random_id(group)
    step = int(trainer.step) if trainer is not None else 0
    files: dict[str, Any] = {f"rng-rank{rank}.json": _rng_state(pm.rng)}
    if trainer is not None:
        files[f"history-rank{rank}.json"] = [dict(row) for row in trainer.history]
    if _rank(group) == 0:
        files[NON_TENSORS] = non_tensors
        files[META] = {"format": FORMAT, "layout": str(pm.layout), "world_size": _world(), "step": step,
                       "trainer": trainer.state_dict() if trainer is not None else None}
    staging = root / f".tmp-{token:016x}"
    if to_host is not None:
        tensors = to_host(tensors)
    return StagedSave(tensors, files, pages, root, staging, root / f"step-{step:08d}-{token:016x}", step, keep)


def commit(staged: StagedSave, group: Any = None) -> Path:
    """The second half, collective on `group` (default: the default group): make the staging
    folder every rank must see, write through DCP,
    record every file's digest in the commit marker, rename the folder into place, point LATEST
    at it, prune. A failure on any rank is raised on every rank (no rank waits at a barrier for
    one that gave up); the previous version stays the latest."""
    staging, final, rank = staged.staging, staged.final, _rank(group)
    _make_staging(staged.root, staging, group)
    dcp.save(staged.tensors, checkpoint_id=str(staging), planner=PagedSavePlanner(staged.pages),
             process_group=group)
    drop_pages(staged.pages)
    _agreed(lambda: [_write_json(staging / name, value) for name, value in staged.files.items()],
            f"writing {staging}", group)
    files = _file_digests(staging, sorted(p.name for p in staging.iterdir()), group)

    def publish() -> None:
        if rank == 0:
            _write_json(staging / COMMIT_MARKER, {"step": staged.step, "files": files})
            _fsync_dir(staging)
            os.rename(staging, final)
            _write_text_atomically(staged.root / LATEST, final.name)
            _fsync_dir(staged.root)
            _prune(staged.root, staged.keep)
    _agreed(publish, f"committing {final}", group)
    return final


def _agreed(action: Callable[[], Any], doing: str, group: Any) -> None:
    """Run this rank's `action`, then raise on every rank if it failed on any (naming which)."""
    failure = None
    try:
        action()
    except Exception as error:  # any: the other ranks must not wait for this one
        failure = f"{type(error).__name__}: {error}"
    failures = [(rank, found) for rank, found in enumerate(_gathered(failure, group)) if found]
    if failures:
        where = "; ".join(f"rank {rank}: {found}" for rank, found in failures)
        raise CheckpointError(f"{doing} failed ({where})")


def _savable_state(pm: Any, trainer: Any, group: Any = None) -> tuple[dict[str, dict], dict[str, Any]]:
    """This rank's tensors (for DCP) and every rank's non-tensor values as JSON (ZeRO-1 and pipeline
    ranks each hold some parameters' optimizer settings). A value JSON cannot hold exactly is
    refused on every rank, naming it, before any folder is made."""
    tensors, others = split_state(rank_state(pm, trainer))
    gathered = _gathered(to_json(others), group)
    refused = _unique(name for _, names in gathered for name in names)
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise CheckpointError(
            f"cannot save {refused[0]}{more}: a checkpoint keeps every non-tensor value as JSON "
            "(None, bool, int, float, str, and tuples or lists of them), never as a pickle; make it "
            "one of those (e.g. float(value)) or a tensor")
    merged: dict[str, Any] = {}
    for encoded, _ in gathered:
        merged.update(encoded)
    return tensors, merged


def _make_staging(root: Path, staging: Path, group: Any = None) -> None:
    """Rank 0 makes the staging folder and every rank must then see it. Rank 0's failure to make it
    (no permission, a file in the way, a full disk) is every rank's error, so no rank waits for it
    at a barrier; a folder local to one host would otherwise fail deep inside DCP on the others."""
    failure = None
    if _rank(group) == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
    failure = _gathered(failure, group)[0]
    if failure is not None:
        raise CheckpointError(f"rank 0 cannot create the checkpoint folder {root} ({failure}); save to a "
                              "folder every rank can write, e.g. one under your home directory")
    seen = _gathered((staging.is_dir(), socket.gethostname()), group)
    unseen = [rank for rank, (visible, _) in enumerate(seen) if not visible]
    if not unseen:
        return
    if _rank(group) == 0:
        shutil.rmtree(staging, ignore_errors=True)
    hosts = ", ".join(_unique(seen[rank][1] for rank in unseen))
    raise CheckpointError(f"rank(s) {', '.join(map(str, unseen))} (on {hosts}) cannot see "
                          f"{staging.parent}, which rank 0 (on {seen[0][1]}) created: save to a folder "
                          "on a file system every host shares")


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """The committed version a load of `path` would use (a root or a version folder)."""
    path = Path(path)
    if (path / COMMIT_MARKER).is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"no committed checkpoint under {str(path)!r} (no {LATEST} file); "
                              "pass the folder given to colab_par.save")
    version = path / pointer.read_text().strip()
    if not (version / COMMIT_MARKER).is_file():
        raise CheckpointError(f"{str(version)!r} has no {COMMIT_MARKER} marker: it was never "
                              "committed; refusing to load a partial checkpoint")
    return version


def saved_history(path: str | os.PathLike) -> list[dict] | None:
    """This rank's trainer history as the latest committed version under `path` saved it (None
    when that version has none for this rank)."""
    found = latest_checkpoint(path) / f"history-rank{_rank()}.json"
    return json.loads(found.read_text()) if found.is_file() else None


# ---- load ----------------------------------------------------------------------------------------
def load(pm: Any, path: str | os.PathLike, *, trainer: Any = None) -> dict:
    """Load the latest committed version under `path` into `pm` (any layout); call on every rank.

    Restores the trainer's step, data position and LR bases, and RNG states when the world size
    matches. Returns the checkpoint's metadata (including the layout it was saved under).

    Before any tensor is read, every file is checked against the sizes and SHA-256 sums recorded at
    commit (raising CheckpointError naming the damaged file and the newest earlier intact
    version), and every tensor's global shape against the model's. Only tensors and JSON are read:
    a checkpoint listing anything pickled is refused (see `checkpoint_format.py`).
    """
    version = latest_checkpoint(path)
    _refuse_other_format(version)
    _refuse_damaged(version)
    meta = json.loads((version / META).read_text())
    if trainer is not None:
        _check_resumable(meta, trainer, version)
    pages = disk_pages(local_optimizer(pm))
    state = rank_state(pm, trainer)
    tensors, others = split_state(state)
    reader = TensorOnlyReader(version)
    saved_others, metadata = _saved_non_tensors(version), reader.read_metadata()
    wanted = [f"{part}.{key}" for part, values in tensors.items() for key in values] + list(others)
    sources = tied_sources(pm.tied_names, wanted, {*metadata.state_dict_metadata, *saved_others})
    _refuse_misfit(tensors, others, metadata, saved_others, version, sources)
    reads, copies = read_through_aliases(tensors, sources)
    dcp.load(reads, storage_reader=reader, planner=PagedLoadPlanner(pages))
    for tensor, source in copies:
        tensor.copy_(source)
    for part, values in tensors.items():
        state[part].update(values)
    for name in others:
        part, key = name.split(".", 1)
        state[part][key] = from_json(saved_others[sources.get(name, name)], name)
    install_state(pm, state)
    if trainer is not None:
        trainer.load_state_dict(meta["trainer"])
    rng_file = version / f"rng-rank{_rank()}.json"
    # Each rank's RNG stream (parallel/rng.py) belongs to its place in the saved layout's mesh.
    if meta["world_size"] == _world() and meta["layout"] == str(pm.layout) and rng_file.is_file():
        _set_rng_state(pm.rng, json.loads(rng_file.read_text()))
    _barrier()
    return meta


def _format(version: Path) -> Any:
    """The format its meta.json names (None when that file is missing or not a JSON object)."""
    try:
        meta = json.loads((version / META).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("format") if isinstance(meta, dict) else None


def _refuse_other_format(version: Path) -> None:
    """Before the checksums: an older version's files are intact, yet this colab_par must not read
    them. (A missing or garbled meta.json is left to the integrity check, which names it.)"""
    found = _format(version)
    if found is None or found == FORMAT:
        return
    if found == 1:
        raise CheckpointError(
            f"checkpoint {version} has format 1 (an older colab_par), which stores optimizer "
            f"settings as pickles; this colab_par reads format {FORMAT} only, because unpickling a "
            "checkpoint can run any code. Load it with the colab_par release that wrote it only if "
            "you trust its source, or train again")
    raise CheckpointError(f"checkpoint {version} has format {found!r}; this colab_par reads format "
                          f"{FORMAT}: load it with the colab_par release that wrote it")


def _saved_non_tensors(version: Path) -> dict[str, Any]:
    saved = json.loads((version / NON_TENSORS).read_text())
    if not isinstance(saved, dict):
        raise CheckpointError(f"{version / NON_TENSORS} is not a JSON object; the file was altered")
    return saved


def _check_resumable(meta: dict, trainer: Any, version: Path) -> None:
    """Refuse, before touching any tensor, a checkpoint the trainer cannot continue from."""
    saved = meta.get("trainer")
    if saved is None:
        raise CheckpointError(f"{str(version)!r} was saved without a trainer; load without "
                              "trainer= or resume from a checkpoint that Trainer wrote")
    if saved.get("data") != trainer.data.describe():
        raise CheckpointError(f"{str(version)!r} was trained on data {saved.get('data')} but this "
                              f"trainer has {trainer.data.describe()}; build the same dataset to resume")


# ---- integrity: checksums recorded at commit, verified at load -------------------------------------
def _damage(version: Path) -> list[str]:
    """What differs from the commit record (same list on every rank)."""
    try:
        recorded = json.loads((version / COMMIT_MARKER).read_text()).get("files")
    except (ValueError, AttributeError):
        return [f"its {COMMIT_MARKER} record is not a JSON object"]
    if not isinstance(recorded, dict):
        return [f"its {COMMIT_MARKER} record lists no file checksums"]
    present = [name for name in sorted(recorded) if (version / name).is_file()]
    found = _file_digests(version, present)
    problems = [f"{name} is not in its {COMMIT_MARKER} record" for name in (META, NON_TENSORS)
                if name not in recorded]
    for name, expected in sorted(recorded.items()):
        actual = found.get(name)
        if actual is None:
            problems.append(f"{name} is missing")
        elif actual["bytes"] != expected["bytes"]:
            problems.append(f"{name} is {actual['bytes']} bytes but {expected['bytes']} were committed")
        elif actual["sha256"] != expected["sha256"]:
            problems.append(f"{name} does not match the SHA-256 recorded at commit")
    return problems


def _refuse_damaged(version: Path) -> None:
    problems = _damage(version)
    if not problems:
        return
    more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
    raise CheckpointError(f"checkpoint {version} is damaged: {problems[0]}{more}; "
                          f"{_earlier_intact(version)}")


def _earlier_intact(version: Path) -> str:
    """Where to go instead: the newest earlier committed version whose files all check out."""
    committed = sorted((p for p in version.parent.glob("step-*")
                        if p != version and (p / COMMIT_MARKER).is_file()),
                       key=lambda p: (p / COMMIT_MARKER).stat().st_mtime, reverse=True)
    for earlier in committed:
        if _format(earlier) == FORMAT and not _damage(earlier):
            return f"the earlier checkpoint {earlier} is intact: load that path instead"
    return f"no earlier committed checkpoint under {version.parent} is intact"


# ---- fit: the checkpoint's tensors against the model's, before DCP reads them -----------------------
def _refuse_misfit(tensors: dict[str, dict], others: dict[str, Any], metadata: Any,
                   saved_others: dict[str, Any], version: Path, sources: dict[str, str]) -> None:
    """Compare names and global shapes with the checkpoint's (tensors with DCP's metadata, other
    values with its JSON; an entry in `sources` with the tied tensor's entry it is read from);
    one line on every rank.

    Each rank checks what it holds; the model names of all ranks together (pipeline stages hold
    only theirs) decide which checkpoint entries this model lacks."""
    saved = metadata.state_dict_metadata
    mismatched, missing = [], []
    local = [(f"{part}.{key}", value) for part, values in tensors.items() for key, value in values.items()]
    for name, value in local + list(others.items()):
        tensor, found = isinstance(value, torch.Tensor), sources.get(name, name)
        shown = name[len("model."):] if name.startswith("model.") else f"optimizer {name[len('optim.'):]}"
        if found not in (saved if tensor else saved_others):
            missing.append(shown)
        elif tensor and list(saved[found].size) != list(value.shape):
            mismatched.append(f"{shown} is {list(saved[found].size)} in the checkpoint but "
                              f"{list(value.shape)} here")
    model_keys = list(tensors["model"]) + [name[len("model."):] for name in others
                                           if name.startswith("model.")]
    gathered = _gathered((mismatched, missing, model_keys))
    mismatched = sorted(_unique(m for rank in gathered for m in rank[0]),
                        key=lambda reason: reason.startswith("optimizer "))  # parameters first
    missing = _unique(m for rank in gathered for m in rank[1])
    ours = {f"model.{key}" for rank in gathered for key in rank[2]}
    unexpected = [key[len("model."):] for key in (*saved, *saved_others)
                  if key.startswith("model.") and key not in ours]
    reasons = (mismatched + [f"{key} is not in the checkpoint" for key in missing]
               + [f"the checkpoint has {key}, which this model lacks" for key in unexpected])
    if not reasons:
        return
    counts = [f"{n} {what}" for n, what in ((len(mismatched), "mismatched"), (len(missing), "missing"),
                                            (len(unexpected), "unexpected")) if n]
    raise CheckpointError(f"checkpoint {version} does not fit this model: {reasons[0]} "
                          f"({', '.join(counts)} in all); build the model it was saved from")


# ---- relayout ------------------------------------------------------------------------------------
def relayout(pm: Any, layout: Any, *, trainer: Any = None,
             model_factory: Callable[[], torch.nn.Module] | None = None,
             scratch_dir: str | os.PathLike | None = None) -> Any:
    """Move a live model to another layout without restarting engines: save through DCP, rebuild,
    parallelize with `layout`, load (DCP reshards). Returns the new ParallelModel and re-points
    `trainer` at it. `scratch_dir` is where the checkpoint is staged, a folder every rank can read
    (default: the system temp dir, which only serves while all ranks run on one host; on several
    hosts it is required)."""
    from colab_par.layout import Layout
    from colab_par.parallel import parallelize

    new_layout = Layout.parse(layout)
    factory = model_factory or _default_factory(pm)
    new_layout.validate(_world(), getattr(factory, "config", None))
    base = _staging_base(scratch_dir)
    scratch = base / f"colab_par-relayout-{shared_random_id():016x}"
    try:
        save(pm, scratch, trainer=trainer, keep=1)
        optimizer_fn = getattr(pm, "optimizer_fn", None) or _same_optimizer(pm.optimizer)
        options = getattr(pm, "parallelize_options", {})  # the same loss_fn, blocks, tp_plan
        new_pm = parallelize(factory, new_layout, **{**options, "optimizer_fn": optimizer_fn})
        load(new_pm, scratch, trainer=trainer)
    finally:
        _barrier()
        if _rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if trainer is not None:
        trainer.pm = new_pm
    return new_pm


def _staging_base(scratch_dir: str | os.PathLike | None) -> Path:
    """`scratch_dir`, or the system temp dir while every rank reports the same host (each host has
    its own temp dir, which the other hosts' ranks cannot read). Same answer on every rank."""
    if scratch_dir is not None:
        return Path(scratch_dir)
    hosts = _gathered(socket.gethostname())
    if len(set(hosts)) > 1:
        raise CheckpointError(_local_staging_refusal(hosts))
    return Path(tempfile.gettempdir())


def _local_staging_refusal(hosts: list[str]) -> str:
    """Why relayout will not stage in a local temp dir for ranks on `hosts` (rank i on hosts[i])."""
    where = "; ".join(f"{host}: rank(s) {', '.join(str(r) for r, h in enumerate(hosts) if h == host)}"
                      for host in _unique(hosts))
    return (f"relayout stages a checkpoint that every rank reads, and the ranks run on "
            f"{len(set(hosts))} hosts ({where}), each with its own {tempfile.gettempdir()}; pass "
            "scratch_dir= a folder on a file system all hosts share (in a notebook: %colossal "
            "relayout LAYOUT --scratch-dir PATH)")


def _same_optimizer(optimizer: torch.optim.Optimizer) -> Callable:
    """An optimizer_fn building the live optimizer's class with its defaults (the checkpoint then
    restores per-group settings and state)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the real one
    accepted = inspect.signature(type(inner).__init__).parameters
    settings = {key: value for key, value in inner.defaults.items() if key in accepted}
    return lambda params: type(inner)(params, **settings)


def _default_factory(pm: Any) -> Callable[[], torch.nn.Module]:
    factory = getattr(pm, "model_factory", None)
    if factory is None:
        raise CheckpointError("relayout needs to rebuild the model but it was not built from a "
                              "config; pass model_factory=lambda: MyModel(...)")
    return factory


# ---- model and optimizer state ---------------------------------------------------------------------
def rank_state(pm: Any, trainer: Any = None) -> dict[str, dict]:
    """{"model": ..., "optim": ...} with DCP-style flat names; mostly tensors, plus the optimizer's
    hyper-parameters (`checkpoint_format.split_state` separates them). A loop with tensors of its
    own (GRPO's frozen reference weights) adds them as more parts by `checkpoint_tensors(pm)`:
    tensors laid out as `pm`, which DCP fills in place."""
    model: dict[str, Any] = {}
    for part in pm.model_parts:
        model.update(get_model_state_dict(part))
    state = {"model": model, "optim": get_optimizer_state_dict(_stages(pm), local_optimizer(pm),
                                                               options=_OPTIONS)}
    own = getattr(trainer, "checkpoint_tensors", None)
    if own is not None:
        state.update(own(pm))
    return state


def install_state(pm: Any, state: dict[str, dict]) -> None:
    """Set `state` (`rank_state`'s dict, its tensors filled in place and its values replaced) into
    this rank's model parts and optimizer."""
    for part in pm.model_parts:
        own = get_model_state_dict(part)
        set_model_state_dict(part, {key: state["model"][key] for key in own})
    set_optimizer_state_dict(_stages(pm), local_optimizer(pm), state["optim"], options=_OPTIONS)
    _expose_loaded_settings(pm.optimizer)


def local_optimizer(pm: Any) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state. ZeRO-1 keeps each parameter's state on one rank in
    an inner optimizer over the parameters it owns: every rank saves its own FQNs, and the union
    is the full state, which DCP reshards into any layout."""
    return pm.optimizer.optim if isinstance(pm.optimizer, ZeroRedundancyOptimizer) else pm.optimizer


def _expose_loaded_settings(optimizer: torch.optim.Optimizer) -> None:
    """ZeroRedundancyOptimizer copies its own param_groups onto its inner optimizer's at every
    step: give them the hyper-parameters just loaded into the inner one."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        for outer, inner in zip(optimizer.param_groups, optimizer.optim.param_groups):
            outer.update({key: value for key, value in inner.items() if key != "params"})


def _stages(pm: Any) -> torch.nn.Module:
    """This rank's model parts as one module under the model's names, which the optimizer's state
    dict goes through (several pipeline stages per rank share one optimizer)."""
    try:
        return stages_as_one(list(pm.model_parts))
    except ValueError as error:
        raise CheckpointError(f"cannot save or load this rank's pipeline stages: {error}") from None
