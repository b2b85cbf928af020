"""Listening TCP sockets of a process, read from Linux's /proc (vLLM-free; errors are the caller's).

``socket_inodes(pid)``: the socket inodes ``pid`` holds (its fd links). ``listen_table(pid, table)``:
inode -> (address, port) of the LISTEN entries of ``/proc/<pid>/net/tcp`` or ``tcp6`` (the process's
network namespace). A socket a process listens on is an inode in both.
"""

from __future__ import annotations

import ipaddress
import os

#: /proc/net table -> hex digits of its addresses.
TABLES = {"tcp": 8, "tcp6": 32}


def socket_inodes(pid: int | str = "self") -> set[str]:
    """Inodes of the sockets ``pid`` holds; OSError when its fd folder cannot be read."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def listen_table(pid: int | str, table: str, unmap_v4: bool = False) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of the LISTEN sockets in ``/proc/<pid>/net/<table>``; ``unmap_v4`` writes an
    IPv4-mapped IPv6 address as the IPv4 one. OSError when the table cannot be read."""
    width = TABLES[table]
    with open(f"/proc/{pid}/net/{table}") as f:
        lines = f.readlines()[1:]
    found = {}
    for line in lines:
        cols = line.split()
        if cols[3] != "0A":  # LISTEN
            continue
        addr_hex, port_hex = cols[1].split(":")
        raw = b"".join(bytes.fromhex(addr_hex[i : i + 8])[::-1] for i in range(0, width, 8))
        addr = ipaddress.ip_address(raw)
        if unmap_v4 and isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        found[cols[9]] = (str(addr), int(port_hex, 16))
    return found
