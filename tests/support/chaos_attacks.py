"""Attack tools of the chaos test's hardening phases (tests/support/chaos_hardening.py).

- `LogWatch`: follows a process's log as it grows and stamps every line with the monotonic time it
  was seen (a log's own timestamps have whole seconds), so a phase can order its own actions (a
  SIGCONT, a flood's start) against what P and D logged.
- `Flood`: a paced stream of random frames (no valid MAC) to ZMQ rank ports from background threads.
- `slowloris`: many connections that each send one byte of a request and nothing more; when and how
  the server closed each.
- `FramePeer`: a ZMQ peer holding the deployment's token, sealing frames exactly as a rank does
  (``pd_connector.transfer.frames``, keyed with ``keys.frame_key``) and opening the answers it receives.
- `metric_total`: the sum of a Prometheus counter's samples on a /metrics page.
"""

from __future__ import annotations

import random
import re
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

from pd_connector import messages as proto
from pd_connector.keys import frame_key
from pd_connector.transfer.frames import FrameOpener, FrameSealer


# -- logs ----------------------------------------------------------------------------------------
class LogWatch:
    """Lines appended to ``path`` from now on, each with the monotonic time this watch read it."""

    def __init__(self, path: Path, interval_s: float = 0.02) -> None:
        self._file = open(path, errors="replace")  # noqa: SIM115 - closed in stop()
        self._file.seek(0, 2)
        self._interval = interval_s
        self._partial = ""
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"logwatch-{path.name}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self._interval)
        self._read()

    def _read(self) -> None:
        chunk = self._file.read()
        if not chunk:
            return
        now = time.monotonic()
        text, self._partial = (self._partial + chunk).rsplit("\n", 1) if "\n" in chunk else ("", self._partial + chunk)
        with self._lock:
            self.lines.extend((now, line) for line in text.split("\n") if line)

    def matching(self, pattern: str, since: float = 0.0) -> list[tuple[float, re.Match[str]]]:
        """(time seen, match) of every line seen at or after ``since`` that ``pattern`` matches."""
        rx = re.compile(pattern)
        with self._lock:
            found = [(t, rx.search(line)) for t, line in self.lines if t >= since]
        return [(t, m) for t, m in found if m is not None]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._file.close()


# -- a flood of refused frames -------------------------------------------------------------------
@dataclass
class FloodCount:
    endpoint: str
    sent: int = 0
    dropped: int = 0  # the socket's queue was full (the receiver is slower than the flood)


class Flood:
    """``rate`` random frames a second (``size`` bytes: long enough that the receiver computes their
    MAC) to each endpoint, from one thread per endpoint, until ``stop()``; frames a full queue would
    block on are dropped and counted."""

    def __init__(self, endpoints: Sequence[str], rng: random.Random, rate: int = 4000, size: int = 400) -> None:
        self._frames = [rng.randbytes(size) for _ in range(64)]
        self._rate = rate
        self.counts = [FloodCount(e) for e in endpoints]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in self.counts]
        self.started = self.stopped = 0.0

    def __enter__(self) -> Flood:
        self.started = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            for t in self._threads:
                t.join(timeout=5)
            self.stopped = time.monotonic()

    def _run(self, count: FloodCount) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 2000)
        sock.connect(count.endpoint)
        tick = 0.01
        per_tick = max(1, int(self._rate * tick))
        i = 0
        try:
            next_tick = time.monotonic()
            while not self._stop.is_set():
                for _ in range(per_tick):
                    try:
                        sock.send(self._frames[i % len(self._frames)], zmq.NOBLOCK)
                        count.sent += 1
                    except zmq.Again:
                        count.dropped += 1
                    i += 1
                next_tick += tick
                time.sleep(max(0.0, next_tick - time.monotonic()))
        finally:
            sock.close(linger=0)
            ctx.term()

    @property
    def sent(self) -> int:
        return sum(c.sent for c in self.counts)

    @property
    def seconds(self) -> float:
        return (self.stopped or time.monotonic()) - self.started


