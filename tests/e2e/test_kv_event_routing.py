"""vllm-router 0.1.17's ``kv_aware`` prefill policy routes on the KV cache events PDConnector prefillers publish.

Two extra prefillers (kv_producer, each with vLLM's ``--kv-events-config`` publishing on its own port)
and the session stack's decoder (tests/e2e/conftest.py), behind ``vllm-router --vllm-pd-disaggregation
--prefill-policy kv_aware``; each process starts once for this module. The router finds each P's
publisher itself (block size from ``GET /server_info?config_format=json``, hence
``VLLM_SERVER_DEV_MODE=1``; endpoint from ``GET /kv_event_sources``), subscribes to it, has every P
render the prompt (``POST /v1/completions/render``, hence ``--enable-scale-out``) and sends the request
to the P with the fewest prompt tokens left to compute; ties go to the first ``--prefill``.
``--pd-kv-events`` is not used: it declares 16-token blocks, and the router drops event batches of
another block size, while vLLM's CPU attention takes multiples of 32 only.

1. control: prompts no P holds go to P1 (the tie), credited nothing;
2. the first 64 tokens (2 blocks) of a 129-token prompt are prefilled on P2 directly, not through the
   router: P2 announces them;
3. the 129-token prompt through the router goes to P2, credited those 64 tokens;
4. the same prompt streamed goes to P2, credited 128: the blocks P2 announced while it prefilled step 3's
   request for D (a PD request: prefilled, pushed, freed);
every answer is token-identical to the colocated ``reference``, each request's KV was pushed by the P it
went to, P and D served none of them without a transfer, and nothing is held afterwards.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launch.processes import (
    LOOPBACK,
    ManagedProcess,
    PDStack,
    ProcessGroup,
    free_ports,
    vllm_env,
    vllm_serve_cmd,
    wait_all_healthy,
    wait_http_ok,
)
from tests.support.front_ends import PUSHES, misrouted, vllm_router_binary, wait_routable
from tests.support.metrics import metric
from tests.support.serving import P_ROOM_TIMEOUT_S, START_TIMEOUT_S, complete, kv_usage, prompts, wait_kv_free

pytestmark = [pytest.mark.e2e]

#: Indices into tests.support.serving.prompts: 129 tokens (4 full 32-token blocks); 47 and 63 tokens (1 block
#: each), sharing no block with it nor with each other (each routed once: the first leaves its block on P1).
SHARED, UNSHARED = 17, {False: 10, True: 11}
#: Tokens of the SHARED prompt prefilled on P2 before the router sees it (2 blocks; the tokenizer is byte-level).
SEEDED = 64
BLOCK = 32  # launch.commands serves with --block-size 32
CREDITED = "vllm_router_pd_credited_prefix_tokens_total"
DECISIONS = "vllm_router_pd_prefill_decisions_total"


@dataclass
class Rig:
    model: str
    router: str
    router_metrics: str
    prefills: dict[str, str]  # name -> URL, in --prefill order
    decode: str
    log: Path


def _events_config(port: int) -> str:
    # vLLM binds its publisher only to a wildcard (or ipc://) endpoint; a host address makes it connect.
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})


def _wait_for_log(proc: ManagedProcess, needles: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = proc.log_path.read_text(errors="replace") if proc.log_path else ""
        missing = [n for n in needles if n not in text]
        if not missing:
            return
        assert proc.poll() is None, f"{proc.name} exited: {text[-2000:]}"
        assert time.monotonic() < deadline, f"{proc.name} never logged {missing}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def rig(pd_stack: PDStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    binary = vllm_router_binary()
    if binary is None:
        pytest.fail("vllm-router is not installed: pip install -e '.[routers]' (scripts/setup.sh does)")
    host, model = pd_stack.host, pd_stack.model
    p1, b1, e1, p2, b2, e2, port, metrics_port = free_ports(8)
    log_dir = tmp_path_factory.mktemp("kv-event-routing")
    with ProcessGroup(log_dir) as group:
        procs = {}
        for name, (http, bootstrap, events, cpus) in {"p1": (p1, b1, e1, "0"), "p2": (p2, b2, e2, "1")}.items():
            cmd = vllm_serve_cmd(
                model, http, kv_role="kv_producer", bootstrap_port=bootstrap, host=host,
                extra_config={"room_timeout_s": P_ROOM_TIMEOUT_S},
                extra_args=["--kv-events-config", _events_config(events), "--enable-scale-out"],
            )  # fmt: skip
            procs[name] = group.start(name, cmd, env=dict(vllm_env(cpus), VLLM_SERVER_DEV_MODE="1"))
        urls = {"p1": f"http://{host}:{p1}", "p2": f"http://{host}:{p2}"}
        wait_all_healthy([(f"{urls[n]}/health", procs[n]) for n in urls], START_TIMEOUT_S)
        for url in urls.values():  # vLLM collects its environment report on the first call: over the router's 3 s
            httpx.get(f"{url}/server_info?config_format=json", timeout=120, trust_env=False).raise_for_status()
        cmd = [
            binary, "--host", host, "--port", str(port), "--vllm-pd-disaggregation",
            "--prefill", urls["p1"], str(b1), "--prefill", urls["p2"], str(b2), "--decode", pd_stack.decode_url,
            "--policy", "round_robin", "--prefill-policy", "kv_aware",
            "--prometheus-host", host, "--prometheus-port", str(metrics_port), "--log-level", "info",
        ]  # fmt: skip
        router = group.start("vllm-router", cmd, env=dict(os.environ, RUST_LOG="info"), cpus="")
        url = f"http://{LOOPBACK}:{port}"
        wait_http_ok(f"{url}/health", 60, router)
        _wait_for_log(router, [f"kv_index {u}: spawned subscriber rank0" for u in urls.values()], 60)
        wait_routable(url, model)
        time.sleep(1.0)  # the subscribers' ZMQ connections are up before anything is published
        yield Rig(model, url, f"http://{host}:{metrics_port}", urls, pd_stack.decode_url, router.log_path)


def _route(rig: Rig, index: int, *, stream: bool, reference: dict) -> tuple[str, float]:
    """One greedy completion of ``prompts()[index]`` through the router: the P that pushed its KV, and the
    prompt tokens the router credited to that P."""
    pushes = {name: metric(url, PUSHES) for name, url in rig.prefills.items()}
    credited = metric(rig.router_metrics, CREDITED)
    got = complete(rig.router, rig.model, prompts()[index], stream=stream)
    want = reference["completions"][stream][index]
    assert got["token_ids"] == want["token_ids"], f"prompt {index}, stream={stream}: not the colocated answer"
    deadline = time.monotonic() + 20
    while True:
        moved = [name for name, url in rig.prefills.items() if metric(url, PUSHES) > pushes[name]]
        if moved or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(moved) == 1, f"prompt {index}, stream={stream}: KV pushed by {moved or 'no P'}"
    return moved[0], metric(rig.router_metrics, CREDITED) - credited


def test_prefill_follows_kv_events(reference: dict, rig: Rig) -> None:
    d = rig.decode
    p1, p2 = rig.prefills["p1"], rig.prefills["p2"]
    decisions = metric(rig.router_metrics, DECISIONS)
    verified = metric(rig.router_metrics, DECISIONS, fallback="none")
    bypassed = misrouted(p1) + misrouted(p2) + misrouted(d)

    # 1. control: a prompt no P holds goes to the first --prefill.
    for stream, index in UNSHARED.items():
        assert _route(rig, index, stream=stream, reference=reference) == ("p1", 0.0)

    # 2. P2 prefills the shared prompt's first two blocks, outside the router (a plain request).
    complete(p2, rig.model, prompts()[SHARED][:SEEDED], stream=False, max_tokens=1)
    time.sleep(1.5)  # P2's BlockStored batch reaches the router's index

    # 3. the whole prompt goes where those blocks are, credited with them.
    where, credited = _route(rig, SHARED, stream=False, reference=reference)
    assert (where, credited) == ("p2", SEEDED), "the router did not follow P2's events"
    time.sleep(1.5)  # the blocks P2 prefilled for that PD request reach the index

    # 4. again: now credited with every full block P2 announced for step 3's request (the last token is
    # always recomputed, so 4 blocks of the 129 tokens).
    where, credited = _route(rig, SHARED, stream=True, reference=reference)
    assert (where, credited) == ("p2", 4 * BLOCK), "the router did not see the blocks of P2's PD request"

    made = 4
    assert metric(rig.router_metrics, DECISIONS) - decisions == made
    assert metric(rig.router_metrics, DECISIONS, fallback="none") - verified == made, (
        f"routed without verified KV placement: {rig.log}"
    )
    # The seed of step 2 is P2's one request without a transfer (counted as such); the routed ones all moved KV.
    assert misrouted(p1) + misrouted(p2) + misrouted(d) == bypassed + 1, "requests served without a KV transfer"
    for name, url in (*rig.prefills.items(), ("decode", d)):
        assert wait_kv_free(url) == 0.0, f"{name} still holds KV: {kv_usage(url)}"
