"""`colab-par demo` as a user runs it: the installed console script, in a subprocess."""
from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from picture import assert_shows_data, empty_plots

from colab_par.cli import dashboard_png
from colab_par.views.dashboard import PANELS

SCRIPT = Path(sys.executable).with_name("colab-par")


def _demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), f"console script {SCRIPT} is not installed; pip install -e . first"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_options():
    result = _demo("demo", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--engines", "--layout", "--steps", "--out"):
        assert option in result.stdout


@pytest.mark.parametrize("args, problem", [
    (["--engines", "3", "--layout", "tp3"], "tp=3"),
    (["--layout", "dp4"], "world"),
    (["--steps", "0"], "at least 1"),
    (["--engines", "two"], "whole number"),
])
def test_bad_options_are_refused_before_engines_start(args, problem, tmp_path):
    result = _demo("demo", "--out", str(tmp_path / "out"), *args, timeout=60)
    assert result.returncode == 2
    assert problem in result.stderr
    assert "engines ready" not in result.stdout


def test_dashboard_png_draws_the_returned_rows():
    """The demo's picture, from rows as the engines return them; without rows it must be blank."""
    def rows(rank: int) -> list[dict]:
        return [{"step": s, "rank": rank, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 2.0 / s,
                 "step_time": 0.1, "tokens_per_s": 900.0 + s,
                 "mfu": 0.01, "mem_params": 2 ** 20, "mem_grads": 2 ** 20, "mem_optimizer": 2 ** 21,
                 "mem_total": 2 ** 22, "time_data": 0.01, "time_forward_backward": 0.08,
                 "time_optimizer": 0.01} for s in range(1, 16)]

    assert_shows_data(dashboard_png([{"rows": rows(0)}, {"rows": rows(1)}], steps=15))
    assert len(empty_plots(dashboard_png([{"rows": []}, {"rows": []}], steps=15))) == len(PANELS)


@pytest.mark.slow
def test_demo_trains_and_writes_dashboard_and_csv(tmp_path):
    steps = 15
    result = _demo("demo", "--steps", str(steps), "--out", str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "chosen by the planner" in out
    assert f"step {steps}/{steps}" in out  # the dashboard's progress lines reached the end

    assert_shows_data((tmp_path / "dashboard.png").read_bytes())

    with open(tmp_path / "run.csv") as handle:
        rows = list(csv.DictReader(handle))
    ranks = sorted({int(row["rank"]) for row in rows})
    assert ranks == [0, 1]
    rank0 = [row for row in rows if row["rank"] == "0"]
    assert [int(row["step"]) for row in rank0] == list(range(1, steps + 1))
    first, last = float(rank0[0]["loss"]), float(rank0[-1]["loss"])
    assert last < first - 0.5, f"loss did not fall: {first} -> {last}"

    # the printed summary agrees with the CSV, and shows memory for every rank
    summary = re.search(r"loss first ([\d.]+) · last ([\d.]+)", out)
    assert summary and float(summary[1]) == pytest.approx(first, abs=1e-4)
    assert float(summary[2]) == pytest.approx(last, abs=1e-4)
    assert re.search(r"tokens/s \(mean after step 1\) [\d,]+", out)
    memory_rows = re.findall(r"^\s+([01])\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)", out, re.M)
    assert [int(rank) for rank, _, _ in memory_rows] == [0, 1]
    assert all(float(total) > float(params) > 0 for _, params, total in memory_rows)
