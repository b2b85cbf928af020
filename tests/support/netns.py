"""Separate hosts on one Linux machine, and the listening sockets of a process tree.

- `listeners(pid)`: every listening TCP socket of a process and its descendants (from
  /proc/<pid>/fd and /proc/<pid>/net/tcp{,6}, so it sees into other network namespaces too);
  `mooncake_listeners(log)`: what an instance's log says Mooncake opened
  (`pd_connector.transfer.mooncake` logs it), the one documented exposure (docs/security.md).
- `Network`: network namespaces joined by veth pairs to a bridge that lives in a namespace of its own,
  addresses from 198.18.0.0/24 (inside the 198.18.0.0/15 test range). Everything it makes is inside
  namespaces it created (`ip -n <its namespace> link add ... peer ... netns <its namespace>`), nothing in
  the caller's; leaving the `with` deletes them all, and with them every veth pair.
- `run_in(ns, fn)`: call `fn` in a thread that entered namespace `ns` (its sockets are opened there).
- `Network.firewall`: an nftables input filter inside one of its hosts (docs/security.md's rules).
- `tcp_probe`: connect and say "open", "refused" or "unreachable".
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pd_connector.transfer.proc_sockets import TABLES, listen_table, socket_inodes
from tests.support.key_files import self_signed

T = TypeVar("T")

#: Addresses of the hosts the tests make: part of 198.18.0.0/15 (RFC 2544, benchmarking), never routed.
TEST_NET = ipaddress.ip_network("198.18.0.0/24")
_CLONE_NEWNET = 0x40000000
_MOONCAKE_LINE = re.compile(r"Mooncake transfer engine listening on (.+?) \(all interfaces")


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: the process holding it, its address and port."""

    pid: int
    host: str
    port: int

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.host).is_unspecified

    @property
    def where(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every descendant of it (threads' children included)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    return found


def _socket_inodes(pid: int) -> set[str]:
    try:
        return socket_inodes(pid)
    except OSError:
        return set()  # gone meanwhile


def _listening(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of the LISTEN sockets in ``pid``'s network namespace."""
    found = {}
    for table in TABLES:
        try:
            found.update(listen_table(pid, table, unmap_v4=True))
        except OSError:
            continue
    return found


def listeners(pid: int) -> list[Listener]:
    """Every listening TCP socket held by ``pid`` or a descendant, by port."""
    found: dict[tuple[str, int], Listener] = {}
    for p in tree_pids(pid):
        table = _listening(p)
        for inode in _socket_inodes(p):
            if inode in table:
                host, port = table[inode]
                found.setdefault((host, port), Listener(p, host, port))
    return sorted(found.values(), key=lambda s: (s.port, s.host))


def mooncake_listeners(log_path: Path) -> set[tuple[str, int]]:
    """(address, port) of the listeners an instance's log says Mooncake's transfer engine opened."""
    found = set()
    for listed in _MOONCAKE_LINE.findall(Path(log_path).read_text(errors="replace")):
        for item in listed.split(", "):
            host, port = item.rsplit(":", 1)
            found.add((host.strip("[]"), int(port)))
    return found


def undocumented_wildcards(pid: int, log_path: Path) -> tuple[list[Listener], list[Listener]]:
    """(wildcard listeners of ``pid``'s tree that are not Mooncake's, all listeners): the bind test's check."""
    socks = listeners(pid)
    mooncake = mooncake_listeners(log_path)
    return [s for s in socks if s.wildcard and (s.host, s.port) not in mooncake], socks


# -- network namespaces -------------------------------------------------------------------------------
def netns_problem() -> str | None:
    """Why this machine cannot make network namespaces for a test, or None."""
    if not os.path.exists("/proc/self/ns/net"):
        return "not Linux (no network namespaces)"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (apt-get install {package})"
    probe = f"pdcprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        veth = subprocess.run(
            ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
            capture_output=True,
            text=True,
        )
        if veth.returncode != 0:
            return f"cannot make a veth pair in a namespace: {veth.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Network:
    """Hosts (network namespaces) on one bridge; ``hosts`` maps a name to the last byte of its address."""

    def __init__(self, hosts: dict[str, int]) -> None:
        self.tag = f"pdc{uuid.uuid4().hex[:6]}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = dict(hosts)
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return str(TEST_NET.network_address + self.hosts[host])

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def sh(self, host: str, *cmd: str) -> str:
        done = subprocess.run([*self.exec_prefix(host), *cmd], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} in {host}: {done.stderr.strip()}")
        return done.stdout

    def __enter__(self) -> Network:
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _make(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        self.made.append(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self.made.append(ns)
            # Both ends are made from inside the bridge namespace: nothing appears in the caller's.
            _ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0", "up")
            self.sh(host, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/{TEST_NET.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def remove(self) -> None:
        """Delete every namespace made (their veth ends and the bridge go with them)."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this network still present (empty after `remove`)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(self.tag)]

    def firewall(self, host: str, rules: Sequence[tuple[str, Sequence[str]]]) -> str:
        """Load an nftables input filter in ``host``: for each (ports, sources), TCP to ``ports``
        ("15000-17000", "8000, 8001") is accepted from ``sources`` only and dropped from anyone else.

        The same rules as docs/security.md's, in an ``inet`` table (IPv4 and IPv6). Returns the ruleset.
        """
        lines = ["ct state established,related accept"]
        for ports, sources in rules:
            if sources:
                lines.append(f"tcp dport {{ {ports} }} ip saddr {{ {', '.join(sources)} }} accept")
            lines.append(f"tcp dport {{ {ports} }} drop")
        ruleset = (
            "table inet pdc_test {\n  chain input {\n    type filter hook input priority filter; policy accept;\n"
            + "".join(f"    {line}\n" for line in lines)
            + "  }\n}\n"
        )
        done = subprocess.run(
            [*self.exec_prefix(host), "nft", "-f", "-"], input=ruleset, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft in {host}: {done.stderr.strip()}\n{ruleset}")
        return ruleset


def run_in(ns: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh thread that first entered network namespace ``ns``.

    A network namespace is per thread: only this thread's (and its own threads') sockets live in ``ns``.
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({ns}) failed")
            finally:
                os.close(fd)
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def tcp_probe(host: str, port: int, timeout: float = 2.0) -> str:
    """ "open" (connected), "refused" (RST) or "unreachable" (no answer / no route) for host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unreachable"


def certificate_for(directory: Path, ip: str) -> tuple[Path, Path]:
    """A fresh self-signed certificate (its own CA) for address ``ip``: ``(cert.pem, key.pem)``."""
    return self_signed(directory, "bootstrap", ip)
