"""Memory tiers on real engines: a budget that forces spilling holds (measured VmHWM), training with
state on disk matches one-process AdamW, checkpoints move between tiered and plain layouts, and
what cannot work is refused before training.

Chunks are lowered to a few KiB (parity) or 2 MiB (budget) so that every run streams several.
"""
from __future__ import annotations

import os
import sys

import cloudpickle
import pytest
import torch

from colab_par.models import GPT, GPTConfig
from parity import (SEED, _parallelized, _train, assert_parity, batches, engine_model, reference_run,
                    training_batches)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

STEPS = 4
SMALL_CHUNK = 16 * 1024  # bytes: the tiny GPT's 0.1 MB of parameters make a dozen chunks
BIG_CHUNK = 2 * 2 ** 20
# 50 M parameters: under dp2 each rank holds 192 MiB of parameters, as much in gradients and in
# DDP's buckets, and 384 MiB of AdamW state. Measured on 2026-11-26 (gloo, 2 engines on 2 cores):
# without tiers a rank peaks ~1090 MiB over its RSS before the model, with its working memory
# ~310-330 MiB; so 900 MiB holds only with much of the state spilled to disk.
BIG_GPT = dict(vocab_size=64, seq_len=16, n_layer=4, n_head=8, d_model=1024, kernels="torch")
BUDGET = 900 * 2 ** 20


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _released() -> None:
    """Hand the memory of a dropped ParallelModel back before the next run on the same engine."""
    import gc

    from colab_par.memory_tiers.host_heap import trim_host_heap

    gc.collect()
    trim_host_heap()


def _peak_run(layout: str, steps: int = 4) -> dict:
    """Engine side: the training peak (VmHWM) of the big GPT above the RSS before parallelize."""
    import colab_par.memory_tiers.chunks as chunks
    from colab_par.memory_tiers import host_heap
    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig
    from colab_par.parallel import memory_report

    chunks.CHUNK_BYTES = BIG_CHUNK
    _released()
    baseline = _status("VmRSS")
    torch.manual_seed(SEED)  # both runs start from the same weights
    pm = parallelize(lambda: GPT(GPTConfig(**BIG_GPT)), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    losses = []
    for batch in batches(64, 16, steps, batch=2):  # as the Trainer steps: the norm read, clipped
        losses.append(pm.forward_backward(*batch))
        pm.clip_grad_norm_(1.0)
        pm.optimizer_step()
    peak = _status("VmHWM")
    report = memory_report(pm)
    tightened = getattr(pm.optimizer, "heap_tightened", False)
    del pm
    _released()
    return {"baseline": baseline, "peak": peak, "losses": losses, "report": report, "tightened": tightened,
            "loosened": not host_heap._tight}


def test_a_budget_that_forces_spilling_holds_and_fails_without_tiers(cluster2) -> None:
    """First in this module, on engines nothing has trained on yet: the training peak of each rank,
    clipping included (its norm reads the gradients on disk), stays within budget + the RSS it had
    before the model was built; the same run without tiers
    does not fit that budget (so the check can fail), and auto placement really spilled to disk.
    The budget binds, so the heap was tightened for the run, and loosened when the model went."""
    tiered = cluster2.run(_peak_run, f"dp2 mem{BUDGET // 2 ** 20}MiB disk")
    plain = cluster2.run(_peak_run, "dp2")  # measured against the same, clean baseline
    for rank, (mine, without) in enumerate(zip(tiered, plain)):
        assert mine["report"]["tier_disk"] > 0, f"rank {rank}: nothing was placed on disk"
        assert mine["report"]["tier_moved"] > 0 and mine["report"]["tier_working"] > 0
        assert mine["report"]["tier_budget"] == BUDGET  # what the dashboard draws its line at
        assert mine["report"]["grads"] == 0, f"rank {rank}: the gradients stayed in memory"
        assert mine["tightened"] and mine["loosened"] and not without["tightened"]
        over, over_without = mine["peak"] - mine["baseline"], without["peak"] - mine["baseline"]
        assert over <= BUDGET, f"rank {rank}: peak {over / 2 ** 20:.1f} MiB over the baseline, budget 900 MiB"
        assert over_without > BUDGET, (
            f"rank {rank}: without tiers the run fits 900 MiB ({over_without / 2 ** 20:.1f} MiB): the budget "
            "proves nothing")
        torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(without["losses"]), rtol=1e-5, atol=0)


def _norm_rise(layout: str) -> dict:
    """Engine side, the big GPT: how far the resident set rises (VmHWM over VmRSS just before) while
    the gradient norm reads the gradients the tiers hold on disk, the norm, and the bytes moved by a
    clipped step and by an unclipped one after it (the first step reads no optimizer state yet)."""
    import math

    import colab_par.memory_tiers.chunks as chunks
    from colab_par import parallelize
    from colab_par.parallel import memory_report

    chunks.CHUNK_BYTES = BIG_CHUNK
    _released()
    torch.manual_seed(SEED)
    pm = parallelize(lambda: GPT(GPTConfig(**BIG_GPT)), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))
    first, clipped, plain = batches(64, 16, 3, batch=2)
    pm.forward_backward(*first)
    pm.optimizer_step()
    pm.forward_backward(*clipped)
    placed = getattr(pm.optimizer, "placed_bytes", None)  # the tiers' optimizer; plain AdamW without
    grads_on_disk = placed()["disk"]["grads"] if placed else 0
    _released()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    norm = float(pm.clip_grad_norm_(math.inf))
    rise = _status("VmHWM") - before
    resident_grads = memory_report(pm)["grads"]
    pm.optimizer_step()
    moved_clipped = getattr(pm.optimizer, "last_moved", 0)
    pm.forward_backward(*plain)
    pm.optimizer_step()
    moved_plain = getattr(pm.optimizer, "last_moved", 0)
    del pm
    _released()
    return {"rise": rise, "grads_on_disk": grads_on_disk, "resident_grads": resident_grads, "norm": norm,
            "moved_by_clipping": moved_clipped - moved_plain}


