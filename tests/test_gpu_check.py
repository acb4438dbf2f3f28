"""benchmarks/gpu_check.py without a GPU: one line, exit 0, nothing written; and how it files its
section into RESULTS.md (the GPU parts themselves run only where a GPU is lent)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--results", str(results)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "gpu_check: no CUDA GPU on this machine; nothing to check (run it where a GPU is lent)"]
    assert not results.exists()


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # so cloudpickle can ship its functions by value
    spec.loader.exec_module(module)
    return module


def test_a_section_goes_first_and_a_later_run_on_the_same_card_replaces_it(tmp_path: Path) -> None:
    gpu_check, results = _gpu_check(), tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Older\n\nold table\n")
    gpu_check.write_section(results, "NVIDIA H100 80GB HBM3", "first run")
    gpu_check.write_section(results, "NVIDIA L4", "l4 run")
    gpu_check.write_section(results, "NVIDIA H100 80GB HBM3", "second run")
    text = results.read_text()
    assert "first run" not in text and text.count("## GPU check on NVIDIA H100 80GB HBM3") == 1
    assert text.index("l4 run") < text.index("second run") < text.index("## Older")
    assert text.endswith("## Older\n\nold table\n")


def test_the_tiers_check_runs_its_engine_code_and_reports_each_layout(cluster2) -> None:
    """The GPU check's memory-tier part, on CPU engines (no GPU here): its engine code runs the
    layouts it names, a tiered run trains as the plain one does (the host step on a CPU rank), and
    the table has a row per layout with the planner's figures for a catalogued card."""
    gpu_check = _gpu_check()
    import cloudpickle

    cloudpickle.register_pickle_by_value(gpu_check)
    tiny = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
    layouts = ("dp2", "dp2 optimizer@disk")  # the GPU check's dp1 layouts, over this cluster's 2 engines
    runs = cluster2.run(gpu_check.tier_measurements, tiny, 4, layouts)[0]
    assert list(runs) == list(layouts)
    assert runs["dp2 optimizer@disk"]["disk"] > 0 and runs["dp2 optimizer@disk"]["moved"] > 0
    for tiered, plain in zip(runs["dp2 optimizer@disk"]["losses"], runs["dp2"]["losses"]):
        assert abs(tiered - plain) <= 1e-5 * abs(plain)
    assert runs["dp2"]["losses"][-1] < runs["dp2"]["losses"][0]
    gpu_check.TIERS_GPT = tiny
    table, failures = gpu_check.tiers_section("NVIDIA H100 80GB HBM3", runs=runs)
    assert failures == []  # the disk arm moved what `expected_moved` computes
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(layouts)
    cells = [[cell.strip() for cell in row.strip(" |").split("|")] for row in rows]
    assert all(float(row[-1]) > 0 for row in cells), rows  # the planner's peak for a catalogued card
    assert cells[0][-2] == "-" and float(cells[1][-2]) > 0, rows  # host <-> device bytes with tiers only
    assert cells[0][6] == "-" and cells[1][6] == cells[1][5] != "0.0", rows  # moved as expected
    runs["dp2 optimizer@disk"]["moved"] -= 4
    assert gpu_check.tiers_section("NVIDIA H100 80GB HBM3", runs=runs)[1] == [
        f"dp2 optimizer@disk: the last step moved {runs['dp2 optimizer@disk']['moved']} bytes, expected "
        f"{runs['dp2 optimizer@disk']['moved'] + 4}"]


def test_the_tier_checks_run_on_engines_and_pass(cluster2, tmp_path: Path) -> None:
    """The tier checks' engine code on CPU engines (dp2 zero3, the state on disk): it trains like
    the plain run, the checkpoint round trip is equal, the bytes moved are as computed, and the
    section reports no failure."""
    gpu_check = _gpu_check()
    import cloudpickle

    cloudpickle.register_pickle_by_value(gpu_check)
    tiny = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
    arms = {name: arm for name, arm in gpu_check.tier_check_arms("dp2 zero3", cuda=False).items()
            if name in ("plain", "optimizer@disk")}
    runs = cluster2.run(gpu_check.tier_checks, tiny, 3, str(tmp_path), arms)[0]
    disk = runs["optimizer@disk"]
    assert disk["moved"] == 16 * disk["elements"] > 0 and disk["round_trip_state"], disk
    table, failures = gpu_check.tier_check_section(3, runs=runs, arms=arms, cuda=False)
    assert failures == [] and table.endswith("Failures: none")
    assert sorted(row.split("|")[1].strip() for row in table.splitlines() if row.startswith("| ")) == sorted(
        ["arm", *arms])


def test_the_tier_checks_name_each_failure() -> None:
    """What the GPU run would show if the state reached the GPU, a round trip lost it, a chunk was
    staged or bytes went uncounted: each is a failure that names the layout."""
    gpu_check = _gpu_check()
    arms = gpu_check.tier_check_arms("dp2 zero3", cuda=True)
    n = 1000
    good = dict(losses=[2.0, 1.5], elements=n, moments_on_gpu=0, allocated=10 * n, peak=20 * n, host=8 * n,
                disk=0, host_step=True, round_trip_state=True, round_trip_loss=(1.0, 1.0))
    runs = {name: dict(good, layout=layout.format(budget=1), moved=gpu_check.expected_moved(name, n, True) or 0,
                       allocated=18 * n if "@" not in layout else 10 * n)
            for name, (layout, _, _) in arms.items()}
    assert gpu_check.tier_check_failures(runs, arms, cuda=True) == []
    runs["optimizer@host"].update(moments_on_gpu=2, allocated=18 * n, host_step=False, moved=0)
    runs["optimizer@disk"].update(round_trip_state=False, losses=[2.0, 1.6])
    runs["budget"].update(peak=2 ** 20 + 1)  # over its budget of 1 MiB
    runs["optimizer@host foreach"].update(host_step=False, moved=0)  # staged as asked, its bytes uncounted
    failures = gpu_check.tier_check_failures(runs, arms, cuda=True)
    assert [f.split(":")[0] for f in failures] == ["dp2 zero3 optimizer@host"] * 4 + [
        "dp2 zero3 optimizer@disk"] * 2 + ["dp2 zero3 mem1MiB", "dp2 zero3 optimizer@host"], failures
    assert "moved 0 bytes, expected 16000" in failures[-1]
