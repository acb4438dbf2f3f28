"""Per-rank timelines from torch.profiler on real engines: `%%colossal --profile`, `Cluster.profile`
and `Trainer(profile_steps=...)`.

What "the lanes add up to the step" means here: for every rank and every profiled Trainer step,
the union of the intervals the rank's lanes draw inside that step's mark (host threads,
communication threads, point-to-point transfers, phases), on the profiler's clock, is within 10 %
of the step time the Trainer's row reports (its own `time.perf_counter`, measured independently of
the profiler). The collectives each layout implies must be in every rank's lanes, in the same
numbers on every rank (sends on one pipeline stage are receives on the other), and the raw trace
files must hold exactly the collectives the compact record counts.
"""
from __future__ import annotations

import json
import sys

import cloudpickle
import pytest

from colab_par.profiling import ProfileSteps
from colab_par.profiling.events import reduce_trace
from colab_par.profiling.timeline import Timeline

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GPT_SIZES = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
DATA = dict(vocab_size=64, seq_len=16, batch_size=4, seed=5)
STEPS = 3
SCHEDULER_SLICE_US = 3000  # EEVDF's slice on 2 CPUs: 0.75 ms × (1 + log2 2) = 1.5 ms; two tasks ahead of ours
IMPLIED = {"dp2": {"all_reduce"}, "dp2 zero3": {"reduce_scatter", "all_gather"}, "tp2": {"all_reduce"},
           "pp2 1f1b": {"send", "recv"}}


def build_trainer(layout: str, steps: int, **options) -> None:
    """On every engine: the test GPT as `layout` and its Trainer, in the engine variable `trainer`."""
    import torch
    from IPython import get_ipython

    from colab_par import Trainer, parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**GPT_SIZES)), layout)
    get_ipython().user_ns["trainer"] = Trainer(pm, SyntheticDataset(**DATA), steps=steps, **options)


def engine_value(expression: str):
    from IPython import get_ipython

    return eval(expression, get_ipython().user_ns)


def union_within(lanes: list[dict], start: float, end: float) -> float:
    pieces = sorted((max(s, start), min(e, end)) for lane in lanes for s, e, _ in lane["segments"]
                    if e > start and s < end)
    total, reach = 0.0, start
    for s, e in pieces:
        total += max(0.0, e - max(s, reach))
        reach = max(reach, e)
    return total


def assert_lanes_add_up(timeline: Timeline, rows: list[list[dict]], steps: list[int]) -> None:
    for rank in timeline.ranks:
        marked = timeline.steps(rank)
        assert [n for n, _, _ in marked] == steps, f"rank {rank} marked steps {marked}"
        by_step = {row["step"]: row for row in rows[rank]}
        for n, start, end in marked:
            covered, step_us = union_within(timeline.lanes(rank), start, end), by_step[n]["step_time"] * 1e6
            assert covered >= 0.9 * (end - start), f"rank {rank} step {n}: lanes cover {covered / (end - start):.0%} of the mark"
            # the mark and the Trainer's clock are read a few statements apart: a context switch there
            # (two engines, the controller and pytest share two cores) adds scheduler slices to the mark
            assert abs((end - start) - step_us) <= 0.1 * step_us + SCHEDULER_SLICE_US, \
                f"rank {rank} step {n}: the mark lasts {end - start:.0f} µs, the step {step_us:.0f} µs"


def assert_raw_traces(timeline: Timeline, folder) -> None:
    """One Chrome trace per rank in `folder`, holding every collective the record counts."""
    for rank in timeline.ranks:
        trace = json.loads((folder / f"rank{rank}.pt.trace.json").read_text())
        spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("gloo:")]
        counted = sum(v["count"] for v in timeline.record(rank)["collectives"].values())
        assert len(spans) == counted > 0


@pytest.mark.parametrize("layout", list(IMPLIED))
def test_profile_shows_the_layouts_collectives_and_adds_up(cluster2, layout, tmp_path):
    cluster2.run(build_trainer, layout, STEPS)
    timeline = cluster2.profile("trainer.fit()", trace_dir=tmp_path)
    counts = [{kind: v["count"] for kind, v in timeline.record(r)["collectives"].items()} for r in (0, 1)]
    for rank in (0, 1):
        assert IMPLIED[layout] <= set(counts[rank]), f"rank {rank} lanes hold {counts[rank]}"
    if layout.startswith("pp"):
        assert counts[0]["send"] == counts[1]["recv"] and counts[0]["recv"] == counts[1]["send"]
        assert sum(timeline.record(r)["totals"]["bubble"] for r in (0, 1)) > 0, "no stage ever waited"
    else:
        assert counts[0] == counts[1], "every rank runs the same collectives"
    assert_lanes_add_up(timeline, cluster2.run(engine_value, "trainer.history"), list(range(1, STEPS + 1)))
    assert_raw_traces(timeline, tmp_path)
    assert f"traces (Perfetto, TensorBoard) in {tmp_path}" in str(timeline)