def test_the_gradient_norm_reads_gradients_on_disk_a_chunk_at_a_time(cluster2) -> None:
    """Clipping with gradients on disk: the norm's pass over them raises a rank's resident set by a
    few 2 MiB chunks, not by the 96 MiB of gradients each rank holds there (read all at once, the
    rise would be that); it reads them once more, what the planner adds for a clipped run
    (`estimate(..., grad_clip=True)`, test_tier_costs), and the norm equals the one of the same
    gradients kept in memory."""
    tiered = cluster2.run(_norm_rise, "dp2 zero3 grads@disk optimizer@disk")
    plain = cluster2.run(_norm_rise, "dp2 zero3")
    for rank, (mine, without) in enumerate(zip(tiered, plain)):
        assert mine["resident_grads"] == 0 and mine["grads_on_disk"] >= 90 * 2 ** 20, mine
        assert mine["rise"] <= 8 * BIG_CHUNK, (
            f"rank {rank}: the norm raised the resident set by {mine['rise'] / 2 ** 20:.1f} MiB with "
            f"{mine['grads_on_disk'] / 2 ** 20:.0f} MiB of gradients on disk")
        assert mine["moved_by_clipping"] == mine["grads_on_disk"]
        assert mine["norm"] == pytest.approx(without["norm"], rel=1e-6)


def _checkpoint_rise(layout: str, folder: str) -> dict:
    """Engine side, the big GPT after two steps: how far the resident set rises (VmHWM over VmRSS
    just before) while it is saved, and while a fresh model loads it; the next loss of each."""
    import colab_par.memory_tiers.chunks as chunks
    from colab_par import load, parallelize, save

    chunks.CHUNK_BYTES = BIG_CHUNK

    def build() -> object:
        _released()
        torch.manual_seed(SEED)
        return parallelize(lambda: GPT(GPTConfig(**BIG_GPT)), layout,
                           optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-3))

    def rise(work: object, pm: object) -> int:
        _released()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        work(pm, folder)
        return _status("VmHWM") - before

    *steps, following = batches(64, 16, 3, batch=2)
    saved = build()
    for batch in steps:
        saved.train_step(*batch)
    on_disk = sum(saved.optimizer.placed_bytes()["disk"].values())
    saving = rise(save, saved)
    continued = saved.train_step(*following)
    del saved
    fresh = build()
    loading = rise(load, fresh)
    result = {"on_disk": on_disk, "save": saving, "load": loading, "continued": continued,
              "loaded": fresh.train_step(*following)}
    del fresh
    _released()
    return result


def test_checkpoints_read_and_write_the_disk_tier_a_chunk_at_a_time(cluster2, tmp_path) -> None:
    """Saving the big GPT with 200 MiB of AdamW state per rank on disk, and loading it into a fresh
    model, raise a rank's resident set by a few chunks and DCP's own buffers, not by that state
    (measured before: +200 MiB at save, DCP holding a copy of every tensor of its file; +290 MiB at
    load, the state's pages and torch's zero-gradient step); the loaded model goes on exactly as
    the saved one does."""
    for rank, result in enumerate(cluster2.run(_checkpoint_rise, "dp2 zero3 optimizer@disk grads@disk",
                                               str(tmp_path / "ckpt"))):
        assert result["on_disk"] >= 190 * 2 ** 20, result
        for what in ("save", "load"):
            assert result[what] <= 64 * 2 ** 20, (
                f"rank {rank}: {what} raised the resident set by {result[what] / 2 ** 20:.0f} MiB with "
                f"{result['on_disk'] / 2 ** 20:.0f} MiB of state on disk")
        assert result["loaded"] == result["continued"]


FULL_DISK_CHILD = r"""
import resource, socket, sys
import torch
import torch.distributed as dist
from colab_par.memory_tiers.stores import DiskStore, DiskTierFull

folder = sys.argv[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))  # python ignores SIGXFSZ
try:
    DiskStore(folder, "big", 2 ** 20, torch.float32)  # 4 MiB
except DiskTierFull as error:
    print("store:", error)
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from colab_par import parallelize
from colab_par.models import GPT, GPTConfig

config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64, kernels="torch")
pm = parallelize(lambda: GPT(config), f"dp1 optimizer@disk disk:{folder}")
tokens = torch.randint(0, 64, (2, 17))
try:
    pm.train_step(tokens[:, :-1], tokens[:, 1:])
except DiskTierFull as error:
    print("step:", error)
"""


