"""Channel: one rank's ZMQ side: a PULL socket peers send to, PUSH sockets to peers, a listener thread.

The listener checks every frame's MAC before anything else reads it (a refused frame is counted,
``auth_refused``, and logged by size only: never decoded), decodes it and hands the message to
``on_message``; a frame that is not a PDConnector message, or whose identifiers are unsafe in a log
or whose endpoints are malformed (``wire_checks``), is counted (``bad_frames``) and dropped. Every
socket refuses frames over ``wire_checks.MAX_FRAME_BYTES`` (``zmq.MAXMSGSIZE``). At least every
POLL_MS, even under a flood of frames, it calls ``on_tick`` with the monotonic time, which drives
the timeouts and heartbeats. Handlers run on the listener thread and must
not block. Liveness frames (``Ping`` / ``Pong``, transfer.liveness) are handled here: a Ping is
answered at once, from the listener thread, so a peer is alive exactly while its listener runs;
the owner drives the pings with ``beat()`` from its tick.

With a token every frame travels in the signed envelope of ``transfer.frames`` (keyed with the frame
key derived from the token, ``keys``): a frame that is not for this endpoint (its audience: meant for
another rank, of this deployment or another sharing the token), stale, or a replay of its session is
refused like a bad MAC (``auth_refused``), its log line naming the message's room and request id (its
MAC matched: a key holder wrote it); a Ping whose ``reply_to``, or a Pong whose
``about``, is not its signed sender is dropped (``bad_frames``): no peer answers for another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from pd_connector import auth
from pd_connector import messages as proto
from pd_connector.config import ConfigError
from pd_connector.keys import frame_key
from pd_connector.log_limit import LogLimiter
from pd_connector.transfer.frames import FrameOpener, FrameRefused, FrameSealer, canonical_endpoint, printable
from pd_connector.transfer.liveness import Heartbeats, Lost, PeerWatch
from pd_connector.transfer.stats import TransferStats
from pd_connector.transfer.wire_checks import MAX_FRAME_BYTES, check_endpoint, escaped, message_problem, with_safe_text

logger = logging.getLogger(__name__)

POLL_MS = 50
SEND_HWM = 10_000


class Channel:
    def __init__(
        self,
        local_ip: str,
        stats: TransferStats,
        on_message: Callable[[proto.Message], None],
        on_tick: Callable[[float], None],
        token: bytes | None = None,
        watch: PeerWatch | None = None,
        port: int | None = None,
        port_origin: str = "",
    ) -> None:
        """``port``: the port the PULL socket binds (a rank's port from ``kv_port``, ``RankSpec.zmq_port``);
        None binds a random free one. ``port_origin`` says where ``port`` came from in the ConfigError raised
        when it cannot be bound (in use, or not a port)."""
        self._stats = stats
        key = frame_key(token)  # frames are signed with a key derived from the token, never the token
        self._on_message = on_message
        self._on_tick = on_tick
        #: Refused and malformed frames: a few lines per kind per window (log_limit), all counted.
        self._refusals = LogLimiter(logger)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.IPV6, 1)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + auth.MAC_BYTES)  # a bigger frame drops its peer
        # Only the address peers are told about: never every interface.
        self.port = self._bind(local_ip, port, port_origin)
        self.endpoint = f"tcp://{zmq_host(local_ip)}:{self.port}"
        self._sealer = FrameSealer(key, self.endpoint)  # this channel's session (transfer.frames)
        self._opener = FrameOpener(key, self.endpoint)
        self._push: dict[str, zmq.Socket] = {}
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="pd-listener", daemon=True)
        self.heartbeats = Heartbeats(watch or PeerWatch(5.0), self.endpoint, self.send)

    def _bind(self, local_ip: str, port: int | None, port_origin: str) -> int:
        if port is None:
            return int(self._pull.bind_to_random_port(f"tcp://{zmq_host(local_ip)}"))
        try:
            if not 0 < port < 65536:
                raise ValueError("not a TCP port (1-65535)")
            self._pull.bind(f"tcp://{zmq_host(local_ip)}:{port}")
        except (zmq.ZMQError, ValueError) as exc:
            self._pull.close(linger=0)
            self._ctx.term()
            raise ConfigError(
                f"PDConnector cannot bind its ZMQ side channel on {local_ip} port {port} ({port_origin or 'set'}): "
                f"{exc}; free that port or choose another kv_transfer_config.kv_port"
            ) from exc
        return port

    def start(self) -> None:
        self._listener.start()

    @property
    def listening(self) -> bool:
        return self._listener.is_alive()

    def send(self, endpoint: str, msg: proto.Message) -> None:
        """Queue ``msg`` to ``endpoint`` without blocking (a full queue drops it, logged); ValueError for an
        endpoint ZMQ would refuse (``wire_checks.check_endpoint``), before any socket is made."""
        check_endpoint(endpoint)
        payload = proto.encode(msg)
        with self._push_lock:  # sealed under the lock: a receiver sees this session's numbers in order
            frame = self._sealer.seal(endpoint, payload)
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                sock.setsockopt(zmq.IPV6, 1)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + auth.MAC_BYTES)
                sock.connect(endpoint)
                self._push[endpoint] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                logger.error("ZMQ send queue to %s is full; %s dropped", endpoint, type(msg).__name__)

    def beat(self, now: float, busy: set[str]) -> list[Lost]:
        """Listener tick: ping the peers in ``busy`` (pending work) that are due; those that went silent."""
        return self.heartbeats.tick(now, busy)

    def stop(self) -> None:
        """Stop the listener (no more handlers run); sending still works until close()."""
        self._stop.set()
        if self._listener.is_alive():
            self._listener.join(timeout=2)

    def close(self) -> None:
        self.stop()
        with self._push_lock:
            for sock in self._push.values():
                sock.close(linger=0)
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()

    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(POLL_MS))
                if self._pull in events:
                    until = time.monotonic() + POLL_MS / 1000  # a flood never holds the timers back
                    while time.monotonic() < until:
                        try:
                            frame = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frame(frame)
                self._on_tick(time.monotonic())
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - the listener must survive anything
                logger.exception("KV transfer listener error (continuing)")

    def _on_frame(self, frame: bytes) -> None:
        try:
            opened = self._opener.open(frame)
        except FrameRefused as exc:
            self._stats.inc("auth_refused")
            self._refusals.warning(  # a frame whose MAC fails is never decoded: what it claims is not worth a parse
                ("auth", exc.reason),
                "refusing ZMQ frame on %s (%d bytes%s): %s",
                self.endpoint,
                len(frame),
                _About(exc.payload),
                exc,
            )
            return
        frame = opened.payload
        try:
            msg = proto.decode(frame)
        except proto.ProtocolError as exc:
            self._stats.inc("bad_frames")
            why = escaped(str(exc), 300)  # msgspec quotes the bad value raw
            self._refusals.warning("malformed", "dropping malformed ZMQ frame on %s: %s", self.endpoint, why)
            return
        problem = message_problem(msg)
        if problem is not None:
            self._stats.inc("bad_frames")
            self._refusals.warning("unsafe", "dropping ZMQ frame on %s: %s", self.endpoint, problem)
            return
        msg = with_safe_text(msg)
        if opened.sender and not _from_sender(msg, opened.sender):
            self._stats.inc("bad_frames")
            self._refusals.warning(
                "not its sender", "dropping a %s on %s: it speaks for another endpoint than its sender %s",
                type(msg).__name__, self.endpoint, printable(opened.sender),
            )  # fmt: skip
            return
        if isinstance(msg, proto.Ping):
            self.heartbeats.on_ping(msg, time.monotonic())
        elif isinstance(msg, proto.Pong):
            self.heartbeats.on_pong(msg, time.monotonic())
        else:
            self._on_message(msg)


class _About:
    """``, Type room=R request_id=I`` of a refused frame a key holder signed (misdirected, stale, replayed: its
    MAC matched), ``, not decoded`` for any other; decoded only when the log line is written (log_limit)."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload

    def __str__(self) -> str:
        if not self._payload:
            return ", not decoded"
        try:
            msg = proto.decode(self._payload)
        except proto.ProtocolError:
            return ", payload not a PDConnector message"
        room, request_id = getattr(msg, "room", None), getattr(msg, "request_id", None)
        parts = [type(msg).__name__]
        if isinstance(room, int):
            parts.append(f"room={room}")
        if isinstance(request_id, str):
            parts.append(f"request_id={escaped(request_id, 100)}")
        return ", " + " ".join(parts)


def _from_sender(msg: proto.Message, sender: str) -> bool:
    """A liveness frame vouches only for its signed sender: a Ping's reply_to, a Pong's about."""
    if isinstance(msg, proto.Ping):
        return canonical_endpoint(msg.reply_to) == canonical_endpoint(sender)
    if isinstance(msg, proto.Pong):
        return canonical_endpoint(msg.about) == canonical_endpoint(sender)
    return True


def zmq_host(ip: str) -> str:
    """An IP as a ZMQ tcp endpoint host (IPv6 literals in brackets)."""
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip
