"""P with several DP ranks registers each room's DP rank when the request arrives (bootstrap.dp_rooms).

vLLM calls the connector's ``on_new_request`` from ``Scheduler.add_request``; the scheduler side only
queues the room, a thread of the registrar posts it (signed with the deployment's token), and a real
bootstrap server answers D's ``query_dp_ranks`` with it before any prefill ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from pd_connector.bootstrap.client import RouteCache
from pd_connector.bootstrap.dp_rooms import DpRoomRegistrar, dp_rooms_for
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.config import parse_config
from pd_connector.kv_params import PrefillParams
from pd_connector.scheduler import PDScheduler
from pd_connector.scheduling.dp_rooms import DpRoomsExtension
from pd_connector.scheduling.selection import extensions_for
from tests.support.fake_scheduler import BS, FakeRequest
from tests.support.loopback import HOST, free_port, wait_for

TOKEN_ENV = "PDC_TEST_DP_ROOMS_TOKEN"
TOKEN = "dp-rooms-test-token-0123456789abcdef"


@pytest.fixture(params=[False, True], ids=["no-token", "token"])
def deployment(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[BootstrapServer, dict]]:
    """A DP-2 prefill deployment's bootstrap server, and the extra config of its ranks (with a token or not)."""
    extra: dict = {"bootstrap_host": HOST, "dp_size": 2}
    token = None
    if request.param:
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        extra["auth_token_env"] = TOKEN_ENV
        token = TOKEN.encode()
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=2), HOST, free_port(), token)
    server.start()
    extra["bootstrap_port"] = server.port
    try:
        yield server, extra
    finally:
        server.stop()


def _scheduler(extra: dict, dp_rank: int) -> tuple[PDScheduler, DpRoomRegistrar]:
    cfg = parse_config("kv_producer", {**extra, "dp_rank": dp_rank})
    engine = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1))  # a dense model: vLLM says 1
    extensions = extensions_for(cfg, BS, dp_rank=dp_rank, vllm_config=engine)  # type: ignore[arg-type]
    sched = PDScheduler(cfg, BS, dp_rank, extensions=extensions)
    extension = sched.extension(DpRoomsExtension)
    assert extension is not None  # chosen: dp_size 2
    return sched, extension.registrar


def test_a_room_is_registered_when_the_request_arrives(deployment: tuple[BootstrapServer, dict]) -> None:
    server, extra = deployment
    sched, registrar = _scheduler(extra, dp_rank=1)
    try:
        sched.on_new_request(FakeRequest("p-1", {"do_remote_decode": True, "bootstrap_room": 4242}, 40))
        named_none = FakeRequest("p-2", {"do_remote_decode": True}, 40)  # P picks its room (P-then-D proxies)
        sched.on_new_request(named_none)
        wait_for(lambda: registrar.registered == 2, 10, what="two registrations")
        picked = sched._params(named_none)  # the room the request keeps (its handoff names it)
        assert isinstance(picked, PrefillParams) and picked.room is not None
        assert server.state.query_dp_ranks([4242, picked.room]) == {"4242": 1, str(picked.room): 1}
        token = TOKEN.encode() if "auth_token_env" in extra else None
        routes = RouteCache(5, token=token)  # what D reads, signed as D signs
        assert routes.query_dp_ranks(f"{HOST}:{server.port}", [4242, 7, picked.room]) == {4242: 1, picked.room: 1}
        assert registrar.failed == 0
    finally:
        registrar.close()


def test_only_p_with_several_dp_ranks_registers(deployment: tuple[BootstrapServer, dict]) -> None:
    _, extra = deployment
    one = SimpleNamespace(data_parallel_size=1)
    assert dp_rooms_for(parse_config("kv_producer", {**extra, "dp_size": 1}), one, 0) is None
    assert dp_rooms_for(parse_config("kv_producer", {k: v for k, v in extra.items() if k != "dp_size"}), one, 0) is None
    assert dp_rooms_for(parse_config("kv_consumer", {}), SimpleNamespace(data_parallel_size=2), 0) is None
    internal = dp_rooms_for(
        parse_config("kv_producer", {"bootstrap_port": 1}), SimpleNamespace(data_parallel_size=2), 1
    )
    assert internal is not None and internal.dp_rank == 1  # vLLM's own DP size (a MoE model's DP engines)
    # D's scheduler never registers; a request without kv_transfer_params registers nothing.
    sched, registrar = _scheduler(extra, dp_rank=0)
    try:
        sched.on_new_request(FakeRequest("local", None, 40))
        assert registrar.registered == registrar.failed == 0 and registrar._thread is None
    finally:
        registrar.close()


def test_an_unreachable_bootstrap_server_is_logged_and_bounded(pd_logs: pytest.LogCaptureFixture) -> None:
    registrar = DpRoomRegistrar(f"{HOST}:{free_port()}", 1, 1.0, retry_delay_s=0.01)
    try:
        registrar.seen(99, "p-99")
        wait_for(lambda: registrar.failed == 1, 10, what="the registration given up")
        assert registrar.registered == 0
        assert any("room=99 req=p-99: dp rank 1 not registered" in r.getMessage() for r in pd_logs.records)
    finally:
        registrar.close()
