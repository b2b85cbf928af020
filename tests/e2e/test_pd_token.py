"""A P/D/Router stack with the control-plane token: whoever lacks it is refused and counted,
and the stack keeps serving, token-identical to colocated vLLM.

One stack (its own: P and D read the token from a file) for the whole module. The Router carries no
connector token: it never calls the bootstrap server, it only tells D where it is.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from launch.processes import PDStack, ProcessGroup, free_port, start_pd_stack
from pd_connector import messages as proto
from pd_connector.bootstrap.signing import signed_headers
from pd_connector.keys import frame_key
from pd_connector.transfer.frames import FrameSealer
from tests.support.serving import PROMPT_LENGTHS, START_TIMEOUT_S, assert_matches_reference, count_in_log, wait_kv_free

pytestmark = pytest.mark.e2e

SAMPLE = [i for i, n in enumerate(PROMPT_LENGTHS) if n in (1, 33, 129, 300)]
_COUNTER = re.compile(r"^vllm:pd_kv_auth_refused_total\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


class TokenStack:
    def __init__(self, stack: PDStack, token: bytes) -> None:
        self.stack, self.token = stack, token
        self.bootstrap = f"http://{stack.host}:{stack.bootstrap_port}"

    def bootstrap_call(
        self, method: str, path: str, token: bytes | None, body: object = None, headers: dict | None = None
    ) -> httpx.Response:
        """A call signed with ``token``'s bootstrap key, or with ``headers`` as given."""
        content = b"" if body is None else body if isinstance(body, bytes) else msgspec.json.encode(body)
        if headers is None:
            headers = {} if token is None else signed_headers(token, method, path, content, audience=self.server_id())
        return httpx.request(
            method, f"{self.bootstrap}{path}", content=content, headers=headers, timeout=10, trust_env=False
        )

    def server_id(self) -> str:
        """The id P's bootstrap server tells: signed calls name it (pd_connector.bootstrap.signing)."""
        return self.bootstrap_call("GET", "/bootstrap/health", None).json()["server_id"]

    def health(self) -> dict:
        return self.bootstrap_call("GET", "/bootstrap/health", None).json()

    def route(self) -> proto.Route:
        resp = self.bootstrap_call("GET", "/bootstrap/route", self.token)
        assert resp.status_code == 200, resp.text
        return msgspec.json.decode(resp.content, type=proto.Route)


@pytest.fixture(scope="module")
def token_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: dict) -> Iterator[TokenStack]:
    """P and D with one token file; ``reference`` (colocated answers) is made before, not beside, them."""
    folder = tmp_path_factory.mktemp("pd-token")
    token = secrets.token_hex(24)
    token_file = folder / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    config = {"auth_token_file": str(token_file), "room_timeout_s": 20.0}
    with ProcessGroup(folder) as group:
        stack = start_pd_stack(
            group,
            tiny_model,
            extra_p_config=config,
            extra_d_config={"auth_token_file": str(token_file), "kv_wait_timeout_s": 15.0},
            timeout=START_TIMEOUT_S,
        )
        yield TokenStack(stack, token.encode())


def test_start_up_says_the_control_plane_is_authenticated(token_stack: TokenStack) -> None:
    for proc in (token_stack.stack.prefill, token_stack.stack.decode):
        assert count_in_log(proc.log_path, r"PDConnector control plane: shared token set") >= 1, proc.name


def test_bootstrap_calls_without_the_token_are_refused_and_counted(token_stack: TokenStack) -> None:
    before = token_stack.health()["refused"]
    real = token_stack.route().rank(0, 0, 0)
    assert real is not None
    attacker = free_port()
    forged = proto.RegisterRank(1, 0, 1, 0, "127.0.0.1", attacker, 32, "float32", num_layers=2)
    wrong = b"not-the-token-0123456789abcdef"
    replayed = signed_headers(token_stack.token, "GET", "/bootstrap/route", audience=token_stack.server_id())
    assert token_stack.bootstrap_call("GET", "/bootstrap/route", None, headers=replayed).status_code == 200
    bearer = {"Authorization": f"Bearer {token_stack.token.decode()}"}  # the token itself no longer opens anything
    calls = [
        ("PUT", "/bootstrap/register_rank", None, {"body": forged}),
        ("PUT", "/bootstrap/register_rank", wrong, {"body": forged}),
        ("PUT", "/bootstrap/register_rank", None, {"body": forged, "headers": bearer}),
        ("GET", "/bootstrap/route", None, {}),
        ("GET", "/bootstrap/route", wrong, {}),
        ("GET", "/bootstrap/route", None, {"headers": replayed}),  # a captured call, replayed
        ("POST", "/bootstrap/register_dp_rank", None, {"body": {"bootstrap_room": 7, "dp_rank": 0}}),
        ("POST", "/bootstrap/query_dp_ranks", None, {"body": {"bootstrap_rooms": [7]}}),
    ]
    for method, path, token, kw in calls:
        resp = token_stack.bootstrap_call(method, path, token, **kw)  # type: ignore[arg-type]
        assert resp.status_code == 401, (method, path, resp.text)
    assert token_stack.health()["refused"] == before + len(calls)
    assert token_stack.route().rank(0, 0, 0) == real  # the forged registration changed nothing
    log = token_stack.stack.prefill.log_path
    assert count_in_log(log, r"bootstrap: refusing PUT /bootstrap/register_rank from 127\.0\.0\.1:\d+") >= 2


