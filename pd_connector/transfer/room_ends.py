"""How P's rooms end other than by a push: aborted prefills, expiry, shutdown, and a release.

``RoomEnds`` is the part of ``prefill_side.PrefillSide`` (its base class) that ends rooms from outside
a D request:

- ``drop_rooms``: vLLM aborted the prefill (the room will never have KV);
- ``expire``: room_timeout_s (or a job's hold_s) passed with no D request, or a D request waited
  for a prefill that never came;
- ``release_room``: the client's request ended (the Router calls ``POST /bootstrap/release_room`` on
  P's bootstrap server, which tells every P rank with a ``TransferCancel`` carrying ``release``). The
  room goes whatever its claims: D requests waiting for its prefill are answered at once, a push in
  flight stops between batches (its D still holds the blocks until P's answer: ``loads``), and the
  room is freed once the writes in flight ended; a room not here yet is remembered released, so its
  prefill is freed as soon as it ends and a D that asks later is refused at once;
- ``shutdown``: P is going away.

``room_status`` tells what this rank knows of a room (held, awaiting its prefill, closed and why, or
unknown), for ``GET /bootstrap/room_status``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from pd_connector import messages as proto
from pd_connector.config import DisaggConfig
from pd_connector.messages import DoneStatus
from pd_connector.transfer.context import RankContext
from pd_connector.transfer.layerwise import LayerStreams
from pd_connector.transfer.rooms import ClaimKey, ClosedRooms, Room, WaitingRequest
from pd_connector.transfer.states import CloseReason, RoomState

logger = logging.getLogger(__name__)

#: ``room_status`` states (the bootstrap server's answer).
HELD, AWAITING_PREFILL, CLOSED, UNKNOWN = "held", "awaiting_prefill", "closed", "unknown"


class RoomEnds:
    """Base of ``PrefillSide``: the room ends that do not come from a D request (see the module)."""

    _ctx: RankContext
    _cfg: DisaggConfig
    _lock: threading.Lock
    _rooms: dict[int, Room]
    _closed: ClosedRooms
    layers: LayerStreams | None

    def _reply(self, req: proto.TransferRequest, status: DoneStatus, error: str = "") -> None:
        raise NotImplementedError

    def _finish_if_served(self, room: Room) -> None:
        raise NotImplementedError

    def _expire_message(self, w: WaitingRequest) -> tuple[DoneStatus, str]:
        if w.closed_before is not None:
            return DoneStatus.ROOM_CLOSED, self._closed.message(w.req.room, w.closed_before)
        return DoneStatus.TIMEOUT, f"prefill did not produce room {w.req.room} in time"

    def drop_rooms(self, rooms: Sequence[int]) -> None:
        """These rooms will never have KV (request aborted); tell their D if it asks."""
        for room in rooms:
            with self._lock:
                self._closed.add(room, CloseReason.ABORTED)
                waiting: list[WaitingRequest] = []
                pending = self._rooms.get(room)
                if pending is not None and pending.state is RoomState.AWAITING_PREFILL:
                    del self._rooms[room]
                    waiting = pending.waiting
            for w in waiting:
                self._reply(w.req, DoneStatus.ABORTED, "prefill request was aborted")
            if self.layers is not None:
                self.layers.abort(room)

    def shutdown(self) -> None:
        """P is going away: every D request still waiting for a prefill is told at once."""
        with self._lock:
            waiting = [w for room in self._rooms.values() for w in room.waiting]
            for room in self._rooms.values():
                room.waiting = []
        for w in waiting:
            self._reply(w.req, DoneStatus.ABORTED, "prefill is shutting down")

    def release_room(self, room_id: int, why: str) -> str:
        """The client's request of ``room_id`` ended (``why``): free the room at once, or once its
        writes in flight ended; what this rank held of it before (``room_status``'s state)."""
        why = why or "the client's request ended"
        waiting: list[WaitingRequest] = []
        streamed: list[ClaimKey] = []
        with self._lock:
            room = self._rooms.get(room_id)
            before = self._state_of(room_id, room)
            if room is None:  # not prefilled yet (or never here, or closed): a later prefill is freed at once
                self._closed.add(room_id, CloseReason.CANCELLED, released=why)
            elif room.state is RoomState.AWAITING_PREFILL:
                waiting, room.waiting = room.waiting, []
                if room.submitted_ids:  # layer-wise streams write: freed once they ended (add_sends)
                    room.released, streamed = why, list(room.submitted_ids)
                else:
                    del self._rooms[room_id]
                    self._closed.add(room_id, CloseReason.CANCELLED, released=why)
            else:  # READY or DRAINING: no new request; pushes stop between batches; freed once they ended
                room.released, room.state = why, RoomState.DRAINING
                streamed = list(room.submitted_ids - room.cancelled)
                self._finish_if_served(room)
        message = f"prefill released room {room_id}: {why}"
        for w in waiting:
            self._reply(w.req, DoneStatus.ROOM_CLOSED, message)
        if self.layers is not None:
            for key in streamed:  # a layer-wise reader stops and answers once its writes ended
                self.layers.stop(room_id, key, DoneStatus.ROOM_CLOSED, message)
        logger.info("room=%d: released (%s); this rank %s", room_id, why, _held_before(before))
        return before

    def room_status(self, room_id: int) -> tuple[str, str]:
        """(state, detail) of ``room_id`` on this rank: ``HELD`` (prefill done, KV held),
        ``AWAITING_PREFILL`` (a D request waits for its prefill), ``CLOSED`` (why), ``UNKNOWN``."""
        with self._lock:
            room = self._rooms.get(room_id)
            state = self._state_of(room_id, room)
            closed = self._closed.entry(room_id)
            detail = ""
            if state == CLOSED and closed is not None and not closed.prefilled and not closed.released:
                state = UNKNOWN if closed.reason is CloseReason.CANCELLED else state
                detail = (
                    "prefill never produced this room (a decode request waited for it, then gave up)"
                    if state == UNKNOWN
                    else self._closed.message(room_id, closed.reason)
                )
            elif state == CLOSED and closed is not None:
                detail = self._closed.message(room_id, closed.reason)
            elif state == HELD and room is not None:
                detail = f"prefill done, KV held ({room.state.value})"
            elif state == AWAITING_PREFILL:
                detail = "a decode request waits for its prefill"
            else:
                detail = "prefill holds no KV for this room (never prefilled, or released and forgotten)"
        return state, detail

    def _state_of(self, room_id: int, room: Room | None) -> str:
        if room is not None:
            return AWAITING_PREFILL if room.state is RoomState.AWAITING_PREFILL else HELD
        return CLOSED if self._closed.get(room_id) is not None else UNKNOWN

    def expire(self, now: float) -> None:
        stale: list[WaitingRequest] = []
        with self._lock:
            for room in list(self._rooms.values()):
                if room.state is RoomState.READY and room.deadline <= now:
                    room.state = RoomState.DRAINING  # accept no more requests; free once in-flight writes end
                    if room.submitted < max(room.expected, 1):
                        # Logged before the room can be freed, so the reason precedes vLLM seeing it.
                        assert room.job is not None
                        self._ctx.stats.inc("rooms_expired")
                        logger.warning(
                            "room=%d req=%s: no decode asked for this KV within %g s; freeing its blocks",
                            room.room,
                            room.job.req_id,
                            room.job.hold_seconds(self._cfg.room_timeout_s),
                        )
                    self._finish_if_served(room)
                elif room.state is RoomState.AWAITING_PREFILL:
                    stale += [w for w in room.waiting if w.deadline <= now]
                    room.waiting = [w for w in room.waiting if w.deadline > now]
                    if not room.waiting and not room.submitted_ids:  # (submitted: a layer-wise stream's)
                        del self._rooms[room.room]
        for w in stale:
            self._reply(w.req, *self._expire_message(w))


def _held_before(state: str) -> str:
    return {
        HELD: "held its KV",
        AWAITING_PREFILL: "had decode requests waiting for its prefill",
        CLOSED: "had closed it already",
    }.get(state, "had not seen it (its prefill is freed as soon as it ends)")