def test_disk_chunks_reserve_their_blocks_and_a_full_disk_is_a_clear_error(tmp_path) -> None:
    """A chunk's file has its blocks allocated when it is made: a write through the mapping into a
    block the disk lacks would kill the rank with SIGBUS mid-step, so a full disk is refused when
    the file is made, naming the folder, the space and what to do; a placement that needs more
    than the folder's free space is refused before any file is written. The full disk is real: the
    file-size limit (RLIMIT_FSIZE) of a child process, which trains one step of a one-rank layout."""
    import shutil
    import subprocess

    from colab_par.memory_tiers.stores import DiskStore, DiskTierFull, check_disk_room

    store = DiskStore(str(tmp_path), "reserved", 2 ** 20, torch.float32)
    assert os.stat(store.path).st_blocks * 512 >= store.nbytes  # not a sparse file
    store.close()
    with pytest.raises(DiskTierFull, match="rank 1: the disk tier's folder .* needs .* GiB more"):
        check_disk_room(str(tmp_path), shutil.disk_usage(tmp_path).free + 2 ** 30, rank=1)
    full = tmp_path / "full"
    full.mkdir()
    done = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(full)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["store", "step"], done.stdout + done.stderr[-2000:]
    for line in lines:
        assert f"the disk tier's folder {full}" in line and "disk:/path" in line, line
    assert not [path for path in full.rglob("*") if path.is_file()]  # nothing half-made is left


def test_parameters_on_disk_leave_the_resident_set(cluster2) -> None:
    """params@disk on engines that trained before (the budget run above tightened and loosened
    glibc's heap, leaving it full of free holes): the big GPT's 192 MiB of parameters per rank live
    in files, paged in a chunk at a time, so each rank's training peak (VmHWM over its RSS before
    the model) falls by most of them against the same run with only the optimizer on disk, and the
    losses are the same. Fails if the parameters stay in memory, or if the heap keeps freed blocks
    resident in their place (measured before the per-forward trim: 9 to 90 MiB on some ranks)."""
    with_params = cluster2.run(_peak_run, "dp2 params@disk optimizer@disk")
    without = cluster2.run(_peak_run, "dp2 optimizer@disk")
    params = sum(p.numel() for p in GPT(GPTConfig(**BIG_GPT)).parameters()) * 4
    for rank, (mine, other) in enumerate(zip(with_params, without)):
        saved = (other["peak"] - other["baseline"]) - (mine["peak"] - mine["baseline"])
        assert saved >= params * 3 / 4, (
            f"rank {rank}: the peak fell by {saved / 2 ** 20:.0f} MiB of {params / 2 ** 20:.0f} MiB of parameters")
        assert mine["report"]["tier_disk"] - other["report"]["tier_disk"] == params
        torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(other["losses"]), rtol=1e-6, atol=0)


def _tiered_run(layout: str, kind: str = "gpt", steps: int = STEPS) -> dict:
    """Engine side: parity's training run with small chunks, plus the memory report."""
    import colab_par.memory_tiers.chunks as chunks
    from colab_par.parallel import memory_report

    chunks.CHUNK_BYTES = SMALL_CHUNK
    pm = _parallelized(engine_model(kind, "module"), layout)
    run = _train(pm, kind, training_batches(kind, steps))
    result = {**run, "state": pm.full_state_dict(), "report": memory_report(pm),
              "tightened": pm.optimizer.heap_tightened, "param_files": _backing_files(pm.model.parameters()),
              "chunks": len(pm.optimizer._chunks), "folder": getattr(pm.optimizer._folder, "path", None)}
    del pm
    _released()
    result["folder_left"] = result["folder"] is not None and os.path.exists(result["folder"])
    return result


def _backing_files(params) -> set:
    """The file behind each parameter's values (/proc/self/maps), "memory" for anonymous memory."""
    from colab_par.memory_tiers.chunks import local

    with open("/proc/self/maps") as maps:
        regions = [(int(span.split("-")[0], 16), int(span.split("-")[1], 16), rest[4] if len(rest) > 4 else "")
                   for span, *rest in (line.split() for line in maps)]
    found = set()
    for p in params:
        address = local(p).data_ptr()
        path = next((path for start, end, path in regions if start <= address < end), "")
        found.add(os.path.dirname(path) if path.startswith("/") else "memory")
    return found


def _check_parameters_in_files(result: dict) -> None:
    """params@disk: every parameter's values live in the run's disk folder, none in memory, and the
    report counts them on disk."""
    assert result["param_files"] == {result["folder"]}, result["param_files"]
    assert result["report"]["params"] == 0 and result["report"]["tier_disk"] > 0


@pytest.mark.parametrize("layout,on_disk", [
    ("dp2 mem1GiB disk", False),  # fits: auto keeps everything resident
    ("dp2 optimizer@disk", True),
    ("dp2 zero3 optimizer@disk", True),
    ("dp2 zero3 optimizer@disk grads@disk", True),
    ("tp2 optimizer@disk", True),  # DTensor local shards
    ("tp2 optimizer@host", False),  # the vocabulary-sharded embedding: its gradient sharded like it
    ("pp2 optimizer@disk", True),  # each rank its stage's parameters
    ("dp2 params@disk optimizer@disk", True),  # parameters too: their storage is the chunk's file
    ("tp2 params@disk optimizer@disk", True),
    ("pp2 params@disk", True),
])
def test_tiered_gpt_trains_like_single_process(cluster2, layout: str, on_disk: bool) -> None:
    results = cluster2.run(_tiered_run, layout)
    assert_parity(results, reference_run("gpt", STEPS))
    for result in results:
        assert result["chunks"] > 3
        assert (result["report"]["tier_disk"] > 0) == on_disk
        assert (result["report"]["tier_moved"] > 0) == on_disk
        assert not result["tightened"], "the heap was tightened though no budget bound"
        assert not result["folder_left"], "the disk tier's folder outlived the model"
        if "params@disk" in layout:
            _check_parameters_in_files(result)
        else:
            assert result["param_files"] == {"memory"}
    if "grads@disk" in layout:
        grads_on_disk = results[0]["report"]["tier_disk"] - results[0]["report"]["optimizer"]
        assert results[0]["report"]["grads"] == 0 and grads_on_disk > 0


