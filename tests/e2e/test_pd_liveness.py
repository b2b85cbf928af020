"""Closed-loop abort and liveness with real processes.

Module setup, beside the session's P/D stack (P1, D): a second prefiller P2 (its own bootstrap
server) and a decoder D2 that runs one sequence at a time (``--max-num-seqs 1``), and two Routers:

- ``queued``: P2 + D2. A long local generation occupies D2, so a Router request is prefilled by P2
  (which then holds its KV) while D2 keeps it queued: D2 never asked P2 for it. The client then
  disconnects: D2's vLLM aborts the queued request, D2 tells P2 (TransferCancel) and P2 frees the
  KV within 1 s, where it used to hold it until room_timeout_s.
- ``two_p``: P1 + P2 in front of the session's D (client rooms: odd rooms go to P2, no background
  health checks, so only the requests' own failures steer the Router). P2 is frozen (SIGSTOP):
  D's loads waiting on it fail once P2 answered no heartbeat for peer_timeout_s; D tells P2 to stop
  and keeps their blocks for the lost wait (``pd_connector.transfer.loads.lost_wait_s``, by the bounds
  P2 advertised: a frozen P2 may resume and land its batch in flight), then answers the error before
  any byte, the Router retries on P1, and every client gets the full answer, equal to colocated
  vLLM's. P2 runs with Mooncake's shortest write timeouts (``FAST_TRANSFER_ENV``), so that wait is
  short. Streamed requests take the Router's first-token path (P alone first): there the Router's
  own watch finds P2's /health silent, marks P2 unhealthy and retries on P1. Then P2 is killed
  (SIGKILL) while more requests are sent: they too are answered in full (through P1, which the
  Router now prefers), and D holds no KV afterwards.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launch.processes import ManagedProcess, ProcessGroup, free_ports, signal_group, vllm_env, vllm_serve_cmd
from launch.sse import sse_lines
from pd_connector.bootstrap.client import ROUTE_TTL_S
from pd_connector.config import DECODE, DisaggConfig
from pd_connector.transfer.loads import PeerTiming, lost_wait_s
from tests.support.serving import (
    D_KV_WAIT_TIMEOUT_S,
    FAST_BATCH_STALL_S,
    FAST_TRANSFER_ENV,
    P_ROOM_TIMEOUT_S,
    PROMPT_LENGTHS,
    complete,
    count_in_log,
    kv_usage,
    prompt_of_length,
    prompts,
    start_router_when_healthy,
    wait_kv_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.vllm023]

#: The connector's default peer_timeout_s (neither the session stack nor P2 sets it): D declares P2 lost
#: after it, and P2 advertises it.
PEER_TIMEOUT_S = DisaggConfig(mode=DECODE).peer_timeout_s
#: How long D keeps a lost P2's loads (told to stop, unanswered) before vLLM may reuse their blocks: by
#: the bounds P2 advertises (its batch_stall_s under FAST_TRANSFER_ENV, its peer_timeout_s).
P2_LOST_WAIT_S = lost_wait_s(DisaggConfig(mode=DECODE), PeerTiming(FAST_BATCH_STALL_S, PEER_TIMEOUT_S))
#: From D asking the frozen P2 until it ends the load as failed: the silence that makes P2 lost, then the wait.
FAILOVER_S = PEER_TIMEOUT_S + P2_LOST_WAIT_S
#: P frees a room D abandoned within this (the acceptance bound).
FREE_BOUND_S = 1.0
LONG_GENERATION = 1900  # tokens: D2 stays busy for many seconds


@dataclass
class LivenessStack:
    model: str
    p2: ManagedProcess
    p2_url: str
    d2: ManagedProcess
    d2_url: str
    queued_router: str
    queued_port: int
    two_p_router: str
    decode_url: str
    decode_log: Path


@pytest.fixture(scope="module")
def liveness(pd_stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivenessStack]:
    host, model = pd_stack.host, pd_stack.model
    with ProcessGroup(tmp_path_factory.mktemp("liveness-logs")) as group:
        p2_port, p2_boot, d2_port, queued_port, two_p_port = free_ports(5)
        p2 = group.start(
            "prefill-2",
            vllm_serve_cmd(
                model, p2_port, kv_role="kv_producer", bootstrap_port=p2_boot,
                extra_config={"room_timeout_s": P_ROOM_TIMEOUT_S},
            ),
            env={**vllm_env("0"), **FAST_TRANSFER_ENV},  # the P2 two_p freezes and kills: a short lost wait
        )  # fmt: skip
        d2 = group.start(
            "decode-one-seq",
            vllm_serve_cmd(
                model, d2_port, kv_role="kv_consumer", bootstrap_port=p2_boot,
                extra_config={"kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S}, extra_args=["--max-num-seqs", "1"],
            ),
            env=vllm_env("1"),
        )  # fmt: skip
        p2_url, d2_url = f"http://{host}:{p2_port}", f"http://{host}:{d2_port}"
        queued = start_router_when_healthy(
            group, queued_port, [(host, p2_port, p2_boot)], [(host, d2_port)],
            [(f"{p2_url}/health", p2), (f"{d2_url}/health", d2)], name="router-queued",
        )  # fmt: skip
        two_p = start_router_when_healthy(
            group, two_p_port,
            [(host, pd_stack.prefill_port, pd_stack.bootstrap_port), (host, p2_port, p2_boot)],
            [(host, pd_stack.decode_port)],
            [(f"{p2_url}/health", p2)], ["--health-interval", "0"], name="router-two-p",
        )  # fmt: skip
        yield LivenessStack(
            model, p2, p2_url, d2, d2_url, queued, queued_port, two_p, pd_stack.decode_url, pd_stack.decode.log_path
        )


def _wait(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(interval)
    return time.monotonic() - t0


def _occupy(url: str, model: str, started: threading.Event, stop: threading.Event) -> None:
    """A long local generation on ``url``, streamed until ``stop`` (then the connection closes)."""
    body = {"model": model, "prompt": "busy", "max_tokens": LONG_GENERATION, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120, trust_env=False) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            for _ in sse_lines(resp):
                started.set()
                if stop.is_set():
                    return


def test_client_gone_before_decode_asked_frees_prefill_kv_within_1s(liveness: LivenessStack) -> None:
    s = liveness
    assert wait_kv_free(s.p2_url) == 0.0
    started, stop = threading.Event(), threading.Event()
    busy = threading.Thread(target=_occupy, args=(s.d2_url, s.model, started, stop), daemon=True)
    busy.start()
    try:
        assert started.wait(60), "D2's long generation did not start"
        room = 7_000_001
        body = {"model": s.model, "prompt": prompt_of_length(150, salt=3), "max_tokens": 8, "bootstrap_room": room}
        data = json.dumps(body).encode()
        client = socket.create_connection(("127.0.0.1", s.queued_port), timeout=30)
        head = "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        client.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        # P2 prefilled (a few ms) and holds the room's KV; D2 (busy) has not asked for it.
        _wait(lambda: kv_usage(s.p2_url) > 0, 60, "P2 holding the prefilled KV")
        time.sleep(0.5)
        assert kv_usage(s.p2_url) > 0
        assert busy.is_alive(), "D2 finished its long generation too early"
        assert count_in_log(s.d2.log_path, rf"room={room} .*loading") == 0, "D2 asked P2 already"
        client.close()  # the client goes away
        freed = _wait(lambda: kv_usage(s.p2_url) == 0, 10 * P_ROOM_TIMEOUT_S, "P2's KV freed")
        assert busy.is_alive(), "D2 stopped being busy before the measurement ended"
    finally:
        stop.set()
        busy.join(60)
    print(f"[liveness] P2 freed the abandoned room's KV {freed:.3f} s after the client disconnected")
    assert freed <= FREE_BOUND_S, f"P2 held the KV {freed:.2f} s after the client left (bound {FREE_BOUND_S} s)"
    told = count_in_log(s.d2.log_path, rf"room={room} .*before its KV was asked for; prefill told")
    cancelled = count_in_log(s.p2.log_path, rf"room={room} .*decode cancelled the transfer")
    # The Router tells P2's bootstrap server itself (release_room); D2's own cancel to P2 is the fallback path,
    # and which of the two reaches P2 first depends on timing.
    released = count_in_log(s.p2.log_path, rf"room={room}:? released \(")
    print(
        f"[liveness] D2 told P2 {told} time(s); P2 logged {cancelled} cancel(s), {released} release(s) for room {room}"
    )
    assert (told >= 1 and cancelled >= 1) or released >= 1
    assert count_in_log(s.p2.log_path, rf"room={room} .*prefill ended as") == 0  # P's prefill was not aborted
    assert wait_kv_free(s.d2_url) == 0.0
    # Both still serve.
    assert complete(s.queued_router, s.model, "still serving", stream=False, max_tokens=4)["token_ids"]


def _ask_all(url: str, model: str, reference: dict, jobs: list[tuple[int, bool, int]]) -> list[float]:
    """Every (prompt index, stream, room) through ``url`` at once; each answer must equal colocated's.

    Returns each request's seconds."""

    def one(job: tuple[int, bool, int]) -> float:
        i, stream, room = job
        t0 = time.monotonic()
        got = complete(url, model, prompts()[i], stream=stream, bootstrap_room=room)
        assert got["token_ids"] == reference["completions"][stream][i]["token_ids"], (
            f"prompt of {PROMPT_LENGTHS[i]} tokens, stream={stream}, room={room}"
        )
        return time.monotonic() - t0

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def test_prefiller_frozen_then_killed_clients_get_full_answers_via_the_other(
    liveness: LivenessStack, reference: dict
) -> None:
    s = liveness
    indices = [9, 12, 15, 18]  # 33..200 tokens
    # Odd rooms go to P2 first. A warm-up makes D cache P2's route (P2's bootstrap server freezes too): the
    # route an earlier test left expires first (a request does not refresh a route that has not expired).
    time.sleep(ROUTE_TTL_S)
    assert complete(s.two_p_router, s.model, prompts()[0], stream=False, bootstrap_room=1)["token_ids"]
    lost_before = count_in_log(s.decode_log, r"silent for")
    signal_group(s.p2.pid, signal.SIGSTOP)
    try:
        frozen = [(i, stream, 8_000_001 + 2 * (2 * n + stream)) for n, i in enumerate(indices) for stream in (0, 1)]
        took = _ask_all(s.two_p_router, s.model, reference, [(i, bool(st), r) for i, st, r in frozen])
        print(f"[liveness] P2 frozen: {len(took)} requests answered in full, slowest {max(took):.1f} s")
        # Unstreamed (P and D at once): D's loads failed by liveness (not by kv_wait_timeout_s), then
        # the Router retried on P1. Streamed (the Router's first-token path waits for P alone): the
        # Router's own watch saw P2's /health silent and retried on P1 (D never heard of P2's rooms).
        two_instance = [t for t, (_, st, _) in zip(took, frozen, strict=True) if not st]
        first_token = [t for t, (_, st, _) in zip(took, frozen, strict=True) if st]
        assert PEER_TIMEOUT_S + 1 < D_KV_WAIT_TIMEOUT_S, "liveness must end the loads before kv_wait_timeout_s"
        assert max(took) < FAILOVER_S + 6, f"lost wait {P2_LOST_WAIT_S:g} s: {took}"
        assert min(two_instance) >= FAILOVER_S - 1, f"answered before D's lost wait for P2 ran out: {took}"
        assert max(first_token) < 1.0 + 2.0 + 4, f"the Router's watch (1 s + a 2 s probe) took longer: {took}"
        lost = count_in_log(s.decode_log, r"silent for") - lost_before
        assert lost >= len(two_instance), f"D logged {lost} liveness failures for {len(two_instance)} requests"
        for _, stream, room in frozen:
            assert count_in_log(s.decode_log, rf"room={room} .*no KV from prefill within") == 0
            if not stream:
                assert count_in_log(s.decode_log, rf"room={room} .*KV load failed: prefill rank .* silent for") >= 1
                held = rf"room={room} .*silent for.*blocks held until prefill stops \(at most {P2_LOST_WAIT_S:.1f} s\)"
                assert count_in_log(s.decode_log, held) >= 1, f"room {room}: D's wait is not P2's lost wait"

        # More requests wait on the frozen P2, then it is killed.
        killed = [(i, bool(st), 9_000_001 + 2 * (2 * n + st)) for n, i in enumerate(indices) for st in (0, 1)]
        with ThreadPoolExecutor(1) as pool:
            answers = pool.submit(_ask_all, s.two_p_router, s.model, reference, killed)
            time.sleep(1.5)
            signal_group(s.p2.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            took = answers.result(timeout=120)
        after_kill = time.monotonic() - t_kill
    finally:
        signal_group(s.p2.pid, signal.SIGCONT)  # no effect once killed
    print(f"[liveness] P2 killed: {len(took)} requests answered in full, {after_kill:.1f} s after the kill")
    assert after_kill < FAILOVER_S + 8, took
    _wait(lambda: not s.p2.is_running(), 30, "P2 gone")
    # A load the Router gave up on (P2's connection reset at the kill, the client answered through P1) is
    # cancelled on D, and a dead P2 never answers: it keeps its blocks for the stop wait (= P2_LOST_WAIT_S).
    freed = _wait(lambda: kv_usage(s.decode_url) == 0, FAILOVER_S + 10, "D's KV freed", interval=0.2)
    print(f"[liveness] D's KV back to 0 {freed:.1f} s after the last answer")
    # The Router keeps serving through P1.
    assert complete(s.two_p_router, s.model, "after the kill", stream=False, bootstrap_room=11)["token_ids"]
