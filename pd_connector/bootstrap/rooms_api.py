"""The bootstrap server's room calls: release a room on every P rank, and ask what P knows of one.

- ``POST /bootstrap/release_room`` ``{"room": R, "reason": "..."}``: the client's request of room R
  ended (the Router calls it when a client disconnects or aborts, at any point of the request). The
  leader rank releases the room itself and tells every other registered P rank with a ``TransferCancel``
  carrying ``release`` (a ZMQ frame signed like every other: ``transfer.frames``); each rank frees the
  room at once, or once a push in flight stopped (``transfer.room_ends``), and remembers it released.
  Answer: ``{"room": R, "before": <what the leader rank held>, "ranks_told": N}``.
- ``GET /bootstrap/room_status?room=R``: what the leader rank knows of room R (``held``,
  ``awaiting_prefill``, ``closed`` with why, or ``unknown``) and the DP rank registered for it. D's API
  server asks it to name why a KV load failed (``pd_connector.api_server.validation``).

Both are signed like every other bootstrap call (``bootstrap.signing``: bound to this server's id).
``RoomControl`` is what the routes call; ``RankRooms`` is the leader rank's (``worker`` wires it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pd_connector import messages as proto
from pd_connector.bootstrap.state import BootstrapState
from pd_connector.transfer.channel import zmq_host

logger = logging.getLogger(__name__)

RELEASE_PATH = "/bootstrap/release_room"
STATUS_PATH = "/bootstrap/room_status"
#: The longest release reason accepted (it is logged and told to a D that asks for the room).
MAX_REASON = 200


class ReleaseRoom(msgspec.Struct, frozen=True):
    """Body of ``POST /bootstrap/release_room``."""

    room: int
    reason: str = ""


class RoomControl(Protocol):
    """What the room calls act on: the prefill ranks of this deployment."""

    def release(self, room: int, why: str) -> dict[str, Any]: ...

    def status(self, room: int) -> dict[str, Any]: ...


class LocalRooms(Protocol):
    """The leader rank's rooms (``transfer.prefill_side.PrefillSide``)."""

    def release_room(self, room_id: int, why: str) -> str: ...

    def room_status(self, room_id: int) -> tuple[str, str]: ...


class RankRooms:
    """``RoomControl`` of the leader rank: ``local`` is its own rooms, ``send`` its ZMQ channel's send,
    ``own_endpoint`` its ZMQ endpoint (the other registered ranks are told by frames)."""

    def __init__(
        self,
        state: BootstrapState,
        local: LocalRooms,
        send: Callable[[str, proto.Message], None],
        own_endpoint: str,
    ) -> None:
        self._state = state
        self._local = local
        self._send = send
        self._own = own_endpoint

    def _others(self) -> list[str]:
        with self._state.lock:
            ranks = list(self._state.rank_table.values())
        endpoints = {f"tcp://{zmq_host(r.rank_ip)}:{r.rank_port}" for r in ranks}
        endpoints.discard(self._own)
        return sorted(endpoints)

    def release(self, room: int, why: str) -> dict[str, Any]:
        before = self._local.release_room(room, why)
        others = self._others()
        cancel = proto.TransferCancel(room=room, request_id="", peer_id="", release=why)
        for endpoint in others:
            self._send(endpoint, cancel)
        return {"room": room, "before": before, "ranks_told": len(others) + 1}

    def status(self, room: int) -> dict[str, Any]:
        state, detail = self._local.room_status(room)
        with self._state.lock:
            dp_rank = self._state.room_to_dp_rank.get(room)
        answer: dict[str, Any] = {"room": room, "state": state, "detail": detail, "dp_rank": dp_rank}
        if self._state.attn_dp_size > 1:
            answer["seen_by"] = "dp rank 0"  # other DP ranks' rooms are theirs: only their registration shows
        return answer


def reason_problem(reason: str) -> str | None:
    """Why a release reason is refused (too long, not printable), else None."""
    if len(reason) > MAX_REASON:
        return f"reason is {len(reason)} characters; at most {MAX_REASON}"
    if not reason.isprintable():
        return "reason must be printable text"
    return None


BodyAs = Callable[[Request, type], Awaitable[object]]
Error = Callable[[int, str], JSONResponse]


def add_room_routes(app: FastAPI, control: RoomControl | None, body_as: BodyAs, error: Error) -> None:
    """Add the room calls to ``app``; without ``control`` (a bootstrap server of no prefill rank) they
    answer 503 naming why."""

    @app.post(RELEASE_PATH)
    async def release_room(request: Request) -> JSONResponse:
        req = await body_as(request, ReleaseRoom)
        assert isinstance(req, ReleaseRoom)
        problem = reason_problem(req.reason)
        if problem is not None:
            return error(400, problem)
        if control is None:
            return error(503, "this bootstrap server runs in no prefill rank: it holds no rooms")
        answer = control.release(req.room, req.reason or "the client's request ended")
        logger.info("bootstrap: room=%d released (%s); %d rank(s) told", req.room, req.reason, answer["ranks_told"])
        return JSONResponse(answer)

    @app.get(STATUS_PATH)
    async def room_status(room: int) -> JSONResponse:
        if control is None:
            return error(503, "this bootstrap server runs in no prefill rank: it holds no rooms")
        return JSONResponse(control.status(room))
