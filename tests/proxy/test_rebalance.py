"""Live rebalancing (proxy/admin/rebalance.py, rebalance_tpot.py): the policy as pure code, the
rebalancer's bound on moves per second against a small fake of the drain's stream table, and a real
Router in front of fake backends (tests/support/fake_backend.py) moving a stream by KV.

In the Router tests ``slow`` streams a token every 0.15 s (ITL 150 ms, over the 80 ms target) and
``fast`` one every 0.02 s; both go on from the fake's own generated ids (a moved stream's text is
the one a single decoder gives). Rooms 0 and 2 both reach ``slow`` (``room`` routing, client rooms).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pd_connector.kv_params import MIGRATE_ROOM
from proxy.admin.drain import TrackedStream
from proxy.admin.rebalance import Rebalancer
from proxy.admin.rebalance_flags import RebalanceConfig
from proxy.admin.rebalance_policy import DecoderView, Move
from proxy.admin.rebalance_tpot import TpotPolicy
from proxy.cli import parse_config
from proxy.router_config import Backend
from proxy.upstream.pool import BackendState
from tests.support.metrics import metric
from tests.support.router_rig import (
    FAKE_BACKEND,
    HOST,
    Proc,
    Router,
    RouterFactory,
    free_port,
    http_client,
    new_rid,
    records,
    request_body,
    sse_events,
    wait_state,
    wait_until,
)

CHUNKS = 40
WHOLE = "".join(f"tok{i} " for i in range(CHUNKS))
KV = "kv_transfer_params"

# -- the policy, as pure code ----------------------------------------------------------------------


def _view(key: str, in_flight: int, itl: float | None, movable: int = 0, healthy: bool = True) -> DecoderView:
    return DecoderView(key, in_flight, itl, movable, healthy)


def test_tpot_policy_moves_from_the_slow_decoder_to_one_with_room() -> None:
    policy = TpotPolicy(80.0)
    slow, fast = _view("d1", 4, 150.0, movable=4), _view("d2", 1, 20.0)
    # ITL in proportion to streams: 150/20 -> 112.5/40 -> 75/60, and d1 is under the target.
    assert policy.decide([slow, fast], budget=10) == [Move("d1", "d2")] * 2
    assert policy.decide([slow, _view("d2", 0, None)], budget=10) == [Move("d1", "d2")] * 2  # unmeasured: 4/0 -> 2/2
    assert policy.decide([slow, fast], budget=0) == []
    # As busy but faster (its streams cost less): it takes streams too (150/20 -> 112.5/26.7 -> 75/33.3).
    assert policy.decide([slow, _view("d2", 3, 20.0)], budget=5) == [Move("d1", "d2")] * 2
    # Over the target after one more stream, or unhealthy: nothing moves.
    assert policy.decide([slow, _view("d2", 0, 90.0)], budget=5) == []
    assert policy.decide([slow, _view("d2", 2, 60.0)], budget=5) == []  # 90 with a third stream
    assert policy.decide([slow, _view("d2", 0, 20.0, healthy=False)], budget=5) == []
    # Under the target: nothing moves however uneven; no stream movable: nothing moves.
    assert policy.decide([_view("d1", 8, 70.0, movable=8), _view("d2", 0, None)], budget=5) == []
    assert policy.decide([_view("d1", 8, 150.0), _view("d2", 0, None)], budget=5) == []


def test_tpot_policy_orders_sources_by_itl_and_targets_by_their_itl_after_the_move() -> None:
    policy = TpotPolicy(80.0)
    views = [
        _view("a", 6, 120.0, movable=6),
        _view("b", 6, 300.0, movable=6),
        _view("c", 2, 30.0),
        _view("d", 1, 40.0),
    ]
    moves = policy.decide(views, budget=3)
    # The slowest first, each time to the decoder fastest after taking it: c (45, 60, 75) before d (80).
    assert moves == [Move("b", "c")] * 3
    with pytest.raises(ValueError, match="--rebalance-tpot-ms must be > 0, got 0"):
        TpotPolicy(0)


def test_tpot_policy_moves_only_to_a_clearly_faster_decoder() -> None:
    hot = _view("d1", 7, 14.8, movable=7)  # 12.7 ms once it gave one up
    strict, loose = TpotPolicy(13.6, min_gain=0.25), TpotPolicy(13.6)
    assert strict.decide([hot, _view("d2", 17, 12.4)], budget=5) == []  # 13.1: not 25% under 12.7
    assert strict.decide([hot, _view("d2", 2, 12.4)], budget=5) == []  # 18.6 with a third: over the target
    assert strict.decide([hot, _view("d2", 4, 6.0)], budget=1) == [Move("d1", "d2")]  # 7.5
    assert strict.decide([hot, _view("d2", 8, 9.0)], budget=1) == []  # 10.1: the move gains too little
    assert loose.decide([hot, _view("d2", 8, 9.0)], budget=1) == [Move("d1", "d2")]
    assert strict.decide([hot, _view("d2", 0, None)], budget=1) == [Move("d1", "d2")]  # idle
    with pytest.raises(ValueError, match="--rebalance-min-gain must be in"):
        TpotPolicy(10.0, min_gain=1.0)


def test_rebalance_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--prefiller-hosts", "h", "--prefiller-ports", "1", "--decoder-hosts", "d", "--decoder-ports", "2"]
    assert parse_config(base).rebalance == RebalanceConfig()
    assert not parse_config(base).rebalance.enabled
    config = parse_config([*base, "--rebalance", "on", "--rebalance-tpot-ms", "40", "--rebalance-max-moves-per-s", "3"])
    assert config.rebalance.enabled and config.rebalance.tpot_ms == 40 and config.rebalance.max_moves_per_s == 3
    with pytest.raises(SystemExit):
        parse_config([*base, "--rebalance-max-moves-per-s", "0"])
    assert "--rebalance-max-moves-per-s must be > 0 (got 0.0)" in capsys.readouterr().err
    assert parse_config([*base, "--rebalance-min-gain", "0.1"]).rebalance.min_gain == 0.1
    assert parse_config([*base, "--rebalance-by-replay"]).rebalance.by_replay
    with pytest.raises(SystemExit):
        parse_config([*base, "--rebalance-min-gain", "-0.5"])
    assert "--rebalance-min-gain must be in [0, 1) (got -0.5)" in capsys.readouterr().err


# -- the rebalancer's rounds, against a fake of the drain's stream table -----------------------------


class _FakeTracker:
    """A stream that gets ``per_round`` tokens each round (its decoder's speed)."""

    def __init__(self, per_round: int, max_tokens: int = 1000) -> None:
        self.generated: list[int] = [1, 2]
        self.per_round = per_round
        self.call = SimpleNamespace(body={"max_tokens": max_tokens})
        self.finished = False


class _FakeDrains:
    """The part of proxy.admin.drain.Drains the rebalancer calls: streams per decoder, and moves
    (a moved stream goes on on its target at ``fast_per_round`` tokens a round)."""

    def __init__(self, streams: dict[BackendState, list[_FakeTracker]], fast_per_round: int) -> None:
        self.streams = streams
        self.fast_per_round = fast_per_round
        self.moved: list[tuple[BackendState, BackendState]] = []

    def streaming(self, d: BackendState) -> list[tuple[Any, Any, Any]]:
        stream = TrackedStream(cast(Any, None), cast(Any, None), rid="r", room=1, kv_room=7)
        return [(t, stream, SimpleNamespace(progress=SimpleNamespace(resumes=0))) for t in self.streams[d]]

    def rebalance_move(self, d: BackendState, tracker: Any, target: BackendState, *, by_replay: bool = False) -> bool:
        self.moved.append((d, target))
        self.streams[d].remove(tracker)
        self.streams[target].append(tracker)
        tracker.per_round = self.fast_per_round
        d.in_flight -= 1
        target.in_flight += 1
        return True

    def tick(self) -> None:
        for trackers in self.streams.values():
            for t in trackers:
                t.generated.extend([0] * t.per_round)


def test_rebalancer_measures_itl_and_bounds_moves_per_second() -> None:
    slow, fast = BackendState(Backend("decode", "h", 1, 9)), BackendState(Backend("decode", "h", 2, 9))
    slow.in_flight, fast.in_flight = 30, 0
    drains = _FakeDrains({slow: [_FakeTracker(1) for _ in range(30)], fast: []}, fast_per_round=25)
    config = RebalanceConfig(enabled=True, tpot_ms=80.0, max_moves_per_s=2.0, interval_s=0.5, min_tokens_left=4)
    router = SimpleNamespace(
        config=SimpleNamespace(rebalance=config, resume_attempts=2),
        pool=SimpleNamespace(active={"decode": [slow, fast]}),
        metrics=SimpleNamespace(registry=CollectorRegistry()),
    )
    rebalancer = Rebalancer(router, drains)  # type: ignore[arg-type]
    made = []
    for i in range(9):  # 4 s of rounds, 0.5 s apart: a token per stream per round on slow = ITL 500 ms
        drains.tick()
        made.append(rebalancer.round(i * 0.5))
    assert made[0] == 0  # the first round only samples
    assert rebalancer.itl[slow] == pytest.approx(500.0) and rebalancer.itl[fast] == pytest.approx(20.0)
    # A bucket of 2 (one second's worth) then 2 per second: at most 2 + 2 * 4 over 4 s, and it is used.
    assert sum(made) == len(drains.moved) <= 2 + 2 * 4 and sum(made) >= 8
    assert all(d is slow and t is fast for d, t in drains.moved)
    assert metric_value(router.metrics.registry, "pd_router_rebalance_itl_ms", backend="h:1") == pytest.approx(500.0)


def metric_value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# -- a real Router --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fakes(proc_dir: Path) -> Iterator[dict[str, int]]:
    """This module's fake backends: name -> port (``slow_bootstrap``: slow's bootstrap port, nothing listens)."""
    ports = {name: free_port() for name in ("p", "slow", "fast")}
    specs = [
        {"port": ports["p"], "mode": "ok"},
        {"port": ports["slow"], "mode": "slow_stream", "chunks": CHUNKS, "chunk_interval": 0.15, "metrics": True},
        {"port": ports["fast"], "mode": "slow_stream", "chunks": CHUNKS, "chunk_interval": 0.02},
    ]
    args = [sys.executable, str(FAKE_BACKEND), "--specs", json.dumps(specs)]
    proc = Proc("rebalance fakes", ports["p"], args, proc_dir / "rebalance-fakes.log").start()
    try:
        for port in ports.values():
            Proc(f"fake {port}", port, [], proc.log_path, proc.popen).wait_listening()
        yield {**ports, "slow_bootstrap": free_port()}
    finally:
        proc.stop()


REBALANCE = ["--rebalance", "on", "--rebalance-tpot-ms", "80", "--rebalance-interval-s", "0.2"]
REBALANCE += ["--rebalance-min-tokens-left", "4"]


class _Client(threading.Thread):
    """One streamed completion in the background, in ``room``; ``events`` once it ended."""

    def __init__(self, router: Router, rid: str, room: int) -> None:
        super().__init__(daemon=True)
        self.url, self.rid = f"{router.url}/v1/completions", rid
        self.body = request_body(
            "/v1/completions",
            stream=True,
            bootstrap_room=room,
            max_tokens=CHUNKS,
            stream_options={"include_usage": True},
        )
        self.events: list[str] = []
        self.status = 0

    def run(self) -> None:
        with http_client(60) as client:
            try:
                response = client.post(self.url, json=self.body, headers={"X-Request-Id": self.rid})
            except httpx.HTTPError:
                return
        self.status = response.status_code
        self.events = sse_events(response.content)


def _text(events: list[str]) -> str:
    return "".join(c.get("text") or "" for e in events if e != "[DONE]" for c in json.loads(e).get("choices") or ())


def _two_streams_on_slow(router: Router, fakes: dict[str, int], tag: str) -> list[_Client]:
    clients = [_Client(router, new_rid(tag), room) for room in (0, 2)]
    for client in clients:
        client.start()
    for client in clients:
        wait_state(fakes["slow"], client.rid, "started")
    for client in clients:
        client.join(30)
    for client in clients:  # each stream whole, one id, no error event
        assert client.status == 200 and client.events.count("[DONE]") == 1, client.events[-3:]
        assert not any("error" in json.loads(e) for e in client.events[:-1])
        assert _text(client.events) == WHOLE
        assert json.loads(client.events[-2])["usage"]["completion_tokens"] == CHUNKS
    return clients


def test_rebalance_moves_one_stream_by_kv_to_the_decoder_with_room(
    fakes: dict[str, int], fresh_router: RouterFactory
) -> None:
    movable = ["--decoder-bootstrap-ports", str(fakes["slow_bootstrap"]), str(free_port())]
    router = fresh_router(fakes["p"], (fakes["slow"], fakes["fast"]), *REBALANCE, *movable)
    clients = _two_streams_on_slow(router, fakes, "rebalance")
    moved = [c for c in clients if records(fakes["fast"], c.rid)]
    assert len(moved) == 1  # 2/0 -> 1/1: then no decoder has room (no trading back)
    (client,) = moved
    (cut,) = records(fakes["slow"], client.rid)
    (leg,) = records(fakes["fast"], client.rid)
    params = leg["body"][KV]
    assert cut["state"] == "disconnected"
    assert params["bootstrap_room"] == cut["body"][KV][MIGRATE_ROOM]  # loaded from slow's held KV
    assert (params["bootstrap_host"], params["bootstrap_port"]) == (HOST, fakes["slow_bootstrap"])
    assert params["prefilled_tokens"] == len(leg["body"]["prompt"]) - 1
    assert len(records(fakes["p"], client.rid)) == 1  # nothing prefilled again
    slow, fast = f"{HOST}:{fakes['slow']}", f"{HOST}:{fakes['fast']}"
    assert metric(router.url, "pd_router_rebalance_moves_total", **{"from": slow, "to": fast, "mode": "kv"}) == 1
    assert metric(router.url, "pd_router_resumes_total", reason="drain") == 1
    assert metric(router.url, "pd_router_drain_moves_total", mode="kv") == 0  # not a drain's move

    def logged() -> str | None:
        text = router.proc.log_text()
        return text if f"rid={client.rid} room" in text and f"moved={slow}>{fast}" in text else None

    log = wait_until(logged, 10)
    assert f"moved off overloaded decoder {slow} to decoder {fast} by kv" in log
    (line,) = [x for x in log.splitlines() if f"rid={client.rid} room" in x and "moved=" in x]
    assert " rebalance +" in line and " resumed +" in line  # the phase trace's marks


def test_streams_of_decoders_without_migration_stay(fakes: dict[str, int], fresh_router: RouterFactory) -> None:
    router = fresh_router(fakes["p"], (fakes["slow"], fakes["fast"]), *REBALANCE)  # no --decoder-bootstrap-ports
    clients = _two_streams_on_slow(router, fakes, "rebalance-none")
    assert not any(records(fakes["fast"], c.rid) for c in clients)
    assert metric(router.url, "pd_router_rebalance_itl_ms", backend=f"{HOST}:{fakes['slow']}") > 80
    text = httpx.get(f"{router.url}/metrics", timeout=5, trust_env=False).text
    assert "pd_router_rebalance_moves_total{" not in text


def test_streams_without_kv_to_move_go_by_replay_with_the_flag(
    fakes: dict[str, int], fresh_router: RouterFactory
) -> None:
    router = fresh_router(fakes["p"], (fakes["slow"], fakes["fast"]), *REBALANCE, "--rebalance-by-replay")
    clients = _two_streams_on_slow(router, fakes, "rebalance-replay")
    moved = [c for c in clients if records(fakes["fast"], c.rid)]
    assert len(moved) == 1  # 2/0 -> 1/1, as by KV
    (client,) = moved
    (leg,) = records(fakes["fast"], client.rid)
    assert MIGRATE_ROOM not in leg["body"][KV]  # no KV held on slow: P prefilled the prompt and the tokens again
    assert len(records(fakes["p"], client.rid)) == 2
    slow, fast = f"{HOST}:{fakes['slow']}", f"{HOST}:{fakes['fast']}"
    assert metric(router.url, "pd_router_rebalance_moves_total", **{"from": slow, "to": fast, "mode": "replay"}) == 1
