"""Chaos test (issue 9 point 7): one token-protected 1P1D stack through seven kinds of trouble.

Phases, in order, each checked on its own (tests below): load at concurrency 16 with random client
disconnects; malformed input to the Router, D and the bootstrap server; garbage on P's and D's ZMQ
rank ports and on the bootstrap port; a spoofed registration without the token; P frozen (SIGSTOP)
under load and resumed; P killed (SIGKILL) under load and restarted on the same ports; D killed
mid-stream and restarted. After each: every client call ended (none hung) with a complete answer or
a clear error, P and D hold no KV within the configured timeouts, the instances not killed answer
/health. At the end a few prompts through the Router equal a colocated vLLM token for token.

Bounded and repeatable: every request plan comes from one seeded RNG (``SEED``), every client call
has a deadline (chaos_tools.CLIENT_DEADLINE_S). The figures (per phase: requests, ok, clear errors,
hangs, seconds to KV free, time) go to ``chaos-figures.json`` in the stack's log directory, to the
test log (printed, and each phase's as a ``record_property``).
"""

from __future__ import annotations

import json
import logging
import random
import re
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
import pytest

from launch.processes import (
    ManagedProcess,
    PDStack,
    ProcessGroup,
    free_port,
    signal_group,
    start_pd_stack,
    vllm_env,
    vllm_serve_cmd,
    wait_http_ok,
)
from tests.e2e import chaos_inputs as inputs
from tests.e2e import chaos_tools as ct
from tests.e2e.helpers import START_TIMEOUT_S, complete, count_in_log, prompt_of_length

pytestmark = pytest.mark.e2e
logger = logging.getLogger(__name__)

SEED = 20261201
ROOM_TIMEOUT_S = 10.0
KV_WAIT_TIMEOUT_S = 10.0
PEER_TIMEOUT_S = 3.0
#: KV must be free within the configured timeout plus this (polling, the engine's step cadence).
KV_FREE_SLACK_S = 5.0
KV_FREE_LIMIT_S = max(ROOM_TIMEOUT_S, KV_WAIT_TIMEOUT_S) + KV_FREE_SLACK_S
FREEZE_S = 5.0
#: No torch.compile warm-up: the stack starts three times (and colocated once) within the test's budget;
#: the colocated reference runs with the same flags.
VLLM_ARGS = ("--enforce-eager",)
#: Prompt lengths (tokens) of the final comparison with colocated vLLM.
CHECK_LENGTHS = (1, 33, 129, 257)
D_ENDPOINT = re.compile(r"KV transfer manager \(decode\) listening on (tcp://\S+?),")
ZMQ_REFUSED = r"refusing ZMQ frame|dropping malformed ZMQ frame"


def _has_config_key(key: str) -> bool:
    from pd_connector.config import DisaggConfig

    return key in {f.name for f in fields(DisaggConfig)}


