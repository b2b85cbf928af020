"""proxy.admin.drain's narrow view of a relayed stream: the decoder, the stream's tracker, a
:class:`proxy.admin.drain.DrainableLeg` (the attempt's ``leg_state``/``cut_for_drain``) and the rooms;
a drain cuts a leg once, and the stream is settled by decoder, tracker and mode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from proxy.admin.drain import LegState, MoveMode
from proxy.request.attempt import AttemptState, Call, Opened
from proxy.request.loop import AttemptLoop
from proxy.request.payloads import COMPLETIONS
from proxy.request.progress import RequestProgress
from proxy.router_config import Backend, RouterConfig
from proxy.router_state import Router
from proxy.strategies.resume_body import StreamTracker
from proxy.upstream.calls import Failure, FailureKind
from tests.proxy.test_resume import _tok

HOST = "127.0.0.1"


@pytest.fixture
def router() -> Iterator[Router]:
    decoders = (Backend("decode", HOST, 1, bootstrap_port=18900), Backend("decode", HOST, 3))
    router = Router(RouterConfig((Backend("prefill", HOST, 2, 18800),), decoders, resume_attempts=2))
    yield router
    router.http.close()


class FakeLeg:
    """A leg as the drain sees it; records the drain's cut."""

    def __init__(self) -> None:
        self.state = LegState.STREAMING
        self.cuts: list[Failure] = []

    def leg_state(self) -> LegState:
        return self.state

    def cut_for_drain(self, failure: Failure) -> None:
        self.cuts.append(failure)
        self.state = LegState.CUT_BY_DRAIN


class FakeRequest:
    """The request context as a drain reads it."""

    rid = "rid-drain"

    def __init__(self) -> None:
        self.progress = RequestProgress(7)


def _tracker() -> StreamTracker:
    call = Call(COMPLETIONS, "rid-drain", {"prompt": "Hi", "max_tokens": 10, "stream": True}, True, 2, {})
    tracker = StreamTracker(call)
    tracker.feed(_tok("a", 7, first=True))  # prompt ids seen: the stream can resume
    return tracker


def test_a_draining_decoders_leg_is_cut_once_and_settled_by_tracker(router: Router) -> None:
    drains = router.drains
    d = router.pool.active["decode"][0]
    request, leg, tracker = FakeRequest(), FakeLeg(), _tracker()
    drains.track(cast(Any, request), d, tracker, leg, 7, 41)
    assert leg.cuts == []  # not draining: only tracked
    d.draining = True
    streams = drains._streams[d]
    assert drains._move(d, tracker, streams[tracker])
    assert [f.kind for f in leg.cuts] == [FailureKind.DRAIN] and leg.cuts[0].state is d
    assert [phase for phase, _ in request.progress.moves] == ["drain"]
    assert drains._move(d, tracker, streams[tracker]) and len(leg.cuts) == 1  # cut already: not again
    assert drains._unsettled(d)
    drains._tally[d] = {}
    other = StreamTracker(tracker.call)
    drains.settled(d, other, MoveMode.KV, request.rid, 9)  # another stream: no-op
    assert drains._unsettled(d) and drains._tally[d] == {}
    drains.settled(d, tracker, MoveMode.KV, request.rid, 9)
    assert not drains._unsettled(d) and drains._tally[d] == {"kv": 1}
    drains.settled(d, tracker, MoveMode.FAILED, request.rid, 9)  # once settled, later calls are no-ops
    assert drains._tally[d] == {"kv": 1}


def test_a_leg_that_ended_or_cannot_resume_is_not_cut(router: Router) -> None:
    drains = router.drains
    d = router.pool.active["decode"][0]
    ended, fresh = FakeLeg(), FakeLeg()
    ended.state = LegState.ENDED
    tracked = _tracker()
    drains.track(cast(Any, FakeRequest()), d, tracked, ended, 7, None)
    unseen = StreamTracker(tracked.call)  # no prompt ids seen yet: nothing to resume from
    drains.track(cast(Any, FakeRequest()), d, unseen, fresh, 8, None)
    d.draining = True
    assert not drains._move(d, tracked, drains._streams[d][tracked])
    assert not drains._move(d, unseen, drains._streams[d][unseen])
    assert ended.cuts == [] and fresh.cuts == [] and not drains._unsettled(d)


def test_an_attempt_is_a_drainable_leg(router: Router) -> None:
    """Attempt.leg_state follows the attempt; cut_for_drain closes its open stream with the failure,
    which the relay then reads as it would a late P failure."""

    class FakeResponse:
        closed = False

        def close(self) -> None:
            self.closed = True

    async def main() -> None:
        call = Call(COMPLETIONS, "rid-leg", {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}, True, 3, {})
        loop = AttemptLoop(router, call, router.rooms.fresh(), time.monotonic())
        p, d = router.pool.active["prefill"][0], router.pool.active["decode"][0]
        attempt = loop.new_attempt(call, p, d, loop.progress.room)  # not run
        assert attempt.resumable and attempt.leg_state() is LegState.CLOSED  # not streaming yet
        response = FakeResponse()
        attempt.opened = Opened(cast(Any, response), b"data: {}\n\n")
        attempt.state = AttemptState.STREAMING
        assert attempt.leg_state() is LegState.STREAMING
        drain = Failure(d, FailureKind.DRAIN, cast(Any, None), True)
        assert attempt.migrate_room is not None and attempt.kv_room_after(drain) == attempt.migrate_room
        assert attempt.kv_room_after(Failure(d, FailureKind.DISCONNECT, cast(Any, None), True)) is None
        attempt.cut_for_drain(drain)
        assert response.closed and attempt.late_p_failure is drain
        assert attempt.leg_state() is LegState.CUT_BY_DRAIN
        attempt.opened = None
        attempt.state = AttemptState.ANSWERED
        assert attempt.leg_state() is LegState.ENDED
        loop.close()

    asyncio.run(main())
