"""A drain moving a decoder's streams WITH their KV (proxy/strategies/kv_move.py, proxy/admin/drain.py), real Router in
front of fake backends of this module's own (tests/support/fake_backend.py, no vLLM).

``src`` is a decoder movable by KV (``--decoder-bootstrap-ports``) that serves ``/metrics`` and counts
``vllm:pd_kv_sent_bytes_total`` for a request it aborts while it names a migrate room; ``dst`` goes on
from the fake's own generated ids (up to tok19); ``dst_fail`` fails every request whose KV comes from
``src``'s bootstrap port (a failed KV load) and serves replayed legs.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pd_connector.kv_params import MIGRATE_ROOM
from proxy.admin.instances import parse_instances
from proxy.cli import parse_config
from proxy.request.payloads import decode_body
from proxy.router_config import Backend
from tests.support.metrics import metric
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
    request_body,
    sse_events,
    wait_state,
    wait_until,
)

WHOLE = "".join(f"tok{i} " for i in range(20))
KV = "kv_transfer_params"


@pytest.fixture(scope="module")
def fakes(proc_dir: Path) -> Iterator[dict[str, int]]:
    """This module's fake backends: name -> port (``src_bootstrap``: src's bootstrap port, nothing listens)."""
    ports = {name: free_port() for name in ("p", "src", "dst", "dst_fail")}
    src_bootstrap = free_port()
    specs = [
        {"port": ports["p"], "mode": "ok"},
        {"port": ports["src"], "mode": "slow_stream", "chunks": 200, "chunk_interval": 0.1, "metrics": True},
        {"port": ports["dst"], "mode": "slow_stream", "chunks": 20, "chunk_interval": 0.1},
        {
            "port": ports["dst_fail"],
            "mode": "slow_stream",
            "chunks": 20,
            "chunk_interval": 0.05,
            "fail_bootstrap_port": src_bootstrap,
        },
    ]
    args = [sys.executable, str(FAKE_BACKEND), "--specs", json.dumps(specs)]
    proc = Proc("kv-move fakes", ports["p"], args, proc_dir / "kv-move-fakes.log").start()
    try:
        for port in ports.values():
            Proc(f"fake {port}", port, [], proc.log_path, proc.popen).wait_listening()
        yield {**ports, "src_bootstrap": src_bootstrap}
    finally:
        proc.stop()


def _movable(fakes: dict[str, int], decoders: tuple[str, ...]) -> tuple[str, ...]:
    ports = [str(fakes["src_bootstrap"]) if d == "src" else str(free_port()) for d in decoders]
    return ("--decoder-bootstrap-ports", *ports)


class _Client(threading.Thread):
    """One streamed completion in the background; ``events`` once it ended."""

    def __init__(self, router: Router, rid: str) -> None:
        super().__init__(daemon=True)
        self.url, self.rid = f"{router.url}/v1/completions", rid
        self.body = request_body(
            "/v1/completions", stream=True, bootstrap_room=0, max_tokens=20, stream_options={"include_usage": True}
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


def _texts(events: list[str]) -> str:
    return "".join(c.get("text") or "" for e in events if e != "[DONE]" for c in json.loads(e).get("choices") or ())


def _one_stream(client: _Client) -> None:
    """The client got one whole stream: one id, no error event, one [DONE], every token, usage 20."""
    assert client.status == 200 and client.events[-1] == "[DONE]" and client.events.count("[DONE]") == 1
    payloads = [json.loads(e) for e in client.events[:-1]]
    assert not any("error" in p for p in payloads)
    assert {p["id"] for p in payloads} == {f"cmpl-{client.rid}"}
    assert _texts(client.events) == WHOLE
    assert payloads[-1]["usage"]["completion_tokens"] == 20


def _drain_while_streaming(router: Router, fakes: dict[str, int], rid: str) -> tuple[_Client, dict[str, Any], bool]:
    """Drain ``src`` while ``rid`` streams from it: the client (ended), the drain's result, and
    whether the client's stream still ran when the drain answered."""
    client = _Client(router, rid)
    client.start()
    wait_state(fakes["src"], rid, "started")
    time.sleep(0.35)  # a few tokens out
    payload = {"role": "decode", "host": HOST, "port": fakes["src"]}
    answer = httpx.post(
        f"{router.url}/instances/drain", json=payload, headers=admin_headers(router), timeout=60, trust_env=False
    )
    streaming = client.is_alive()
    client.join(30)
    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["results"]
    return client, result, streaming


