"""Chaos test: one token-protected 1P1D stack through eleven kinds of trouble.

Phases, in order, each checked on its own (tests below): load at concurrency 16 with random client
disconnects; malformed input to the Router, D and the bootstrap server; garbage on P's and D's ZMQ
rank ports and on the bootstrap port; replayed frames and bootstrap calls; a spoofed registration
without the token; slowloris on the Router; P frozen (SIGSTOP) under load and resumed; a flood of
refused frames while liveness must keep live peers alive and find a frozen P; clients leaving while
P is frozen mid-request (D keeps the blocks until P answered); P killed (SIGKILL) under load, frozen
first so that D's loads wait on it when it dies, and restarted on the same ports; D killed
mid-stream and restarted (tests/support/: chaos_hardening.py holds the security phases,
chaos_attacks.py their tools, chaos_stack.py the stack and its settings). After each: every client call ended (none hung)
with a complete answer or a clear error, P and D hold no KV within the configured timeouts, the
instances not killed answer /health. At the end a few prompts through the Router equal a colocated
vLLM token for token.

P and D run with Mooncake's shortest write timeouts (tests.support.serving.FAST_TRANSFER_ENV): D
keeps a lost P's loads for ``pd_connector.transfer.loads.lost_wait_s`` of what P advertises, and
the bounds on a killed P's failover derive from it (chaos_stack.LOST_WAIT_S).

Bounded and repeatable: every request plan comes from one seeded RNG (``SEED``), every client call
has a deadline (chaos_tools.CLIENT_DEADLINE_S). The figures (per phase: requests, ok, clear errors,
hangs, seconds to KV free, time) go to ``chaos-figures.json`` in the stack's log directory, to the
test log (printed, and each phase's as a ``record_property``).
"""

from __future__ import annotations

