"""Capacity that moves, end to end: a rebalancing move mid-stream, and a pool change under load.

Module setup: TWO extra instances beside the session stack (P, D): a decoder started with the
connector's ``migration`` (its own bootstrap server, ``--decoder-bootstrap-ports``) and one started
with kv_role ``kv_both``.

1. rebalance: a Router (``--rebalance on``, a target so low that any measured decoder is over it) in
   front of P, the stack's decoder (even rooms) and the migration decoder (odd rooms). Two greedy
   streams go to the migration decoder, none to the stack's: the rebalancer moves exactly one of them
   by KV (2/0 -> 1/1: then no decoder has room). Rooms 0 and 2, run afterwards on the stack's decoder
   with the same prompts (``stream_completion``: rooms 2k and 2k+1 share one), are the uninterrupted
   twins both streams must equal token for token.
2. role change: a Router in front of P and the stack's decoder plus the kv_both instance in both pools
   (``--both-hosts``); the kv_both instance serves as decoder only, then (its streams running) as prefiller
   only, then (its prefills running) as decoder only, then both again (``POST /instances/role``): its streams
   move by replay, every stream is whole, no request failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from launch.processes import (
    ManagedProcess,
    PDStack,
    ProcessGroup,
    free_port,
    free_ports,
    router_cmd,
    vllm_env,
    vllm_serve_cmd,
    wait_all_healthy,
    wait_http_ok,
)
from proxy.access.admin_token import admin_headers
from tests.support.metrics import metric
from tests.support.serving import D_KV_WAIT_TIMEOUT_S, START_TIMEOUT_S
from tests.support.streams import Outcome, stream_completion

pytestmark = pytest.mark.e2e

#: Long enough that the rebalancer (a round every 0.2 s) moves a stream well before its end.
REBALANCE_TOKENS = 600
#: Long enough that the kv_both decoder's streams still run when it becomes a prefiller.
ROLE_TOKENS = 400
CLIENT_BOUND_S = 300.0


@dataclass
class Extras:
    group: ProcessGroup
    host: str
    migrating: int  # the migration decoder's HTTP port
    migrating_bootstrap: int
    both: int  # the kv_both instance's HTTP port
    both_bootstrap: int


@pytest.fixture(scope="module")
def extras(pd_stack: PDStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extras]:
    with ProcessGroup(tmp_path_factory.mktemp("rebalance-logs")) as group:
        m, mb, b, bb = free_ports(4)
        host = pd_stack.host
        migrating = group.start(
            "decode-migrating",
            vllm_serve_cmd(
                pd_stack.model,
                m,
                kv_role="kv_consumer",
                bootstrap_port=mb,
                extra_config={"kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S, "migration": True},
            ),
            env=vllm_env("1"),
        )
        both = group.start(
            "both",
            vllm_serve_cmd(pd_stack.model, b, kv_role="kv_both", bootstrap_port=bb),
            env=vllm_env("0"),
        )
        wait_all_healthy(
            [(f"http://{host}:{m}/health", migrating), (f"http://{host}:{b}/health", both)], START_TIMEOUT_S
        )
        yield Extras(group, host, m, mb, b, bb)


def _router(extras: Extras, name: str, cmd: list[str]) -> tuple[str, ManagedProcess]:
    process = extras.group.start(name, cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://{extras.host}:{cmd[cmd.index('--port') + 1]}"
    wait_http_ok(f"{url}/health", 60, process)
    return url, process


def _whole(outcome: Outcome, tokens: int) -> None:
    assert outcome.status == 200 and outcome.error is None, outcome
    assert outcome.error_event is None, f"room {outcome.room}: {outcome.error_event}"
    assert outcome.done and outcome.usage is not None and outcome.usage["completion_tokens"] == tokens, outcome.usage


def test_rebalance_moves_a_stream_by_kv_token_identical(pd_stack: PDStack, extras: Extras) -> None:
    host, model = pd_stack.host, pd_stack.model
    port = free_port()
    cmd = router_cmd(
        port,
        [(host, pd_stack.prefill_port, pd_stack.bootstrap_port)],
        [(host, pd_stack.decode_port), (host, extras.migrating)],
        host=host,
    )
    cmd += ["--trust-client-room", "--health-interval", "1", "--health-timeout", "15"]
    cmd += ["--decoder-bootstrap-ports", "0", str(extras.migrating_bootstrap)]
    cmd += ["--rebalance", "on", "--rebalance-tpot-ms", "0.001", "--rebalance-interval-s", "0.2"]
    url, process = _router(extras, "router-rebalance", cmd)
    try:
        started: list[int] = []
        with ThreadPoolExecutor(2) as pool:  # odd rooms: the migration decoder
            moved_pair = list(
                pool.map(lambda r: stream_completion(url, model, r, REBALANCE_TOKENS, started, CLIENT_BOUND_S), (1, 3))
            )
        with ThreadPoolExecutor(2) as pool:  # their twins, never moved (the stack's decoder has no migration)
            twins = list(
                pool.map(lambda r: stream_completion(url, model, r, REBALANCE_TOKENS, started, CLIENT_BOUND_S), (0, 2))
            )
        for outcome in (*moved_pair, *twins):
            _whole(outcome, REBALANCE_TOKENS)
        for got, want in zip(moved_pair, twins, strict=True):
            assert got.text == want.text, f"room {got.room} differs from its twin room {want.room}"
        source, target = f"{host}:{extras.migrating}", f"{host}:{pd_stack.decode_port}"
        assert metric(url, "pd_router_rebalance_moves_total", **{"from": source, "to": target, "mode": "kv"}) == 1
        assert metric(url, "pd_router_rebalance_moves_total") == 1
        assert metric(url, "pd_router_resume_replayed_tokens_total") == 0  # moved with its KV
    finally:
        extras.group.stop(process)


def _role(url: str, port: int, host: str, serves: str) -> dict[str, Any]:
    body = {"host": host, "port": port, "serves": serves, "timeout_s": 120}
    answer = httpx.post(
        f"{url}/instances/role",
        json=body,
        headers=admin_headers(int(url.rsplit(":", 1)[1])),
        timeout=180,
        trust_env=False,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_role_change_under_load_fails_no_request(pd_stack: PDStack, extras: Extras) -> None:
    host, model = pd_stack.host, pd_stack.model
    port = free_port()
    cmd = router_cmd(
        port, [(host, pd_stack.prefill_port, pd_stack.bootstrap_port)], [(host, pd_stack.decode_port)], host=host
    )
    cmd += [
        "--both-hosts",
        host,
        "--both-ports",
        str(extras.both),
        "--both-bootstrap-ports",
        str(extras.both_bootstrap),
    ]
    cmd += ["--trust-client-room", "--health-interval", "1", "--health-timeout", "15"]
    url, process = _router(extras, "router-roles", cmd)
    try:
        # The kv_both instance as decoder only: odd rooms stream from it (decoders[1]), even ones from the stack's.
        changes = [_role(url, extras.both, host, "decode")]
        started: list[int] = []
        with ThreadPoolExecutor(8) as pool:

            def submit(rooms: range) -> list[Future[Outcome]]:
                return [
                    pool.submit(stream_completion, url, model, room, ROLE_TOKENS, started, CLIENT_BOUND_S)
                    for room in rooms
                ]

            futures = submit(range(10, 14))
            deadline = time.monotonic() + 120
            while not {11, 13} <= set(started) and time.monotonic() < deadline:
                time.sleep(0.05)
            changes.append(_role(url, extras.both, host, "prefill"))  # its streams move to the stack's decoder
            futures += submit(range(14, 18))  # odd rooms: the kv_both instance prefills them
            changes.append(_role(url, extras.both, host, "decode"))  # its prefills answered, rooms loaded
            changes.append(_role(url, extras.both, host, "both"))
            outcomes = [f.result(timeout=CLIENT_BOUND_S) for f in futures]
        for outcome in outcomes:
            _whole(outcome, ROLE_TOKENS)
        assert [sorted(c["joined"]) for c in changes] == [[], ["prefill"], ["decode"], ["prefill"]]
        assert [[d["role"] for d in c["drained"]] for c in changes] == [["prefill"], ["decode"], ["prefill"], []]
        assert all(d["result"] == "drained" for c in changes for d in c["drained"])
        assert changes[1]["drained"][0]["moved"].get("replay", 0) >= 1  # kv_both has no migration: by replay
        assert metric(url, "pd_router_errors_total") == 0
    finally:
        extras.group.stop(process)
