"""A real one-node Slurm on this machine for the tests: its own munge key and daemon, a MariaDB
and slurmdbd keeping accounting (so accounts exist or not, and are enforced), slurmctld and slurmd
with their own slurm.conf (node = this host, the CPUs it has), state and free ports, all in a
temporary folder; `SLURM_CONF` points Slurm's commands at it. CI installs Debian's packages."""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

NODE = socket.gethostname()  # so the job's node list resolves, as sbatch scripts expect
PARTITION = "debug"
ACCOUNT = "colabpar"
DAEMONS = ("munged", "mariadb-install-db", "mariadbd", "slurmdbd", "slurmctld", "slurmd")


class SlurmSite:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}

    def start(self) -> "SlurmSite":
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            raise RuntimeError(f"Slurm is not installed here (no {', '.join(missing)}); .ci/run "
                               "installs Debian's slurmctld, slurmd, slurmdbd, mariadb-server and munge")
        for folder in ("state", "spool", "log"):
            (self.root / folder).mkdir()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.root / "munge.sock"
        self._run(["munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                   f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'log/munged.log'}",
                   f"--seed-file={self.root / 'munged.seed'}"])
        self._database()
        self.conf.write_text(self._config())
        dbd = self.root / "slurmdbd.conf"  # slurmdbd reads it beside SLURM_CONF
        dbd.write_text(self._dbd_config())
        dbd.chmod(0o600)
        self._run(["slurmdbd"])
        self._wait_for(["sacctmgr", "--noheader", "list", "cluster"], "slurmdbd")
        for add in (["cluster", "colabpar"], ["account", ACCOUNT, "cluster=colabpar"],
                    ["user", getpass.getuser(), f"account={ACCOUNT}", f"defaultaccount={ACCOUNT}"]):
            self._run(["sacctmgr", "--immediate", "add", *add])
        self._run(["slurmctld", "-f", str(self.conf), "-i"])
        self._run(["slurmd", "-f", str(self.conf), "-N", NODE])
        self.wait_idle()
        return self

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            pid_file = self.root / f"{name}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), 15)
                except (ProcessLookupError, ValueError):
                    pass

    def command(self, *args: str) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30,
                              env={**os.environ, **self.env})
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
        return done.stdout

    def jobs(self) -> list[str]:
        """Every job the queue lists (pending, running or completing)."""
        return self.command("squeue", "--noheader", "--format=%i %T").splitlines()

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True,
                                  env={**os.environ, **self.env})
            if done.returncode == 0 and done.stdout.strip() == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the test Slurm's node never became idle: {done.stdout}{done.stderr}; "
                           f"see {self.root / 'log'}")

    def _database(self) -> None:
        """A private MariaDB on a free port, with the user slurmdbd logs in as."""
        self.db_port = _free_port()
        self._run(["mariadb-install-db", "--no-defaults", f"--datadir={self.root / 'db'}", "--user=root",
                   "--auth-root-authentication-method=normal", "--skip-test-db"])
        socket_path = self.root / "db.sock"
        subprocess.Popen(["mariadbd", "--no-defaults", f"--datadir={self.root / 'db'}", "--user=root",
                          f"--socket={socket_path}", f"--port={self.db_port}", "--bind-address=127.0.0.1",
                          f"--pid-file={self.root / 'mariadbd.pid'}", f"--log-error={self.root / 'log/db.err'}",
                          "--skip-log-bin", "--innodb-buffer-pool-size=16M"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait_for(["mariadb", "--no-defaults", f"--socket={socket_path}", "-uroot", "-e",
                        "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'colabpar'; "
                        "GRANT ALL ON *.* TO 'slurm'@'127.0.0.1';"], "MariaDB")

    def _wait_for(self, command: list[str], what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **self.env})
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer: {done.stderr}; see {self.root / 'log'}")
            time.sleep(0.2)

    def _dbd_config(self) -> str:
        return f"""AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort={self.dbd_port}
SlurmUser={getpass.getuser()}
PidFile={self.root}/slurmdbd.pid
LogFile={self.root}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.db_port}
StorageUser=slurm
StoragePass=colabpar
StorageLoc=slurm_acct_db
"""

    def _run(self, command: list[str]) -> None:
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **self.env})
        if done.returncode:
            raise RuntimeError(f"{command[0]} did not start: {done.stderr or done.stdout}")

    def _config(self) -> str:
        user, root = getpass.getuser(), self.root
        controller_port, node_port, self.dbd_port = _free_port(), _free_port(), _free_port()
        return f"""ClusterName=colabpar
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmdPort={node_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.dbd_port}
AccountingStoragePass={self.munge_socket}
AccountingStorageEnforce=associations
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MessageTimeout=5
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