def _sent_bytes(port: int) -> float:
    return metric(f"http://{HOST}:{port}", "vllm:pd_kv_sent_bytes_total")


def test_movable_decoder_requests_carry_a_fresh_migrate_room(
    fakes: dict[str, int], fresh_router: RouterFactory
) -> None:
    router = fresh_router(fakes["p"], fakes["src"], *_movable(fakes, ("src",)))
    rooms = []
    for _ in range(2):
        rid = new_rid("kv-room")
        body = request_body("/v1/completions", stream=True, max_tokens=3)
        with (
            http_client() as client,
            client.stream("POST", f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as answer,
        ):
            assert answer.status_code == 200
            next(answer.iter_raw())  # src streams for 20 s: one chunk, then hang up
        (sent,) = records(fakes["src"], rid)
        rooms.append(sent["body"][KV][MIGRATE_ROOM])
    assert all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms) and rooms[0] != rooms[1]
    rid = new_rid("kv-room-json")  # not streamed: never moved, so no room to hold KV in
    with http_client(1.0) as client, pytest.raises(httpx.ReadTimeout):  # src answers in 20 s: hang up
        client.post(f"{router.url}/v1/completions", json=request_body("/v1/completions"), headers={"X-Request-Id": rid})
    (sent,) = wait_until(lambda: records(fakes["src"], rid), 10)
    assert MIGRATE_ROOM not in sent["body"][KV]
    listing = httpx.get(f"{router.url}/instances", headers=admin_headers(router), trust_env=False).json()
    assert listing["decoders"][0]["bootstrap_port"] == fakes["src_bootstrap"]


def test_drain_moves_the_stream_with_its_kv(fakes: dict[str, int], fresh_router: RouterFactory) -> None:
    router = fresh_router(fakes["p"], (fakes["src"], fakes["dst"]), *_movable(fakes, ("src", "dst")))
    rid = new_rid("kv-move")
    sent_before = _sent_bytes(fakes["src"])
    client, result, streaming = _drain_while_streaming(router, fakes, rid)
    assert result["result"] == "drained" and result["moved"] == {"kv": 1} and result["waited"] == 0
    assert streaming  # the leg on dst holds nothing on src: the drain did not wait for the stream's end
    pushed = _sent_bytes(fakes["src"]) - sent_before
    assert pushed > 0 and result["kv_bytes_moved"] == pushed
    assert result["held"] == {
        "vllm:num_requests_running": 0.0,
        "vllm:num_requests_waiting": 0.0,
        "vllm:pd_kv_rooms_held": 0.0,
    }
    _one_stream(client)
    # The same request straight to the target, never cut: the same text.
    with http_client() as direct:
        alone = direct.post(f"http://{HOST}:{fakes['dst']}/v1/completions", json=client.body)
    assert _texts(sse_events(alone.content)) == _texts(client.events)
    (cut,) = records(fakes["src"], rid)
    (moved,) = records(fakes["dst"], rid)
    prompt = moved["body"]["prompt"]
    assert prompt[:2] == [ord("H"), ord("i")] and prompt[2:] == list(range(1000, 1000 + len(prompt) - 2))
    assert len(prompt) > 2
    params = moved["body"][KV]
    assert params["do_remote_prefill"] is True
    assert params["bootstrap_room"] == cut["body"][KV][MIGRATE_ROOM]
    assert (params["bootstrap_host"], params["bootstrap_port"]) == (HOST, fakes["src_bootstrap"])
    assert params["prefill_dp_rank"] == 0 and params["prefilled_tokens"] == len(prompt) - 1
    assert moved["body"]["max_tokens"] == 20 - (len(prompt) - 2)
    assert isinstance(params[MIGRATE_ROOM], int)  # the target is movable too: its own room
    assert len(records(fakes["p"], rid)) == 1  # P prefilled only the first leg: nothing replayed
    assert metric(router.url, "pd_router_drain_moves_total", mode="kv") == 1
    assert metric(router.url, "pd_router_drain_moves_total", mode="replay") == 0
    assert metric(router.url, "pd_router_resumes_total", reason="drain") == 1
    assert metric(router.url, "pd_router_resume_replayed_tokens_total") == 0

    def logged() -> str | None:
        text = router.proc.log_text()
        return text if f"rid={rid} room" in text and " drain +" in text else None

    log = wait_until(logged, 10)
    assert f"rid={rid} room={params['bootstrap_room']} moved off draining decoder {HOST}:{fakes['src']} by kv" in log


