"""Nothing a cluster starts listens beyond the address its world uses: 127.0.0.1 on one host.

Read from the kernel's own tables (/proc/net/tcp{,6} and each process's open file descriptors), so
the rendezvous store, gloo's listeners and ipyparallel's sockets are all seen, whoever opened them.
"""
from __future__ import annotations

import ipaddress
import os

from colab_par.cluster import descendant_pids

INTENDED = ipaddress.ip_address("127.0.0.1")
LISTEN = "0A"


def _address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """'0100007F:1F90' -> (127.0.0.1, 8080); IPv6 words are little-endian 32-bit groups."""
    hex_ip, hex_port = hex_address.split(":")
    raw = b"".join(bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, len(hex_ip), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(hex_port, 16)


def listening_sockets() -> dict[int, tuple]:
    """inode -> (address, port) of every listening TCP socket of this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for line in rows.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == LISTEN:
                    found[int(fields[9])] = _address(fields[1])
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def test_every_process_of_the_cluster_listens_only_on_loopback(cluster2):
    pids = set(cluster2.pids)
    for pid in list(pids):
        pids |= descendant_pids(pid)
    listeners = listening_sockets()
    by_pid = {pid: {listeners[i] for i in socket_inodes(pid) if i in listeners} for pid in pids}
    exposed = {pid: sorted(f"{ip}:{port}" for ip, port in found if ip != INTENDED)
               for pid, found in by_pid.items()}
    assert not any(exposed.values()), f"listening beyond {INTENDED}: {exposed}"

    # not vacuous: the rendezvous store and every engine's gloo listener were among those checked
    def world_ports():
        import os

        import torch.distributed as dist

        return os.getpid(), int(os.environ["MASTER_PORT"]), dist.get_rank()

    engines = cluster2.run(world_ports)
    rank0_pid, store_port, _ = engines[0]
    assert (INTENDED, store_port) in by_pid[rank0_pid]
    for pid, _, rank in engines:
        assert pid in pids and len(by_pid[pid] - {(INTENDED, store_port)}) >= 1, (rank, by_pid[pid])
    assert len([pid for pid in pids if by_pid[pid]]) > len(engines)  # the controller too
