"""``--routing cache-aware``: in process on a BackendPool, and through a real Router process."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.cli import parse_config
from proxy.request.payloads import estimate_prompt_tokens
from proxy.router_config import Backend
from proxy.upstream.pool import BackendPool
from proxy.upstream.routing import POLICIES, CacheAware, RouteRequest, RoutingOptions
from tests.support.router_rig import (
    FAKE_BACKEND,
    HOST,
    Proc,
    Router,
    RouterFactory,
    admin_headers,
    free_port,
    http_client,
    new_rid,
    records,
    wait_until,
)

P = tuple(Backend("prefill", "p", 8100 + i, 18800) for i in range(2))
D = tuple(Backend("decode", "d", 8200 + i) for i in range(2))


def _chat(system: str, turns: int) -> dict[str, Any]:
    """A chat body: one system prompt, then ``turns`` user turns with the assistant's replies between."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f"answer {turn} " * 5})
        messages.append({"role": "user", "content": f"question {turn} " * 5})
    return {"model": "fake-model", "messages": messages, "max_tokens": 4}


def _route(body: dict[str, Any], room: int = 0) -> RouteRequest:
    return RouteRequest(room, estimate_prompt_tokens(body), body)


# --- in process ----------------------------------------------------------------------------------


def test_turns_stay_on_one_prefiller_while_balanced_and_move_on_imbalance() -> None:
    pool = BackendPool(P, D, "cache-aware", RoutingOptions(cache_aware_balance_abs=500, cache_aware_balance_rel=2.0))
    p0, p1 = pool.active["prefill"]
    first = pool.pick("prefill", 1, request=_route(_chat("system A " * 20, 1), room=1))
    other = p1 if first is p0 else p0
    for turn in range(2, 6):  # unloaded: every turn follows its history, whatever the room
        assert pool.pick("prefill", turn, request=_route(_chat("system A " * 20, turn), room=turn)) is first
    # Another conversation: no match anywhere, so the least-loaded prefiller.
    busy = pool.lease(first, 400)
    assert pool.pick("prefill", 7, request=_route(_chat("system B " * 20, 1), room=7)) is other
    # 400 tokens more than the idlest: under the absolute threshold, the conversation stays.
    assert pool.pick("prefill", 8, request=_route(_chat("system A " * 20, 6), room=8)) is first
    # 600 over (> 500) and more than 2x the idlest: imbalanced, the turn goes to the least loaded.
    busier = pool.lease(first, 200)
    assert pool.pick("prefill", 9, request=_route(_chat("system A " * 20, 7), room=9)) is other
    for lease in (busy, busier):
        lease.release()
    # Both thresholds must pass: 3000 vs 2000 is 1000 over (> 500) but only 1.5x (< 2x), so the
    # turn follows its longest prefix (now on `other`, where the last turn went), busier or not.
    loads = [pool.lease(first, 2000), pool.lease(other, 3000)]
    assert pool.pick("prefill", 10, request=_route(_chat("system A " * 20, 8), room=10)) is other
    for lease in loads:
        lease.release()
    assert pool.pick("prefill", 11, request=_route(_chat("system A " * 20, 9), room=11)) is other


def test_best_match_ties_go_to_the_least_loaded_and_short_matches_to_least_loaded() -> None:
    pool = BackendPool(P, D, "cache-aware", RoutingOptions(cache_aware_min_match=0.5))
    p0, p1 = pool.active["prefill"]
    shared = {"prompt": "x" * 400}
    assert pool.pick("prefill", 0, request=_route(shared)) is p0  # nothing anywhere: least loaded, room 0
    assert pool.pick("prefill", 1, exclude={p0}, request=_route(shared)) is p1  # a retry elsewhere
    lease = pool.lease(p0, 50)
    assert pool.pick("prefill", 0, request=_route(shared)) is p1  # both hold it whole: the less loaded
    # 400 of 1000 characters matched (< 0.5): least loaded, though p0 and p1 both hold the prefix.
    longer = {"prompt": "x" * 400 + "y" * 600}
    assert pool.pick("prefill", 0, request=_route(longer)) is p1
    lease.release()
    # A body with no prompt text (prompt_embeds) is routed by load alone.
    assert pool.pick("prefill", 0, request=_route({"prompt_embeds": "..."})) is p0


