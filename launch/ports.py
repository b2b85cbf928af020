"""TCP ports for local processes: pick free ones, check that one is free.

Ports are picked in :data:`PICK_RANGE`, below the kernel's ephemeral range (``ip_local_port_range``,
32768-60999 by default) and above the ports Mooncake's transfer engine draws for its RPC listeners
(15000-17000 seen here) and the default bootstrap port 18800. A port picked by binding to port 0
comes from the ephemeral range, where every outgoing connection (ZMQ, HTTP clients, Mooncake's
TCP transport) also takes its local port: between the pick and the server's bind, such a
connection could take it ("address already in use"). Ports handed out by this process are not
handed out again while fresher ones are left.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"
#: Where free ports are picked: [low, high).
PICK_RANGE = (20000, 32000)
_handed: set[int] = set()
_rng = random.SystemRandom()


def _bindable(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind((LOOPBACK, port))
    except OSError:
        return False
    return True


def _pick(socks: list[socket.socket]) -> int:
    """Bind a fresh socket (appended to ``socks``) to a free port of PICK_RANGE not handed out before."""
    low, high = PICK_RANGE
    if len(_handed) > (high - low) // 2:
        _handed.clear()
    for _ in range(200):
        port = _rng.randrange(low, high)
        if port in _handed:
            continue
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if _bindable(sock, port):
            socks.append(sock)
            _handed.add(port)
            return port
        sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # the range is crowded: any free port
    sock.bind((LOOPBACK, 0))
    socks.append(sock)
    return int(sock.getsockname()[1])


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago (bound and released)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Return `count` distinct free ports (all held open together while choosing them)."""
    socks: list[socket.socket] = []
    try:
        return [_pick(socks) for _ in range(count)]
    finally:
        for sock in socks:
            sock.close()


def port_in_use(host: str, port: int) -> bool:
    """True if `port` cannot be bound on `host` right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
