"""Malformed requests of the chaos test (tests/e2e/test_chaos.py) for the Router, D and P's bootstrap server.

Each `Probe` is one raw HTTP call and the answers it may get: `Expect.CLIENT_ERROR` (4xx only) for
input that is wrong, `Expect.NOT_SERVER_ERROR` (200 or 4xx) for input that is odd but may be served
(a NUL inside a prompt, say). A 5xx, a traceback in the body, a connection cut or a hang is a bug.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


class Expect(enum.Enum):
    CLIENT_ERROR = "4xx"
    NOT_SERVER_ERROR = "200 or 4xx"


@dataclass(frozen=True)
class Probe:
    name: str
    method: str
    url: str
    content: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    expect: Expect = Expect.CLIENT_ERROR


@dataclass(frozen=True)
class ProbeAnswer:
    probe: Probe
    status: int
    body: str

    @property
    def problem(self) -> str | None:
        """Why this answer is wrong, None if it is fine."""
        if self.status == 0:
            return f"no answer: {self.body}"
        if "Traceback (most recent call last)" in self.body:
            return f"HTTP {self.status} with a traceback"
        if 400 <= self.status < 500:
            return None
        if self.status == 200 and self.probe.expect is Expect.NOT_SERVER_ERROR:
            return None
        return f"HTTP {self.status} (expected {self.probe.expect.value}): {self.body[:200]!r}"


JSON = {"Content-Type": "application/json"}


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def router_probes(url: str, model: str) -> list[Probe]:
    """Bad bodies, types, sizes and methods for the Router's OpenAI endpoints."""
    comp, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    ok = {"model": model, "prompt": "hello", "max_tokens": 2}
    return [
        Probe("bad JSON", "POST", comp, b'{"model": "x", "prompt": ', JSON),
        Probe("not UTF-8", "POST", comp, b'{"prompt": "\xff\xfe\xfa"}', JSON),
        Probe("JSON array body", "POST", comp, b"[1, 2, 3]", JSON),
        Probe("JSON string body", "POST", comp, b'"prompt"', JSON),
        Probe("empty body", "POST", comp, b"", JSON),
        Probe("prompt of wrong type", "POST", comp, _json({**ok, "prompt": {"a": 1}}), JSON),
        Probe("prompt missing", "POST", comp, _json({"model": model, "max_tokens": 2}), JSON),
        Probe("max_tokens a string", "POST", comp, _json({**ok, "max_tokens": "ten"}), JSON),
        Probe("max_tokens negative", "POST", comp, _json({**ok, "max_tokens": -1}), JSON),
        Probe("max_tokens huge", "POST", comp, _json({**ok, "max_tokens": 10**12}), JSON),
        Probe("max_tokens 2**80", "POST", comp, _json({**ok, "max_tokens": 2**80}), JSON),
        Probe("temperature a string", "POST", comp, _json({**ok, "temperature": "hot"}), JSON),
        Probe("stream a string", "POST", comp, _json({**ok, "stream": "yes"}), JSON),
        Probe("model unknown", "POST", comp, _json({**ok, "model": "no-such-model"}), JSON),
        Probe("model with NUL", "POST", comp, _json({**ok, "model": model + "\x00x"}), JSON),
        Probe("model a number", "POST", comp, _json({**ok, "model": 7}), JSON),
        Probe("prompt longer than the model", "POST", comp, _json({**ok, "prompt": "x" * 100_000}), JSON),
        Probe("prompt with NUL", "POST", comp, _json({**ok, "prompt": "a\x00b\x00"}), JSON, Expect.NOT_SERVER_ERROR),
        Probe("token ids out of vocabulary", "POST", comp, _json({**ok, "prompt": [10**9, -5]}), JSON),
        Probe("kv_transfer_params a string", "POST", comp, _json({**ok, "kv_transfer_params": "x"}), JSON),
        Probe("kv_transfer_params a list", "POST", comp, _json({**ok, "kv_transfer_params": [1]}), JSON),
        Probe("bootstrap_room a string", "POST", comp, _json({**ok, "bootstrap_room": "room"}), JSON),
        Probe(
            "bootstrap_room negative", "POST", comp, _json({**ok, "kv_transfer_params": {"bootstrap_room": -3}}), JSON
        ),
        Probe("bootstrap_room 2**64", "POST", comp, _json({**ok, "bootstrap_room": 2**64}), JSON),
        Probe("body over 32 MiB", "POST", comp, _json({**ok, "prompt": "y" * (33 << 20)}), JSON),
        Probe("text/plain body", "POST", comp, b"hello", {"Content-Type": "text/plain"}),
        Probe("GET on completions", "GET", comp),
        Probe("DELETE on completions", "DELETE", comp),
        Probe("chat: messages a string", "POST", chat, _json({"model": model, "messages": "hi"}), JSON),
        Probe("chat: messages empty", "POST", chat, _json({"model": model, "messages": []}), JSON),
        Probe("chat: message of wrong shape", "POST", chat, _json({"model": model, "messages": [{"role": 5}]}), JSON),
        Probe("unknown path", "POST", f"{url}/v1/nothing", _json(ok), JSON),
        Probe("admin add without a body", "POST", f"{url}/instances/add", b"{", JSON),
        Probe(
            "admin remove of wrong type", "POST", f"{url}/instances/remove", _json({"type": 5, "instance": None}), JSON
        ),
    ]


