"""P's room record (transfer.rooms), pure: typed claim keys, a stream taking waiting requests, the
claims carried to the READY room, the bounded memory of closed rooms."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from pd_connector import messages as proto
from pd_connector.metadata import SendJob
from pd_connector.transfer import rooms
from pd_connector.transfer.liveness import claims_toward
from pd_connector.transfer.rooms import ClaimKey, Room, WaitingRequest, remember
from pd_connector.transfer.states import CloseReason, RoomState


def _req(room: int, request_id: str, peer_id: str) -> proto.TransferRequest:
    return proto.TransferRequest(room, request_id, peer_id, [1, 2], 0, "tcp://127.0.0.1:5555")


def test_claim_keys_are_typed_and_keep_at_signs_in_ids() -> None:
    key = ClaimKey.of(_req(1, "req@with@ats", "10.0.0.1:5000/dp0/tp0"))
    assert key == ClaimKey("req@with@ats", "10.0.0.1:5000/dp0/tp0")
    assert (key.request_id, key.peer_id) == ("req@with@ats", "10.0.0.1:5000/dp0/tp0")
    cancel = proto.TransferCancel(1, "req@with@ats", "10.0.0.1:5000/dp0/tp0")
    assert ClaimKey.of(cancel) == key


def test_a_stream_takes_the_waiting_requests_once_and_the_ready_room_inherits_them() -> None:
    first, repeat, other = _req(7, "r", "d0"), _req(7, "r", "d0"), _req(7, "r", "d1")
    old = Room(7, RoomState.AWAITING_PREFILL, waiting=[WaitingRequest(w, 9.0) for w in (first, repeat, other)])
    assert old.take_waiting() == [first, other]  # the repeated claim is dropped
    assert old.waiting == [] and old.submitted == 2
    assert old.has_claim(ClaimKey("r", "d0")) and not old.has_claim(ClaimKey("r", "d2"))
    old.finished = 1
    ready = Room(7, RoomState.READY, SendJob("p", 7, [1, 2], 32))
    assert ready.carry_streamed(old) in {"d0", "d1"}  # a peer id, as sent (no string parsing)
    assert (ready.submitted, ready.finished, ready.submitted_ids) == (2, 1, old.submitted_ids)
    assert ready.close_reason is CloseReason.SENT


def test_in_flight_claims_toward_a_lost_peer_are_cancelled_with_their_own_ids() -> None:
    room = Room(3, RoomState.READY, SendJob("p", 3, [1], 16), submitted=1)
    room.submitted_ids.add(ClaimKey("a@b", "d@1"))
    assert claims_toward("", [room], {}) == [proto.TransferCancel(3, "a@b", "d@1")]


def test_remember_keeps_the_newest_rooms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rooms, "CLOSED_ROOMS_KEPT", 2)
    table: OrderedDict[int, CloseReason] = OrderedDict()
    for room in (1, 2, 3):
        remember(table, room, CloseReason.SENT)
    remember(table, 2, CloseReason.EXPIRED)  # refreshed: now the newest
    assert list(table.items()) == [(3, CloseReason.SENT), (2, CloseReason.EXPIRED)]