def test_decoders_are_chosen_by_load() -> None:
    pool = BackendPool(P, D, "cache-aware")
    d0, d1 = pool.active["decode"]
    lease = pool.lease(d0)
    body = _chat("system", 1)
    assert {pool.pick("decode", room, request=_route(body, room)).backend.port for room in range(4)} == {8201}
    lease.release()


def test_each_pool_has_its_own_state_and_forgets_removed_instances() -> None:
    a = BackendPool(P, D, "cache-aware", RoutingOptions(cache_aware_max_chars=64))
    b = BackendPool(P, D, "cache-aware")
    assert isinstance(a.policy, CacheAware) and isinstance(b.policy, CacheAware)
    assert a.policy is not b.policy is not POLICIES["cache-aware"]
    chosen = a.pick("prefill", 0, request=_route({"prompt": "z" * 100}))
    assert chosen is not None
    assert list(a.policy.trees) == [chosen] and not b.policy.trees
    assert a.policy.trees[chosen].chars == 64  # the pool's own bound
    assert not POLICIES["cache-aware"].trees  # type: ignore[attr-defined]
    a.remove(chosen)
    assert not a.policy.trees
    # Only the other prefiller is left; the prompt's history went with the removed one.
    assert a.pick("prefill", 0, request=_route({"prompt": "z" * 100})) is a.active["prefill"][0]


BASE = ["--prefiller-hosts", "p", "--prefiller-ports", "1", "--decoder-hosts", "d", "--decoder-ports", "2"]


