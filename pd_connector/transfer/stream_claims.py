"""P's rooms, the layer-wise side (``transfer_mode: "layer"``): claims a ``layerwise`` stream serves.

Mixed into ``prefill_side.PrefillSide`` (it uses the room table, the lock, the peers and the
replies there). A stream takes the D requests waiting in a room whose prefill is still running
(``take_for_stream``: they count as submitted on that room, as a request-mode push does) and
reports each one's end (``stream_done``: logged like a push, D answered, the claim finished).
When the prefill's ``SendJob`` comes the READY room inherits those counts (``carry_streamed``),
so it is freed once every expected request was served, whichever mode served it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pd_connector import protocol as proto
from pd_connector.metadata import SendJob
from pd_connector.protocol import DoneStatus
from pd_connector.transfer.layerwise import LayerStreams, StreamResult
from pd_connector.transfer.room_push import log_push
from pd_connector.transfer.states import RoomState
from pd_connector.transfer.write_guard import guard_push

if TYPE_CHECKING:
    from pd_connector.transfer.rooms import Room

logger = logging.getLogger(__name__)


def _claim(request_id: str, peer_id: str) -> str:
    return f"{request_id}@{peer_id}"  # as rooms.claim


class StreamClaims:
    """The layer-wise half of PrefillSide (needs its ``_lock``, ``_rooms``, ``_peers``, ``_reply``...)."""

    _lock: threading.Lock
    _rooms: dict[int, Room]
    _peers: dict[str, proto.PeerHello]
    _peer_errors: dict[str, str]
    layers: LayerStreams | None = None

    def enable_layer_push(self, layer_regions: Mapping[str, range]) -> LayerStreams:
        """Stream each layer's KV while the prefill runs (the worker feeds it save_kv_layer calls)."""
        self.layers = LayerStreams(self._ctx, self._backend, self, layer_regions)  # type: ignore[attr-defined]
        return self.layers

    def take_for_stream(self, room: int) -> list[proto.TransferRequest]:
        with self._lock:
            held = self._rooms.get(room)
            if held is None or held.state is not RoomState.AWAITING_PREFILL:
                return []
            taken, kept = [], []
            for w in held.waiting:
                key = _claim(w.req.request_id, w.req.peer_id)
                if key in held.submitted_ids:
                    continue  # a repeat (refused on arrival since issue 22; dropped here too): the first copy is served
                held.submitted += 1
                held.submitted_ids.add(key)
                taken.append(w.req)
            held.waiting = kept
        return taken

    def peer_of(self, peer_id: str) -> tuple[proto.PeerHello | None, str | None]:
        with self._lock:
            return self._peers.get(peer_id), self._peer_errors.get(peer_id)

    def guard_of(self, peer: proto.PeerHello, req: proto.TransferRequest) -> tuple[Any, Any]:
        return guard_push(peer, req, self._spec)  # type: ignore[attr-defined]

    def stream_done(self, p_req_id: str, done: StreamResult) -> None:
        req = done.req
        job = SendJob(p_req_id, req.room, [], 0)
        ok = done.status is DoneStatus.OK
        try:
            if ok:  # D first (its first token waits for this), then the log line
                self._ctx.traces.get(req.room, req.room, p_req_id).mark("push_done")  # type: ignore[attr-defined]
                self._reply(req, done.status, done.error, done.nbytes, done.checksum)  # type: ignore[attr-defined]
            log_push(self._ctx.stats, job, req, done.status, done.error, done.nbytes, done.entries, done.seconds)  # type: ignore[attr-defined]
            if not ok:  # a failure is logged before D can see it
                self._reply(req, done.status, done.error, done.nbytes, done.checksum)  # type: ignore[attr-defined]
        finally:  # the stream's writes ended: the room closes even if D cannot be told
            with self._lock:
                room = self._rooms.get(req.room)
                if room is not None and _claim(req.request_id, req.peer_id) in room.submitted_ids:
                    room.finished += 1
                    self._finish_if_served(room)  # type: ignore[attr-defined]

    def carry_streamed(self, old: Room, ready: Room) -> None:
        """The prefill finished: its READY room takes over the claims streams took. Caller holds the lock."""
        ready.submitted, ready.finished = old.submitted, old.finished
        ready.submitted_ids = set(old.submitted_ids)
        if ready.expected == 0 and ready.job is not None:
            peer_id = next(iter(old.submitted_ids)).rsplit("@", 1)[-1]
            ready.expected = self._expected(ready.job, peer_id)  # type: ignore[attr-defined]