def decode_probes(url: str, model: str, bootstrap_port: int) -> list[Probe]:
    """Wrong kv_transfer_params sent straight to D (its validation middleware must answer 400)."""
    comp = f"{url}/v1/completions"
    good = {
        "do_remote_prefill": True,
        "bootstrap_room": 12345,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
    }

    def kv(name: str, params: object) -> Probe:
        body = {"model": model, "prompt": "hello there", "max_tokens": 2, "kv_transfer_params": params}
        return Probe(f"D: {name}", "POST", comp, _json(body), JSON)

    return [
        kv("kv_transfer_params a list", [good]),
        kv("kv_transfer_params a string", "do_remote_prefill"),
        kv("do_remote_prefill a string", {**good, "do_remote_prefill": "yes"}),
        kv("both remote flags", {**good, "do_remote_decode": True}),
        kv("room a string", {**good, "bootstrap_room": "x"}),
        kv("room negative", {**good, "bootstrap_room": -1}),
        kv("room 2**70", {**good, "bootstrap_room": 2**70}),
        kv("room a float", {**good, "bootstrap_room": 1.5}),
        kv("room missing", {k: v for k, v in good.items() if k != "bootstrap_room"}),
        kv("port a string", {**good, "bootstrap_port": "abc"}),
        kv("port 0", {**good, "bootstrap_port": 0}),
        kv("port 70000", {**good, "bootstrap_port": 70000}),
        kv("host missing", {k: v for k, v in good.items() if k != "bootstrap_host"}),
        kv("host with NUL", {**good, "bootstrap_host": "127.0.0.1\x00evil"}),
        kv("host 10 kB", {**good, "bootstrap_host": "a" * 10_000}),
        kv("host a URL", {**good, "bootstrap_host": "http://127.0.0.1/x"}),
        kv("host a number", {**good, "bootstrap_host": 127001}),
        kv("prefill_dp_rank negative", {**good, "prefill_dp_rank": -2}),
        kv("prefill_dp_rank huge", {**good, "prefill_dp_rank": 2**40}),
        Probe("D: bad JSON", "POST", comp, b'{"kv_transfer_params": {', JSON),
        Probe("D: GET on completions", "GET", comp),
    ]


#: Signs one bootstrap call: (method, path and query, body) -> its headers (chaos_stack.call_headers).
Signer = Callable[[str, str, bytes], dict[str, str]]


def _signed(name: str, method: str, url: str, content: bytes, sign: Signer) -> Probe:
    """A probe whose call carries a valid signature: only its body, method or path is wrong."""
    target = httpx.URL(url).raw_path.decode()
    return Probe(name, method, url, content, {**JSON, **sign(method, target, content)})


