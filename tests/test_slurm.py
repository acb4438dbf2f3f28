"""Engines as a job of a real Slurm (a one-node cluster with accounting this test starts on this
machine): they form the process group and train a layout as local engines do; `%colossal stop`
leaves no job in the queue and no process behind; a missing Slurm, a pending job and a wrong
partition or account are explained. The exported sbatch job runs there too."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell
from notebook_run import losses_in, printed_losses, with_losses_printed
from parity import assert_parity, engine_run, reference_run
from slurm_site import ACCOUNT, NODE, PARTITION, SlurmSite

from colab_par import Cluster, LauncherError, Slurm
from colab_par.notebook import magics
from colab_par.cli import main


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, monkeypatch_module):
    site = SlurmSite(tmp_path_factory.mktemp("slurm")).start()
    monkeypatch_module.setenv("SLURM_CONF", str(site.conf))
    yield site
    site.stop()


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "colab_par")
    return ip


def processes_of_job(job: str) -> list[psutil.Process]:
    """Processes still running for the job: its tasks (they carry SLURM_JOB_ID) and slurmstepd."""
    left = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if f"[{job}." in " ".join(process.info["cmdline"] or ()) or \
                    process.environ().get("SLURM_JOB_ID") == job:
                left.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def test_engines_as_a_slurm_job_train_a_layout_and_stop_leaves_nothing(slurm, shell, capsys) -> None:
    scripts_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "colab_par-slurm-*")))
    shell.run_line_magic("colossal", f"start --launcher slurm -n 2 --partition {PARTITION} "
                                     f"--account {ACCOUNT} --time 10:00 --timeout 60")
    try:
        cluster = magics._default
        [queued] = slurm.jobs()
        job, state = queued.split()
        assert state == "RUNNING"
        # The engines really are the job's tasks.
        assert cluster.run(lambda: (os.environ["SLURM_JOB_ID"], os.environ["SLURMD_NODENAME"])) == \
            [(job, NODE)] * 2
        assert_parity(cluster.run(engine_run, "dp2", "gpt", 4), reference_run("gpt", 4))
    finally:
        shell.run_line_magic("colossal", "stop")
    assert slurm.jobs() == []
    assert processes_of_job(job) == []
    assert "engines stopped" in capsys.readouterr().out
    # nor the folder of the job's script
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "colab_par-slurm-*"))) <= scripts_before


def test_no_reachable_slurm_is_named_before_anything_starts(slurm, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on PATH
    with pytest.raises(LauncherError, match=r"needs Slurm's `sbatch` on PATH.*launcher='local'"):
        Cluster(n=2, launcher="slurm", dashboard=False).start()
    monkeypatch.undo()
    dead = tmp_path / "slurm.conf"  # a controller that does not answer
    dead.write_text(slurm.conf.read_text().replace("SlurmctldPort=", "SlurmctldPort=1"))
    monkeypatch.setenv("SLURM_CONF", str(dead))
    started = time.monotonic()
    with pytest.raises(LauncherError, match="Slurm could not list the partitions"):
        Cluster(n=2, launcher="slurm", dashboard=False).start()
    assert time.monotonic() - started < 60


def test_an_unknown_partition_is_refused_with_the_ones_there_are(slurm) -> None:
    with pytest.raises(LauncherError, match=f"no partition 'gpu-large'; it has: {PARTITION}"):
        Cluster(n=2, launcher=Slurm(partition="gpu-large"), dashboard=False).start()
    assert slurm.jobs() == []


def test_an_unknown_account_is_refused_with_the_users_accounts(slurm) -> None:
    refused = subprocess.run(["sbatch", "--account=nope", "--wrap=true"], capture_output=True, text=True)
    assert refused.returncode != 0 and "Invalid account" in refused.stderr  # Slurm enforces accounts
    with pytest.raises(LauncherError, match=f"no account 'nope' for this user; yours: {ACCOUNT}"):
        Cluster(n=2, launcher=Slurm(account="nope"), dashboard=False).start()
    assert slurm.jobs() == []


def test_a_job_left_pending_says_why_and_is_cancelled_at_the_start_timeout(slurm) -> None:
    slurm.command("scontrol", "update", f"nodename={NODE}", "state=drain", "reason=test")
    try:
        with pytest.raises(TimeoutError, match=r"0 of 2 engines started within the start timeout "
                                               r"\(3s\): Slurm job \d+ is PENDING \(reason: "):
            Cluster(n=2, launcher="slurm", timeout=3, dashboard=False).start()
        assert slurm.jobs() == []
    finally:
        slurm.command("scontrol", "update", f"nodename={NODE}", "state=resume")
        slurm.wait_idle()


def test_an_exported_notebook_runs_as_the_sbatch_job_it_was_exported_with(slurm, kernel_path, executed_notebooks,
                                                                         tmp_path) -> None:
    """`colab-par export --slurm`'s job (srun + torchrun, rendezvous on its first node) trains as
    the notebook did under nbclient (the run test_export and test_notebooks share)."""
    notebook = tmp_path / "quickstart.ipynb"
    notebook.write_text(json.dumps(with_losses_printed("01_quickstart")))
    script = tmp_path / "quickstart.py"
    assert main(["export", str(notebook), "-o", str(script), "--slurm", "--procs-per-node", "2",
                 "--partition", PARTITION, "--time", "10:00"]) == 0
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1"}
    submitted = subprocess.run(["sbatch", "--wait", str(script.with_suffix(".sbatch"))], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300, env=env)
    job = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert submitted.returncode == 0, output[-3000:]
    in_notebook = losses_in(executed_notebooks("01_quickstart"))
    assert len(in_notebook) >= 12
    assert printed_losses(output) == pytest.approx(in_notebook, rel=1e-6)
    assert slurm.jobs() == []