ZERO1_STEPS = 6


def _disk_bytes(folder: "str | None") -> int:
    """Bytes of the files in the disk tier's folder, as the file system sizes them."""
    if folder is None or not os.path.isdir(folder):
        return 0
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))


def _zero1_run(layout: str) -> dict:
    """Engine side: parity's training run with small chunks, the memory report and the disk
    tier's file bytes after the first step and at the end, and the state elements this rank owns."""
    import colab_par.memory_tiers.chunks as chunks
    from colab_par.memory_tiers.chunks import local
    from colab_par.parallel import memory_report

    chunks.CHUNK_BYTES = SMALL_CHUNK
    pm = _parallelized(engine_model("gpt", "module"), layout)
    batches = training_batches("gpt", ZERO1_STEPS)
    first = _train(pm, "gpt", batches[:1])
    optimizer = pm.optimizer
    folder = getattr(optimizer._folder, "path", None)
    after_first = {"report": memory_report(pm), "files": _disk_bytes(folder)}
    rest = _train(pm, "gpt", batches[1:])
    owned = sum(slot.numel for chunk in optimizer._chunks for slot in chunk.slots)
    return {**{key: first[key] + rest[key] for key in first}, "state": pm.full_state_dict(),
            "first": after_first, "report": memory_report(pm), "files": _disk_bytes(folder), "owned": owned,
            "elements": sum(local(p).numel() for p in pm.model.parameters())}


@pytest.mark.parametrize("layout", ["dp2 zero1 optimizer@disk", "dp2 zero1 mem1GiB disk"])
def test_zero1_keeps_and_tiers_only_this_ranks_share_of_the_state(cluster2, layout: str) -> None:
    """ZeRO-1 with tiers trains like one-process AdamW over 6 steps while each rank keeps, steps and
    writes to disk only its own share of the AdamW state: the two shares partition the parameters,
    and after the first step each rank's state on disk (reported, and the files' sizes) is about
    half of what the same layout without zero1 puts there. With a budget the first step is placed
    pessimistically (the state on disk); the measured placement then brings the tiny model's state
    back into memory, still this rank's share."""
    results = cluster2.run(_zero1_run, layout)
    assert_parity(results, reference_run("gpt", ZERO1_STEPS))
    zero0 = cluster2.run(_zero1_run, layout.replace("zero1 ", ""))
    n = results[0]["elements"]
    assert sum(result["owned"] for result in results) == n and all(result["owned"] == n for result in zero0)
    whole, whole_files = zero0[0]["first"]["report"]["tier_disk"], zero0[0]["first"]["files"]
    assert whole == 8 * n  # zero0: both AdamW moments of every element on every rank's disk
    for rank, result in enumerate(results):
        share = 8 * result["owned"]
        first, last = result["first"], result["report"]
        assert first["report"]["tier_disk"] == share, f"rank {rank}: on disk is not its own share"
        assert abs(2 * share - whole) <= 0.1 * whole, f"rank {rank} keeps {share} of {whole} bytes of state"
        assert abs(2 * first["files"] - whole_files) <= 0.1 * whole_files, (
            f"rank {rank}: {first['files']} bytes of files, zero0 {whole_files}")
        if "optimizer@disk" in layout:
            assert last["tier_disk"] == share and last["optimizer"] == 0
        else:  # the measured step found room for it: back in memory, counted as this rank's
            assert last["tier_disk"] == 0 and last["optimizer"] == share


def _one_parameter_error(layout: str) -> str:
    from colab_par import parallelize

    try:
        parallelize(torch.nn.Linear(4, 4, bias=False), layout, optimizer_fn=lambda p: torch.optim.AdamW(p))
    except ValueError as error:
        return str(error)
    return "no error"


def test_zero1_tiers_refuse_a_rank_that_would_own_nothing(cluster2) -> None:
    for message in cluster2.run(_one_parameter_error, "dp2 zero1 optimizer@disk"):
        assert "rank(s) [1] would own none" in message and "zero2/zero3" in message


def test_zero1_partition_is_largest_first_onto_the_least_loaded_rank() -> None:
    from colab_par.memory_tiers.ownership import owners_by_bytes

    # 5 -> rank 0 (5); 4 -> rank 1 (4); 3 -> rank 1 (7); 3 -> rank 0 (8); 1 -> rank 1 (8)
    assert owners_by_bytes([5, 4, 3, 3, 1], 2) == [0, 1, 1, 0, 1]
    assert owners_by_bytes([1, 1, 1], 4) == [0, 1, 2]


@pytest.mark.parametrize("layout,on_disk", [("dp2 mem1GiB disk", False), ("dp2 zero3 optimizer@disk", True),
                                            ("dp2 zero3 optimizer@disk grads@disk", True),
                                            ("dp2 params@disk optimizer@disk", True)])