@dataclass
class Chaos:
    """The stack under test and what the phases found."""

    stack: PDStack
    group: ProcessGroup
    token: str
    rng: random.Random
    figures_path: Path
    tiny_model: Path
    figures: list[ct.PhaseFigures] = field(default_factory=list)
    #: Colocated vLLM's token ids per (prompt length, stream), filled while D restarts.
    reference: dict[tuple[int, bool], list[int]] = field(default_factory=dict)
    t_start: float = field(default_factory=time.monotonic)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def bootstrap_url(self) -> str:
        return f"http://{self.stack.host}:{self.stack.bootstrap_port}"

    def route(self) -> dict:
        resp = httpx.get(f"{self.bootstrap_url}/bootstrap/route", headers=self.auth, timeout=10, trust_env=False)
        assert resp.status_code == 200, f"route: HTTP {resp.status_code} {resp.text[:200]}"
        return resp.json()

    def record(self, fig: ct.PhaseFigures, record_property) -> None:
        """Keep ``fig``, rewrite the figures file, print and record it."""
        self.figures.append(fig)
        summary = {
            "seed": SEED,
            "timeouts_s": {"room": ROOM_TIMEOUT_S, "kv_wait": KV_WAIT_TIMEOUT_S, "peer": self.peer_timeout},
            "elapsed_s": round(time.monotonic() - self.t_start, 1),
            "phases": [f.as_dict() for f in self.figures],
        }
        self.figures_path.write_text(json.dumps(summary, indent=2))
        line = json.dumps(fig.as_dict())
        print(f"chaos phase {fig.name}: {line}")
        logger.info("chaos phase %s: %s", fig.name, line)
        record_property(f"chaos_{fig.name}", line)

    @property
    def peer_timeout(self) -> float | None:
        return PEER_TIMEOUT_S if _has_config_key("peer_timeout_s") else None

    def kv_free(self, fig: ct.PhaseFigures, sides: str = "PD", limit: float = KV_FREE_LIMIT_S) -> None:
        urls = {"P": self.stack.prefill_url, "D": self.stack.decode_url}
        for side in sides:
            fig.kv_free_s[side] = ct.seconds_to_kv_free(urls[side], limit)

    def assert_healthy(self, sides: str = "PD") -> None:
        urls = {"P": self.stack.prefill_url, "D": self.stack.decode_url, "R": self.stack.router_url}
        for side in sides:
            assert ct.healthy(urls[side]), f"{side} ({urls[side]}) is not healthy"

    def wait_router_healthy(self, timeout: float = 60.0) -> float:
        """The Router's /health probes P and D itself: 200 once both answer."""
        return ct.wait_until("the Router sees P and D healthy", lambda: ct.healthy(self.stack.router_url), timeout)

    def load(self, n: int, fig: ct.PhaseFigures, disconnect_share: float = 0.0) -> list[ct.Result]:
        todo = ct.plans(self.rng, n, disconnect_share)
        results = ct.run_load(self.stack.router_url, self.stack.model, todo)
        fig.add(results)
        return results

    def kill(self, proc: ManagedProcess) -> None:
        """SIGKILL ``proc``'s whole process group (API server, EngineCore, workers) and reap it."""
        signal_group(proc.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        self.group.stop(proc, grace_s=5)  # takes it off the group's list; kills any straggler

    def restart(self, proc: ManagedProcess, name: str, cpus: str) -> ManagedProcess:
        """The same command line again (same HTTP and bootstrap ports), in this group."""
        return self.group.start(name, proc.cmd, env=vllm_env(cpus))


@pytest.fixture(scope="module")
def chaos(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    log_dir = tmp_path_factory.mktemp("chaos")
    token = "chaos-" + random.Random(SEED).randbytes(16).hex()
    token_file = log_dir / "pd-token"
    token_file.write_text(token)
    common: dict[str, object] = {"auth_token_file": str(token_file)}
    if _has_config_key("peer_timeout_s"):
        common["peer_timeout_s"] = PEER_TIMEOUT_S
    with ProcessGroup(log_dir) as group:
        stack = start_pd_stack(
            group,
            tiny_model,
            extra_p_config={**common, "room_timeout_s": ROOM_TIMEOUT_S},
            extra_d_config={**common, "kv_wait_timeout_s": KV_WAIT_TIMEOUT_S},
            timeout=START_TIMEOUT_S,
            p_args=VLLM_ARGS,
            d_args=VLLM_ARGS,
        )
        state = Chaos(stack, group, token, random.Random(SEED), log_dir / "chaos-figures.json", tiny_model)
        yield state
        total = round(time.monotonic() - state.t_start, 1)
        print(f"chaos: {len(state.figures)} phases in {total} s after the stack start; figures in {state.figures_path}")


def _phase(name: str) -> tuple[ct.PhaseFigures, float]:
    return ct.PhaseFigures(name), time.monotonic()


def _done(chaos: Chaos, fig: ct.PhaseFigures, t0: float, record_property) -> None:
    fig.seconds = round(time.monotonic() - t0, 1)
    chaos.record(fig, record_property)


def test_1_load_with_client_disconnects(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("load_disconnects")
    results = chaos.load(64, fig, disconnect_share=0.25)
    ct.assert_all_answered(fig.name, results)
    assert fig.disconnects >= 8, f"only {fig.disconnects} of 64 requests disconnected"
    assert fig.clear_errors == 0, f"errors without any fault: {fig.sample_errors}"
    chaos.kv_free(fig)
    chaos.assert_healthy()
    _done(chaos, fig, t0, record_property)


def test_2_malformed_input(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("malformed_input")
    stack = chaos.stack
    logs = stack.log_paths
    tracebacks = {name: count_in_log(path, "Traceback") for name, path in logs.items()}
    route = chaos.route()
    probes = [
        *inputs.router_probes(stack.router_url, stack.model),
        *inputs.decode_probes(stack.decode_url, stack.model, stack.bootstrap_port),
        *inputs.bootstrap_probes(chaos.bootstrap_url, chaos.token),
    ]
    answers = [inputs.send(p) for p in probes]
    bad = [f"{a.probe.name}: {a.problem}" for a in answers if a.problem]
    fig.extra = {"probes": len(answers), "answered_4xx": sum(400 <= a.status < 500 for a in answers), "bad": bad}
    assert not bad, f"{len(bad)} of {len(answers)} malformed requests were not refused cleanly: {bad}"
    # D asked to load from a bootstrap port nobody listens on: a clear error, not a hang.
    body = {
        "model": stack.model,
        "prompt": "nobody prefilled this",
        "max_tokens": 2,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "bootstrap_room": 77,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": free_port(),
        },
    }
    t1 = time.monotonic()
    resp = httpx.post(f"{stack.decode_url}/v1/completions", json=body, timeout=KV_WAIT_TIMEOUT_S + 30, trust_env=False)
    fig.extra["unreachable_bootstrap"] = {"status": resp.status_code, "seconds": round(time.monotonic() - t1, 2)}
    assert resp.status_code >= 400 and ct.error_message(resp.json()), resp.text[:300]
    assert chaos.route() == route, "a malformed call changed the route"
    grown = {n: count_in_log(p, "Traceback") - tracebacks[n] for n, p in logs.items()}
    fig.extra["new_tracebacks"] = grown
    assert not any(grown.values()), f"tracebacks logged while answering malformed input: {grown}"
    ct.assert_all_answered(fig.name, chaos.load(16, fig))
    assert fig.ok == fig.requests, f"requests failed after the malformed ones: {fig.sample_errors}"
    chaos.kv_free(fig)
    chaos.assert_healthy()
    _done(chaos, fig, t0, record_property)


@pytest.mark.parametrize("target", ["router", "decode", "bootstrap"])
def test_2b_deeply_nested_json_is_a_client_error(chaos: Chaos, target: str, record_property) -> None:
    fig, t0 = _phase(f"deep_json_{target}")
    stack = chaos.stack
    probe = inputs.deep_json_probes(stack.router_url, stack.decode_url, chaos.bootstrap_url, chaos.token)[target]
    answer = inputs.send(probe)
    fig.extra = {"status": answer.status}
    try:
        assert answer.problem is None, f"{probe.name}: {answer.problem}"
    finally:
        chaos.assert_healthy("PDR")
        _done(chaos, fig, t0, record_property)


def test_3_garbage_on_the_wire(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("garbage_frames")
    stack = chaos.stack
    route = chaos.route()
    p_endpoints = [f"tcp://{r['rank_ip']}:{r['rank_port']}" for r in route["ranks"].values()]
    found = D_ENDPOINT.findall(stack.decode.log_path.read_text(errors="replace"))
    assert p_endpoints and found, f"rank endpoints not found: P {p_endpoints}, D {found}"
    d_endpoint = found[-1]
    refused_before = {
        s: count_in_log(p, ZMQ_REFUSED) for s, p in (("P", stack.prefill.log_path), ("D", stack.decode.log_path))
    }
    frames = ct.garbage_payloads(chaos.rng, 40)
    sent = sum(ct.zmq_garbage(e, frames) for e in (*p_endpoints, d_endpoint))
    written = 0
    for endpoint in (*p_endpoints, d_endpoint):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        written += ct.tcp_garbage(host, int(port), chaos.rng)
    written += ct.tcp_garbage(stack.host, stack.bootstrap_port, chaos.rng)
    time.sleep(1.0)  # let the listeners drain their queues
    refused = {
        s: count_in_log(p, ZMQ_REFUSED) - refused_before[s]
        for s, p in (("P", stack.prefill.log_path), ("D", stack.decode.log_path))
    }
    fig.extra = {"zmq_frames_sent": sent, "tcp_bytes_written": written, "frames_refused_in_logs": refused}
    assert refused["P"] > 0 and refused["D"] > 0, f"no refused frame logged: {refused}"
    assert chaos.route() == route, "garbage changed the route"
    chaos.assert_healthy("PDR")
    ct.assert_all_answered(fig.name, chaos.load(16, fig))
    assert fig.ok == fig.requests, f"requests failed after the garbage: {fig.sample_errors}"
    chaos.kv_free(fig)
    _done(chaos, fig, t0, record_property)


def test_4_spoofed_registration_is_refused(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("spoofed_registration")
    route = chaos.route()
    url = chaos.bootstrap_url
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.5)
    rank = {
        "attn_tp_size": route["attn_tp_size"], "attn_tp_rank": 0, "attn_dp_size": route["dp_size"], "attn_dp_rank": 0,
        "rank_ip": "127.0.0.1", "rank_port": trap.getsockname()[1], "block_size": route["block_size"],
        "kv_cache_dtype": route["kv_cache_dtype"], "num_layers": route["num_layers"], "model": route["model"],
    }  # fmt: skip
    wrong = {"Authorization": "Bearer " + "z" * len(chaos.token)}
    calls = [
        ("PUT", "/bootstrap/register_rank", rank, {}),
        ("PUT", "/bootstrap/register_rank", rank, wrong),
        ("POST", "/bootstrap/register_dp_rank", {"bootstrap_room": 5, "dp_rank": 0}, {}),
        ("GET", "/bootstrap/route", None, {}),
    ]
    statuses = []
    with httpx.Client(timeout=10, trust_env=False) as client:
        refused_before = client.get(f"{url}/bootstrap/health").json().get("refused", 0)
        for method, path, body, headers in calls:
            statuses.append(client.request(method, url + path, json=body, headers=headers).status_code)
        refused = client.get(f"{url}/bootstrap/health").json().get("refused", 0) - refused_before
    fig.extra = {"spoofed_calls": len(calls), "statuses": statuses, "counted_refused": refused}
    try:
        assert all(s in (401, 403) for s in statuses), f"spoofed calls answered {statuses}"
        assert refused == len(calls), f"the bootstrap server counted {refused} refused calls, not {len(calls)}"
        assert chaos.route() == route, "the route changed after a registration without the token"
        ct.assert_all_answered(fig.name, chaos.load(16, fig))
        assert fig.ok == fig.requests, f"requests failed after the spoofing: {fig.sample_errors}"
        with pytest.raises(TimeoutError):
            trap.accept()[0].close()  # nobody was sent to the spoofer's listener
    finally:
        trap.close()
    chaos.kv_free(fig)
    chaos.assert_healthy()
    _done(chaos, fig, t0, record_property)


def test_5_prefill_frozen_under_load(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("prefill_sigstop")
    stack = chaos.stack
    running = ct.start_load(stack.router_url, stack.model, ct.plans(chaos.rng, 32, 0.0))
    time.sleep(1.0)
    signal_group(stack.prefill.pid, signal.SIGSTOP)
    try:
        time.sleep(FREEZE_S)
    finally:
        signal_group(stack.prefill.pid, signal.SIGCONT)
    results = running.result(timeout=ct.CLIENT_DEADLINE_S + 30)
    fig.add(results)
    ct.assert_all_answered(fig.name, results)
    chaos.kv_free(fig)
    chaos.assert_healthy()
    fig.extra["router_healthy_after_s"] = round(chaos.wait_router_healthy(), 1)
    after = ct.PhaseFigures("after")
    ct.assert_all_answered(fig.name, chaos.load(8, after))
    assert after.ok == after.requests, f"requests failed after P resumed: {after.sample_errors}"
    fig.extra["after_ok"] = f"{after.ok}/{after.requests}"
    _done(chaos, fig, t0, record_property)


def test_6_prefill_killed_and_restarted(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("prefill_sigkill")
    stack = chaos.stack
    running = ct.start_load(stack.router_url, stack.model, ct.plans(chaos.rng, 32, 0.0))
    time.sleep(1.5)
    chaos.kill(stack.prefill)
    t_kill = time.monotonic()
    results = running.result(timeout=ct.CLIENT_DEADLINE_S + 30)
    fig.add(results)
    fig.extra["clients_done_after_kill_s"] = round(time.monotonic() - t_kill, 1)
    ct.assert_all_answered(fig.name, results)
    chaos.kv_free(fig, "D", limit=KV_WAIT_TIMEOUT_S + KV_FREE_SLACK_S)
    chaos.assert_healthy("D")
    t_restart = time.monotonic()
    stack.prefill = chaos.restart(stack.prefill, "prefill-restarted", "0")
    wait_http_ok(f"{stack.prefill_url}/health", START_TIMEOUT_S, stack.prefill)
    chaos.wait_router_healthy()
    fig.extra["restart_s"] = round(time.monotonic() - t_restart, 1)
    after = ct.PhaseFigures("after")
    ct.assert_all_answered(fig.name, chaos.load(16, after))
    assert after.ok == after.requests, f"requests failed after P's restart: {after.sample_errors}"
    fig.extra["after_ok"] = f"{after.ok}/{after.requests}"
    chaos.kv_free(fig)
    _done(chaos, fig, t0, record_property)


def _start_colocated(chaos: Chaos) -> tuple[ManagedProcess, str]:
    port = free_port()
    proc = chaos.group.start(
        "colocated", vllm_serve_cmd(chaos.tiny_model, port, extra_args=VLLM_ARGS), env=vllm_env("0")
    )
    return proc, f"http://127.0.0.1:{port}"


def _fill_reference(chaos: Chaos, proc: ManagedProcess, url: str) -> None:
    try:
        wait_http_ok(f"{url}/health", START_TIMEOUT_S, proc)
        for n in CHECK_LENGTHS:
            for stream in (False, True):
                got = complete(url, chaos.stack.model, prompt_of_length(n, salt=n % 7), stream=stream)
                chaos.reference[(n, stream)] = got["token_ids"]
    finally:
        chaos.group.stop(proc)


def test_7_decode_killed_mid_stream_and_restarted(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("decode_sigkill")
    stack = chaos.stack
    todo = [ct.Plan(p.prompt_len, p.salt, True, 48) for p in ct.plans(chaos.rng, 24, 0.0)]
    running = ct.start_load(stack.router_url, stack.model, todo)
    time.sleep(2.0)
    chaos.kill(stack.decode)
    results = running.result(timeout=ct.CLIENT_DEADLINE_S + 30)
    fig.add(results)
    ct.assert_all_answered(fig.name, results)
    # D restarts (CPU 1) while colocated vLLM (CPU 0, P is idle) computes the final reference.
    t_restart = time.monotonic()
    stack.decode = chaos.restart(stack.decode, "decode-restarted", "1")
    colocated, colocated_url = _start_colocated(chaos)
    chaos.kv_free(fig, "P", limit=ROOM_TIMEOUT_S + KV_FREE_SLACK_S)
    chaos.assert_healthy("P")
    _fill_reference(chaos, colocated, colocated_url)
    wait_http_ok(f"{stack.decode_url}/health", START_TIMEOUT_S, stack.decode)
    chaos.wait_router_healthy()
    fig.extra["restart_s"] = round(time.monotonic() - t_restart, 1)
    after = ct.PhaseFigures("after")
    ct.assert_all_answered(fig.name, chaos.load(16, after))
    assert after.ok == after.requests, f"requests failed after D's restart: {after.sample_errors}"
    fig.extra["after_ok"] = f"{after.ok}/{after.requests}"
    chaos.kv_free(fig)
    _done(chaos, fig, t0, record_property)


def test_8_answers_equal_colocated_after_the_chaos(chaos: Chaos, record_property) -> None:
    fig, t0 = _phase("correctness")
    if not chaos.reference:
        _fill_reference(chaos, *_start_colocated(chaos))
    for n in CHECK_LENGTHS:
        for stream in (False, True):
            got = complete(chaos.stack.router_url, chaos.stack.model, prompt_of_length(n, salt=n % 7), stream=stream)
            assert got["token_ids"] == chaos.reference[(n, stream)], f"prompt of {n} tokens, stream={stream}"
            fig.requests += 1
            fig.ok += 1
    chaos.kv_free(fig)
    chaos.assert_healthy("PDR")
    _done(chaos, fig, t0, record_property)