# -- slowloris ------------------------------------------------------------------------------------
@dataclass
class SlowConnection:
    sock: socket.socket
    opened: float
    closed_after_s: float | None = None  # seconds from its byte to the server's close
    answer: bytes = b""


@dataclass
class SlowlorisResult:
    connections: int
    refused: int = 0  # connections the server would not even accept
    closed: list[float] = field(default_factory=list)  # seconds to close, per connection closed
    statuses: dict[str, int] = field(default_factory=dict)  # status line (or "" for a bare close) -> count
    still_open: int = 0


def slowloris(host: str, port: int, n: int, wait_s: float) -> SlowlorisResult:
    """Open ``n`` connections that send one byte each (a request's first) and nothing more; wait up
    to ``wait_s`` for the server to close them; what it answered and when."""
    result = SlowlorisResult(n)
    sel = selectors.DefaultSelector()
    open_conns: list[SlowConnection] = []
    try:
        for _ in range(n):
            try:
                sock = socket.create_connection((host, port), timeout=5)
                sock.sendall(b"P")  # "POST ..." never comes
            except OSError:
                result.refused += 1
                continue
            sock.setblocking(False)
            conn = SlowConnection(sock, time.monotonic())
            open_conns.append(conn)
            sel.register(sock, selectors.EVENT_READ, conn)
        deadline = time.monotonic() + wait_s
        pending = len(open_conns)
        while pending and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                conn = key.data
                try:
                    data = conn.sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""  # reset: closed too
                if data:
                    conn.answer += data
                    continue
                conn.closed_after_s = time.monotonic() - conn.opened
                sel.unregister(conn.sock)
                pending -= 1
        for conn in open_conns:
            if conn.closed_after_s is None:
                result.still_open += 1
                continue
            result.closed.append(round(conn.closed_after_s, 2))
            status = conn.answer.split(b"\r\n", 1)[0].decode(errors="replace") if conn.answer else ""
            result.statuses[status] = result.statuses.get(status, 0) + 1
    finally:
        sel.close()
        for conn in open_conns:
            conn.sock.close()
    return result


# -- frames a peer with the token would send -----------------------------------------------------
class FramePeer:
    """A ZMQ peer holding the deployment's token: a PULL socket of its own (``endpoint``), frames sealed
    for one receiver as a rank seals them, PUSH sockets to the ranks."""

    def __init__(self, token: str, host: str = "127.0.0.1") -> None:
        self._token = token.encode()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        key = frame_key(self._token)
        self._sealer, self._opener = FrameSealer(key, self.endpoint), FrameOpener(key, self.endpoint)

    def seal(self, receiver: str, msg: proto.Message) -> bytes:
        return self._sealer.seal(receiver, proto.encode(msg))

    def send_raw(self, endpoint: str, frame: bytes) -> None:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._push[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        sock.send(frame)

    def receive(self, timeout_s: float) -> tuple[bytes, proto.Message] | None:
        """The next frame sent to this peer within ``timeout_s`` and its message (the frame opened and
        checked as a rank would), or None."""
        if not self._pull.poll(int(timeout_s * 1000)):
            return None
        frame = self._pull.recv()
        return frame, proto.decode(self._opener.open(frame).payload)

    def ping(self, endpoint: str, timeout_s: float) -> float | None:
        """Seconds until the rank at ``endpoint`` answered a Ping sealed for it (its Pong), None if it did
        not within ``timeout_s``; other frames received meanwhile are dropped."""
        t0 = time.monotonic()
        self.send_raw(endpoint, self.seal(endpoint, proto.Ping(about=endpoint, reply_to=self.endpoint)))
        while (left := t0 + timeout_s - time.monotonic()) > 0:
            got = self.receive(left)
            if got is not None and isinstance(got[1], proto.Pong) and got[1].about == endpoint:
                return time.monotonic() - t0
        return None

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()


def metric_total(url: str, name: str) -> float:
    """Sum of every sample of the counter ``name`` (``<name>_total``) on ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    rx = re.compile(rf"^{re.escape(name)}_total(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in rx.findall(text))