def test_hugging_face_decoder_with_state_on_disk_trains_like_single_process(cluster2, layout: str,
                                                                             on_disk: bool) -> None:
    results = cluster2.run(_tiered_run, layout, "llama")
    assert_parity(results, reference_run("llama", STEPS))
    assert all((result["report"]["tier_disk"] > 0) == on_disk for result in results)
    if "params@disk" in layout:
        for result in results:
            _check_parameters_in_files(result)


def _accumulated_run(layout: str) -> dict:
    """Engine side: every step's gradient accumulated from two synchronised backward passes of
    half weight on the same batch (0.5 g + 0.5 g is g exactly): the reference's training."""
    import math

    import colab_par.memory_tiers.chunks as chunks

    chunks.CHUNK_BYTES = SMALL_CHUNK
    pm = _parallelized(engine_model("gpt", "module"), layout)
    losses, grad_norms = [], []
    for batch in training_batches("gpt", STEPS):
        losses.append(pm.forward_backward(*batch, loss_scale=0.5))
        pm.forward_backward(*batch, loss_scale=0.5)
        grad_norms.append(pm.clip_grad_norm_(math.inf))
        pm.optimizer_step()
    return {"losses": losses, "grad_norms": grad_norms, "state": pm.full_state_dict()}


CLIP = 0.5  # below every step's gradient norm of the test GPT (1.1-1.6), so every step is scaled


def _clipped_run(layout: str) -> dict:
    """Engine side: parity's training with every step's gradients clipped to CLIP."""
    import colab_par.memory_tiers.chunks as chunks

    chunks.CHUNK_BYTES = SMALL_CHUNK
    pm = _parallelized(engine_model("gpt", "module"), layout)
    return {**_train(pm, "gpt", training_batches("gpt", STEPS), CLIP), "state": pm.full_state_dict()}


@pytest.mark.parametrize("layout", ["dp2 zero3 optimizer@disk grads@disk",
                                    "dp2 params@disk optimizer@disk"])  # DDP: replicas split the norm
def test_clipping_gradients_on_disk_scales_them_as_one_process_does(cluster2, layout: str) -> None:
    """The norm counts the gradients on disk a chunk at a time and the step reads them scaled:
    Adam sees each step's clipping factor (it differs per step), so a factor left out shows."""
    assert_parity(cluster2.run(_clipped_run, layout),
                  reference_run("gpt", STEPS, max_norm=CLIP))


def test_gradients_on_disk_accumulate_over_backward_passes(cluster2) -> None:
    assert_parity(cluster2.run(_accumulated_run, "dp2 zero3 optimizer@disk grads@disk"), reference_run("gpt", STEPS))


def _reports(layout: str) -> dict:
    """Engine side: memory_report after the first backward and after the first and second steps."""
    import colab_par.memory_tiers.chunks as chunks
    from colab_par.memory_tiers.chunks import local
    from colab_par.parallel import memory_report
    from colab_par.training.telemetry import memory_sample

    chunks.CHUNK_BYTES = SMALL_CHUNK
    pm = _parallelized(engine_model("gpt", "module"), layout)
    first, second = training_batches("gpt", 2)
    pm.forward_backward(*first)
    backward = memory_report(pm)
    pm.optimizer_step()
    step = memory_report(pm)
    pm.train_step(*second)
    elements = sum(local(p).numel() for p in pm.model.parameters())
    published = {k: v for k, v in memory_sample(pm, 0, 0).items() if k.startswith("mem_tier_")}
    return {"backward": backward, "step": step, "second": memory_report(pm), "elements": elements,
            "published": published}


def test_memory_report_counts_state_per_tier(cluster2) -> None:
    """zero3 fp32 AdamW, optimizer and gradients pinned to disk: per rank 4 bytes per local element
    of parameters stay on the device, 4 of gradients and 8 of state are on disk, and a step moves
    the gradients in and the state in and out; telemetry publishes the same figures."""
    for report in cluster2.run(_reports, "dp2 zero3 optimizer@disk grads@disk"):
        n = report["elements"]
        assert report["backward"]["grads"] == 0 and report["backward"]["tier_disk"] == 4 * n
        for after in (report["step"], report["second"]):
            assert after["tier_device"] == after["params"] == 4 * n and after["optimizer"] == 0
            assert after["tier_disk"] == 12 * n and after["tier_host"] == 0
        # gradients written and read, state written (first step) / read and written (second)
        assert report["step"]["tier_moved"] == 4 * n + 4 * n + 8 * n
        assert report["second"]["tier_moved"] == 4 * n + 4 * n + 16 * n
        # what telemetry publishes to the dashboard: the same figures under mem_tier_*
        assert report["published"] == {f"mem_{key}": float(value) for key, value in report["second"].items()
                                       if key.startswith("tier_")}


def _bf16_shards(layout: str, source: str) -> dict:
    import colab_par.memory_tiers.chunks as chunks
    from colab_par.memory_tiers.chunks import local

    chunks.CHUNK_BYTES = SMALL_CHUNK
    pm = _parallelized(engine_model("gpt", source), layout)
    pm.forward_backward(*training_batches("gpt", 1)[0])
    grads = sorted({str(local(p.grad).dtype) for p in pm.model.parameters() if p.grad is not None})
    pm.optimizer_step()
    optimizer = pm.optimizer
    return {"params": sorted({str(local(p).dtype) for p in pm.model.parameters()}), "grads": grads,
            "master": sorted({store.tier for stores in optimizer._stores for kind, store in stores.items()
                              if kind == "master"})}


