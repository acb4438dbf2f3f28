"""benchmarks/rl.py keeps running: its quickest mode (`--quick`: the rollout part with a small model,
one round, no TRL) on real engines, its table read back and checked against its own arithmetic."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "rl.py"
ARMS = ["dp2 zero3, 2 engines x 1 thread", "one process, 1 thread", "one process, 2 threads"]


def test_quick_mode_prints_rollout_rates_and_the_generating_share() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    rows = re.findall(r"^(.+?)\s+\|\s+(\d+) \((\d+)-(\d+)\)\s+\|\s+([\d.]+)$", out, re.M)
    assert [row[0] for row in rows] == ARMS, out
    rates = {name: float(median) for name, median, *_ in rows}
    assert all(rate > 0 for rate in rates.values())
    for name, median, low, high, ratio in rows:  # one round: min = median = max; ratio = zero3 / arm
        assert low == median == high
        # the rates are printed rounded to whole tokens/s (thousands here), the ratio to 0.01
        assert float(ratio) == pytest.approx(rates[ARMS[0]] / rates[name], abs=0.011), (name, out)
    share = re.search(r"GRPO step under dp2 zero3 .+: ([\d.]+) \([\d.]+-[\d.]+\) s, generating (\d+) \((\d+)-(\d+)\) %",
                      out)
    assert share, out
    seconds, generating = float(share.group(1)), [int(v) for v in share.groups()[1:]]
    assert seconds > 0 and 0 < generating[1] <= generating[0] <= generating[2] < 100
