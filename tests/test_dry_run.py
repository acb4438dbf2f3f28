"""The dry run at scale (colab_par/planning/dry_run/) against a real world.

A real 2-rank gloo world (two spawned processes) runs the kit's GPT under dp2, dp2 zero3 and tp2
and measures each rank's last training step with the same tracker; the dry run, one process in a
`fake` world of 2, must see the same step: every collective's calls and bytes per mesh dimension
exactly, every phase's memory within 3 % (`assert_same_step`), with real tensors and with fake
ones (no storage). The planner's prediction for the same layout is printed beside it, and its
model state (ZeRO arithmetic) must agree with the trace.
"""
from __future__ import annotations

import pickle
from dataclasses import replace
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from colab_par import parallelize
from colab_par.layout import LayoutError
from colab_par.models import GPTConfig
from colab_par.planning.devices import get_device
from colab_par.planning.dry_run import dry_run
from colab_par.planning.dry_run.compare import compare
from colab_par.planning.dry_run.report import MemoryKinds
from colab_par.planning.dry_run.run import model_factory, token_batch, traced_step

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
BATCH = (4, 16)
LAYOUTS = ("dp2", "dp2 zero3", "tp2")


def real_rank(rank: int, port: int, out: str) -> None:
    """Rank `rank` of a real gloo world of 2: each layout's traced step, pickled into `out`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        for layout in LAYOUTS:
            torch.manual_seed(0)
            pm = parallelize(model_factory(CONFIG), layout)
            inputs, targets = token_batch(CONFIG.vocab_size, BATCH)
            report = traced_step(pm, inputs, targets, world="gloo")
            Path(out, f"{layout}-{rank}.pkl").write_bytes(pickle.dumps(report))
    finally:
        dist.destroy_process_group()


def assert_same_step(traced, real) -> None:
    """Collectives exactly; memory within 3 % per phase and at the peak. Not exactly: in a real
    world an asynchronous collective's output can outlive the moment a fake world's (completed at
    once) is freed; with tp2 one all-reduce buffer (8 KiB of 0.45 MiB, 1.8 %) at the backward peak."""
    assert traced.collectives == real.collectives
    for name in real.phases:
        assert abs(traced.phases[name].total - real.phases[name].total) <= 0.03 * real.phases[name].total, name
    assert abs(traced.peak.total - real.peak.total) <= 0.03 * real.peak.total


@pytest.fixture(scope="module")
def real_reports(tmp_path_factory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("real_world")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.start_processes(real_rank, args=(port, str(out)), nprocs=2, start_method="spawn")
    return {layout: pickle.loads(Path(out, f"{layout}-0.pkl").read_bytes()) for layout in LAYOUTS}


@pytest.mark.parametrize("layout,dim", [("dp2", "dp"), ("dp2 zero3", "dp"), ("tp2", "tp")])
def test_dry_run_sees_the_real_worlds_step(real_reports, layout: str, dim: str) -> None:
    real = real_reports[layout]
    traced = dry_run(CONFIG, layout, 2, batch=BATCH)
    print(traced, "\n", real, "\n", compare(traced, CONFIG))
    assert (traced.world, real.world) == ("fake", "gloo")
    assert_same_step(traced, real)
    # the layout's own traffic is there, on its own mesh dimension
    assert traced.collective_bytes()[dim] > 0
    assert traced.peak.params > 0 and traced.peak.optimizer > 0 and traced.phases["forward"].activations > 0


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3", "tp2"])
def test_fake_tensors_see_the_same_step(real_reports, layout: str) -> None:
    """No storage at all (FakeTensorMode, what makes an 8 B model at world 64 fit this machine):
    the same allocations by kind, the same collectives; DDP's too (its reducer's bucket
    all-reduce is answered by the fake world)."""
    real = real_reports[layout]
    traced = dry_run(CONFIG, layout, 2, batch=BATCH, tensors="fake")
    assert traced.tensors == "fake"
    assert_same_step(traced, real)


def test_planner_model_state_matches_the_trace(real_reports) -> None:
    """Adam's state is the ZeRO arithmetic (8 bytes per local fp32 parameter, sharded over dp for
    zero3, split by tp): the planner's must equal the traced one up to Adam's step counters
    (a 4-byte scalar per parameter tensor, 0.1 % here)."""
    for layout in LAYOUTS:
        table = compare(real_reports[layout], CONFIG)
        optimizer = next(row for row in table.rows if row.kind == "optimizer")
        assert abs(optimizer.relative_error) < 0.01, table


def test_a_step_that_does_not_fit_names_its_phase_and_kind(real_reports) -> None:
    """The same trace judged on a device whose usable memory (90 %, less the process baseline) is
    just under the forward phase's peak: that phase and its largest kind are named."""
    report = real_reports["tp2"]
    roomy = compare(report, CONFIG, device="H100")
    assert roomy.fits and "fits" in str(roomy)
    baseline = get_device("cpu").process_memory
    tight = replace(get_device("cpu"), memory=(baseline + report.phases["forward"].total - 1000) / 0.9)
    verdict = compare(report, CONFIG, device=tight)
    largest = max(("params", "grads", "optimizer", "activations", "temporaries"),
                  key=lambda kind: getattr(report.phases["forward"], kind))
    assert not verdict.fits and verdict.overflow.startswith("forward") and verdict.overflow.endswith(largest)
    # state offloaded to the host is not the device's: with enough of it there, the same step fits
    host = MemoryKinds(optimizer=report.peak.total - report.phases["forward"].total + 2000)
    assert compare(replace(report, host=host), CONFIG, device=tight).fits


def test_refuses_bad_requests_before_starting_a_process() -> None:
    with pytest.raises(ValueError, match="spans 2 ranks"):
        dry_run(CONFIG, "dp2", 4, batch=BATCH)
    with pytest.raises(ValueError, match="rank=5"):
        dry_run(CONFIG, "dp2", 2, rank=5, batch=BATCH)
    with pytest.raises(LayoutError):
        dry_run(CONFIG, "tp4", 4, batch=BATCH)  # 2 heads do not split over 4 ranks
    with pytest.raises(ValueError, match="tensors="):
        dry_run(CONFIG, "dp2", 2, batch=BATCH, tensors="meta")
    with pytest.raises(TypeError, match="factory"):
        dry_run(torch.nn.Linear(2, 2), "dp2", 2, batch=BATCH)