def test_failed_kv_leg_falls_back_to_replay(fakes: dict[str, int], fresh_router: RouterFactory) -> None:
    router = fresh_router(fakes["p"], (fakes["src"], fakes["dst_fail"]), *_movable(fakes, ("src", "dst_fail")))
    rid = new_rid("kv-fallback")
    client, result, _ = _drain_while_streaming(router, fakes, rid)
    assert result["result"] == "drained" and result["moved"] == {"replay": 1}
    _one_stream(client)
    kv_leg, replayed = records(fakes["dst_fail"], rid)
    assert kv_leg["body"][KV]["bootstrap_port"] == fakes["src_bootstrap"] and kv_leg["state"] == "completed"
    assert replayed["body"][KV]["bootstrap_port"] == router.bootstrap_port  # P's: the tokens prefilled again
    assert "prefilled_tokens" not in replayed["body"][KV]
    assert len(records(fakes["p"], rid)) == 2
    assert metric(router.url, "pd_router_drain_moves_total", mode="replay") == 1
    assert metric(router.url, "pd_router_drain_moves_total", mode="kv") == 0
    assert metric(router.url, "pd_router_resume_replayed_tokens_total") > 0


def test_decoder_without_bootstrap_port_replays(fakes: dict[str, int], fresh_router: RouterFactory) -> None:
    router = fresh_router(fakes["p"], (fakes["src"], fakes["dst"]))
    rid = new_rid("kv-none")
    client, result, _ = _drain_while_streaming(router, fakes, rid)
    assert result["result"] == "drained" and result["moved"] == {"replay": 1} and result["kv_bytes_moved"] == 0
    _one_stream(client)
    (cut,) = records(fakes["src"], rid)
    assert MIGRATE_ROOM not in cut["body"][KV]
    (moved,) = records(fakes["dst"], rid)
    assert moved["body"][KV]["bootstrap_port"] == router.bootstrap_port


# -- configuration and bodies, as pure code -------------------------------------------------------

BASE = ["--prefiller-hosts", "h", "--prefiller-ports", "1", "--decoder-hosts", "d1", "d2", "--decoder-ports", "2", "3"]


def test_decoder_bootstrap_ports_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert [d.bootstrap_port for d in parse_config(BASE).decoders] == [None, None]
    assert not any(d.movable for d in parse_config(BASE).decoders)
    one = parse_config([*BASE, "--decoder-bootstrap-ports", "18900"])
    assert [d.bootstrap_port for d in one.decoders] == [18900, 18900] and all(d.movable for d in one.decoders)
    each = parse_config([*BASE, "--decoder-bootstrap-ports", "18900", "18901"])
    assert [d.bootstrap_port for d in each.decoders] == [18900, 18901]
    assert "(bootstrap 18901)" in each.describe()
    mixed = parse_config([*BASE, "--decoder-bootstrap-ports", "0", "18901"])  # 0: that decoder has none
    assert [d.bootstrap_port for d in mixed.decoders] == [None, 18901]
    assert [d.movable for d in mixed.decoders] == [False, True]
    for bad in (["18900", "18901", "18902"], ["65536"]):
        with pytest.raises(SystemExit):
            parse_config([*BASE, "--decoder-bootstrap-ports", *bad])
    assert "one per decoder (2)" in capsys.readouterr().err


def test_instances_add_decoder_bootstrap_port() -> None:
    (plain,) = parse_instances({"role": "decode", "host": "d", "port": 2})
    assert plain.bootstrap_port is None and not plain.movable
    (movable,) = parse_instances({"role": "decode", "host": "d", "port": 2, "bootstrap_port": 18900})
    assert movable.bootstrap_port == 18900 and movable.movable
    (item,) = parse_instances({"type": "decode", "instances": [{"host": "d", "port": 2, "bootstrap_port": 18901}]})
    assert item.bootstrap_port == 18901
    (prefiller,) = parse_instances({"role": "prefill", "host": "p", "port": 1})
    assert prefiller.bootstrap_port == 18800


def test_decode_body_from_a_drained_decoder() -> None:
    drained = Backend("decode", "10.0.0.2", 8200, 18900)
    params = decode_body({"prompt": [1, 2, 3]}, 7, drained, 2, 99)[KV]
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "bootstrap_room": 7,
        "bootstrap_host": "10.0.0.2",
        "bootstrap_port": 18900,
        "prefill_dp_rank": 0,
        "prefilled_tokens": 2,
        MIGRATE_ROOM: 99,
    }
