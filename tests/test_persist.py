"""Engines that outlive the kernel, with real kernels: an IPython process starts a persisted
cluster (`%colossal start --persist`), trains a model 4 steps and exits; a new IPython process
lists it, attaches and trains on from step 4: every step's loss equals an uninterrupted run. The
same exit ends a cluster started without --persist; a persisted cluster whose controller died is
cleaned from the list, processes and all; `%colossal stop` removes the cluster and its record."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SETUP = '''
import json, torch
from colab_par import Trainer, parallelize
from colab_par.data import SyntheticDataset
from colab_par.models import GPT, GPTConfig
torch.manual_seed(0)
config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
pm = parallelize(GPT(config), "dp2", optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2))
data = SyntheticDataset(vocab_size=64, seq_len=16, batch_size=4, max_stride=1)
trainer = Trainer(pm, data, steps=8, telemetry=False)
'''
LOSSES = 'if rank == 0:\n    print("LOSSES " + json.dumps([row["loss"] for row in trainer.history]))\n'

PRELUDE = '''
import json, sys
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
ip.run_line_magic("load_ext", "colab_par")
def cell(source):
    ip.run_cell(source).raise_error()
'''
FIRST_KERNEL = PRELUDE + '''
from colab_par import Cluster
from colab_par.notebook.magics import default_cluster
ip.run_line_magic("colossal", "start -n 2 --persist")
cell("%%%%colossal\\n" + %r + "trainer.fit(4)\\n" + %r)
doomed = Cluster(n=1, backend="gloo", dashboard=False, persist=True).start()
plain = Cluster(n=1, backend="gloo", dashboard=False).start()
print("CLUSTERS " + json.dumps({"kept": default_cluster().cluster_id, "doomed": doomed.cluster_id,
                                "plain_pids": sorted(plain.pids)}))
''' % (SETUP, LOSSES)
SECOND_KERNEL = PRELUDE + '''
ip.run_line_magic("colossal", "list")
ip.run_line_magic("colossal", "attach")
cell("%%%%colossal\\ntrainer.fit()\\n" + %r)
ip.run_line_magic("colossal", "stop")
ip.run_line_magic("colossal", "list")
''' % LOSSES


def kernel(code: str, ipython_dir: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "IPYTHONDIR": str(ipython_dir)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def losses(text: str) -> list[float]:
    return json.loads(re.findall(r"^LOSSES (.+)$", text, re.M)[-1])


def record(ipython_dir: Path, cluster_id: str) -> Path:
    return ipython_dir / "profile_default" / "security" / f"colab_par-cluster-{cluster_id}.json"


def gone(pids: set[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() !=
                                              psutil.STATUS_ZOMBIE for p in pids):
        time.sleep(0.1)
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def recorded_pids(path: Path) -> set[int]:
    return {int(pid) for pid in json.loads(path.read_text())["pids"]}


def test_persisted_engines_outlive_the_kernel_and_train_on_in_the_next(cluster2, tmp_path, capsys):
    cluster2.execute(SETUP + "trainer.fit()\n" + LOSSES)  # the uninterrupted run
    uninterrupted = losses(capsys.readouterr().out)

    first = kernel(FIRST_KERNEL, tmp_path)
    clusters = json.loads(re.findall(r"^CLUSTERS (.+)$", first, re.M)[0])
    assert len(losses(first)) == 4
    assert gone(set(clusters["plain_pids"]))  # without --persist nothing outlives the kernel
    kept, doomed = record(tmp_path, clusters["kept"]), record(tmp_path, clusters["doomed"])
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    kept_pids, doomed_pids = recorded_pids(kept), recorded_pids(doomed)
    assert len(kept_pids) >= 3 and all(psutil.pid_exists(p) for p in kept_pids | doomed_pids)
    os.kill(json.loads(doomed.read_text())["controller"]["pid"], signal.SIGKILL)  # a cluster dies

    second = kernel(SECOND_KERNEL, tmp_path)
    listed = [line for line in second.splitlines() if line.startswith(clusters["kept"])]
    assert len(listed) == 1 and re.search(r" \d+m \d\ds +2/2 +gloo +local +[\d.]+ [MG]iB  pid \d+$", listed[0]), second
    assert clusters["doomed"] not in second and not doomed.exists() and gone(doomed_pids)
    assert f"attached to cluster {clusters['kept']}: 2 engines (gloo" in second
    resumed = losses(second)
    assert len(resumed) == len(uninterrupted) == 8
    assert resumed == pytest.approx(uninterrupted, rel=1e-6)
    assert resumed[-1] < resumed[0] - 0.8  # it learns: a wrong resume would show
    assert second.rstrip().endswith("no persisted cluster is running on this host")
    assert not kept.exists() and gone(kept_pids)
