"""A load reported done without the bytes fails the request and leaves D's prefix cache clean.

A test peer plays a prefill deployment: a real bootstrap server (in this process) where one fake
P rank is registered, and that rank speaking the real ZMQ protocol (signed frames when a token is
set). It answers every ``TransferRequest`` with ``TransferDone(OK)`` and never writes a byte. A
client request sent to D with that bootstrap address must fail at once (not after
``kv_wait_timeout_s``), and the same prompt sent afterwards through the real P must equal
colocated vLLM's answer: the blocks of the failed load never entered D's prefix cache.

What catches the lie:

- a bare "done" (no byte count, as an old or foreign peer sends): D's byte accounting, always on
  (checked here against the session's D, which runs without verify_kv);
- a "done" that claims the right byte count (and a made-up checksum): only ``verify_kv: true``
  catches it. That D is one extra decode instance, fresh (empty prefix cache), beside the session
  stack's P, with its own Router in front of both. Without verify_kv such a peer would be trusted;
  the control-plane token and ``trusted_bootstrap_hosts`` keep it from being reached.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from launch.processes import PDStack, ProcessGroup, free_port, vllm_env, vllm_serve_cmd
from pd_connector import messages as proto
from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.keys import frame_key
from pd_connector.layouts.regions import Region
from pd_connector.transfer.frames import FrameOpener, FrameRefused, FrameSealer
from tests.support.serving import (
    D_KV_WAIT_TIMEOUT_S,
    PROMPT_LENGTHS,
    assert_matches_reference,
    count_in_log,
    prompts,
    start_router_when_healthy,
    wait_kv_free,
)

pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"
#: The prompt the fake peer "serves" first: 200 tokens, 7 blocks of 32.
PROMPT = PROMPT_LENGTHS.index(200)


@dataclass
class FakePrefill:
    """A bootstrap server with one registered P rank that says "done" and writes nothing."""

    route: proto.Route  # copied from the real P, so D's layout checks pass
    claim_bytes: bool  # False: a bare done; True: the byte count D's blocks hold, and checksum 0
    token: bytes | None = None
    requests: list[proto.TransferRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._hellos: dict[str, proto.PeerHello] = {}
        self._zmq = zmq.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.rank_port = self._pull.bind_to_random_port(f"tcp://{HOST}")
        endpoint, key = f"tcp://{HOST}:{self.rank_port}", frame_key(self.token)
        self._opener, self._sealer = FrameOpener(key, endpoint), FrameSealer(key, endpoint)  # a real P's envelope
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-prefill", daemon=True)
        self.server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port(), self.token)

    def start(self) -> None:
        self.server.start()
        self._thread.start()
        r = self.route
        info = proto.RegisterRank(
            1, 0, 1, 0, HOST, self.rank_port, r.block_size, r.kv_cache_dtype, num_layers=r.num_layers, model=r.model
        )
        assert register_rank(f"{HOST}:{self.server.port}", info, 3, 0.1, 5.0, self.token)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pull.close(linger=0)
        self._zmq.term()
        self.server.stop()

    def _serve(self) -> None:
        push: dict[str, zmq.Socket] = {}
        try:
            while not self._stop.is_set():
                if not self._pull.poll(50):
                    continue
                try:
                    msg = proto.decode(self._opener.open(self._pull.recv()).payload)
                except (FrameRefused, proto.ProtocolError):
                    continue
                if isinstance(msg, proto.PeerHello):
                    self._hellos[msg.peer_id] = msg
                elif isinstance(msg, proto.TransferRequest):
                    self.requests.append(msg)
                    sock = push.get(msg.endpoint)
                    if sock is None:
                        sock = push[msg.endpoint] = self._zmq.socket(zmq.PUSH)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(msg.endpoint)
                    sock.send(self._sealer.seal(msg.endpoint, proto.encode(self._done(msg))))
        finally:
            for sock in push.values():
                sock.close(linger=0)

    def _done(self, req: proto.TransferRequest) -> proto.TransferDone:
        done = proto.TransferDone(room=req.room, request_id=req.request_id, tp_rank=0, status=proto.DoneStatus.OK)
        hello = self._hellos.get(req.peer_id)
        if not self.claim_bytes or hello is None:
            return done
        per_block = sum(Region(*r).block_bytes for r in hello.regions)
        checksum = 0 if req.want_checksum else None
        return msgspec.structs.replace(done, nbytes=per_block * len(req.dst_block_ids), checksum=checksum)


def prefill_route(stack: PDStack) -> proto.Route:
    resp = httpx.get(f"http://{HOST}:{stack.bootstrap_port}/bootstrap/route", timeout=10, trust_env=False)
    assert resp.status_code == 200, resp.text
    return msgspec.json.decode(resp.content, type=proto.Route)


@dataclass
class VerifyingDecode:
    """A decode instance with verify_kv on, fed by the session stack's P, and a Router over both."""

    url: str
    router_url: str
    log_path: Path


