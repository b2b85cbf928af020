"""P's rooms: one prefilled request's KV waiting for (or being written to) its D ranks.

``Room`` is the per-room record ``PrefillSide`` keeps; its ``RoomState`` moves AWAITING_PREFILL ->
READY -> SENDING/DRAINING -> closed. A claim is one D rank's ask for a room (``claim``): the D ranks
of one request share the request id, so claims are keyed by (request id, D peer id).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_connector import protocol as proto
from pd_connector.metadata import SendJob
from pd_connector.transfer.states import CloseReason, RoomState


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
    submitted_ids: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)  # D requests' ranks that gave up (each counts as claimed)

    def has_claim(self, key: str) -> bool:
        """Whether the claim ``key`` (``claim``) came already: submitted, cancelled, or waiting for the prefill."""
        if key in self.submitted_ids or key in self.cancelled:
            return True
        return any(claim(w.req.request_id, w.req.peer_id) == key for w in self.waiting)

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
        if self.submitted_ids - self.cancelled:
            return CloseReason.SENT
        return CloseReason.CANCELLED if self.cancelled else CloseReason.EXPIRED


def claim(request_id: str, peer_id: str) -> str:
    """Key of one D rank's claim on a room: the D request id is shared by all D ranks of the request."""
    return f"{request_id}@{peer_id}"
