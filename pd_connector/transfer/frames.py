"""The signed envelope of every ZMQ frame: sender, session, sequence, time, receiver.

With a token, a frame is ``MAC(32) | header | sender | receiver | payload``:

- header: envelope ``VERSION`` (1 byte), the sender's session id (16 random bytes, new for every
  ``Channel``), a sequence number (8 bytes, +1 per frame the session sends), the send time (Unix
  ms, 8 bytes); then the sender's and the receiver's endpoints (2-byte length + UTF-8 each);
- MAC: HMAC-SHA256 of the version label (``pd-connector zmq frame v3``) and everything after the MAC,
  keyed with the *frame key* (``keys.frame_key``), never the token itself.

The receiver's endpoint is the frame's audience. One token may be shared by every P and D, and a rank's
endpoint (``tcp://ip:port``) names exactly one rank of one deployment at a time; a frame signed for rank X
of one deployment is refused by every other rank, of that deployment or another. A rank restarted on the
same endpoint is told apart only by the clocks: frames are accepted within ``FRAME_MAX_AGE_S``.

A receiver (``FrameOpener``) checks the MAC first and reads nothing of a frame that fails it (but a frame
whose first byte names an older or newer envelope version is refused as ``version``, naming both: the
peer runs another PDConnector release); then it refuses (``FrameRefused``, ``reason``): a frame addressed
to another endpoint (``misdirected``: a frame captured on its way to one rank replayed to another), a
frame sent more than ``FRAME_MAX_AGE_S`` ago or ahead (``stale``, by the wall clocks: hosts must be
NTP-synchronised to well within it), and a sequence number not above the last one accepted from that
session (``replay``). Sessions are remembered ``2 * FRAME_MAX_AGE_S`` after their last frame (older
frames are stale anyway), at most ``SESSIONS_KEPT``; the oldest dropped beyond that raises a floor
that frames of unknown sessions must be newer than. Without a token a frame is the bare payload.

One session sends to each receiver over one ZMQ PUSH socket (``Channel.send`` seals under its
socket lock), so a receiver sees a session's numbers in increasing order; gaps (a full send queue
dropped a frame) are fine.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pd_connector.auth import MAC_BYTES, AuthError

#: The envelope this release signs and accepts (2: before frames were labelled with their version; the
#: messages inside have their own version, ``messages.WIRE_VERSION``, checked by the hello).
VERSION = 3
_LABEL = f"pd-connector zmq frame v{VERSION}\n".encode()
_HEADER = struct.Struct(">B16sQQ")  # version, session, sequence, sent at (Unix ms)
_LEN = struct.Struct(">H")
#: How far a frame's send time may be from the receiver's clock (either way).
FRAME_MAX_AGE_S = 60.0
#: Sender sessions a receiver remembers at most (each Channel of a peer is one session).
SESSIONS_KEPT = 65_536


class FrameRefused(AuthError):
    """A frame the receiver will not read: ``reason`` is mac, short, version, misdirected, stale or replay.

    ``payload``: for a frame whose MAC matched (misdirected, stale, replay: a key holder wrote it), its
    payload, which the receiver may decode for its log line (room, request id); else empty."""

    def __init__(self, reason: str, message: str, payload: bytes = b"") -> None:
        super().__init__(message)
        self.reason = reason
        self.payload = payload


@dataclass(frozen=True)
class Opened:
    """An accepted frame: its payload and who sent it (empty ``sender`` without a token)."""

    payload: bytes
    sender: str = ""
    session: str = ""  # first 8 hex digits of the session id (for logs)
    seq: int = 0


def canonical_endpoint(endpoint: str) -> str:
    """``tcp://host:port`` with an IP literal written one way (``[::1]`` and ``[0::1]`` are one endpoint)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        bare = str(ipaddress.ip_address(bare))
    except ValueError:
        bare = bare.lower()
    return f"{bare}:{port}"