def test_bf16_zero3_with_optimizer_on_disk_keeps_bf16_shards_and_a_float32_master_on_disk(cluster2) -> None:
    """What a model larger than memory needs: each rank holds bf16 working shards (and bf16
    gradients), master and AdamW state on disk; it trains like float32 within bf16's rounding."""
    for source in ("module", "factory"):  # built whole, or shard-first on meta
        for shards in cluster2.run(_bf16_shards, "dp2 zero3 bf16 optimizer@disk", source):
            assert shards == {"params": ["torch.bfloat16"], "grads": ["torch.bfloat16"], "master": ["disk"]}
    results = cluster2.run(_tiered_run, "dp2 zero3 bf16 optimizer@disk")
    reference = reference_run("gpt", STEPS)
    losses, expected = torch.tensor(results[0]["losses"]), torch.tensor(reference["losses"])
    torch.testing.assert_close(losses, expected, rtol=2e-2, atol=0.0)
    assert losses[-1] < losses[0]
    for key, value in reference["state"].items():  # 5e-3: see parity.assert_close_to_fp32
        torch.testing.assert_close(results[0]["state"][key].float(), value, rtol=0.0, atol=5e-3)


def _moved_between_layouts(first: str, second: str, folder: str) -> dict:
    """Engine side: 2 steps under `first`, saved; loaded under `second`: its next loss, and the
    next loss `first` itself goes on to."""
    import colab_par.memory_tiers.chunks as chunks
    from colab_par import load, parallelize, save

    chunks.CHUNK_BYTES = SMALL_CHUNK
    batches = training_batches("gpt", 3)
    optimizer_fn = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731  (large steps: a lost state shows)
    before = parallelize(engine_model("gpt", "module"), first, optimizer_fn=optimizer_fn)
    for batch in batches[:2]:
        before.train_step(*batch)
    save(before, folder)
    after = parallelize(engine_model("gpt", "module"), second, optimizer_fn=optimizer_fn)
    load(after, folder)
    return {"continued": before.train_step(*batches[2]), "loaded": after.train_step(*batches[2]),
            "again": after.train_step(*batches[2]), "first_again": before.train_step(*batches[2])}


@pytest.mark.parametrize("first,second", [("dp2 zero3 optimizer@disk grads@disk", "dp2 zero3"),
                                          ("dp2", "dp2 optimizer@disk"),
                                          ("dp2 zero1 optimizer@disk", "dp2"),  # each rank saved its half
                                          ("dp2 zero1", "dp2 zero1 optimizer@disk")])  # another partition
def test_checkpoint_moves_between_tiered_and_plain_layouts(cluster2, tmp_path, first: str, second: str) -> None:
    """Save with tiers -> load without (and back): the same next losses, two steps on, so the
    AdamW state (not only the weights) came across."""
    for result in cluster2.run(_moved_between_layouts, first, second, str(tmp_path / "ckpt")):
        assert result["loaded"] == pytest.approx(result["continued"], rel=1e-6)
        assert result["again"] == pytest.approx(result["first_again"], rel=1e-6)


def _parallelize_error(layout: str, optimizer: str = "AdamW") -> str:
    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    try:
        pm = parallelize(lambda: GPT(GPTConfig(**BIG_GPT)), layout,
                         optimizer_fn=lambda p: getattr(torch.optim, optimizer)(p, lr=1e-3))
        pm.train_step(*training_batches("gpt", 1)[0])
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_budget_below_the_parameters_is_refused_before_training(cluster2) -> None:
    for message in cluster2.run(_parallelize_error, "dp2 zero3 mem64MiB disk"):
        assert message.startswith("TierBudgetError") and "give at least" in message and "zero3" in message


def test_an_optimizer_tiers_cannot_reproduce_is_refused(cluster2) -> None:
    for message in cluster2.run(_parallelize_error, "dp2 optimizer@disk", "SGD"):
        assert message.startswith("ValueError") and "use torch.optim.AdamW" in message


@pytest.mark.parametrize("layout,words", [
    ("dp2 grads@disk", "grads@disk needs zero2 or zero3"),
    ("dp2 zero3 params@disk", "FSDP holds the shards"),
    ("dp2 zero1 params@disk", "its share of the state"),
    ("dp2 zero3 offload optimizer@disk", "keep one"),
])
def test_what_tiers_cannot_do_is_a_layout_error(layout: str, words: str) -> None:
    from colab_par.layout import Layout, LayoutError

    with pytest.raises(LayoutError, match=words):
        Layout.parse(layout).validate(2)


def test_adam_with_l2_weight_decay_is_refused() -> None:
    from colab_par.memory_tiers.optimizer import check_optimizer

    with pytest.raises(ValueError, match="use torch.optim.AdamW"):
        check_optimizer(torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], weight_decay=0.1))
    check_optimizer(torch.optim.Adam([torch.nn.Parameter(torch.ones(2))]))  # weight_decay=0 is AdamW's update


@pytest.mark.parametrize("optimizer_tier", ["device", "disk"])
def test_bf16_parameters_update_through_a_float32_master_in_the_chunk(tmp_path, optimizer_tier: str) -> None:
    """Working parameters in bf16 (as a bf16 ZeRO layout holds them): the chunk keeps the float32
    master, AdamW updates it exactly as float32 AdamW updates float32 weights on the same gradients
    (bf16 values, so both see the same numbers), and the working copy is the master rounded. State
    on disk steps with torch's fused kernel (the fast host step), state in memory with the user's
    AdamW as built: the reference is the same AdamW implementation."""
    from colab_par.memory_tiers.optimizer import TieredAdamW
    from colab_par.layout.tier_options import MemoryTiers

    torch.manual_seed(SEED)
    reference = torch.nn.Linear(48, 40)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))  # representable in bf16: both start equal
    working = torch.nn.Linear(48, 40).to(torch.bfloat16)
    working.load_state_dict(reference.state_dict())
    expected = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1,
                                 fused=optimizer_tier == "disk")
    tiers = MemoryTiers(optimizer=optimizer_tier, disk=str(tmp_path))
    tiered = TieredAdamW(torch.optim.AdamW(working.parameters(), lr=1e-2, weight_decay=0.1), tiers, [working],
                         device=torch.device("cpu"), rank=0, baseline=0, grads_movable=False, chunk_bytes=4096)
    for _ in range(3):
        for p, q in zip(reference.parameters(), working.parameters()):
            q.grad = torch.randn_like(p).to(torch.bfloat16)
            p.grad = q.grad.float()
        expected.step()
        tiered.step()
    assert len(tiered._chunks) > 1
    for (name, p), q in zip(reference.named_parameters(), working.parameters()):
        chunk, slot = tiered._slot_of[id(q)]
        torch.testing.assert_close(slot.of(tiered._stores[chunk.index]["master"].tensor), p.detach(),
                                   rtol=0, atol=0, msg=name)
        torch.testing.assert_close(q.detach(), p.detach().to(torch.bfloat16), rtol=0, atol=0, msg=name)
        assert not torch.equal(q.detach().float(), p.detach()), f"{name}: the master adds nothing"
    state = tiered.state_dict()["state"]
    assert set(state[0]) == {"step", "exp_avg", "exp_avg_sq"} and state[0]["step"].item() == 3
    tiered.release()
    assert list(tmp_path.iterdir()) == []


def _tiered_linear(tmp_path, tier: str, dtype: torch.dtype = torch.float32, **options) -> tuple:
    """An in-process TieredAdamW over a small Linear (several chunks), state in `tier`."""
    from colab_par.memory_tiers.optimizer import TieredAdamW
    from colab_par.layout.tier_options import MemoryTiers

    torch.manual_seed(SEED)
    model = torch.nn.Linear(48, 40).to(dtype)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, **options.pop("adamw", {}))
    tiered = TieredAdamW(adamw, MemoryTiers(optimizer=tier, disk=str(tmp_path)), [model],
                         device=torch.device("cpu"), rank=0, baseline=0, grads_movable=False, chunk_bytes=4096,
                         **options)
    return model, tiered


def _store_view(tiered, p, kind: str) -> torch.Tensor:
    chunk, slot = tiered._slot_of[id(p)]
    return slot.of(tiered._stores[chunk.index][kind].tensor)


@pytest.mark.parametrize("tier", ["device", "disk"])
def test_state_is_the_stores_and_state_dict_and_load_go_through_them(tmp_path, tier: str) -> None:
    """AdamW's state is plain views of the stores (no copy, no DTensor), so what the step writes
    is what state_dict reads, and load_state_dict writes the stores."""
    model, tiered = _tiered_linear(tmp_path, tier)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    tiered.step()
    for p in model.parameters():
        for kind in ("exp_avg", "exp_avg_sq"):
            value, store = tiered.state[p][kind], _store_view(tiered, p, kind)
            assert type(value) is torch.Tensor and value.data_ptr() == store.data_ptr(), kind
    weight = model.weight
    _store_view(tiered, weight, "exp_avg").fill_(0.25)  # the store changes: the state dict sees it
    state = tiered.state_dict()
    assert torch.equal(state["state"][0]["exp_avg"], torch.full_like(weight, 0.25))
    state["state"][0]["exp_avg"] = torch.full_like(weight, 3.0)  # a fresh tensor, loaded into the store
    tiered.load_state_dict(state)
    assert torch.equal(_store_view(tiered, weight, "exp_avg"), torch.full_like(weight, 3.0))
    assert tiered.state[weight]["exp_avg"].data_ptr() == _store_view(tiered, weight, "exp_avg").data_ptr()
    tiered.release()


@pytest.mark.parametrize("tier", ["device", "disk"])
def test_loading_keeps_float32_moments_of_bf16_parameters_exact(tmp_path, tier: str) -> None:
    """bf16 working parameters keep float32 moments: a load must not round them to the parameter's
    dtype (Optimizer.load_state_dict's cast): 1 + 2^-12 is not a bf16 number and comes back exactly."""
    model, tiered = _tiered_linear(tmp_path, tier, torch.bfloat16)
    tiered.place_state()
    exact = 1 + 2.0 ** -12
    state = tiered.state_dict()
    for index, p in enumerate(model.parameters()):
        state["state"][index] = {"step": torch.tensor(5.0), "exp_avg": torch.full(p.shape, exact),
                                 "exp_avg_sq": torch.full(p.shape, 2 * exact)}
    tiered.load_state_dict(state)
    for index, p in enumerate(model.parameters()):
        assert _store_view(tiered, p, "exp_avg").dtype == torch.float32
        assert torch.equal(_store_view(tiered, p, "exp_avg"), torch.full(p.shape, exact))
        assert torch.equal(tiered.state_dict()["state"][index]["exp_avg_sq"], torch.full(p.shape, 2 * exact))
        assert tiered.state[p]["step"].item() == 5.0
    tiered.release()


