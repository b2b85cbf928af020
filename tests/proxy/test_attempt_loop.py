"""proxy.request.loop: one request's attempt loop (its rooms from the one room factory, its attempts, their
failures settled by the failure policy) and the policy's rules for a KV move's leg and a cut stream."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from proxy.errors import RouterError
from proxy.request.attempt import Call
from proxy.request.failure_policy import Tried, count_failure, decide, settle
from proxy.request.loop import AttemptLoop
from proxy.request.payloads import COMPLETIONS, new_room
from proxy.request.rooms_in_flight import RoomsInUse
from proxy.router_config import Backend, RouterConfig
from proxy.router_state import Router
from proxy.upstream.calls import Failure, FailureKind
from proxy.upstream.pool import BackendState
from tests.proxy.test_failure_policy import FakeAttempt, FakeRouter
from tests.support.router_rig import Backends, RouterFactory, http_client

HOST = "127.0.0.1"


class _Draws(random.Random):
    """A random source that draws the given numbers in turn."""

    def __init__(self, draws: list[int]) -> None:
        super().__init__()
        self.draws = iter(draws)

    def getrandbits(self, k: int, /) -> int:
        return next(self.draws)


def test_the_factory_draws_from_its_one_source_and_claims_each_room() -> None:
    rooms = RoomsInUse(random.Random(7))
    room = rooms.fresh()
    assert room == new_room(random.Random(7))
    with pytest.raises(RouterError, match=str(room)):
        rooms.claim(room)  # a request that names it is refused while it is in flight
    rooms.release(room)
    rooms.claim(room)


def test_the_factory_skips_a_room_in_flight() -> None:
    rooms = RoomsInUse(_Draws([5, 5, 9]))
    rooms.claim(5)
    assert rooms.fresh() == 9
    assert len(rooms) == 2


@pytest.fixture
def router() -> Iterator[Router]:
    decoder = Backend("decode", HOST, 1, bootstrap_port=18900)  # movable by KV
    router = Router(RouterConfig((Backend("prefill", HOST, 2, 18800),), (decoder,)))
    yield router
    router.http.close()


def _call(stream: bool = True) -> Call:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
    return Call(COMPLETIONS, "rid-loop", body, stream, 3, {})


def test_every_room_of_a_request_is_held_until_it_ends(router: Router) -> None:
    async def main() -> None:
        first = router.rooms.fresh()
        loop = AttemptLoop(router, _call(), first, time.monotonic())
        retry_room = loop.next_room()
        p, d = router.pool.active["prefill"][0], router.pool.active["decode"][0]
        attempt = loop.new_attempt(loop.call, p, d, retry_room)  # not run
        assert attempt.migrate_room is not None  # a resumable stream on a decoder movable by KV
        assert loop.current is attempt and loop.progress.room == retry_room
        for room in (first, retry_room, attempt.migrate_room):
            with pytest.raises(RouterError, match="in use"):
                router.rooms.claim(room)
        assert len(router.rooms) == 3
        loop.close()
        assert len(router.rooms) == 0
        assert attempt.p_lease.released and attempt.d_lease.released

    asyncio.run(main())


def test_no_migrate_room_where_the_stream_cannot_move(router: Router) -> None:
    async def main() -> None:
        loop = AttemptLoop(router, _call(stream=False), router.rooms.fresh(), time.monotonic())
        p, d = router.pool.active["prefill"][0], router.pool.active["decode"][0]
        assert loop.new_attempt(loop.call, p, d, loop.progress.room).migrate_room is None
        loop.close()
        assert len(router.rooms) == 0

    asyncio.run(main())


def _failure(state: BackendState, kind: FailureKind, retryable: bool = True) -> Failure:
    return Failure(state, kind, RouterError(502, f"{kind.value} on {state.backend.name}", "x"), retryable)


def _decoders() -> tuple[BackendState, BackendState]:
    return BackendState(Backend("decode", "src", 8200, bootstrap_port=18900)), BackendState(
        Backend("decode", "dst", 8201)
    )


def test_a_kv_legs_target_is_avoided_only_where_unreachable() -> None:
    source, target = _decoders()
    leg = cast(Any, FakeAttempt(source, target, p_answered=True))  # the "P" is the drained decoder
    fake = FakeRouter()
    tried = Tried()
    decision = settle(cast(Any, fake), COMPLETIONS, _failure(target, FailureKind.HTTP_5XX), tried, leg)
    assert tried.p == set() and tried.d == set()  # a failed load is most often the source's doing
    assert not decision.release_room  # the source frees its own room (migrate_hold_s)
    decision = settle(cast(Any, fake), COMPLETIONS, _failure(target, FailureKind.CONNECT), tried, leg)
    assert tried.d == {target} and tried.p == set()
    assert decision.mark_unhealthy and not decision.release_room
    assert [kind for _, _, kind in fake.metrics.errors] == ["http_5xx", "connect"]


def test_a_cut_stream_avoids_its_decoder_and_p_where_d_failed_for_p() -> None:
    p = BackendState(Backend("prefill", "p", 8100, 18800))
    d = BackendState(Backend("decode", "d", 8200))
    tried = Tried.after_cut(_failure(d, FailureKind.ERROR_EVENT), p, d)
    assert tried.d == {d} and tried.p == {p}
    tried = Tried.after_cut(_failure(p, FailureKind.DISCONNECT), p, d)  # P failed while D streamed
    assert tried.p == {p} and tried.d == {d}
    tried = Tried.after_cut(_failure(d, FailureKind.DISCONNECT), p, d)
    assert tried.p == set() and tried.d == {d}


def test_count_failure_counts_every_failure_and_marks_only_the_unreachable() -> None:
    p = BackendState(Backend("prefill", "p", 8100, 18800))
    fake = FakeRouter()
    assert not count_failure(cast(Any, fake), "/v1/models", _failure(p, FailureKind.HTTP_5XX)).mark_unhealthy
    assert count_failure(cast(Any, fake), "/v1/models", _failure(p, FailureKind.CONNECT)).mark_unhealthy
    assert fake.metrics.errors == [
        ("/v1/models", p.backend.address, "http_5xx"),
        ("/v1/models", p.backend.address, "connect"),
    ]
    assert fake.pool.marked == [(p, "connect on " + p.backend.name)]
    assert decide(_failure(p, FailureKind.CONNECT)).mark_unhealthy


def test_models_marks_an_unreachable_decoder_with_the_metric(router_factory: RouterFactory, backends: Backends) -> None:
    router = router_factory(backends.ok_p, backends.down)
    with http_client() as client:
        reply = client.get(f"{router.url}/v1/models")
        metrics = client.get(f"{router.url}/metrics").text
    assert reply.status_code >= 500, reply.text  # the one decoder could not be connected to
    labels = f'backend="{HOST}:{backends.down}",endpoint="/v1/models",kind="connect",role="decode"'
    pattern = r"pd_router_backend_errors_total\{" + re.escape(labels) + r"\} ([0-9.]+)"
    counted = re.search(pattern, metrics)
    assert counted is not None and float(counted.group(1)) >= 1, metrics


def test_p_kv_no_attempt_took_over_is_released_as_the_request_ends(router: Router) -> None:
    async def main() -> None:
        p = router.pool.active["prefill"][0]
        loop = AttemptLoop(router, _call(), router.rooms.fresh(), time.monotonic())
        loop.p_holds(p, loop.progress.room, loop.call, 3)  # P answered (the first-token path)
        loop.close()  # the answer was token 1 alone: a one-token decoder request frees the room
        assert len(router.tasks) == 1
        for task in list(router.tasks):
            task.cancel()

    asyncio.run(main())


def test_p_kv_an_attempt_took_over_is_not_released_by_the_loop(router: Router) -> None:
    async def main() -> None:
        p, d = router.pool.active["prefill"][0], router.pool.active["decode"][0]
        loop = AttemptLoop(router, _call(), router.rooms.fresh(), time.monotonic())
        loop.p_holds(p, loop.progress.room, loop.call, 3)
        loop.new_attempt(loop.call, p, d, loop.progress.room, p_answered=True, prefilled_tokens=3)  # D asks for it
        loop.close()
        assert len(router.tasks) == 0

    asyncio.run(main())


def test_the_first_pick_in_the_planned_room_is_the_pair_the_path_was_chosen_for() -> None:
    prefillers = tuple(Backend("prefill", HOST, port, 18800 + port) for port in (2, 3))
    decoders = tuple(Backend("decode", HOST, port) for port in (4, 5))
    router = Router(RouterConfig(prefillers, decoders, routing="least-loaded"))
    try:
        pool, room = router.pool, router.rooms.fresh()
        loop = AttemptLoop(router, _call(), room, time.monotonic())
        policy_p, policy_d = pool.pick("prefill", room), pool.pick("decode", room)  # ties broken by the room
        other_p = next(s for s in pool.active["prefill"] if s is not policy_p)
        other_d = next(s for s in pool.active["decode"] if s is not policy_d)
        loop.plan(room, other_p, other_d)
        assert loop.pick("prefill", loop.call, room, ()) is other_p
        assert loop.pick("decode", loop.call, room, ()) is other_d
        assert loop.pick("decode", loop.call, room, ()) is policy_d  # once: later picks are the policy's
        loop.plan(room, other_p, other_d)
        fresh = loop.next_room()
        assert loop.pick("prefill", loop.call, fresh, ()) is pool.pick("prefill", fresh)  # another room
        assert loop.pick("decode", loop.call, room, (other_d,)) is policy_d  # a planned instance to avoid
        loop.close()
    finally:
        router.http.close()
