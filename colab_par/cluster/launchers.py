"""Where engines run: this host, MPI, a Slurm job or hosts over SSH (ipyparallel's launchers).

Each launcher says what ipyparallel needs to start engines its way, which address the controller
listens on, what to check before anything starts (so a missing Slurm or a wrong partition is
named at once), and why engines have not come yet (a job pending in the queue).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Union

from traitlets.config import Config

from colab_par.cluster.engine import address_toward

NAMES = ("local", "mpi", "slurm", "ssh")


class LauncherError(RuntimeError):
    """The engines cannot be started the way asked (no scheduler, a bad partition, a failed job)."""


class _Launcher:
    """What every launcher answers; the defaults suit engines on this host."""

    name = ""
    nanny = False  # engines on this host are signalled with a plain os.kill
    # Why this launcher cannot start one engine in a dead one's place ("" where it can)
    cannot_replace = "it starts its engines together (one job), and a new one could land on another node"

    def replacement_sets(self, places: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
        """The engine sets ipyparallel starts to put fresh engines where the engines of `places`
        (their `engine.host_info`) ran: (count, the set's launcher options) each."""
        return [(len(places), {})]

    def check(self) -> None:
        """Refuse, before anything starts, what cannot work."""

    def controller_ip(self) -> str:
        return "127.0.0.1"

    def configure(self, config: Config) -> None:
        """Settings for ipyparallel's launcher."""

    def waiting(self, ipp_cluster: Any) -> str | None:
        """Why engines have not registered yet, if the launcher knows."""
        return None

    def stop(self, ipp_cluster: Any) -> None:
        ipp_cluster.stop_cluster_sync()


@dataclass(frozen=True)
class Local(_Launcher):
    """Engines as child processes of this kernel."""

    name = "local"
    cannot_replace = ""


@dataclass(frozen=True)
class MPI(_Launcher):
    """Engines through ipyparallel's MPI launcher (mpiexec; a hostfile goes in `mpi_args`)."""

    mpi_args: tuple[str, ...] = ()
    name = "mpi"

    def check(self) -> None:
        if shutil.which("mpiexec") is None:
            raise LauncherError("launcher='mpi' needs `mpiexec` on PATH (e.g. Debian's openmpi-bin); "
                                "use launcher='local' for engines on this host")
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # OpenMPI refuses root by default
            os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        os.environ.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")  # containers have few cores

    def configure(self, config: Config) -> None:
        if self.mpi_args:
            config.MPILauncher.mpi_args = list(self.mpi_args)


@dataclass(frozen=True)
class SSH(_Launcher):
    """Engines on the given hosts over SSH: ``SSH({"node1": 2, "node2": 2})``.

    Every host needs the same Python (`python`, default this kernel's) with colab_par installed;
    `ssh_args` go to ssh and scp (a key, a port, a config file). The controller listens on this
    host's address toward the first host, which every host is assumed to reach.
    """

    hosts: dict[str, int]
    ssh_args: tuple[str, ...] = ()
    python: str = sys.executable
    name = "ssh"
    nanny = True  # signals to engines on other hosts go through ipyparallel's nanny
    cannot_replace = ""

    def __post_init__(self) -> None:
        if not self.hosts or any(not isinstance(n, int) or n < 1 for n in self.hosts.values()):
            raise ValueError(f"hosts={self.hosts!r} must map each host to a positive number of "
                             "engines, e.g. SSH({'node1': 2, 'node2': 2})")

    @property
    def n(self) -> int:
        return sum(self.hosts.values())

    def check(self) -> None:
        if shutil.which("ssh") is None or shutil.which("scp") is None:
            raise LauncherError("launcher=SSH(...) needs `ssh` and `scp` on PATH")

    def controller_ip(self) -> str:
        return address_toward(_host_address(next(iter(self.hosts))))

    def replacement_sets(self, places: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
        """One SSH engine set a host: as many engines as died there."""
        counts: dict[str, int] = {}
        for place in places:
            host = self.host_of(place)
            counts[host] = counts.get(host, 0) + 1
        return [(count, {"engines": {host: count}}) for host, count in counts.items()]

    def host_of(self, place: dict[str, Any]) -> str:
        """The host (as `hosts` names it) of an engine that reported `place` (`engine.host_info`):
        named by its hostname, or by an address that resolves to the engine's."""
        for host in self.hosts:
            if host == place["host"] or _host_address(host) == place["ip"]:
                return host
        raise LauncherError(f"the engine on {place['host']} ({place['ip']}) runs on none of the SSH hosts "
                            f"{', '.join(self.hosts)}; restart() starts every engine again")

    def configure(self, config: Config) -> None:
        config.SSHEngineSetLauncher.engines = dict(self.hosts)
        config.SSHLauncher.ssh_args = list(self.ssh_args)
        config.SSHLauncher.scp_args = list(self.ssh_args)
        config.SSHLauncher.remote_python = self.python


@dataclass(frozen=True)
class Slurm(_Launcher):
    """Engines as one Slurm job, one srun task per engine (ipyparallel's Slurm launcher).

    `partition`, `account` and `time` (sbatch's formats, e.g. "2:00:00") are checked against the
    scheduler before the job is submitted. With `gpus_per_node`, each node runs that many engines,
    one per GPU; `nodes` fixes the node count. The controller runs in this kernel, listening on
    this host's primary address, which the compute nodes are assumed to reach.
    """

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    name = "slurm"
    nanny = True

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{key}={value!r} must be a positive integer, e.g. {key}=2")

    def sbatch_options(self, *, tasks_per_node: int | None = None) -> list[str]:
        """The job's #SBATCH options (shared with `colab-par export --slurm`, one torchrun task per
        node). Engine jobs run one task per GPU on each node: without ``--ntasks-per-node``
        Slurm may pack a job's tasks onto fewer nodes than its GPUs need (8 on one 4-GPU node)."""
        options = [f"--nodes={self.nodes}"] * (self.nodes is not None)
        options += [f"--gpus-per-node={self.gpus_per_node}"] * bool(self.gpus_per_node)
        per_node = tasks_per_node or self.gpus_per_node
        options += [f"--ntasks-per-node={per_node}"] * bool(per_node)
        options += [f"--partition={self.partition}"] * bool(self.partition)
        options += [f"--account={self.account}"] * bool(self.account)
        options += [f"--time={self.time}"] * bool(self.time)
        return options

    def check(self) -> None:
        for command in ("sbatch", "squeue", "scancel", "sinfo"):
            if shutil.which(command) is None:
                raise LauncherError(f"launcher='slurm' needs Slurm's `{command}` on PATH, and none "
                                    "is there; use launcher='local' (this host) or SSH(...)")
        partitions = _slurm(["sinfo", "--noheader", "--format=%R"], "list the partitions")
        known = sorted(set(partitions.split()))
        if self.partition and self.partition not in known:
            raise LauncherError(f"Slurm has no partition {self.partition!r}; it has: "
                                f"{', '.join(known) or 'none'}")
        if self.account:
            accounts = _slurm_accounts()
            if accounts is not None and self.account not in accounts:
                raise LauncherError(f"Slurm has no account {self.account!r} for this user; yours: "
                                    f"{', '.join(sorted(accounts)) or 'none'}")

    def controller_ip(self) -> str:
        return address_toward("192.0.2.1")  # the default route's address (TEST-NET: nothing is sent)

    def configure(self, config: Config) -> None:
        config.SlurmEngineSetLauncher.batch_template = _ENGINE_JOB
        # ipyparallel writes the job script into the working directory (the user's notebooks)
        # unless its name is absolute; sbatch reads it once, at submission.
        config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
            tempfile.mkdtemp(prefix="colab_par-slurm-"), "engines.sbatch")
        config.SlurmEngineSetLauncher.namespace = {
            "colab_par_options": "\n".join(f"#SBATCH {option}" for option in self.sbatch_options())}

    def waiting(self, ipp_cluster: Any) -> str | None:
        """Why the engines' job has no running engines yet; raises when the job is gone."""
        reasons = []
        for engine_set in ipp_cluster.engines.values():
            state = _job_state(engine_set.job_id) if engine_set.job_id else None
            if state is None:
                raise LauncherError(f"the engines' Slurm job {engine_set.job_id or '(none)'} ended "
                                    f"before its engines registered; its output:\n"
                                    f"{_tail(engine_set.output_file)}")
            state, reason = state
            reasons.append(f"Slurm job {engine_set.job_id} is {state} (reason: {reason})")
        return "; ".join(reasons) or None

    def stop(self, ipp_cluster: Any, grace_s: float = 30.0) -> None:
        """scancel the engines' job, and wait until the queue no longer lists it."""
        jobs = [engine_set.job_id for engine_set in ipp_cluster.engines.values() if engine_set.job_id]
        scripts = [engine_set.batch_file_name for engine_set in ipp_cluster.engines.values()]
        ipp_cluster.stop_cluster_sync()
        deadline = time.monotonic() + grace_s
        while any(_job_state(job) for job in jobs):
            if time.monotonic() > deadline:
                raise LauncherError(f"Slurm still lists job(s) {', '.join(jobs)} {grace_s:.0f}s "
                                    "after scancel; see `squeue` and the slurmd log")
            time.sleep(0.2)
        for script in scripts:  # in the folder `configure` made for it
            shutil.rmtree(os.path.dirname(script), ignore_errors=True)


Launcher = Union[Local, MPI, SSH, Slurm]


def launcher_from(value: str | Launcher) -> Launcher:
    """A launcher from its name or as given; `ssh` needs its hosts, so only SSH(...) will do."""
    if isinstance(value, (Local, SSH, Slurm)):
        return value
    if value == "ssh":
        raise ValueError("launcher='ssh' needs the hosts to start engines on: "
                         "launcher=colab_par.SSH({'node1': 2, 'node2': 2})")
    named = {"local": Local, "mpi": MPI, "slurm": Slurm}
    if value not in named:
        raise ValueError(f"launcher={value!r} is unknown; use one of {', '.join(NAMES)} "
                         "(or colab_par.Slurm(...) / colab_par.SSH(...) with options)")
    return named[value]()


def launcher_state(launcher: Launcher) -> dict[str, Any]:
    """A launcher as JSON-able fields (a persisted cluster's record), read by `launcher_from_state`."""
    return {"name": launcher.name, **asdict(launcher)}


def launcher_from_state(state: dict[str, Any]) -> Launcher:
    kinds = {"local": Local, "mpi": MPI, "ssh": SSH, "slurm": Slurm}
    fields = {key: tuple(value) if isinstance(value, list) else value
              for key, value in state.items() if key != "name"}
    return kinds[state["name"]](**fields)


_ENGINE_JOB = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=colab_par-engines
#SBATCH --ntasks={n}
#SBATCH --output={output_file}
{colab_par_options}
srun {program_and_args}
"""


def _slurm(command: list[str], doing: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise LauncherError(f"Slurm did not answer within 30 s when asked to {doing} "
                            f"(`{' '.join(command)}`); is slurmctld up?") from None
    if done.returncode:
        raise LauncherError(f"Slurm could not {doing} (`{' '.join(command)}`): "
                            f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _job_state(job: str) -> tuple[str, str] | None:
    """(state, reason) of a job the queue lists, or None once it has left the queue."""
    try:
        listed = _slurm(["squeue", "--noheader", f"--jobs={job}", "--format=%T|%r"],
                        "ask about the engines' job").strip()
    except LauncherError as error:
        if "Invalid job id" in str(error):  # purged from slurmctld: long gone
            return None
        raise
    if not listed:
        return None
    state, _, reason = listed.partition("|")
    return state, reason


def _slurm_accounts() -> set[str] | None:
    """This user's accounts, or None where Slurm keeps no accounting (then it takes any account)."""
    if shutil.which("sacctmgr") is None:
        return None
    try:
        done = subprocess.run(["sacctmgr", "--noheader", "--parsable2", "show", "associations",
                               f"user={os.environ.get('USER') or _user()}", "format=account"],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode:
        return None
    return {line.strip() for line in done.stdout.splitlines() if line.strip()}


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _host_address(host: str) -> str:
    import socket

    try:
        return socket.gethostbyname(host)
    except OSError as error:
        raise LauncherError(f"host {host!r} does not resolve ({error}); give its address") from None


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no output file)"
