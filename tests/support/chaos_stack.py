"""The chaos test's stack and settings (tests/e2e/test_chaos.py): one token-protected 1P1D stack.

`Chaos` holds the running stack, the seeded RNG, the token and the figures of the phases done so
far; the constants are the timeouts the stack runs with and the bounds the phases check.
"""

from __future__ import annotations

import json
import logging
import random
import re
import signal
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx

from launch.processes import ManagedProcess, PDStack, ProcessGroup, signal_group, vllm_env
from pd_connector.api_server.validation import ROUTE_TTL_S as CHECK_ROUTE_TTL_S
from pd_connector.bootstrap.client import ROUTE_TTL_S
from pd_connector.bootstrap.signing import signed_headers
from pd_connector.config import DECODE, DisaggConfig
from pd_connector.transfer.loads import PeerTiming, lost_wait_s, stop_wait_s
from tests.support import chaos_tools as ct
from tests.support.serving import FAST_BATCH_STALL_S, FAST_TRANSFER_ENV, complete, prompt_of_length

logger = logging.getLogger(__name__)

SEED = 20261201
ROOM_TIMEOUT_S = 10.0
KV_WAIT_TIMEOUT_S = 10.0
PEER_TIMEOUT_S = 3.0
#: P and D run with Mooncake's shortest write timeouts (FAST_TRANSFER_ENV): what bounds P's writes, as P
#: advertises it to D (pd_connector.transfer.loads.PeerTiming).
P_TIMING = PeerTiming(FAST_BATCH_STALL_S, PEER_TIMEOUT_S)
#: D keeps a stopped load's blocks (P told to stop, no answer) at most this long (loads.stop_wait_s) ...
STOP_WAIT_S = stop_wait_s(DisaggConfig(mode=DECODE), P_TIMING)
#: ... and a lost P's loads this long after it declared P lost (loads.lost_wait_s): a killed P's clients
#: get their answer (and D's KV is free) up to PEER_TIMEOUT_S + LOST_WAIT_S after the kill.
LOST_WAIT_S = lost_wait_s(DisaggConfig(mode=DECODE), P_TIMING)
#: KV must be free within the configured timeout plus this (polling, the engine's step cadence).
KV_FREE_SLACK_S = 5.0
KV_FREE_LIMIT_S = max(ROOM_TIMEOUT_S, KV_WAIT_TIMEOUT_S) + KV_FREE_SLACK_S
FREEZE_S = 5.0
#: The Router's --header-timeout in the chaos stack (its default is 10 s): the slowloris phase's bound.
HEADER_TIMEOUT_S = 3.0
ROUTER_ARGS = ("--header-timeout", str(HEADER_TIMEOUT_S))
#: No torch.compile warm-up: the stack starts three times (and colocated once) within the test's budget;
#: the colocated reference runs with the same flags.
VLLM_ARGS = ("--enforce-eager",)
#: Prompt lengths (tokens) of the final comparison with colocated vLLM.
CHECK_LENGTHS = (1, 33, 129, 257)
D_ENDPOINT = re.compile(r"KV transfer manager \(decode\) listening on (tcp://\S+?),")
ZMQ_REFUSED = r"refusing ZMQ frame|dropping malformed ZMQ frame"


def has_config_key(key: str) -> bool:
    from pd_connector.config import DisaggConfig

    return key in {f.name for f in fields(DisaggConfig)}


def call_headers(token: str, method: str, target: str, body: bytes = b"", *, bootstrap_url: str) -> dict[str, str]:
    """The ``Authorization`` of one bootstrap call made with ``token``: signed (the id the server at
    ``bootstrap_url`` tells now, method, path, body hash, time, a fresh nonce: ``pd_connector.bootstrap.signing``);
    good for one call."""
    health = httpx.get(f"{bootstrap_url}/bootstrap/health", timeout=10, trust_env=False).json()
    return signed_headers(token.encode(), method, target, body, audience=health["server_id"])


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

    def signed(self, method: str, target: str, body: bytes = b"") -> dict[str, str]:
        return call_headers(self.token, method, target, body, bootstrap_url=self.bootstrap_url)

    @property
    def bootstrap_url(self) -> str:
        return f"http://{self.stack.host}:{self.stack.bootstrap_port}"

    def route(self) -> dict:
        resp = httpx.get(
            f"{self.bootstrap_url}/bootstrap/route",
            headers=self.signed("GET", "/bootstrap/route"),
            timeout=10,
            trust_env=False,
        )
        assert resp.status_code == 200, f"route: HTTP {resp.status_code} {resp.text[:200]}"
        return resp.json()

    def rank_endpoints(self) -> tuple[list[str], str]:
        """P's rank endpoints (from the route) and D's (from its log)."""
        p_endpoints = [f"tcp://{r['rank_ip']}:{r['rank_port']}" for r in self.route()["ranks"].values()]
        found = D_ENDPOINT.findall(self.stack.decode.log_path.read_text(errors="replace"))
        assert p_endpoints and found, f"rank endpoints not found: P {p_endpoints}, D {found}"
        return p_endpoints, found[-1]

    def record(self, fig: ct.PhaseFigures, record_property) -> None:
        """Keep ``fig``, rewrite the figures file, print and record it."""
        self.figures.append(fig)
        summary = {
            "seed": SEED,
            "timeouts_s": {
                "room": ROOM_TIMEOUT_S, "kv_wait": KV_WAIT_TIMEOUT_S, "peer": self.peer_timeout,
                "stop_wait": STOP_WAIT_S, "lost_wait": LOST_WAIT_S, "router_header": HEADER_TIMEOUT_S,
            },
            "elapsed_s": round(time.monotonic() - self.t_start, 1),
            "phases": [f.as_dict() for f in self.figures],
        }  # fmt: skip
        self.figures_path.write_text(json.dumps(summary, indent=2))
        line = json.dumps(fig.as_dict())
        print(f"chaos phase {fig.name}: {line}")
        logger.info("chaos phase %s: %s", fig.name, line)
        record_property(f"chaos_{fig.name}", line)

    @property
    def peer_timeout(self) -> float | None:
        return PEER_TIMEOUT_S if has_config_key("peer_timeout_s") else None

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

    def fresh_route(self) -> None:
        """Have D hold a route to P fetched just now, good for ROUTE_TTL_S. D's connector
        (``pd_connector.bootstrap.client``) and its API server's request check
        (``pd_connector.api_server.validation``, the same TTL) each keep a route that long and read an
        expired one from P's bootstrap server, which runs in P's process: a freeze stops it too, and D
        answers such a request (502) or fails its load at once, holding nothing. A phase whose loads must
        wait on a frozen P calls this first: the routes the earlier phases left expire, and one answered
        request fetches them anew (a request does not refresh a route that has not expired)."""
        time.sleep(max(ROUTE_TTL_S, CHECK_ROUTE_TTL_S))
        warm = complete(
            self.stack.router_url, self.stack.model, prompt_of_length(40, salt=5), stream=False, max_tokens=2
        )
        assert warm["token_ids"], warm

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
        """The same command line again (same HTTP and bootstrap ports), in this group, with FAST_TRANSFER_ENV."""
        return self.group.start(name, proc.cmd, env={**vllm_env(cpus), **FAST_TRANSFER_ENV})


def phase(name: str) -> tuple[ct.PhaseFigures, float]:
    return ct.PhaseFigures(name), time.monotonic()


def done(chaos: Chaos, fig: ct.PhaseFigures, t0: float, record_property) -> None:
    fig.seconds = round(time.monotonic() - t0, 1)
    chaos.record(fig, record_property)
