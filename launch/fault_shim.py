"""A fault-injecting TCP proxy for the ZMQ control plane between D and a P rank (ZMTP 3 over TCP).

D finds a P rank's ZMQ endpoint in the route of P's bootstrap server (``GET /bootstrap/route``,
``rank_ip``/``rank_port`` per rank, ``pd_connector.bootstrap``). P advertises the port its PULL socket
binds and has no separate advertised port (``local_ip`` and vLLM's ``kv_port`` set both the bind and
the advertisement), so the bootstrap shim (``launch.fault_shim_http``) rewrites each rank of the route
it serves to a `ZmtpFaultProxy` in front of that rank: D's PUSH socket connects to the proxy, which
connects on to P. Liveness works through it: a D Ping names P's endpoint as D knows it and P's Pong
echoes it (``pd_connector.messages.Ping``). With an auth token, frames name their receiver's endpoint
and P refuses them as ``misdirected``: the proxy is for stacks without a token.

What the proxy does, honestly, on the D -> P direction only (P -> D bytes are relayed untouched):

- the ZMTP greeting (64 bytes) is relayed as it arrives, then the stream is parsed into ZMTP frames
  (flags byte, 1- or 8-byte size, body). Command frames (READY, PING/PONG of ZMTP's own heartbeat)
  pass untouched; message frames are grouped into messages (up to the frame without MORE) and each
  message gets at most one fault, drawn with the configured probabilities (`FaultRates`):
- ``drop``: the message is not sent on;
- ``duplicate``: sent twice in a row;
- ``delay``: the connection stalls ``delay_s`` before it is sent (later messages wait behind it, as on TCP);
- ``reorder``: held back until the next message went on (or ``hold_s`` passed without one, or D
  closed its side), so the next message overtakes it;
- ``truncate``: its last frame's body is cut to a random shorter length; the framing stays valid ZMTP,
  so P's socket delivers a message whose payload is cut short.

Every counter is in `ZmtpFaultProxy.counts` (``passed``, ``commands``, ``connections`` and one per fault).
"""

from __future__ import annotations

import enum
import logging
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass

from launch.ports import LOOPBACK

logger = logging.getLogger(__name__)

GREETING_BYTES = 64
FLAG_MORE = 0x01
FLAG_LONG = 0x02
FLAG_COMMAND = 0x04
_POLL_S = 0.05


class FrameFault(enum.Enum):
    DROP = "drop"
    DUPLICATE = "duplicate"
    DELAY = "delay"
    REORDER = "reorder"
    TRUNCATE = "truncate"