def test_profile_flag_draws_the_timeline_in_the_notebook(cluster2, shell_on, captured, tmp_path):
    """The cell's recording wins over a Trainer's profile_steps inside it: one picture, the cell's,
    with every step (the Trainer neither restarts nor stops the recording around its window)."""
    cluster2.run(build_trainer, "dp2", 2, profile_steps=ProfileSteps(1, 1, trace_dir=str(tmp_path / "steps")))
    shell_on.run_cell_magic("colossal", f"--profile {tmp_path}", "trainer.fit()")
    pictures = [o["data"] for o in captured if "image/png" in o["data"]]
    assert len(pictures) == 1 and "colab_par profile: 2 rank(s), steps 1–2" in pictures[0]["text/plain"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert cluster2.run(engine_value, "trainer.timeline") == [None, None]


def test_trainer_profile_steps_records_only_those_steps(cluster2, shell_on, captured, tmp_path):
    """profile_steps=(2, 3) of a 4-step run: rank 0 draws the timeline of steps 2 and 3 in the
    notebook when step 3 ends, both ranks wrote their traces, and the lanes add up."""
    cluster2.run(build_trainer, "dp2", 4, profile_steps=ProfileSteps(2, 3, trace_dir=str(tmp_path)))
    shell_on.run_cell_magic("colossal", "", "trainer.fit()\nprint('fitted', len(trainer.history))")
    pictures = [o["data"] for o in captured if "image/png" in o["data"]]
    assert len(pictures) == 1 and "steps 2–3" in pictures[0]["text/plain"]
    data = cluster2.run(engine_value, "trainer.timeline.to_json() if trainer.timeline else None")
    assert data[1] is None, "only rank 0 holds the timeline"
    timeline = Timeline.from_json(data[0])
    assert_lanes_add_up(timeline, cluster2.run(engine_value, "trainer.history"), [2, 3])
    assert_raw_traces(timeline, tmp_path)


@pytest.mark.parametrize("value,error", [((3, 2), "1 <= first <= last"), ((0, 1), "1 <= first <= last"),
                                         ("10", "a step number"), ((1, 2, 3), "a step number")])
def test_bad_profile_steps_are_refused(value, error):
    with pytest.raises((ValueError, TypeError), match=error):
        ProfileSteps.of(value)


# ---- the reduction of one trace, on a hand-made trace whose answer is known --------------------------
def _event(name, start, end, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": 1000.0 + start, "dur": end - start, "tid": tid, "pid": 1, "cat": cat}


def test_reduction_puts_each_instant_in_one_category():
    """Host thread 1, gloo worker 7: compute; a reduce-scatter gloo runs as an all-reduce, waited
    for; a receive waited for (a bubble); host code; the optimizer with its own ops; a data phase."""
    trace = {"traceEvents": [
        _event("aten::mm", 0, 10),
        _event("c10d::_reduce_scatter_base_", 2, 4),
        _event("gloo:all_reduce", 5, 29, tid=7, cat="user_annotation"),
        _event("aten::add", 30, 40),
        _event("c10d::recv_", 40, 42),
        _event("gloo:recv", 41, 80, cat="user_annotation"),
        _event("aten::mul", 85, 90),
        _event("Optimizer.step#SGD.step", 90, 100, cat="user_annotation"),
        _event("aten::add_", 92, 95),
        _event("colab_par.data", 100, 110, cat="user_annotation"),
        _event("aten::slice", 101, 104),
        _event("colab_par.step 4", 0, 110, cat="user_annotation"),
    ]}
    record = reduce_trace(trace, host_thread=1, rank=0, host="h")
    host = next(lane for lane in record["lanes"] if lane["name"] == "host")["segments"]
    assert host == [[0, 2, "compute"], [2, 4, "communication"], [4, 10, "compute"], [10, 29, "waiting"],
                    [29, 30, "host"], [30, 40, "compute"], [40, 42, "communication"], [42, 80, "bubble"],
                    [80, 85, "host"], [85, 90, "compute"], [90, 100, "optimizer"], [100, 110, "data"]]
    comm = {lane["name"]: lane["segments"] for lane in record["lanes"] if lane["kind"] == "comm"}
    assert comm == {"comm thread 1": [[5, 29, "reduce_scatter"]], "p2p": [[41, 80, "recv"]]}
    assert record["steps"] == [[4, 0, 110]]
    assert record["collectives"] == {"reduce_scatter": {"count": 1, "us": 24}, "recv": {"count": 1, "us": 39}}
    # the reduce-scatter ran beside compute from 5 to 10; the receive was only ever waited for
    assert record["comm_busy_us"] == 24 + 39 and record["comm_hidden_us"] == 5
