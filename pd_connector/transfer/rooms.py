"""P's rooms: one prefilled request's KV waiting for (or being written to) its D ranks.

``Room`` is the record ``PrefillSide`` keeps per room; ``PrefillSide`` alone moves its
``states.RoomState``: AWAITING_PREFILL (D asked first; its requests wait) -> READY (prefill done, KV
held) -> DRAINING (expired: no new request, freed once in-flight writes end) -> CLOSED, or READY ->
CLOSED once every expected claim was served or cancelled. A room that never reaches READY (aborted,
cancelled, its waiting requests timed out) leaves the table from AWAITING_PREFILL; every room that
leaves it is remembered by its ``CloseReason`` (``ClosedRooms``: the newest ``CLOSED_ROOMS_KEPT``). A
claim is one D rank's ask for a room
(``ClaimKey``): the D ranks of one request share the request id, so claims are keyed by
(request id, D peer id). The same keys name the layer-wise readers (``layerwise``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from pd_connector import messages as proto
from pd_connector.metadata import SendJob
from pd_connector.transfer.states import CloseReason, RoomState

#: Rooms remembered after they left the table (their CloseReason, early cancels); the oldest are forgotten.
CLOSED_ROOMS_KEPT = 100_000
V = TypeVar("V")


class ClaimKey(NamedTuple):
    """One D rank's claim on a room: the D request id is shared by all D ranks of the request."""

    request_id: str
    peer_id: str

    @classmethod
    def of(cls, msg: proto.TransferRequest | proto.TransferCancel) -> ClaimKey:
        return cls(msg.request_id, msg.peer_id)


@dataclass
class WaitingRequest:
    """A D request for a room whose prefill has not finished."""

    req: proto.TransferRequest
    deadline: float
    closed_before: CloseReason | None = None  # the room was closed when this came: wait a short grace


@dataclass
class Room:
    room: int
    state: RoomState
    job: SendJob | None = None  # set from READY on
    deadline: float = 0.0  # READY: when unclaimed KV is freed
    expected: int = 0  # requests this rank will get for the room (0: unknown yet)
    submitted: int = 0
    finished: int = 0
    waiting: list[WaitingRequest] = field(default_factory=list)  # AWAITING_PREFILL
    # Claims are per (D request, D rank): every D rank of one request asks (and may cancel) for itself.
    submitted_ids: set[ClaimKey] = field(default_factory=set)
    cancelled: set[ClaimKey] = field(default_factory=set)  # D requests' ranks that gave up (each counts as claimed)
    #: Why the room was released (the client's request ended: the Router told P's bootstrap server);
    #: empty: not released. A released room is DRAINING and closes once its in-flight writes end.
    released: str = ""

    def has_claim(self, key: ClaimKey) -> bool:
        """Whether the claim ``key`` came already: submitted, cancelled, or waiting for the prefill."""
        if key in self.submitted_ids or key in self.cancelled:
            return True
        return any(ClaimKey.of(w.req) == key for w in self.waiting)

    def take_waiting(self) -> list[proto.TransferRequest]:
        """AWAITING_PREFILL: a layer-wise stream takes every waiting request (each counts as submitted)."""
        taken = []
        for w in self.waiting:
            key = ClaimKey.of(w.req)
            if key in self.submitted_ids:
                continue  # a repeat (refused on arrival by the frame checks; dropped here too): the first copy is served
            self.submitted += 1
            self.submitted_ids.add(key)
            taken.append(w.req)
        self.waiting = []
        return taken

    def carry_streamed(self, old: Room) -> str:
        """This READY room takes over the claims layer-wise streams took on ``old`` (its AWAITING_PREFILL
        record); the D peer id of one of them (it tells how many requests to expect)."""
        self.submitted, self.finished = old.submitted, old.finished
        self.submitted_ids = set(old.submitted_ids)
        return next(iter(old.submitted_ids)).peer_id

    @property
    def claimed(self) -> int:
        """Expected requests that came (submitted) or will not (cancelled)."""
        return len(self.submitted_ids | self.cancelled)

    @property
    def served(self) -> bool:
        """Every write ended, and no more will come (all expected claimed, or draining)."""
        idle = self.finished == self.submitted
        all_in = self.expected > 0 and self.claimed >= self.expected
        return idle and (self.state is RoomState.DRAINING or all_in)

    @property
    def close_reason(self) -> CloseReason:
        if self.released:  # a later prefill of it is freed at once, like a cancelled room's
            return CloseReason.CANCELLED
        if self.submitted_ids - self.cancelled:
            return CloseReason.SENT
        return CloseReason.CANCELLED if self.cancelled else CloseReason.EXPIRED


def remember(table: OrderedDict[int, V], room: int, value: V) -> None:
    """``table[room] = value`` as its newest entry; the oldest beyond ``CLOSED_ROOMS_KEPT`` are forgotten."""
    table[room] = value
    table.move_to_end(room)
    while len(table) > CLOSED_ROOMS_KEPT:
        table.popitem(last=False)


class ClosedEntry(NamedTuple):
    reason: CloseReason
    held_s: float  # how long an expired room was held unclaimed
    released: str  # why the room was released (empty: not released)
    prefilled: bool  # its prefill ended here (False: aborted, or D gave up waiting for it)


class ClosedRooms:
    """Rooms that left P's table: why each closed and, for an expired one, how long it was held
    unclaimed (its job's ``hold_s``, else room_timeout_s); a released room, why it was released (a D
    request for it is refused at once); the newest ``CLOSED_ROOMS_KEPT``."""

    def __init__(self, room_timeout_s: float) -> None:
        self._room_timeout_s = room_timeout_s
        self._table: OrderedDict[int, ClosedEntry] = OrderedDict()

    def add(
        self, room: int, reason: CloseReason, held_s: float | None = None, released: str = "", prefilled: bool = False
    ) -> None:
        """``room`` closed for ``reason``; a release (``released``) or a prefill (``prefilled``) remembered
        for it before stays remembered."""
        held = self._room_timeout_s if held_s is None else held_s
        old = self._table.get(room)
        if old is not None:
            released, prefilled = released or old.released, prefilled or old.prefilled
        remember(self._table, room, ClosedEntry(reason, held, released, prefilled))

    def entry(self, room: int) -> ClosedEntry | None:
        return self._table.get(room)

    def get(self, room: int) -> CloseReason | None:
        entry = self._table.get(room)
        return None if entry is None else entry.reason

    def released(self, room: int) -> str:
        """Why ``room`` was released, if it was (empty otherwise)."""
        entry = self._table.get(room)
        return "" if entry is None else entry.released

    def message(self, room: int, reason: CloseReason) -> str:
        """What a D asking for ``room`` is told of its close for ``reason`` (an expired room names its
        hold, a released one why it was released)."""
        entry = self._table.get(room)
        if entry is not None and entry.released:
            return f"prefill released room {room}: {entry.released}"
        return reason.message(self._room_timeout_s if entry is None else entry.held_s)