def _text(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 0xFFFF:
        raise ValueError(f"endpoint of {len(raw)} bytes is too long for a frame envelope")
    return _LEN.pack(len(raw)) + raw


class FrameSealer:
    """The sending side of one session: seals payloads for their receiver (thread-safe)."""

    def __init__(self, key: bytes | None, sender: str, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._sender = _text(sender)
        self._clock = clock  # tests send stale frames with a clock of their own
        self.session = os.urandom(16)
        self._seq = 0
        self._lock = threading.Lock()

    def seal(self, receiver: str, payload: bytes) -> bytes:
        """The frame carrying ``payload`` to ``receiver`` (the bare payload without a key)."""
        if self._key is None:
            return payload
        with self._lock:
            self._seq += 1
            seq = self._seq
        header = _HEADER.pack(VERSION, self.session, seq, int(self._clock() * 1000))
        body = header + self._sender + _text(receiver) + payload
        return _mac(self._key, body) + body


@dataclass
class _Session:
    seq: int
    sent_ms: int
    seen: float  # receiver's clock, seconds


class FrameOpener:
    """The receiving side of one endpoint: checks and opens frames, remembers sessions (thread-safe)."""

    def __init__(
        self,
        key: bytes | None,
        endpoint: str,
        clock: Callable[[], float] = time.time,
        max_age_s: float = FRAME_MAX_AGE_S,
        kept: int = SESSIONS_KEPT,
    ) -> None:
        self._key = key
        self._endpoint = canonical_endpoint(endpoint)
        self._clock = clock
        self._max_age_ms = int(max_age_s * 1000)
        self._kept = kept
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()  # least recently heard first
        self._floor_ms = 0  # frames of unknown sessions must be sent after this (sessions dropped for room)
        self._lock = threading.Lock()

    def open(self, frame: bytes) -> Opened:
        """The payload and sender of ``frame``; FrameRefused (naming why) for one that must not be read."""
        if self._key is None:
            return Opened(frame)
        if len(frame) < MAC_BYTES + _HEADER.size + 2 * _LEN.size:
            raise FrameRefused("short", f"frame of {len(frame)} bytes is shorter than a signed envelope")
        mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(self._key, body)):
            if 0 < body[0] < 16 and body[0] != VERSION:  # what it claims (not authenticated): for the message only
                raise FrameRefused(
                    "version",
                    f"frame in envelope version {body[0]}; this rank signs and accepts version {VERSION} only "
                    "(frames labelled with their version): run the same PDConnector release on every P and D",
                )
            raise FrameRefused("mac", "frame MAC does not match the deployment's frame key (a wrong token)")
        # Authenticated from here on: the fields below were written by a holder of the key.
        _, session, seq, sent_ms = _HEADER.unpack_from(body)
        at = _HEADER.size
        sender, at = _read_text(body, at)
        receiver, at = _read_text(body, at)
        payload = body[at:]
        who = f"{printable(sender)} (session {session.hex()[:8]}, seq {seq})"
        if canonical_endpoint(receiver) != self._endpoint:
            raise FrameRefused(
                "misdirected", f"frame from {who} is addressed to {printable(receiver)}, not to this rank", payload
            )
        now = self._clock()
        now_ms = int(now * 1000)
        if abs(now_ms - sent_ms) > self._max_age_ms:
            raise FrameRefused(
                "stale", f"frame from {who} was sent {(now_ms - sent_ms) / 1000:.1f} s ago "
                f"(accepted: within {self._max_age_ms / 1000:g} s of this rank's clock)", payload,
            )  # fmt: skip
        with self._lock:
            self._forget(now)
            known = self._sessions.get(session)
            if known is not None and seq <= known.seq:
                raise FrameRefused(
                    "replay", f"frame from {who} repeats or precedes seq {known.seq} of its session", payload
                )
            if known is None and sent_ms <= self._floor_ms:
                raise FrameRefused(
                    "replay", f"frame from {who} is older than the sessions this rank still remembers", payload
                )
            if known is None:
                known = self._sessions[session] = _Session(seq, sent_ms, now)
                while len(self._sessions) > self._kept:
                    _, dropped = self._sessions.popitem(last=False)
                    self._floor_ms = max(self._floor_ms, dropped.sent_ms)
            known.seq, known.sent_ms, known.seen = seq, max(known.sent_ms, sent_ms), now
            self._sessions.move_to_end(session)
        return Opened(payload, sender, session.hex()[:8], seq)

    def _forget(self, now: float) -> None:
        """Drop sessions not heard for twice the age limit (their frames are stale now). Caller holds the lock."""
        horizon = now - 2 * self._max_age_ms / 1000
        while self._sessions:
            first = next(iter(self._sessions.values()))
            if first.seen >= horizon:
                break
            self._sessions.popitem(last=False)

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, _LABEL + body, hashlib.sha256).digest()


def printable(text: str, limit: int = 200) -> str:
    """Endpoint text for a log line: non-printable characters escaped (a key holder wrote it, still a peer)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[:limit])


def _read_text(body: bytes, at: int) -> tuple[str, int]:
    if at + _LEN.size > len(body):
        raise FrameRefused("short", "signed frame ends inside its envelope")
    (n,) = _LEN.unpack_from(body, at)
    at += _LEN.size
    if at + n > len(body):
        raise FrameRefused("short", "signed frame ends inside its envelope")
    try:
        return body[at : at + n].decode(), at + n
    except UnicodeDecodeError:
        raise FrameRefused("short", "signed frame's envelope holds an endpoint that is not UTF-8") from None
