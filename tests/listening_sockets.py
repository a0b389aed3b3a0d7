"""The TCP ports a set of processes listens on, read from /proc: tests check that a run's ranks can be reached
from this machine only."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

LISTEN = "0A"


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp* prints each 32-bit word of the address in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            addr, port = fields[1].split(":")
            found[fields[9]] = (_address(addr, family), int(port, 16))
    return found


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes listen on."""
    inodes = _listening_inodes()
    out = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except FileNotFoundError:  # it exited since it was listed: it listens on nothing
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                out.append((pid, *inodes[target[8:-1]]))
    return out


def off_loopback(pids: list[int]) -> list[tuple[int, str, int]]:
    """The listening sockets that another machine could reach (bound to an address that is not loopback)."""
    def loopback(addr: str) -> bool:
        ip = ipaddress.ip_address(addr)
        return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)

    return [s for s in listening(pids) if not loopback(s[1])]
