"""P, D and the Router on three hosts of their own (network namespaces), as a real deployment runs them.

The hosts: network namespaces on one bridge (which lives in a namespace of its own), addresses from
198.18.0.0/24 (`tests.support.netns`): P 198.18.0.1, D .2, the Router .3, an attacker .66. Each instance's
`local_ip` is its own address; P's bootstrap server serves TLS (a certificate for P's address, D's and
P's ranks verify it) and P and D share the control-plane token. Each P/D host loads the firewall
docs/security.md prescribes (nftables): Mooncake's ports (15000-17000) on D only from P, on P from
nobody (P writes to D, never the reverse), the vLLM API only from the Router. Checked:

- every listener of P and D binds its own address, but Mooncake's two per rank (the known exposure);
- completions through the Router, greedy, streaming and not, are token-identical to colocated vLLM's;
  KV moved (P's sent and D's received byte counters); the connections measured between the hosts;
- the attacker (no token) tries every port P and D listen on: ZMQ rank ports get a frame (refused and
  logged), the bootstrap server a registration (401), the vLLM API and Mooncake's ports a connection
  (unreachable: firewalled). Afterwards the stack still serves.

Skipped where namespaces cannot be made (not root, no `ip`/`nft`). The namespaces (and with them every
veth pair and the bridge) are deleted when the module ends, pass or fail.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from launch.processes import ManagedProcess, ProcessGroup, router_cmd, vllm_env, vllm_serve_cmd
from pd_connector import messages as proto
from pd_connector.bootstrap.signing import signed_headers
from tests.support.netns import (
    Listener,
    Network,
    certificate_for,
    listeners,
    mooncake_listeners,
    netns_problem,
    run_in,
    tcp_probe,
    undocumented_wildcards,
)
from tests.support.serving import PROMPT_LENGTHS, START_TIMEOUT_S, assert_matches_reference, count_in_log

pytestmark = pytest.mark.e2e

HOSTS = {"p": 1, "d": 2, "r": 3, "x": 66}
P_HTTP, BOOTSTRAP, D_HTTP, ROUTER = 18000, 18001, 18002, 18003  # fresh namespaces: every port is free
MOONCAKE_RANGE = "15000-17000"  # Mooncake's default MC_MIN_RPC_PORT-MC_MAX_RPC_PORT
SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (1, 33, 129)]
_RANK_LINE = re.compile(r"KV transfer manager \((?:prefill|decode)\) listening on tcp://(\S+):(\d+),")


def _counter(text: str, name: str) -> float:
    found = re.findall(rf"^{name}(?:_total)?(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", text, re.M)
    return sum(float(v) for v in found)


@dataclass
class TwoHosts:
    net: Network
    prefill: ManagedProcess
    decode: ManagedProcess
    router: ManagedProcess
    model: str
    token: bytes
    cert: Path

    def ip(self, host: str) -> str:
        return self.net.addr(host)

    def url(self, host: str, port: int) -> str:
        return f"http://{self.ip(host)}:{port}"

    def get(self, url: str) -> httpx.Response:
        """A GET from the Router's host (the only one the API ports accept)."""
        return run_in(self.net.ns("r"), httpx.get, url, timeout=10, trust_env=False)