def test_a_forged_hello_is_refused_and_counted(token_stack: TokenStack) -> None:
    """D's own peer id, a wrong KV dtype: the attack that broke D's next requests before the token."""
    decode_log = token_stack.stack.decode.log_path.read_text(errors="replace")
    peer = re.search(r"KV transfer manager \(decode\) listening on (\S+), peer (\S+)", decode_log)
    assert peer is not None
    endpoint, peer_id = peer.groups()
    rank = token_stack.route().rank(0, 0, 0)
    assert rank is not None
    hello = proto.PeerHello(
        peer_id=peer_id, transfer_descriptor=b"attacker", endpoint=endpoint, tp_rank=0, tp_size=1,
        block_size=32, kv_dtype="int8", num_layers=2, regions=[],
    )  # fmt: skip
    payload = proto.encode(hello)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"tcp://{rank.rank_ip}:{rank.rank_port}")
        sock.send(payload)  # unsigned
        wrong = FrameSealer(frame_key(b"not-the-token-0123456789abcdef"), endpoint)  # signed with a wrong token
        signed = wrong.seal(f"tcp://{rank.rank_ip}:{rank.rank_port}", payload)
        sock.send(signed)
        sock.close()
    finally:
        ctx.term()
    log = token_stack.stack.prefill.log_path
    deadline = time.monotonic() + 10
    # Refused frames are never decoded: the line names the size and why, not who it claims to be.
    sizes = f"(?:{len(payload)}|{len(signed)})"
    while count_in_log(log, rf"refusing ZMQ frame on .* \({sizes} bytes, not decoded\)") < 2:
        assert time.monotonic() < deadline, "P did not log the refused frames"
        time.sleep(0.2)


def test_untrusted_or_unreachable_bootstrap_addresses_fail_at_once(token_stack: TokenStack) -> None:
    stack = token_stack.stack
    dead = free_port()
    cases = [("192.0.2.1", 18800, 403, "192.0.2.1:18800"), ("2001:db8::1", 18800, 403, "[2001:db8::1]:18800"),
             ("127.0.0.1", dead, 502, f"127.0.0.1:{dead}")]  # fmt: skip
    for host, port, status, named in cases:
        params = {"do_remote_prefill": True, "bootstrap_room": secrets.randbits(63), "bootstrap_host": host,
                  "bootstrap_port": port}  # fmt: skip
        body = {"model": stack.model, "prompt": "hello", "max_tokens": 4, "kv_transfer_params": params}
        t0 = time.monotonic()
        resp = httpx.post(f"{stack.decode_url}/v1/completions", json=body, timeout=30, trust_env=False)
        took = time.monotonic() - t0
        assert resp.status_code == status, resp.text
        assert named in resp.json()["error"]["message"] and took < 5, (named, took)


def test_with_the_token_the_stack_serves_as_colocated(token_stack: TokenStack, reference: dict) -> None:
    """Runs last: after every refusal above, P and D still serve, token-identical to colocated vLLM."""
    stack = token_stack.stack
    assert_matches_reference(stack.router_url, stack.model, reference, SAMPLE, "with the token, after the attacks")
    assert wait_kv_free(stack.prefill_url) == 0.0
    assert wait_kv_free(stack.decode_url) == 0.0
    # The refused frames reached vLLM's metrics with the next engine steps.
    text = httpx.get(f"{stack.prefill_url}/metrics", timeout=10, trust_env=False).text
    assert sum(float(v) for v in _COUNTER.findall(text)) >= 2