@dataclass(frozen=True)
class FaultRates:
    """Probability of each fault per message (their sum at most 1) and the delay / hold times."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    reorder: float = 0.0
    truncate: float = 0.0
    delay_s: float = 0.2
    hold_s: float = 0.5

    def __post_init__(self) -> None:
        rates = [self.drop, self.duplicate, self.delay, self.reorder, self.truncate]
        if any(r < 0 for r in rates) or sum(rates) > 1.0 + 1e-9:
            raise ValueError(f"fault probabilities must be >= 0 and sum to at most 1, not {rates}")

    def draw(self, rng: random.Random) -> FrameFault | None:
        x = rng.random()
        for fault in FrameFault:
            x -= getattr(self, fault.value)
            if x < 0:
                return fault
        return None


NO_FAULTS = FaultRates()


def encode_frame(flags: int, body: bytes) -> bytes:
    """One ZMTP 3 frame: short form up to 255 bytes, long form (8-byte size) beyond."""
    if len(body) <= 255:
        return bytes([flags & ~FLAG_LONG]) + bytes([len(body)]) + body
    return bytes([flags | FLAG_LONG]) + struct.pack(">Q", len(body)) + body


class _Closed(Exception):
    pass


class _Connection:
    """One D connection: the parsing relay D -> P and the raw relay P -> D."""

    def __init__(self, proxy: ZmtpFaultProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()
        self.held: list[bytes] | None = None
        self.held_until = 0.0
        client.settimeout(_POLL_S)

    def start(self) -> None:
        threading.Thread(target=self._up, name="zmtp-shim-up", daemon=True).start()
        threading.Thread(target=self._down, name="zmtp-shim-down", daemon=True).start()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _recv_chunk(self, n: int) -> bytes | None:
        """At most ``n`` bytes from D, None when the socket's timeout passed first; _Closed when D or
        the shim is gone."""
        try:
            chunk = self.client.recv(n)
        except TimeoutError:
            if self.closed.is_set():
                raise _Closed from None
            return None
        except OSError:
            raise _Closed from None
        if not chunk:
            raise _Closed
        return chunk

    def _recv(self, n: int) -> bytes:
        """Exactly ``n`` bytes from D; flushes a held message whose hold ran out while waiting."""
        out = bytearray()
        while len(out) < n:
            if self.held is not None and time.monotonic() >= self.held_until:
                self._send_held()
            chunk = self._recv_chunk(n - len(out))
            if chunk is not None:
                out += chunk
        return bytes(out)

    def _send(self, frames: list[bytes]) -> None:
        try:
            self.upstream.sendall(b"".join(frames))
        except OSError:
            raise _Closed from None

    def _send_held(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            self._send(held)

    def _up(self) -> None:
        try:
            got = 0
            while got < GREETING_BYTES:  # relayed as it comes: each side waits for the other's signature
                chunk = self._recv_chunk(GREETING_BYTES - got)
                if chunk is not None:
                    got += len(chunk)
                    self._send([chunk])
            message: list[bytes] = []
            while True:
                flags = self._recv(1)[0]
                size = struct.unpack(">Q", self._recv(8))[0] if flags & FLAG_LONG else self._recv(1)[0]
                body = self._recv(size) if size else b""
                if flags & FLAG_COMMAND:
                    self.proxy.count("commands")
                    self._send([encode_frame(flags, body)])
                    continue
                message.append(encode_frame(flags, body))
                if not flags & FLAG_MORE:
                    self._forward(message, flags, body)
                    message = []
        except _Closed:
            if not self.closed.is_set():
                try:
                    self._send_held()  # D closed its side: a held message still goes on
                except _Closed:
                    pass
        except Exception:  # a bug here must not leave D's connection half open
            logger.exception("ZMTP fault proxy: relay D -> P failed")
        finally:
            self.close()

    def _forward(self, message: list[bytes], last_flags: int, last_body: bytes) -> None:
        fault = self.proxy.draw()
        if fault is FrameFault.REORDER and self.held is not None:
            fault = None  # one message held at a time: this one overtakes it
        if fault is not None:
            self.proxy.count(fault.value)
        if fault is FrameFault.DROP:
            return
        if fault is FrameFault.TRUNCATE:
            message = [*message[:-1], encode_frame(last_flags, last_body[: self.proxy.randbelow(len(last_body))])]
        if fault is FrameFault.DELAY:
            time.sleep(self.proxy.rates.delay_s)
        if fault is FrameFault.REORDER:
            self.held, self.held_until = message, time.monotonic() + self.proxy.rates.hold_s
            return
        self._send(message)
        if fault is FrameFault.DUPLICATE:
            self._send(message)
        if fault is None:
            self.proxy.count("passed")
        self._send_held()  # a held message goes on after the one that overtook it

    def _down(self) -> None:
        try:
            while not self.closed.is_set():
                data = self.upstream.recv(65536)
                if not data:
                    break
                self.client.sendall(data)
        except OSError:
            pass
        finally:
            self.close()


class ZmtpFaultProxy:
    """Listens on ``host:port`` (0: a free port) and relays every connection to ``upstream``.

    ``rates`` may be changed at any time (`set_rates`); the faults are drawn from ``rng``.
    """

    def __init__(self, upstream: tuple[str, int], rng: random.Random, *, host: str = LOOPBACK, port: int = 0) -> None:
        self.upstream = upstream
        self.rates = NO_FAULTS
        self._rng = rng
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(_POLL_S)
        self.host, self.port = self._listener.getsockname()[:2]
        self._connections: list[_Connection] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"zmtp-shim-{self.port}", daemon=True)

    def start(self) -> ZmtpFaultProxy:
        self._thread.start()
        return self

    def set_rates(self, rates: FaultRates) -> None:
        with self._lock:
            self.rates = rates

    def draw(self) -> FrameFault | None:
        with self._lock:
            return self.rates.draw(self._rng)

    def randbelow(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(n) if n > 0 else 0

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                reset(client)  # P's rank is gone: D sees what it would see without the proxy
                continue
            self.count("connections")
            conn = _Connection(self, client, upstream)
            self._connections = [c for c in self._connections if not c.closed.is_set()] + [conn]
            conn.start()

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        for conn in self._connections:
            conn.close()
        self._thread.join(timeout=2)


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST (SO_LINGER 0) instead of an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