@pytest.mark.parametrize("by_compile", [True, False])
def test_fused_chosen_by_compile_keeps_the_host_step_for_state_off_the_device(tmp_path, by_compile: bool) -> None:
    """`compile` builds AdamW with fused=True where the user chose no kernel; the tiers still step
    state on disk where it is (the host step), not staged; a user's own fused=True is kept."""
    model, tiered = _tiered_linear(tmp_path, "disk", adamw={"fused": True}, fused_by_compile=by_compile)
    tiered.place_state()
    group, stores = tiered.param_groups[0], tiered._stores[0]
    assert group["fused"] is True and tiered._host_step(group, stores) is by_compile
    tiered.release()


def test_working_memory_counts_only_what_the_devices_measure_holds() -> None:
    """On CUDA the allocator's peak never includes host memory (pinned stores): subtracting them
    from it would leave the working memory near 0 and place state back onto the GPU."""
    from colab_par.memory_tiers.measure import counted_bytes

    host = [torch.zeros(256), torch.zeros(64, dtype=torch.bfloat16)]
    assert counted_bytes(torch.device("cpu"), host) == 256 * 4 + 64 * 2
    assert counted_bytes(torch.device("cuda", 0), host) == 0
    assert counted_bytes(torch.device("cuda", 0), [torch.zeros(8, device="meta")]) == 0


def _dtensor_state(layout: str) -> dict:
    """Engine side: after a step under FSDP, where AdamW's state and its state dict live."""
    import colab_par.memory_tiers.chunks as chunks
    from torch.distributed.tensor import DTensor

    from colab_par.compat import storage_holder

    chunks.CHUNK_BYTES = SMALL_CHUNK
    pm = _parallelized(engine_model("gpt", "module"), layout)
    pm.train_step(*training_batches("gpt", 1)[0])
    tiered, out = pm.optimizer, {"plain": True, "over_stores": True, "sees_store": True, "loads_store": True}
    params = tiered._params()
    for p in params:
        for kind in ("exp_avg", "exp_avg_sq"):
            value, store = tiered.state[p][kind], _store_view(tiered, p, kind)
            out["plain"] &= type(value) is torch.Tensor and value.data_ptr() == store.data_ptr()
    state = tiered.state_dict()
    for index, p in enumerate(params):
        for kind in ("exp_avg", "exp_avg_sq"):
            value, store = state["state"][index][kind], _store_view(tiered, p, kind)
            held = storage_holder(value)
            out["over_stores"] &= (isinstance(value, DTensor) and value.placements == p.placements
                                   and value.shape == p.shape and held.data_ptr() == store.data_ptr()
                                   and held.device == store.device)
        _store_view(tiered, p, "exp_avg").fill_(0.5)  # the store changes: the state dict sees it
        out["sees_store"] &= bool((tiered.state_dict()["state"][index]["exp_avg"].to_local() == 0.5).all())
        saved = state["state"][index]["exp_avg"]
        state["state"][index]["exp_avg"] = DTensor.from_local(torch.full_like(saved.to_local(), 2.0),
                                                              p.device_mesh, p.placements)
    tiered.load_state_dict(state)
    for p in params:
        out["loads_store"] &= bool((_store_view(tiered, p, "exp_avg") == 2.0).all())
    return out


def test_fsdp_state_is_plain_store_views_and_its_state_dict_dtensors_wrap_them(cluster2) -> None:
    """zero3 (DTensor parameters): AdamW's state holds plain views of the stores; state_dict's
    moments are DTensors like their parameter over those very views (a wrapper that copied a
    host or disk store onto a CUDA mesh's device would have another storage there); load writes
    the stores."""
    for result in cluster2.run(_dtensor_state, "dp2 zero3 optimizer@disk"):
        assert result == {"plain": True, "over_stores": True, "sees_store": True, "loads_store": True}


def test_fsdp_offload_pins_host_memory_only_on_a_cuda_mesh() -> None:
    """FSDP's CPU offload (the layout's 'offload', beside the tiers) pins its host shards on a
    CUDA mesh only: pinning on a gloo world would open a CUDA context on every GPU machine."""
    from colab_par.layout import Layout
    from colab_par.parallel.data_parallel import fsdp_options

    layout = Layout.parse("dp2 zero3 offload")
    assert fsdp_options(layout, "cuda")["offload_policy"].pin_memory is True
    assert fsdp_options(layout, "cpu")["offload_policy"].pin_memory is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_host_steps_staging_updates_like_adamw(tmp_path, dtype: torch.dtype) -> None:
    """The CUDA host step's path (gradients and float32 parameters through alternating staging
    buffers, parameters or masters sent back), taken on CPU where its copies are plain: exactly
    torch's fused AdamW on the same numbers. The side stream itself is the GPU check's."""
    reference = torch.nn.Linear(48, 40)
    model, tiered = _tiered_linear(tmp_path, "disk", dtype)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.float())
    expected = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    tiered._cuda = True  # the path a CUDA rank takes; Transfers on a CPU device copies plainly
    for _ in range(3):
        for p, q in zip(reference.parameters(), model.parameters()):
            q.grad = torch.randn_like(p).to(dtype)
            p.grad = q.grad.float()
        expected.step()
        tiered.step()
    assert len(tiered._chunks) > 1 and {key[0] for key in tiered._transfers._staging} == {0, 1}
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(q.detach(), p.detach().to(dtype))
    tiered.release()
