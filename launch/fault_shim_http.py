"""A fault-injecting HTTP proxy in front of P's bootstrap server (``pd_connector.bootstrap.server``).

The Router is given the shim's port as P's bootstrap port (``--prefiller-bootstrap-ports``), so D's
route lookups (and any other bootstrap call naming that port) go through it; P's own ranks register
with the real server. Every route it passes on (``GET /bootstrap/route``, 200) has each rank's
``rank_ip``/``rank_port`` rewritten to a `ZmtpFaultProxy` in front of that rank (one per rank
endpoint, made on first sight), so D's ZMQ control plane toward P goes through the frame-level faults
of ``launch.fault_shim``.

Modes (`BootstrapMode`), switched at any time:

- ``pass``: relayed as is (route rewritten);
- ``refuse_rst``: the connection is reset (TCP RST) once the request was read, nothing answered;
- ``refuse_503``: ``503`` with a JSON error body, not relayed;
- ``slow``: relayed after ``slow_s`` seconds.

`BootstrapShim.restart` closes the listener (new connections are refused, as with P's bootstrap
server down) for ``down_s`` and listens again on the same port. P's bootstrap server itself
unreachable (P killed) is passed on as a reset connection, not as an HTTP answer. The shim speaks plain
HTTP only (no ``bootstrap_ssl_*``) and forwards ``Authorization`` unchanged.
"""

from __future__ import annotations

import enum
import http.client
import json
import logging
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from launch.fault_shim import FaultRates, ZmtpFaultProxy, reset
from launch.ports import LOOPBACK

logger = logging.getLogger(__name__)

ROUTE_PATH = "/bootstrap/route"
_HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "content-length"}


class BootstrapMode(enum.Enum):
    PASS = "pass"
    REFUSE_RST = "refuse_rst"
    REFUSE_503 = "refuse_503"
    SLOW = "slow"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        logger.debug("bootstrap shim: " + format, *args)

    def _any(self) -> None:
        shim = self.server.shim
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        mode, slow_s = shim.mode, shim.slow_s
        shim.count(mode.value)
        if mode is BootstrapMode.REFUSE_RST:
            self.close_connection = True
            reset(self.connection)
            return
        if mode is BootstrapMode.REFUSE_503:
            self._answer(503, "application/json", json.dumps({"error": "fault shim: bootstrap refused"}).encode())
            return
        if mode is BootstrapMode.SLOW:
            time.sleep(slow_s)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
        conn = http.client.HTTPConnection(*shim.upstream, timeout=30)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            status, ctype, data = resp.status, resp.getheader("Content-Type", "application/json"), resp.read()
        except OSError:
            shim.count("upstream_down")
            self.close_connection = True
            reset(self.connection)
            return
        finally:
            conn.close()
        if status == 200 and self.path.split("?")[0] == ROUTE_PATH:
            data = shim.rewrite_route(data)
        self._answer(status, ctype, data)

    def _answer(self, status: int, ctype: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = _any


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], shim: BootstrapShim) -> None:
        self.shim = shim
        super().__init__(addr, _Handler)


class BootstrapShim:
    """Proxy ``host:port`` (0: a free port, kept across restarts) -> P's bootstrap server at ``upstream``."""

    def __init__(self, upstream: tuple[str, int], rng: random.Random, *, host: str = LOOPBACK, port: int = 0) -> None:
        self.upstream = upstream
        self.mode = BootstrapMode.PASS
        self.slow_s = 1.0
        self.counts: Counter[str] = Counter()
        self._rng = rng
        self._lock = threading.Lock()
        self._zmq: dict[tuple[str, int], ZmtpFaultProxy] = {}
        self._zmq_rates = FaultRates()
        self.host = host
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port = port
        self._listen()

    def _listen(self) -> None:
        self._server = _Server((self.host, self.port), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def _close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    def set_mode(self, mode: BootstrapMode, slow_s: float | None = None) -> None:
        with self._lock:
            self.mode = mode
            if slow_s is not None:
                self.slow_s = slow_s

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def set_zmq_rates(self, rates: FaultRates) -> None:
        """Faults of every rank proxy, those made later included."""
        with self._lock:
            self._zmq_rates = rates
            proxies = list(self._zmq.values())
        for proxy in proxies:
            proxy.set_rates(rates)

    @property
    def zmq_proxies(self) -> list[ZmtpFaultProxy]:
        with self._lock:
            return list(self._zmq.values())

    def zmq_counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for proxy in self.zmq_proxies:
            total.update(proxy.counts)
        return total

    def proxy_for(self, ip: str, port: int) -> ZmtpFaultProxy:
        with self._lock:
            proxy = self._zmq.get((ip, port))
            if proxy is None:
                proxy = ZmtpFaultProxy((ip, port), random.Random(self._rng.random()), host=self.host).start()
                proxy.set_rates(self._zmq_rates)
                self._zmq[(ip, port)] = proxy
                logger.info(
                    "bootstrap shim :%d: P rank %s:%d behind ZMTP fault proxy :%d", self.port, ip, port, proxy.port
                )
            return proxy

    def rewrite_route(self, data: bytes) -> bytes:
        """The route with each rank's endpoint replaced by its fault proxy's; unchanged if it is not a route."""
        try:
            route = json.loads(data)
            ranks = route["ranks"]
            for info in ranks.values():
                proxy = self.proxy_for(str(info["rank_ip"]), int(info["rank_port"]))
                info["rank_ip"], info["rank_port"] = proxy.host, proxy.port
        except (ValueError, KeyError, TypeError, AttributeError):
            return data
        return json.dumps(route).encode()

    def restart(self, down_s: float) -> None:
        """Stop listening for ``down_s`` seconds, then listen again on the same port."""
        self.count("restarts")
        self._close()
        time.sleep(down_s)
        self._listen()

    def stop(self) -> None:
        self._close()
        for proxy in self.zmq_proxies:
            proxy.stop()
