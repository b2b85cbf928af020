"""The chaos test's security phases (replay, a refused-frame flood, slowloris, a cancel while P is frozen).

Each function runs one phase on the chaos stack and fills its figures; tests/e2e/test_chaos.py calls
them in its order and checks what every phase checks (KV free, health). The tools are in
chaos_attacks.py.

- `replay`: a peer holding the token seals a Ping for P's rank port exactly as a rank does; P answers
  the first copy (a Pong, whose frame the peer opens and checks), refuses the same bytes sent again
  (``replay``) and D refuses them too (``misdirected``: sealed for P), as it refuses P's own Pong; a
  signed bootstrap call is answered once and refused (401, counted) when replayed.
- `flood_during_liveness`: random frames (no valid MAC) at a steady rate on P's and D's rank ports.
  While they come, requests through the Router complete, no peer is declared lost, and a peer with
  the token pinging P and D every 0.25 s gets every Pong within a third of peer_timeout_s (the
  heartbeats keep live peers alive); then P is frozen (SIGSTOP), still flooded, requests come, and D must declare it
  lost within peer_timeout_s plus slack: its listener's timers keep running under the flood.
- `slowloris`: connections that each send one byte of a request to the Router are all closed
  within its header deadline (``--header-timeout``, 3 s here) plus slack, while requests are served.
- `cancel_while_prefill_frozen`: the write-after-free rule end to end. The tiny model's KV push takes
  milliseconds over Mooncake TCP and nothing in a real stack can slow it on demand (a slow backend
  is tests/unit/test_write_after_free.py's subject, which records per block when each byte landed),
  so P is frozen (SIGSTOP) for less than peer_timeout_s while requests are in flight: to D, a P
  rank that does not answer is exactly a P whose push is stuck in a slow batch. The clients leave
  while P is frozen; D cancels the loads and must keep their blocks (CANCELLING) until P, resumed,
  answered (P stops a push between batches, or answers a cancel for a room it holds no write of),
  never sooner: each release is logged after the SIGCONT with "prefill answered", or, had P not
  come back, after ``stop_wait_s`` (by the bounds P advertises; liveness finding P silent meanwhile
  does not end the wait). P's lines for those rooms (the cancel, a push stopped
  between batches when the freeze caught one) are counted.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from launch.processes import signal_group
from pd_connector import messages as proto
from tests.support import chaos_tools as ct
from tests.support.chaos_attacks import Flood, FramePeer, LogWatch, metric_total, slowloris
from tests.support.chaos_stack import FREEZE_S, HEADER_TIMEOUT_S, PEER_TIMEOUT_S, STOP_WAIT_S, Chaos

REFUSED_METRIC = "vllm:pd_kv_auth_refused"
REPLAY_LINE = r"refusing ZMQ frame.*(?:repeats or precedes|replay)"
MISDIRECTED_LINE = r"refusing ZMQ frame.*not to this rank"
PEER_LOST_LINE = r"peer (tcp://\S+) did not answer for ([0-9.]+) s"
#: Frames a second on each flooded rank port, and their size (above a signed envelope: the MAC is computed).
FLOOD_RATE = 5000
FLOOD_FRAME_BYTES = 400
#: A peer holding the token pings P and D this often during the flood; each must answer within PING_BOUND_S
#: (a third of peer_timeout_s: a rank that answers slower than that under a flood risks being found lost).
PING_EVERY_S = 0.25
PING_BOUND_S = PEER_TIMEOUT_S / 3
#: A frozen P is declared lost within peer_timeout_s plus this (the loads under way when it froze,
#: ticks every 50 ms, the log copied to its file).
LIVENESS_SLACK_S = 2.0
SLOWLORIS_CONNECTIONS = 150
#: Every slow connection closed within the header deadline plus this (event loop under load).
SLOWLORIS_SLACK_S = 3.0
#: How long P stays frozen while clients leave: under peer_timeout_s, so D waits for P's answer.
CANCEL_FREEZE_S = 1.8
D_CANCEL_LINE = r"room=(\d+) req=\S+: request aborted while its KV loads; cancelling it"
D_RELEASE_LINE = r"room=(\d+) req=\S+: KV load failed: request aborted; (.*)"
P_CANCEL_LINE = r"room=(\d+) req=\S+: decode cancelled the transfer"
P_STOPPED_LINE = r"room=(\d+) req=\S+: KV push to \S+ failed \(CANCELLED\).*the reader gave up"


def replay(chaos: Chaos, fig: ct.PhaseFigures) -> None:
    stack = chaos.stack
    p_endpoints, d_endpoint = chaos.rank_endpoints()
    target = p_endpoints[0]
    route = chaos.route()
    before = {s: metric_total(u, REFUSED_METRIC) for s, u in (("P", stack.prefill_url), ("D", stack.decode_url))}
    watch = {"P": LogWatch(stack.prefill.log_path), "D": LogWatch(stack.decode.log_path)}
    peer = FramePeer(chaos.token)
    try:
        frame = peer.seal(target, proto.Ping(about=target, reply_to=peer.endpoint))
        peer.send_raw(target, frame)
        first = peer.receive(5.0)
        assert first is not None and isinstance(first[1], proto.Pong), f"P did not answer a legitimate Ping: {first}"
        pong_frame, pong = first
        assert pong.about == target, pong
        peer.send_raw(target, frame)  # the same bytes again
        second = peer.receive(2.0)
        peer.send_raw(d_endpoint, frame)  # sealed for P, replayed to D
        peer.send_raw(d_endpoint, pong_frame)  # a frame P signed, captured by its receiver, replayed to D
        third = peer.receive(2.0)
        fig.extra["replayed_frame_answered"] = second is not None
        assert second is None, f"P answered a replayed frame ({second[1]}): no replay protection on the ZMQ wire"
        assert third is None, f"D answered a frame sealed for P: {third[1]}"
        ct.wait_until("P logs the replayed frame as refused", lambda: bool(watch["P"].matching(REPLAY_LINE)), 5)
        ct.wait_until(
            "D logs the frames sealed for P as refused", lambda: bool(watch["D"].matching(MISDIRECTED_LINE)), 5
        )
        fig.extra["refusal_lines"] = {
            "P_replay": len(watch["P"].matching(REPLAY_LINE)), "D_misdirected": len(watch["D"].matching(MISDIRECTED_LINE))
        }  # fmt: skip
    finally:
        peer.close()
        for w in watch.values():
            w.stop()
    fig.extra["bootstrap_call"] = _replayed_call(chaos)
    assert chaos.route() == route, "the replays changed the route"
    ct.assert_all_answered(fig.name, chaos.load(8, fig))
    assert fig.ok == fig.requests, f"requests failed after the replays: {fig.sample_errors}"
    # The refusals reach vLLM's metrics with the engine steps of the load above.
    grown: dict[str, float] = {}

    def counted() -> bool:
        for side, url in (("P", stack.prefill_url), ("D", stack.decode_url)):
            grown[side] = metric_total(url, REFUSED_METRIC) - before[side]
        return grown["P"] >= 1 and grown["D"] >= 2

    ct.wait_until(f"{REFUSED_METRIC} counts the replays (P >= 1, D >= 2)", counted, 10)
    fig.extra["auth_refused_counted"] = grown


def _replayed_call(chaos: Chaos) -> dict[str, object]:
    """GET /bootstrap/route with one signed header, twice: answered once, then refused and counted."""
    headers = chaos.signed("GET", "/bootstrap/route")
    with httpx.Client(timeout=10, trust_env=False) as client:
        refused_before = client.get(f"{chaos.bootstrap_url}/bootstrap/health").json().get("refused", 0)
        first = client.get(f"{chaos.bootstrap_url}/bootstrap/route", headers=headers)
        second = client.get(f"{chaos.bootstrap_url}/bootstrap/route", headers=headers)
        refused = client.get(f"{chaos.bootstrap_url}/bootstrap/health").json().get("refused", 0) - refused_before
    out = {"first": first.status_code, "replayed": second.status_code, "counted_refused": refused}
    assert first.status_code == 200, f"a freshly signed call was refused: {first.text[:200]}"
    assert second.status_code == 401, f"a replayed bootstrap call was answered HTTP {second.status_code}: {out}"
    assert ct.error_message(second.json()), second.text[:200]
    assert refused == 1, f"the bootstrap server counted {refused} refused calls, not 1"
    return out


def flood_during_liveness(chaos: Chaos, fig: ct.PhaseFigures) -> None:
    stack = chaos.stack
    p_endpoints, d_endpoint = chaos.rank_endpoints()
    before = {s: metric_total(u, REFUSED_METRIC) for s, u in (("P", stack.prefill_url), ("D", stack.decode_url))}
    watch = {"P": LogWatch(stack.prefill.log_path), "D": LogWatch(stack.decode.log_path)}
    try:
        with Flood([*p_endpoints, d_endpoint], chaos.rng, FLOOD_RATE, FLOOD_FRAME_BYTES) as flood:
            live = ct.PhaseFigures("live")
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pinger") as pool:
                stop = threading.Event()
                pinging = pool.submit(_ping_while, chaos.token, [p_endpoints[0], d_endpoint], stop)
                try:
                    results = chaos.load(12, live)
                finally:
                    stop.set()
                rtts = pinging.result(timeout=30)
            fig.add(results)
            ct.assert_all_answered(fig.name, results)
            assert live.ok == live.requests, f"requests failed under the flood: {live.sample_errors}"
            spurious = {s: [m.group(0) for _, m in w.matching(PEER_LOST_LINE)] for s, w in watch.items()}
            fig.extra["live_requests_ok"] = f"{live.ok}/{live.requests}"
            fig.extra["pings_under_flood"] = _rtt_figures(rtts)
            unanswered = {ep: sum(r is None for r in rs) for ep, rs in rtts.items()}
            assert not any(unanswered.values()), f"Pings unanswered under the flood: {unanswered}"
            slowest = max(r for rs in rtts.values() for r in rs if r is not None)
            assert slowest <= PING_BOUND_S, f"a rank answered a Ping after {slowest:.2f} s under the flood"
            assert not any(spurious.values()), f"a live peer was declared lost under the flood: {spurious}"
            detected = _frozen_prefill_detected(chaos, fig, watch["D"])
        fig.extra["flood"] = {
            "frames_sent": flood.sent, "seconds": round(flood.seconds, 1),
            "per_s": round(flood.sent / max(flood.seconds, 1e-3)), "dropped_queue_full": sum(c.dropped for c in flood.counts),
        }  # fmt: skip
    finally:
        for w in watch.values():
            w.stop()
    fig.extra["prefill_lost_after_s"], fig.extra["silent_s_logged"] = detected
    fig.extra["router_healthy_after_s"] = round(chaos.wait_router_healthy(), 1)
    after = ct.PhaseFigures("after")
    ct.assert_all_answered(fig.name, chaos.load(8, after))
    assert after.ok == after.requests, f"requests failed after the flood: {after.sample_errors}"
    refused = {
        s: metric_total(u, REFUSED_METRIC) - before[s] for s, u in (("P", stack.prefill_url), ("D", stack.decode_url))
    }
    fig.extra["auth_refused_counted"] = refused
    assert refused["D"] > 0, f"D counted no refused frame of the flood: {refused}"


def _ping_while(token: str, endpoints: list[str], stop: threading.Event) -> dict[str, list[float | None]]:
    """A peer with the token pings each endpoint in turn (every PING_EVERY_S) until ``stop``: its round trips."""
    rtts: dict[str, list[float | None]] = {ep: [] for ep in endpoints}
    peer = FramePeer(token)
    try:
        while not stop.is_set():
            for ep in endpoints:
                rtts[ep].append(peer.ping(ep, PEER_TIMEOUT_S))
            stop.wait(PING_EVERY_S)
    finally:
        peer.close()
    return rtts


def _rtt_figures(rtts: dict[str, list[float | None]]) -> dict[str, dict[str, float | int]]:
    out = {}
    for ep, rs in rtts.items():
        got = sorted(r for r in rs if r is not None)
        median = got[len(got) // 2] if got else 0.0
        out[ep] = {"pings": len(rs), "answered": len(got), "median_ms": round(median * 1e3, 1)}
        out[ep]["max_ms"] = round(max(got, default=0.0) * 1e3, 1)
    return out


def _frozen_prefill_detected(chaos: Chaos, fig: ct.PhaseFigures, d_watch: LogWatch) -> tuple[float, float]:
    """P frozen (SIGSTOP) under load while the flood goes on: seconds until D logged it lost, and the
    silence D logged; both within peer_timeout_s plus slack."""
    stack = chaos.stack
    # D watches P only while a load waits on it. The tiny model prefills a few hundred tokens in
    # milliseconds, so a load started before the freeze may be over by then (CI saw D watch nothing and
    # declare nothing); so P is frozen first and the requests come after: D, asked at the same time as P,
    # sends its TransferRequests to the frozen ranks and waits, its route to P fresh (Chaos.fresh_route).
    chaos.fresh_route()
    todo = [ct.Plan(chaos.rng.randint(200, 300), chaos.rng.randint(0, 150), False, 4) for _ in range(8)]
    t_stop = time.monotonic()
    signal_group(stack.prefill.pid, signal.SIGSTOP)
    running = ct.start_load(stack.router_url, stack.model, todo, concurrency=8)
    try:
        limit = PEER_TIMEOUT_S + LIVENESS_SLACK_S
        ct.wait_until(
            "D declares the frozen, flooded P lost",
            lambda: bool(d_watch.matching(PEER_LOST_LINE, t_stop)),
            limit + 3,
            0.05,
        )
        seen, match = d_watch.matching(PEER_LOST_LINE, t_stop)[0]
        time.sleep(max(0.0, t_stop + FREEZE_S - time.monotonic()))
    finally:
        signal_group(stack.prefill.pid, signal.SIGCONT)
    results = running.result(timeout=ct.CLIENT_DEADLINE_S + 30)
    fig.add(results)
    ct.assert_all_answered(fig.name, results)
    after_s, silent_s = round(seen - t_stop, 2), float(match.group(2))
    assert after_s <= limit, f"D declared the frozen P lost {after_s} s after the freeze (bound {limit} s)"
    assert silent_s <= PEER_TIMEOUT_S + 1.0, f"D's timers ran late under the flood: P silent {silent_s} s when found"
    return after_s, silent_s


def slowloris_phase(chaos: Chaos, fig: ct.PhaseFigures) -> None:
    stack = chaos.stack
    bound = HEADER_TIMEOUT_S + SLOWLORIS_SLACK_S
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="slowloris") as pool:
        slow = pool.submit(slowloris, stack.host, stack.router_port, SLOWLORIS_CONNECTIONS, bound + 10)
        time.sleep(0.5)  # the connections are open: requests meanwhile
        ct.assert_all_answered(fig.name, chaos.load(12, fig))
        result = slow.result(timeout=bound + 30)
    fig.extra = {
        "connections": result.connections, "refused_at_connect": result.refused, "still_open": result.still_open,
        "closed_after_s": {"min": min(result.closed, default=0.0), "max": max(result.closed, default=0.0)},
        "answers": result.statuses, "bound_s": bound,
    }  # fmt: skip
    assert fig.ok == fig.requests, f"requests failed beside the slow connections: {fig.sample_errors}"
    assert result.refused == 0, f"the Router refused {result.refused} connections"
    assert result.still_open == 0, f"{result.still_open} slow connections still open after {bound + 10:g} s"
    late = [s for s in result.closed if s > bound]
    assert not late, f"{len(late)} slow connections closed after the bound of {bound:g} s: up to {max(late)} s"
    chaos.assert_healthy("R")


def cancel_while_prefill_frozen(chaos: Chaos, fig: ct.PhaseFigures) -> None:
    stack = chaos.stack
    watch = {"P": LogWatch(stack.prefill.log_path), "D": LogWatch(stack.decode.log_path)}

    def leaving(n: int) -> list[ct.Plan]:
        return [
            ct.Plan(
                chaos.rng.randint(200, 300), chaos.rng.randint(0, 150), False, 64, ct.Disconnect.BEFORE_ANSWER, 0, 1.0
            )
            for _ in range(n)
        ]

    chaos.fresh_route()  # D's loads sent while P is frozen wait on it, not on its bootstrap server
    try:
        before = ct.start_load(stack.router_url, stack.model, leaving(6))
        time.sleep(0.3)
        t_stop = time.monotonic()
        signal_group(stack.prefill.pid, signal.SIGSTOP)
        try:
            during = ct.start_load(stack.router_url, stack.model, leaving(6))  # D asks the frozen P
            time.sleep(CANCEL_FREEZE_S)
        finally:
            signal_group(stack.prefill.pid, signal.SIGCONT)
            t_cont = time.monotonic()
        for running in (before, during):
            results = running.result(timeout=ct.CLIENT_DEADLINE_S + 30)
            fig.add(results)
            ct.assert_all_answered(fig.name, results)
        cancelled = {int(m.group(1)): t for t, m in watch["D"].matching(D_CANCEL_LINE, t_stop) if t < t_cont}
        fig.extra["freeze_s"], fig.extra["loads_cancelled_while_frozen"] = round(t_cont - t_stop, 2), len(cancelled)
        assert cancelled, "no load was cancelled while P was frozen: the phase proved nothing"
        ct.wait_until(
            "D releases every cancelled load",
            lambda: set(cancelled) <= {int(m.group(1)) for _, m in watch["D"].matching(D_RELEASE_LINE, t_stop)},
            STOP_WAIT_S + 5,
        )
        _check_releases(fig, cancelled, watch, t_stop, t_cont)
    finally:
        for w in watch.values():
            w.stop()
    fig.extra["stop_wait_s"] = STOP_WAIT_S
    fig.extra["router_healthy_after_s"] = round(chaos.wait_router_healthy(), 1)


def _check_releases(
    fig: ct.PhaseFigures, cancelled: dict[int, float], watch: dict[str, LogWatch], t_stop: float, t_cont: float
) -> None:
    """Each load cancelled while P was frozen kept its blocks until P answered after its SIGCONT (or
    until stop_wait_s, had P not come back); P logged the cancel of each room."""
    releases = {int(m.group(1)): (t, m.group(2)) for t, m in watch["D"].matching(D_RELEASE_LINE, t_stop)}
    held = {room: round(releases[room][0] - t, 2) for room, t in cancelled.items()}
    how = {room: releases[room][1] for room in cancelled}
    answered = [room for room, why in how.items() if why.startswith("prefill answered")]
    other = {room: why for room, why in how.items() if room not in answered}
    early = [room for room in answered if releases[room][0] < t_cont]
    p_cancels = {int(m.group(1)) for _, m in watch["P"].matching(P_CANCEL_LINE, t_stop)}
    p_stopped = {int(m.group(1)) for _, m in watch["P"].matching(P_STOPPED_LINE, t_stop)}
    first_release = min(releases[room][0] for room in cancelled)
    fig.extra.update(
        released_after_prefill_answered=len(answered), released_otherwise=other,
        first_release_after_sigcont_s=round(first_release - t_cont, 2),
        held_s={"min": min(held.values()), "max": max(held.values())},
        p_cancels_logged=len(p_cancels & set(cancelled)), p_pushes_stopped_between_batches=len(p_stopped),
    )  # fmt: skip
    assert not early, f"D released rooms {early} as answered by P while P was frozen"
    stated = f"prefill did not answer within {STOP_WAIT_S:g} s"
    bad = {room: why for room, why in other.items() if why.strip() != stated}
    assert not bad, f"cancelled loads released for another reason than P's answer or a stated bound: {bad}"
    assert answered, f"no cancelled load was released on P's answer (P resumed after {t_cont - t_stop:.1f} s): {other}"
    missing = set(answered) - p_cancels
    assert not missing, f"D says P answered rooms {sorted(missing)}, but P logged no cancel of them"