def bootstrap_probes(url: str, sign: Signer) -> list[Probe]:
    """Calls signed with the token but with bad bodies/methods (the unsigned ones are the spoofing phase's)."""
    reg = f"{url}/bootstrap/register_rank"
    dp, query = f"{url}/bootstrap/register_dp_rank", f"{url}/bootstrap/query_dp_ranks"
    # Outside the 1-rank topology, so none of them may replace the live rank's entry.
    rank = {
        "attn_tp_size": 1, "attn_tp_rank": 7, "attn_dp_size": 1, "attn_dp_rank": 0,
        "rank_ip": "127.0.0.1", "rank_port": 1, "block_size": 32, "kv_cache_dtype": "float32",
    }  # fmt: skip
    signed = [
        ("bootstrap: bad JSON", "PUT", reg, b"{{{"),
        ("bootstrap: empty body", "PUT", reg, b""),
        ("bootstrap: body a list", "PUT", reg, b"[]"),
        ("bootstrap: rank_port a string", "PUT", reg, _json({**rank, "rank_port": "x"})),
        ("bootstrap: tp rank outside the topology", "PUT", reg, _json(rank)),
        ("bootstrap: tp size mismatch", "PUT", reg, _json({**rank, "attn_tp_size": 4, "attn_tp_rank": 0})),
        ("bootstrap: rank_ip with NUL", "PUT", reg, _json({**rank, "rank_ip": "1.2.3.4\x00"})),
        ("bootstrap: rank_ip 1 MB", "PUT", reg, _json({**rank, "rank_ip": "9" * 1_000_000})),
        ("bootstrap: dp_rank outside", "POST", dp, _json({"bootstrap_room": 1, "dp_rank": 99})),
        ("bootstrap: dp room a string", "POST", dp, _json({"bootstrap_room": "r", "dp_rank": 0})),
        ("bootstrap: query rooms not a list", "POST", query, _json({"bootstrap_rooms": 5})),
        ("bootstrap: GET on register_rank", "GET", reg, b""),
        ("bootstrap: DELETE on route", "DELETE", f"{url}/bootstrap/route", b""),
        ("bootstrap: unknown path", "GET", f"{url}/bootstrap/../../etc/passwd", b""),
    ]
    return [
        *(_signed(name, method, target, body, sign) for name, method, target, body in signed),
        Probe("bootstrap: wrong token", "GET", f"{url}/bootstrap/route", b"", {"Authorization": "Bearer " + "x" * 40}),
        Probe(
            "bootstrap: signature of another call",
            "GET",
            f"{url}/bootstrap/route",
            b"",
            sign("GET", "/bootstrap/health", b""),
        ),
    ]


#: JSON nested deeper than Python's (and msgspec's) recursion limit: parsers raise RecursionError,
#: which is not a ValueError/DecodeError, so a handler that catches only those answers 500.
DEEP_ARRAY = b"[" * 100_000 + b"]" * 100_000
DEEP_UNDER_A_KEY = b'{"x": ' + DEEP_ARRAY + b"}"


def deep_json_probes(router_url: str, decode_url: str, bootstrap_url: str, sign: Signer) -> dict[str, Probe]:
    """One too-deeply-nested body for each server, by target name (the bootstrap call signed)."""
    return {
        "router": Probe("Router: deeply nested JSON", "POST", f"{router_url}/v1/completions", DEEP_ARRAY, JSON),
        "decode": Probe("D: deeply nested JSON", "POST", f"{decode_url}/v1/completions", DEEP_ARRAY, JSON),
        "bootstrap": _signed(
            "bootstrap: deeply nested JSON", "POST", f"{bootstrap_url}/bootstrap/query_dp_ranks", DEEP_UNDER_A_KEY, sign
        ),
    }


def send(probe: Probe, timeout: float = 30.0) -> ProbeAnswer:
    """Send one probe; a transport error or timeout comes back as status 0 (never raises)."""
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            resp = client.request(probe.method, probe.url, content=probe.content or None, headers=probe.headers)
            return ProbeAnswer(probe, resp.status_code, resp.text[:2000])
    except httpx.HTTPError as exc:
        return ProbeAnswer(probe, 0, f"{type(exc).__name__}: {exc}")