def test_cache_aware_flags() -> None:
    assert parse_config(BASE).routing_options == RoutingOptions()
    config = parse_config(
        [
            *BASE,
            "--routing",
            "cache-aware",
            "--cache-aware-balance-abs",
            "100",
            "--cache-aware-balance-rel",
            "1.2",
            "--cache-aware-min-match",
            "0.6",
            "--cache-aware-max-chars",
            "1M",
        ]
    )
    assert config.routing == "cache-aware"
    assert config.routing_options == RoutingOptions(100, 1.2, 0.6, 1024**2)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--cache-aware-balance-abs", "-1"),
        ("--cache-aware-balance-rel", "0.5"),
        ("--cache-aware-balance-rel", "inf"),
        ("--cache-aware-min-match", "1.5"),
        ("--cache-aware-max-chars", "0"),
        ("--cache-aware-max-chars", "lots"),
    ],
)
def test_bad_cache_aware_flags_exit_2(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config([*BASE, flag, value])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


# --- through a Router process --------------------------------------------------------------------

#: Prefillers that answer after 1.5 s: a request's prompt tokens stay in flight that long.
P_DELAY_S = 1.5


@pytest.fixture(scope="module")
def slow_prefillers(proc_dir: Path) -> Iterator[tuple[int, int, int]]:
    """Two fake prefillers answering after P_DELAY_S and one fast decoder: their ports."""
    ports = (free_port(), free_port(), free_port())
    specs = [{"port": ports[0], "delay": P_DELAY_S}, {"port": ports[1], "delay": P_DELAY_S}, {"port": ports[2]}]
    args = [sys.executable, str(FAKE_BACKEND), "--specs", json.dumps(specs)]
    proc = Proc("slow prefillers", ports[0], args, proc_dir / "cache-aware-backends.log").start()
    try:
        for port in ports:
            Proc(f"fake backend {port}", port, [], proc.log_path, proc.popen).wait_listening()
        yield ports
    finally:
        proc.stop()


def _served_by(prefillers: tuple[int, ...], rid: str) -> int:
    found = wait_until(lambda: [port for port in prefillers if records(port, rid)], timeout=10)
    assert len(found) == 1, found
    return found[0]


def test_router_keeps_a_conversation_on_one_prefiller_until_loads_are_imbalanced(
    slow_prefillers: tuple[int, int, int], fresh_router: RouterFactory
) -> None:
    p_a, p_b, d = slow_prefillers
    router = fresh_router(
        (p_a, p_b),
        d,
        "--routing",
        "cache-aware",
        "--cache-aware-balance-abs",
        "2000",
        "--cache-aware-min-match",
        "0.01",
    )
    system = "You are the assistant of conversation 1. " * 10
    url = f"{router.url}/v1/chat/completions"

    def send(body: dict[str, Any], rid: str) -> None:
        with http_client() as client:
            response = client.post(url, json=body, headers={"X-Request-Id": rid})
        assert response.status_code == 200, response.text

    rids = [new_rid(f"turn{turn}") for turn in range(1, 4)]
    for turn, rid in enumerate(rids, start=1):
        send(_chat(system, turn), rid)  # each answered by D at once; P holds it for 1.5 s
    home = _served_by((p_a, p_b), rids[0])
    assert [_served_by((p_a, p_b), rid) for rid in rids] == [home] * 3
    away = p_b if home == p_a else p_a

    def in_background(body: dict[str, Any], rid: str) -> threading.Thread:
        thread = threading.Thread(target=send, args=(body, rid))
        thread.start()
        wait_until(lambda: records(home, rid), timeout=10)  # on P: its lease is counted in flight
        return thread

    # A long request sharing the conversation's history goes home too: ~3000 tokens in flight there.
    heavy = _chat(system, 3)
    heavy["messages"].append({"role": "user", "content": "long document " * 850})
    assert estimate_prompt_tokens(heavy) > 3000
    heavy_rid = new_rid("heavy")
    thread = in_background(heavy, heavy_rid)
    turn4 = new_rid("turn4")
    send(_chat(system, 4), turn4)
    assert _served_by((p_a, p_b), heavy_rid) == home
    assert _served_by((p_a, p_b), turn4) == away  # 3000+ over the idlest (> 2000): least loaded
    thread.join()
    # Loads drained: the next turn follows its longest prefix, now on the other prefiller.
    wait_until(lambda: _in_flight(router) == [0, 0], timeout=10)
    turn5 = new_rid("turn5")
    send(_chat(system, 5), turn5)
    assert _served_by((p_a, p_b), turn5) == away


def _listing(router: Router) -> dict[str, Any]:
    return httpx.get(f"{router.url}/instances", headers=admin_headers(router), timeout=5, trust_env=False).json()


def _in_flight(router: Router) -> list[int]:
    return [p["in_flight_prompt_tokens"] for p in _listing(router)["prefillers"]]


def test_router_drops_a_removed_prefillers_history(
    slow_prefillers: tuple[int, int, int], fresh_router: RouterFactory
) -> None:
    p_a, p_b, d = slow_prefillers
    router = fresh_router((p_a, p_b), d, "--routing", "cache-aware")
    system = "You are the assistant of conversation 2. " * 10
    with http_client() as client:

        def turn(number: int) -> int:
            rid = new_rid(f"rm-turn{number}")
            response = client.post(
                f"{router.url}/v1/chat/completions", json=_chat(system, number), headers={"X-Request-Id": rid}
            )
            assert response.status_code == 200, response.text
            return _served_by((p_a, p_b), rid)

        home = turn(1)
        assert turn(2) == home
        away = p_b if home == p_a else p_a
        instance = {"role": "prefill", "host": HOST, "port": home, "bootstrap_port": router.bootstrap_port}
        admin = admin_headers(router)
        assert client.post(f"{router.url}/instances/remove", json=instance, headers=admin).status_code == 200
        assert turn(3) == away  # recorded in away's tree, though away is the only prefiller now
        wait_until(lambda: not _listing(router)["draining"], timeout=10)
        assert client.post(f"{router.url}/instances/add", json=instance, headers=admin).status_code == 200
        # The re-added prefiller starts with no history; the conversation stays where it went.
        assert [turn(n) for n in (4, 5)] == [away, away]
