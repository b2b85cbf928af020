"""Role change without a restart (``POST /instances/role``, proxy/admin/roles.py): a kv_role kv_both
instance moves between the Router's pools, the role it gives up drained first; a fixed-role
instance is refused. A real Router in front of fake backends (tests/support/fake_backend.py).

``both`` stands for the kv_both instance (``--both-hosts``): as a decoder it streams a token every
0.1 s, as a prefiller its (non-streamed) answer takes 2 s; ``d`` is a fixed decoder that goes on
from the fake's own generated ids, ``p`` a fixed prefiller.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.admin.instances import parse_instances
from proxy.admin.roles import parse_role_change
from proxy.errors import RouterError
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
)

CHUNKS = 20
WHOLE = "".join(f"tok{i} " for i in range(CHUNKS))


def test_role_change_body() -> None:
    assert parse_role_change({"host": "h", "port": 2, "serves": "both"}) == ("h", 2, "both", 300.0, None)
    assert parse_role_change({"host": "h", "port": 2, "serves": "prefill", "timeout_s": 5, "bootstrap_port": 9})[
        3:
    ] == (
        5.0,
        9,
    )
    for body, message in (
        ({"host": "h", "port": 2, "serves": "P"}, "'serves' must be 'prefill', 'decode' or 'both', got 'P'"),
        ({"host": "h", "port": 0, "serves": "both"}, "'port' must be a port number in 1..65535, got 0"),
        ({"host": "h", "port": 2, "serves": "both", "timeout_s": 0}, "'timeout_s' must be a number > 0, got 0"),
    ):
        with pytest.raises(RouterError, match=message):
            parse_role_change(body)


def test_instances_add_kv_both() -> None:
    (both,) = parse_instances({"role": "decode", "host": "d", "port": 2, "kv_role": "kv_both"})
    assert both.both and not both.movable
    (fixed,) = parse_instances({"role": "prefill", "host": "p", "port": 1, "kv_role": "kv_producer"})
    assert not fixed.both
    with pytest.raises(RouterError, match="'kv_role' of a decode instance must be 'kv_both' or its own"):
        parse_instances({"role": "decode", "host": "d", "port": 2, "kv_role": "kv_producer"})
    with pytest.raises(RouterError, match="kv_role kv_both runs no migration"):
        parse_instances({"role": "decode", "host": "d", "port": 2, "kv_role": "kv_both", "bootstrap_port": 9})


@pytest.fixture(scope="module")
def fakes(proc_dir: Path) -> Iterator[dict[str, int]]:
    ports = {name: free_port() for name in ("p", "d", "both")}
    specs = [
        {"port": ports["p"], "mode": "ok"},
        {"port": ports["d"], "mode": "slow_stream", "chunks": CHUNKS, "chunk_interval": 0.05},
        {"port": ports["both"], "mode": "slow_stream", "chunks": CHUNKS, "chunk_interval": 0.1, "metrics": True},
    ]
    args = [sys.executable, str(FAKE_BACKEND), "--specs", json.dumps(specs)]
    proc = Proc("role fakes", ports["p"], args, proc_dir / "role-fakes.log").start()
    try:
        for port in ports.values():
            Proc(f"fake {port}", port, [], proc.log_path, proc.popen).wait_listening()
        yield ports
    finally:
        proc.stop()


def _role(router: Router, port: int, serves: str, **extra: Any) -> httpx.Response:
    body = {"host": HOST, "port": port, "serves": serves, **extra}
    return httpx.post(
        f"{router.url}/instances/role", json=body, headers=admin_headers(router), timeout=60, trust_env=False
    )


def _ports(listing: dict[str, Any], key: str) -> list[int]:
    return [i["port"] for i in listing[key]]


class _Client(threading.Thread):
    """One streamed completion in ``room``, in the background."""

    def __init__(self, router: Router, rid: str, room: int) -> None:
        super().__init__(daemon=True)
        self.url, self.rid = f"{router.url}/v1/completions", rid
        self.body = request_body("/v1/completions", stream=True, bootstrap_room=room, max_tokens=CHUNKS)
        self.events: list[str] = []
        self.status = 0

    def run(self) -> None:
        with http_client(60) as client:
            response = client.post(self.url, json=self.body, headers={"X-Request-Id": self.rid})
        self.status = response.status_code
        self.events = sse_events(response.content)

    def whole(self) -> bool:
        if self.status != 200 or self.events[-1:] != ["[DONE]"]:
            return False
        payloads = [json.loads(e) for e in self.events[:-1]]
        text = "".join(c.get("text") or "" for p in payloads for c in p.get("choices") or ())
        return not any("error" in p for p in payloads) and text == WHOLE


def test_fixed_role_and_unknown_instances_are_refused(fakes: dict[str, int], fresh_router: RouterFactory) -> None:
    router = fresh_router(fakes["p"], fakes["d"])
    answer = _role(router, fakes["d"], "prefill")
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert f"decoder {HOST}:{fakes['d']} has a fixed role" in error["message"] and "kv_both" in error["message"]
    assert _role(router, free_port(), "decode").status_code == 404
    listing = httpx.get(f"{router.url}/instances", headers=admin_headers(router), trust_env=False).json()
    assert _ports(listing, "decoders") == [fakes["d"]] and _ports(listing, "prefillers") == [fakes["p"]]


def test_the_only_instance_of_a_role_stays(fakes: dict[str, int], fresh_router: RouterFactory) -> None:
    router = fresh_router(fakes["p"], fakes["d"], "--both-hosts", HOST, "--both-ports", str(fakes["both"]))
    assert _role(router, fakes["both"], "decode").status_code == 200  # p is left as prefiller
    answer = _role(router, fakes["both"], "both")
    assert answer.status_code == 200 and fakes["both"] in _ports(answer.json(), "prefillers")
    only = fresh_router(fakes["p"], fakes["d"])  # a Router whose kv_both instance is its only decoder
    added = httpx.post(
        f"{only.url}/instances/add",
        json={"role": "decode", "host": HOST, "port": fakes["both"], "kv_role": "kv_both"},
        headers=admin_headers(only),
        trust_env=False,
    )
    assert added.status_code == 200, added.text
    removed = httpx.post(
        f"{only.url}/instances/remove",
        json={"role": "decode", "host": HOST, "port": fakes["d"]},
        headers=admin_headers(only),
        trust_env=False,
    )
    assert removed.status_code == 200, removed.text
    answer = _role(only, fakes["both"], "prefill")
    assert answer.status_code == 409 and "is the only active decoder" in answer.json()["error"]["message"]


def test_decoder_becomes_prefiller_and_back_draining_first(fakes: dict[str, int], fresh_router: RouterFactory) -> None:
    router = fresh_router(fakes["p"], fakes["d"], "--both-hosts", HOST, "--both-ports", str(fakes["both"]))
    answer = _role(router, fakes["both"], "decode")  # P side leaves (nothing in flight): D = [d, both]
    assert answer.status_code == 200, answer.text
    assert _ports(answer.json(), "prefillers") == [fakes["p"]]
    # A stream on the kv_both decoder (room 1: decoders[1]), then it becomes a prefiller.
    client = _Client(router, new_rid("role-d"), 1)
    client.start()
    wait_state(fakes["both"], client.rid, "started")
    answer = _role(router, fakes["both"], "prefill", timeout_s=30)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["joined"] == {"prefill": "added"}
    (drained,) = result["drained"]
    assert drained["role"] == "decode" and drained["result"] == "drained" and drained["moved"] == {"replay": 1}
    assert _ports(result, "decoders") == [fakes["d"]] and sorted(_ports(result, "prefillers")) == sorted(
        [fakes["p"], fakes["both"]]
    )
    client.join(30)
    assert client.whole()  # moved by replay to d: no error, every token
    assert records(fakes["d"], client.rid)
    # A prefill in flight on it (room 1: prefillers[1]), then it becomes a decoder again: the call
    # returns once that prefill answered.
    second = _Client(router, new_rid("role-p"), 1)
    second.start()
    wait_state(fakes["both"], second.rid, "started")
    answer = _role(router, fakes["both"], "decode", timeout_s=30)
    assert answer.status_code == 200, answer.text
    (prefill,) = records(fakes["both"], second.rid)
    assert prefill["state"] == "completed" and prefill["body"]["max_tokens"] == 1  # P's answer came first
    (drained,) = answer.json()["drained"]
    assert drained["role"] == "prefill" and drained["result"] == "drained"
    assert drained["held"] == {"vllm:pd_kv_rooms_held": 0.0}  # only its P side's rooms: its D side serves on
    second.join(30)
    assert second.whole()
    assert metric(router.url, "pd_router_drains_total", role="prefill", outcome="drained") == 2  # both calls