def _wait_healthy(net: Network, checks: list[tuple[str, ManagedProcess]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(checks)
    while pending:
        url, proc = pending[0]
        assert proc.poll() is None, proc.describe_failure("exited while starting")
        try:
            if run_in(net.ns("r"), httpx.get, url, timeout=5, trust_env=False).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, proc.describe_failure(f"{url} not healthy after {timeout:.0f} s")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def two_hosts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: dict) -> Iterator[TwoHosts]:
    """The three hosts, firewalled, serving; ``reference`` is made before, not beside, them."""
    problem = netns_problem()
    if problem:
        pytest.skip(f"cannot make separate hosts (network namespaces) here: {problem}")
    folder = tmp_path_factory.mktemp("two-hosts")
    token = secrets.token_hex(24)
    token_file = folder / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    net = Network(HOSTS)
    try:
        with net, ProcessGroup(folder / "logs") as group:
            p, d, r = net.addr("p"), net.addr("d"), net.addr("r")
            cert, key = certificate_for(folder, p)
            net.firewall("p", [(MOONCAKE_RANGE, []), (str(P_HTTP), [r])])  # nobody writes to P
            net.firewall("d", [(MOONCAKE_RANGE, [p]), (str(D_HTTP), [r])])
            common = {"auth_token_file": str(token_file), "bootstrap_host": p, "bootstrap_ssl_ca_certs": str(cert)}
            p_extra = {**common, "bootstrap_ssl_certfile": str(cert), "bootstrap_ssl_keyfile": str(key)}
            p_cmd = vllm_serve_cmd(
                tiny_model, P_HTTP, kv_role="kv_producer", bootstrap_port=BOOTSTRAP,
                extra_config={**p_extra, "room_timeout_s": 20.0}, host=p, extra_args=["--enforce-eager"],
            )  # fmt: skip
            d_cmd = vllm_serve_cmd(
                tiny_model, D_HTTP, kv_role="kv_consumer", bootstrap_port=BOOTSTRAP,
                extra_config={**common, "kv_wait_timeout_s": 15.0}, host=d, extra_args=["--enforce-eager"],
            )  # fmt: skip
            prefill = group.start("prefill", [*net.exec_prefix("p"), *p_cmd], env=vllm_env("0"))
            decode = group.start("decode", [*net.exec_prefix("d"), *d_cmd], env=vllm_env("1"))
            r_cmd = router_cmd(ROUTER, [(p, P_HTTP, BOOTSTRAP)], [(d, D_HTTP)], host=r)
            router = group.start(
                "router", [*net.exec_prefix("r"), *r_cmd], env=dict(os.environ, PYTHONUNBUFFERED="1"), cpus=""
            )
            t0 = time.monotonic()
            _wait_healthy(net, [(f"http://{p}:{P_HTTP}/health", prefill), (f"http://{d}:{D_HTTP}/health", decode)],
                          START_TIMEOUT_S)  # fmt: skip
            _wait_healthy(net, [(f"http://{r}:{ROUTER}/health", router)], 60.0)
            print(f"\ntwo hosts: P, D and the Router healthy after {time.monotonic() - t0:.1f} s")
            yield TwoHosts(net, prefill, decode, router, str(tiny_model), token.encode(), cert)
    finally:
        net.remove()
        assert not net.leftovers(), f"namespaces left behind: {net.leftovers()}"


def _own_ports(stack: TwoHosts, proc: ManagedProcess, host: str) -> list[Listener]:
    """``proc``'s listeners; none is a wildcard but Mooncake's, every other one is on ``host``'s address
    or loopback (vLLM's EngineCore keeps a dozen of its own there)."""
    wild, socks = undocumented_wildcards(proc.pid, proc.log_path)
    assert not wild, f"{proc.name}: undocumented wildcard listeners {[s.where for s in wild]}"
    mooncake = mooncake_listeners(proc.log_path)
    assert len(mooncake) == 2 and mooncake <= {(s.host, s.port) for s in socks}, (proc.name, mooncake, socks)
    on_lo = [s for s in socks if ipaddress.ip_address(s.host).is_loopback]  # vLLM's own, this host only
    stray = [s.where for s in socks if (s.host, s.port) not in mooncake and s.host != stack.ip(host) and s not in on_lo]
    assert not stray, f"{proc.name}: listeners off {stack.ip(host)} and loopback: {stray}"
    return socks


def test_each_host_listens_on_its_own_address(two_hosts: TwoHosts) -> None:
    table = []
    for proc, host in ((two_hosts.prefill, "p"), (two_hosts.decode, "d")):
        table += [
            f"{proc.name} ({two_hosts.ip(host)}): {s.where} pid {s.pid}" for s in _own_ports(two_hosts, proc, host)
        ]
    router = listeners(two_hosts.router.pid)
    assert [s.where for s in router] == [f"{two_hosts.ip('r')}:{ROUTER}"], router
    assert count_in_log(two_hosts.prefill.log_path, rf"bootstrap server listening on https://{two_hosts.ip('p')}") == 1
    print("\n".join(["listening sockets:", *table]))


def _flows(stack: TwoHosts, host: str) -> list[str]:
    out = subprocess.run([*stack.net.exec_prefix(host), "ss", "-tnH", "state", "established"], capture_output=True,
                         text=True).stdout  # fmt: skip
    return sorted({" ".join(line.split()[2:4]) for line in out.splitlines() if "127.0.0.1" not in line})


def test_completions_match_colocated_and_kv_moves_between_hosts(two_hosts: TwoHosts, reference: dict) -> None:
    router_url = two_hosts.url("r", ROUTER)
    made = run_in(
        two_hosts.net.ns("r"), assert_matches_reference, router_url, two_hosts.model, reference, SAMPLE, "two hosts"
    )
    assert made == 2 * len(SAMPLE)
    sent = _counter(two_hosts.get(f"{two_hosts.url('p', P_HTTP)}/metrics").text, "vllm:pd_kv_sent_bytes")
    got = _counter(two_hosts.get(f"{two_hosts.url('d', D_HTTP)}/metrics").text, "vllm:pd_kv_received_bytes")
    assert sent > 0 and got > 0, (sent, got)
    flows = {host: _flows(two_hosts, host) for host in ("p", "d")}
    d_mooncake = {port for _, port in mooncake_listeners(two_hosts.decode.log_path)}
    p_ip, d_ip = two_hosts.ip("p"), two_hosts.ip("d")
    to_d_mooncake = [f for f in flows["p"] if any(f.endswith(f"{d_ip}:{port}") for port in d_mooncake)]
    assert to_d_mooncake, f"no connection from P to D's Mooncake ports {d_mooncake}: {flows}"
    print(f"\nKV sent {sent:.0f} bytes, received {got:.0f}; connections (local peer) at P {p_ip}: {flows['p']}")
    print(f"at D {d_ip}: {flows['d']}")


def _frame() -> bytes:
    hello = proto.PeerHello(
        peer_id="attacker", transfer_descriptor=b"attacker", endpoint="tcp://198.18.0.66:1", tp_rank=0, tp_size=1,
        block_size=32, kv_dtype="int8", num_layers=2, regions=[],
    )  # fmt: skip
    return proto.encode(hello)


def _attack(stack: TwoHosts, targets: dict[str, list[tuple[str, int, str]]]) -> dict[str, str]:
    """From the attacker's host: each (ip, port, kind) tried as its kind asks; what happened to each."""
    results = {}
    ctx = zmq.Context()
    try:
        for ip, port, kind in targets["zmq"]:
            reach = tcp_probe(ip, port, 2.0)
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(f"tcp://{ip}:{port}")
            sock.send(_frame())
            sock.close()
            results[f"{kind} {ip}:{port}"] = f"tcp {reach}, frame sent"
    finally:
        ctx.term()
    for ip, port, kind in targets["bootstrap"]:
        body = proto.RegisterRank(
            attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1, attn_dp_rank=0, rank_ip="198.18.0.66", rank_port=1,
            block_size=32, kv_cache_dtype="int8",
        )  # fmt: skip
        content = msgspec.json.encode(body)
        path = "/bootstrap/register_rank"
        statuses = []
        for headers in ({}, signed_headers(b"not-the-token-0123456789abcdef", "PUT", path, content, audience="0" * 32)):
            resp = httpx.put(f"https://{ip}:{port}{path}", content=content, headers=headers, verify=ssl.create_default_context(cafile=str(stack.cert)),
                             timeout=10, trust_env=False)  # fmt: skip
            statuses.append(resp.status_code)
        plain = tcp_probe(ip, port, 2.0)
        results[f"{kind} {ip}:{port}"] = f"tcp {plain}, registrations: HTTP {statuses}"
    for ip, port, kind in targets["connect"]:
        results[f"{kind} {ip}:{port}"] = tcp_probe(ip, port, 1.0)
    return results


def test_an_attacker_without_the_token_reaches_nothing(two_hosts: TwoHosts, reference: dict) -> None:
    targets: dict[str, list[tuple[str, int, str]]] = {"zmq": [], "bootstrap": [], "connect": []}
    for proc, host, http in ((two_hosts.prefill, "p", P_HTTP), (two_hosts.decode, "d", D_HTTP)):
        ip = two_hosts.ip(host)
        rank = {int(port) for _, port in _RANK_LINE.findall(proc.log_path.read_text(errors="replace"))}
        mooncake = {port for _, port in mooncake_listeners(proc.log_path)}
        for sock in _own_ports(two_hosts, proc, host):
            if sock.port in rank:
                targets["zmq"].append((ip, sock.port, f"{proc.name} ZMQ rank port"))
            elif sock.port == BOOTSTRAP and host == "p":
                targets["bootstrap"].append((ip, sock.port, "prefill bootstrap server"))
            elif sock.port in mooncake:
                targets["connect"].append((ip, sock.port, f"{proc.name} Mooncake"))
            elif sock.port == http:
                targets["connect"].append((ip, sock.port, f"{proc.name} vLLM API"))
            elif ipaddress.ip_address(sock.host).is_loopback:  # tried at the host's address: nothing there
                targets["connect"].append((ip, sock.port, f"{proc.name} loopback-only"))
            else:
                pytest.fail(f"{proc.name} listens on {sock.where}, which this test does not know")
    kinds = sorted({kind for found in targets.values() for _, _, kind in found})
    assert len(targets["zmq"]) == 2 and len(targets["bootstrap"]) == 1, targets
    assert sum(kind.endswith(("Mooncake", "vLLM API")) for _, _, kind in targets["connect"]) == 6, kinds
    refused_before = [count_in_log(p.log_path, "refusing ZMQ frame") for p in (two_hosts.prefill, two_hosts.decode)]
    results = run_in(two_hosts.net.ns("x"), _attack, two_hosts, targets)
    print("\nthe attacker (198.18.0.66, no token):\n" + "\n".join(f"  {k}: {v}" for k, v in results.items()))
    for kind, outcome in results.items():
        if "ZMQ" in kind:
            assert outcome.startswith("tcp open"), (kind, outcome)  # reached, so the refusal below is the token's
        elif "bootstrap" in kind:
            assert outcome == "tcp open, registrations: HTTP [401, 401]", (kind, outcome)
        else:
            assert outcome in ("refused", "unreachable"), (kind, outcome)
    deadline = time.monotonic() + 15
    for proc, before in zip((two_hosts.prefill, two_hosts.decode), refused_before, strict=True):
        while count_in_log(proc.log_path, "refusing ZMQ frame") <= before:
            assert time.monotonic() < deadline, f"{proc.name} did not log the attacker's frame as refused"
            time.sleep(0.3)
    # ...and the deployment still serves, as colocated vLLM does.
    router_url = two_hosts.url("r", ROUTER)
    run_in(two_hosts.net.ns("r"), assert_matches_reference, router_url, two_hosts.model, reference, SAMPLE[-1:],
           "two hosts, after the attacks")  # fmt: skip