import random
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from launch.processes import (
    ManagedProcess,
    ProcessGroup,
    free_port,
    signal_group,
    start_pd_stack,
    vllm_env,
    vllm_serve_cmd,
    wait_http_ok,
)
from tests.support import chaos_hardening as hardening
from tests.support import chaos_inputs as inputs
from tests.support import chaos_tools as ct
from tests.support.chaos_stack import (
    CHECK_LENGTHS,
    FREEZE_S,
    KV_FREE_SLACK_S,
    KV_WAIT_TIMEOUT_S,
    LOST_WAIT_S,
    PEER_TIMEOUT_S,
    ROOM_TIMEOUT_S,
    ROUTER_ARGS,
    SEED,
    STOP_WAIT_S,
    VLLM_ARGS,
    ZMQ_REFUSED,
    Chaos,
    done,
    has_config_key,
    phase,
)
from tests.support.serving import FAST_TRANSFER_ENV, START_TIMEOUT_S, complete, count_in_log, prompt_of_length

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def chaos(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    log_dir = tmp_path_factory.mktemp("chaos")
    token = "chaos-" + random.Random(SEED).randbytes(16).hex()
    token_file = log_dir / "pd-token"
    token_file.write_text(token)
    common: dict[str, object] = {"auth_token_file": str(token_file)}
    if has_config_key("peer_timeout_s"):
        common["peer_timeout_s"] = PEER_TIMEOUT_S
    with ProcessGroup(log_dir) as group, pytest.MonkeyPatch.context() as env:
        for name, value in FAST_TRANSFER_ENV.items():  # P and D inherit it (start_pd_stack's vllm_env)
            env.setenv(name, value)
        stack = start_pd_stack(
            group,
            tiny_model,
            extra_p_config={**common, "room_timeout_s": ROOM_TIMEOUT_S},
            extra_d_config={**common, "kv_wait_timeout_s": KV_WAIT_TIMEOUT_S},
            timeout=START_TIMEOUT_S,
            p_args=VLLM_ARGS,
            d_args=VLLM_ARGS,
            router_args=ROUTER_ARGS,
        )
        env.undo()  # only the stack's instances (and Chaos.restart's) run with it
        state = Chaos(stack, group, token, random.Random(SEED), log_dir / "chaos-figures.json", tiny_model)
        yield state
        total = round(time.monotonic() - state.t_start, 1)
        print(f"chaos: {len(state.figures)} phases in {total} s after the stack start; figures in {state.figures_path}")


def test_1_load_with_client_disconnects(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("load_disconnects")
    results = chaos.load(64, fig, disconnect_share=0.25)
    ct.assert_all_answered(fig.name, results)
    assert fig.disconnects >= 8, f"only {fig.disconnects} of 64 requests disconnected"
    assert fig.clear_errors == 0, f"errors without any fault: {fig.sample_errors}"
    chaos.kv_free(fig)
    chaos.assert_healthy()
    done(chaos, fig, t0, record_property)


def test_2_malformed_input(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("malformed_input")
    stack = chaos.stack
    logs = stack.log_paths
    tracebacks = {name: count_in_log(path, "Traceback") for name, path in logs.items()}
    route = chaos.route()
    probes = [
        *inputs.router_probes(stack.router_url, stack.model),
        *inputs.decode_probes(stack.decode_url, stack.model, stack.bootstrap_port),
        *inputs.bootstrap_probes(chaos.bootstrap_url, chaos.signed),
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
    done(chaos, fig, t0, record_property)


@pytest.mark.parametrize("target", ["router", "decode", "bootstrap"])
def test_2b_deeply_nested_json_is_a_client_error(chaos: Chaos, target: str, record_property) -> None:
    fig, t0 = phase(f"deep_json_{target}")
    stack = chaos.stack
    probe = inputs.deep_json_probes(stack.router_url, stack.decode_url, chaos.bootstrap_url, chaos.signed)[target]
    answer = inputs.send(probe)
    fig.extra = {"status": answer.status}
    try:
        assert answer.problem is None, f"{probe.name}: {answer.problem}"
    finally:
        chaos.assert_healthy("PDR")
        done(chaos, fig, t0, record_property)


def test_3_garbage_on_the_wire(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("garbage_frames")
    stack = chaos.stack
    route = chaos.route()
    p_endpoints, d_endpoint = chaos.rank_endpoints()
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
    done(chaos, fig, t0, record_property)


def test_3b_replayed_frames_and_calls_are_refused(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("replay")
    try:
        hardening.replay(chaos, fig)
    finally:
        done(chaos, fig, t0, record_property)  # figures even when it waits for replay protection
    chaos.kv_free(fig)
    chaos.assert_healthy("PDR")


def test_4_spoofed_registration_is_refused(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("spoofed_registration")
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
    done(chaos, fig, t0, record_property)


def test_4b_slowloris_on_the_router(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("slowloris")
    hardening.slowloris_phase(chaos, fig)
    chaos.kv_free(fig)
    chaos.assert_healthy()
    done(chaos, fig, t0, record_property)


def test_5_prefill_frozen_under_load(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("prefill_sigstop")
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
    done(chaos, fig, t0, record_property)


def test_5b_refused_frame_flood_during_liveness(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("flood_liveness")
    hardening.flood_during_liveness(chaos, fig)
    chaos.kv_free(fig)
    chaos.assert_healthy("PDR")
    done(chaos, fig, t0, record_property)


def test_5c_cancel_while_the_push_is_stuck(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("cancel_frozen_push")
    hardening.cancel_while_prefill_frozen(chaos, fig)
    chaos.kv_free(fig)
    chaos.assert_healthy("PDR")
    after = ct.PhaseFigures("after")
    ct.assert_all_answered(fig.name, chaos.load(8, after))
    assert after.ok == after.requests, f"requests failed after the cancels: {after.sample_errors}"
    fig.extra["after_ok"] = f"{after.ok}/{after.requests}"
    done(chaos, fig, t0, record_property)


#: D releases a load the dead P never answered once its wait ran out (lost_wait_s after the loss,
#: stop_wait_s after a cancel: both by what P advertised).
HELD_RELEASE = rf"KV load failed: .*; prefill did not answer within (?:{LOST_WAIT_S:g}|{STOP_WAIT_S:g}) s"


def test_6_prefill_killed_and_restarted(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("prefill_sigkill")
    stack = chaos.stack
    # D declares the killed P lost after PEER_TIMEOUT_S and keeps its loads' blocks LOST_WAIT_S more (P
    # might only be cut off, its batch still landing): the clients' calls must outlast that.
    failover_s = PEER_TIMEOUT_S + LOST_WAIT_S
    assert ct.CLIENT_DEADLINE_S >= failover_s + KV_FREE_SLACK_S, f"client deadline under the {failover_s:g} s failover"
    released_before = count_in_log(stack.decode.log_path, HELD_RELEASE)
    chaos.fresh_route()  # the loads sent while P is frozen wait on P, not on its frozen bootstrap server
    running = ct.start_load(stack.router_url, stack.model, ct.plans(chaos.rng, 32, 0.0))
    time.sleep(1.5)
    # The tiny model answers that load within the sleep; so that the kill also catches loads D waits on,
    # P is frozen first and a few more requests come (the Router asks P and D at once; D asks the frozen
    # P, its route fresh), then the frozen P is killed.
    signal_group(stack.prefill.pid, signal.SIGSTOP)
    todo = [ct.Plan(p.prompt_len, p.salt, False, p.max_tokens) for p in ct.plans(chaos.rng, 8, 0.0)]
    waiting = ct.start_load(stack.router_url, stack.model, todo, concurrency=8)  # not streamed: P and D at once
    time.sleep(1.0)
    t_kill = time.monotonic()
    chaos.kill(stack.prefill)
    fig.extra["kill_s"] = round(time.monotonic() - t_kill, 1)  # SIGKILL until the group was reaped
    try:
        results = [
            *running.result(timeout=ct.CLIENT_DEADLINE_S + 30),
            *waiting.result(timeout=ct.CLIENT_DEADLINE_S + 30),
        ]
        fig.add(results)
        fig.extra["clients_done_after_kill_s"] = round(time.monotonic() - t_kill, 1)
        ct.assert_all_answered(fig.name, results)
        # A client answered at once (P's connection reset) leaves D's load waiting out the stop wait.
        chaos.kv_free(fig, "D", limit=max(KV_WAIT_TIMEOUT_S, failover_s) + KV_FREE_SLACK_S)
        fig.extra["d_kv_free_after_clients_s"] = fig.kv_free_s["D"]  # the phase's last kv_free overwrites it

        def held() -> int:
            return count_in_log(stack.decode.log_path, HELD_RELEASE) - released_before

        ct.wait_until(
            "D logs a load released after waiting on the killed P (else the phase proved nothing)",
            lambda: held() >= 1,
            5,
        )
        fig.extra["loads_released_after_the_wait"] = held()
        chaos.assert_healthy("D")
    finally:  # the later phases need P back, whatever this one found
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
    done(chaos, fig, t0, record_property)


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
    fig, t0 = phase("decode_sigkill")
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
    done(chaos, fig, t0, record_property)


def test_8_answers_equal_colocated_after_the_chaos(chaos: Chaos, record_property) -> None:
    fig, t0 = phase("correctness")
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
    done(chaos, fig, t0, record_property)
