"""Two "hosts" on this machine for the multi-host tests: each a network and UTS namespace with its
own hostname and an address on a private bridge, running its own sshd. Processes started over SSH
live in that host's namespaces (hostname, network); the file system and the process table stay
shared, as on cluster nodes with a shared home. Everything is made here and removed by `remove`."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

SUBNET = "10.231.7"
BRIDGE = "cpbr7"
HOSTS = {"colabpar-a": f"{SUBNET}.2", "colabpar-b": f"{SUBNET}.3"}
CONTROLLER = f"{SUBNET}.1"


class CannotMakeHosts(RuntimeError):
    """This machine does not let the test make namespaces (no root, no iproute2, no sshd)."""


class TwoHosts:
    def __init__(self, root: Path):
        self.root = root
        self.key = root / "id_ed25519"
        self._sshd: list[subprocess.Popen] = []

    @property
    def addresses(self) -> list[str]:
        return list(HOSTS.values())

    @property
    def ssh_args(self) -> tuple[str, ...]:
        return ("-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "BatchMode=yes")

    def make(self) -> "TwoHosts":
        missing = [tool for tool in ("ip", "unshare", "ssh-keygen", "ssh", "scp") if shutil.which(tool) is None]
        if not Path("/usr/sbin/sshd").exists():
            missing.append("/usr/sbin/sshd")
        if missing or os.geteuid() != 0:
            raise CannotMakeHosts(f"making two hosts needs root and {', '.join(missing) or 'iproute2'}"
                                  f" (euid {os.geteuid()}); .ci/run installs openssh-server")
        self.remove()  # what an interrupted run left
        try:
            self._network()
            self._sshds()
        except subprocess.CalledProcessError as error:
            self.remove()
            raise CannotMakeHosts(f"this machine cannot make network namespaces: `{' '.join(error.cmd)}`"
                                  f" said {error.stderr.strip()}") from None
        return self

    def run_on(self, host: str, command: str) -> str:
        """Run a shell command on a host over SSH, as the launcher does."""
        done = subprocess.run(["ssh", *self.ssh_args, HOSTS[host], command], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def remove(self) -> None:
        for sshd in self._sshd:
            sshd.kill()
            sshd.wait()
        self._sshd = []
        subprocess.run(["pkill", "-f", "sshd -D -e -f .*/sshd-colabpar-"], capture_output=True)  # a crashed run's
        for number, name in enumerate(HOSTS):
            subprocess.run(["ip", "link", "del", f"{BRIDGE}v{number}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)

    def _network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{CONTROLLER}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for number, (name, address) in enumerate(HOSTS.items()):
            veth = f"{BRIDGE}v{number}"
            _ip("netns", "add", name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", veth, "master", BRIDGE, "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def _sshds(self) -> None:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / "host_key"))
        for name, address in HOSTS.items():
            config = self.root / f"sshd-{name}.conf"
            config.write_text(f"""ListenAddress {address}
HostKey {self.root / 'host_key'}
PidFile {self.root / f'sshd-{name}.pid'}
AuthorizedKeysFile {self.key}.pub
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PrintMotd no
Subsystem sftp /usr/lib/openssh/sftp-server
""")
            self._sshd.append(subprocess.Popen(
                ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c",
                 f"hostname {name} && exec /usr/sbin/sshd -D -e -f {config}"],
                stdout=subprocess.DEVNULL, stderr=open(self.root / f"sshd-{name}.log", "w")))
        deadline = time.monotonic() + 20
        for name in HOSTS:
            while True:
                probe = subprocess.run(["ssh", *self.ssh_args, "-o", "ConnectTimeout=2", HOSTS[name],
                                        "hostname"], capture_output=True, text=True)
                if probe.returncode == 0 and probe.stdout.strip() == name:
                    break
                if time.monotonic() > deadline:
                    raise CannotMakeHosts(f"sshd on {name} did not answer: {probe.stderr.strip()}; "
                                          f"see {self.root / f'sshd-{name}.log'}")
                time.sleep(0.2)


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)