@pytest.fixture(scope="module")
def verifying_decode(pd_stack: PDStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerifyingDecode]:
    with ProcessGroup(tmp_path_factory.mktemp("integrity-logs")) as group:
        port, router_port = free_port(), free_port()
        extra = {"verify_kv": True, "kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S}
        cmd = vllm_serve_cmd(
            pd_stack.model, port, kv_role="kv_consumer", bootstrap_port=pd_stack.bootstrap_port, extra_config=extra
        )
        proc = group.start("decode-verify", cmd, env=vllm_env("1"))
        url = f"http://{HOST}:{port}"
        router_url = start_router_when_healthy(
            group,
            router_port,
            [(HOST, pd_stack.prefill_port, pd_stack.bootstrap_port)],
            [(HOST, port)],
            [(f"{url}/health", proc)],
            name="router-verify",
        )
        yield VerifyingDecode(url, router_url, proc.log_path)


def fake_load(decode_url: str, model: str, fake: FakePrefill, room: int) -> tuple[httpx.Response, float]:
    """A D request whose KV is to come from the fake peer; (response, seconds it took)."""
    body = {
        "model": model,
        "prompt": prompts()[PROMPT],
        "max_tokens": 12,
        "temperature": 0,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "bootstrap_room": room,
            "bootstrap_host": HOST,
            "bootstrap_port": fake.server.port,
        },
    }
    t0 = time.monotonic()
    resp = httpx.post(f"{decode_url}/v1/completions", json=body, timeout=D_KV_WAIT_TIMEOUT_S + 60, trust_env=False)
    return resp, time.monotonic() - t0


def assert_failed_at_once(
    resp: httpx.Response, elapsed: float, fake: FakePrefill, room: int, *, fresh_cache: bool = True
) -> None:
    """The request failed, at once, after D asked the fake for its blocks (all of them when D's cache is fresh:
    the session D may hold the prompt's first blocks from earlier tests, and asks only for the rest)."""
    assert resp.status_code >= 400, f"a load that never landed was served: {resp.status_code} {resp.text[:300]}"
    assert resp.json().get("error"), resp.text
    assert elapsed < D_KV_WAIT_TIMEOUT_S, f"the failure took {elapsed:.1f} s: a timeout, not the check"
    asked = [r for r in fake.requests if r.room == room]
    least = PROMPT_LENGTHS[PROMPT] // 32 - 1 if fresh_cache else 1
    assert len(asked) == 1 and len(asked[0].dst_block_ids) >= least, asked


def test_a_bare_done_fails_without_verify_kv_and_the_prompt_then_equals_colocated(
    pd_stack: PDStack, reference: dict
) -> None:
    """The session's D (no verify_kv): a done that does not say what it wrote fails the request."""
    fake = FakePrefill(prefill_route(pd_stack), claim_bytes=False)
    fake.start()
    try:
        room = 9_100_001
        resp, elapsed = fake_load(pd_stack.decode_url, pd_stack.model, fake, room)
        assert_failed_at_once(resp, elapsed, fake, room, fresh_cache=False)
    finally:
        fake.stop()
    line = rf"room={room} .*KV load failed: .*without saying how many bytes"
    assert count_in_log(pd_stack.decode.log_path, line) == 1
    assert wait_kv_free(pd_stack.decode_url) == 0.0
    assert_matches_reference(pd_stack.router_url, pd_stack.model, reference, [PROMPT], "after a bare done")


def test_a_done_that_lies_about_the_bytes_fails_with_verify_kv_and_leaves_the_cache_clean(
    pd_stack: PDStack, reference: dict, verifying_decode: VerifyingDecode
) -> None:
    """A fresh D with verify_kv: both kinds of fake done fail; the real P's KV then passes the checksum."""
    d = verifying_decode
    for room, claim in ((9_100_011, False), (9_100_012, True)):
        fake = FakePrefill(prefill_route(pd_stack), claim_bytes=claim)
        fake.start()
        try:
            resp, elapsed = fake_load(d.url, pd_stack.model, fake, room)
            # D asked for every block both times: the first failed load cached nothing.
            assert_failed_at_once(resp, elapsed, fake, room)
            assert fake.requests[0].want_checksum
        finally:
            fake.stop()
    assert count_in_log(d.log_path, r"room=9100011 .*KV load failed: .*without saying how many bytes") == 1
    assert count_in_log(d.log_path, r"room=9100012 .*KV load failed: verify_kv: checksum mismatch") == 1
    assert wait_kv_free(d.url) == 0.0
    made = assert_matches_reference(d.router_url, pd_stack.model, reference, [PROMPT], "verify_kv D, after fakes")
    # The real loads passed the checksum: the fakes' two are the only failed loads.
    assert count_in_log(d.log_path, r"KV load failed") == 2
    assert count_in_log(d.log_path, r"KV received") >= made - 1  # the second may hit D's prefix cache
    assert wait_kv_free(d.url) == 0.0
