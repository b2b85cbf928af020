"""Liveness: heartbeats between the D ranks and P ranks that share pending work.

Only peers this rank has pending work with are watched: on D, the P ranks a load waits on
(AWAITING_KV, CANCELLING); on P, the D ranks whose requests wait for a prefill or receive a write.
The owner says which peers those are at every listener tick (``PeerWatch.tick(now, busy)``); a
watched peer gets a ``Ping`` every ``interval_s`` and answers with a ``Pong`` from its listener
thread (``Heartbeats``). Hearing a Ping from a peer or a Pong about it counts as hearing it. A
watched peer not heard for ``timeout_s`` (since it was last heard, or since watching began) is
LOST: reported once, so its owner fails that peer's pending rooms and loads at once, and no longer
watched; new work toward it starts a fresh window. Peers nobody waits on cost nothing.

Peer states (``PeerState``): IDLE (not watched) -> WATCHED (pending work, pinged) -> IDLE (work
done) or LOST (silent for timeout_s) -> WATCHED again when new work comes, or IDLE once heard.
The frames go over the rank's ZMQ channel and are HMAC-signed like every other frame.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd_connector import messages as proto
from pd_connector.log_limit import LogLimiter

if TYPE_CHECKING:
    from pd_connector.transfer.rooms import ClaimKey, Room

logger = logging.getLogger(__name__)

#: Pings per timeout window: a peer is declared lost after this many unanswered pings.
PINGS_PER_WINDOW = 5
#: Lost peers remembered (for ``state()``) before the oldest is forgotten.
LOST_KEPT = 1024
_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")


class PeerState(enum.Enum):
    IDLE = "idle"  # no pending work toward it: not watched
    WATCHED = "watched"  # pending work: pinged every interval, must answer
    LOST = "lost"  # was silent for timeout_s while watched: its work was failed


@dataclass
class _Watched:
    heard: float  # last time it was heard, or when watching began
    pinged: float  # last Ping sent to it


@dataclass(frozen=True)
class Lost:
    """A watched peer that went silent: its endpoint and for how long it was not heard."""

    endpoint: str
    silent_s: float


@dataclass(frozen=True)
class Beat:
    """What one tick decided: peers to ping now, peers lost now."""

    ping: list[str]
    lost: list[Lost]


class PeerWatch:
    """The liveness state machine of one rank, driven by the caller's clock (pure, thread-safe)."""

    def __init__(self, timeout_s: float, interval_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"peer timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else timeout_s / PINGS_PER_WINDOW
        self._lock = threading.Lock()
        self._watched: dict[str, _Watched] = {}
        self._lost: OrderedDict[str, float] = OrderedDict()

    def heard(self, endpoint: str, now: float) -> None:
        """The peer at ``endpoint`` showed a sign of life (a Ping from it, a Pong about it)."""
        with self._lock:
            peer = self._watched.get(endpoint)
            if peer is not None:
                peer.heard = max(peer.heard, now)
            self._lost.pop(endpoint, None)

    def tick(self, now: float, busy: Iterable[str]) -> Beat:
        """Watch exactly the peers in ``busy`` (those with pending work); which to ping, which are lost."""
        busy = set(busy)
        ping: list[str] = []
        lost: list[Lost] = []
        with self._lock:
            for endpoint in [e for e in self._watched if e not in busy]:
                del self._watched[endpoint]  # no work left toward it
            for endpoint in busy:
                peer = self._watched.get(endpoint)
                if peer is None:  # new work: a full window from now, first ping at once
                    peer = self._watched[endpoint] = _Watched(heard=now, pinged=float("-inf"))
                silent = now - peer.heard
                if silent >= self.timeout_s:
                    del self._watched[endpoint]
                    self._lost[endpoint] = now
                    self._lost.move_to_end(endpoint)
                    while len(self._lost) > LOST_KEPT:
                        self._lost.popitem(last=False)
                    lost.append(Lost(endpoint, silent))
                elif now - peer.pinged >= self.interval_s:
                    peer.pinged = now
                    ping.append(endpoint)
        return Beat(sorted(ping), sorted(lost, key=lambda x: x.endpoint))

    def state(self, endpoint: str) -> PeerState:
        with self._lock:
            if endpoint in self._watched:
                return PeerState.WATCHED
            return PeerState.LOST if endpoint in self._lost else PeerState.IDLE


class Heartbeats:
    """Ping / Pong over a rank's channel: answers every Ping, feeds a ``PeerWatch``, sends its pings."""

    def __init__(self, watch: PeerWatch, endpoint: str, send: Callable[[str, proto.Message], None]) -> None:
        self.watch = watch
        self._endpoint = endpoint
        self._send = send
        self._refusals = LogLimiter(logger)  # malformed Pings: a few lines per window (log_limit)

    def on_ping(self, ping: proto.Ping, now: float) -> None:
        if not _ENDPOINT.match(ping.reply_to):
            self._refusals.warning("ping", "dropping a Ping with a malformed reply endpoint %r", ping.reply_to[:100])
            return
        self.watch.heard(ping.reply_to, now)
        self._send(ping.reply_to, proto.Pong(about=ping.about))

    def on_pong(self, pong: proto.Pong, now: float) -> None:
        self.watch.heard(pong.about, now)

    def tick(self, now: float, busy: Iterable[str]) -> list[Lost]:
        """Ping the busy peers that are due; the peers found lost (each reported once)."""
        beat = self.watch.tick(now, busy)
        for endpoint in beat.ping:
            self._send(endpoint, proto.Ping(about=endpoint, reply_to=self._endpoint))
        for lost in beat.lost:
            logger.error(
                "peer %s did not answer for %.1f s (peer_timeout_s %g): failing the work that waits on it",
                lost.endpoint, lost.silent_s, self.watch.timeout_s,
            )  # fmt: skip
        return beat.lost


# ----------------------------------------------------------------- P side, pure


def _endpoint_of(peer_id: str, fallback: str, peers: Mapping[str, proto.PeerHello]) -> str:
    hello = peers.get(peer_id)
    return hello.endpoint if hello is not None else fallback


def _in_flight(room: Room) -> list[ClaimKey]:
    """The claims (request id, D peer id) of a room that still has writes running."""
    if room.finished >= room.submitted:
        return []
    return list(room.submitted_ids - room.cancelled)


def decode_peers_waited_on(rooms: Iterable[Room], peers: Mapping[str, proto.PeerHello]) -> set[str]:
    """P: endpoints of the D ranks whose requests wait for a prefill or get a write now."""
    busy: set[str] = set()
    for room in rooms:
        busy.update(_endpoint_of(w.req.peer_id, w.req.endpoint, peers) for w in room.waiting)
        busy.update(_endpoint_of(peer_id, "", peers) for _, peer_id in _in_flight(room))
    busy.discard("")
    return busy


def claims_toward(
    endpoint: str, rooms: Iterable[Room], peers: Mapping[str, proto.PeerHello]
) -> list[proto.TransferCancel]:
    """P: the cancels that end every pending claim of the D rank at ``endpoint`` (it went silent)."""
    cancels: list[proto.TransferCancel] = []
    for room in rooms:
        for w in room.waiting:
            if _endpoint_of(w.req.peer_id, w.req.endpoint, peers) == endpoint:
                cancels.append(proto.TransferCancel(room.room, w.req.request_id, w.req.peer_id))
        for request_id, peer_id in _in_flight(room):
            if _endpoint_of(peer_id, "", peers) == endpoint:
                cancels.append(proto.TransferCancel(room.room, request_id, peer_id))
    return cancels
