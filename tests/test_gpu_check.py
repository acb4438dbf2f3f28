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
