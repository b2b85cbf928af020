"""HTTP client of the bootstrap server (P ranks register; D ranks read routes).

Requests ignore HTTP(S)_PROXY: the bootstrap server is on the cluster network, and a proxy set
for pip or model downloads must not sit between P and D.

With ``ca_certs`` (``bootstrap_ssl_ca_certs``) every call uses https and verifies the server's
certificate with that CA bundle; without it, plain http. D's ``RouteCache`` contacts only hosts
its ``TrustedHosts`` allow (``BootstrapUntrusted`` otherwise, before any connection).

With a token, every call is signed with the bootstrap key derived from it (``bootstrap.signing``),
for the server id the server at that address tells (``bootstrap.audience``: read once, kept; read again
and the call signed anew once when the server refuses it as meant for another id, after a restart):
the token never travels, a server that receives a call cannot forge another call or a ZMQ frame, and
no other server accepts it.
What a server answers in an error is logged here, never put into the error D reports to its client
(a request names the bootstrap address: its server is not trusted to write into D's answers).
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import msgspec

from pd_connector.bootstrap.audience import SERVER_IDS, AudienceError, Send
from pd_connector.bootstrap.rooms_api import RELEASE_PATH, STATUS_PATH
from pd_connector.bootstrap.signing import sign_call
from pd_connector.bootstrap.trust import TrustedHosts, split_addr
from pd_connector.keys import bootstrap_key
from pd_connector.messages import RegisterRank, Route

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

logger = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    """The bootstrap server could not be reached or refused the call."""


class BootstrapBusy(BootstrapError):
    """The bootstrap server is there but slow or not ready yet: worth another try."""


class BootstrapUntrusted(BootstrapError):
    """The address is not on this instance's ``trusted_bootstrap_hosts``: never contacted."""


@functools.lru_cache(maxsize=8)
def _ssl_context(ca_certs: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_certs or None)


def base_url(addr: str, ca_certs: str = "") -> str:
    """``https://addr`` when the server is verified with ``ca_certs``, else ``http://addr``."""
    return f"{'https' if ca_certs else 'http'}://{addr}"


def verify_of(ca_certs: str) -> ssl.SSLContext | bool:
    """httpx's ``verify``: the CA bundle's context (https); for plain http the default context, made once
    (httpx builds ``verify=True``'s context, certifi's bundle loaded, on every call: ~80 ms a call here)."""
    return _ssl_context(ca_certs)


def _sender(ca_certs: str, client: httpx.Client | None) -> Send:
    """How ``call`` sends: through ``client`` (its connection kept), else one request of its own (no proxy)."""
    if client is not None:
        return client.request
    verify = verify_of(ca_certs)

    def send(method: str, url: str, **kwargs: object) -> httpx.Response:
        fn = getattr(httpx, method.lower())  # httpx.get / put / post, looked up per call
        return fn(url, trust_env=False, verify=verify, **kwargs)  # type: ignore[no-any-return]

    return send


def call(
    method: str,
    addr: str,
    path: str,
    body: bytes,
    key: bytes | None,
    timeout_s: float,
    ca_certs: str = "",
    client: httpx.Client | None = None,
) -> httpx.Response:
    """One bootstrap call to ``addr``, signed with ``key`` (none: unsigned) for the id of the server there.

    The id is read from the server once and kept (``bootstrap.audience``); when the server refuses the call
    as signed for another id (it restarted), the id is read again and the call, signed anew, sent once more.
    httpx errors and ``AudienceError`` pass to the caller."""
    base = base_url(addr, ca_certs)
    send = _sender(ca_certs, client)
    headers = {"content-type": "application/json"} if body else {}
    for attempt in (1, 2):
        audience = ""
        if key is not None:
            audience = SERVER_IDS.of(base, send, timeout_s)
            headers.update(sign_call(key, method, path, body, audience=audience))
        content = {"content": body} if body else {}
        resp = send(method, f"{base}{path}", headers=headers, timeout=timeout_s, **content)
        if attempt == 1 and audience and resp.status_code == 401 and _refusal_reason(resp) == "audience":
            SERVER_IDS.forget(base, audience)
            logger.info("bootstrap server %s has a new server id (it restarted): signing for it again", addr)
            continue
        return resp
    raise AssertionError("unreachable")


def _refusal_reason(resp: httpx.Response) -> str:
    try:
        answer = resp.json()
    except ValueError:
        return ""
    reason = answer.get("reason") if isinstance(answer, dict) else None
    return reason if isinstance(reason, str) else ""


def register_rank(
    addr: str,
    info: RegisterRank,
    retries: int,
    interval_s: float,
    timeout_s: float,
    token: bytes | None = None,
    ca_certs: str = "",
) -> bool:
    """PUT this rank into the rank table, retrying while the server comes up.

    Returns False (after logging an error) if every try failed: a late rank
    must not take the whole instance down.
    """
    body = msgspec.json.encode(info)
    key = bootstrap_key(token)
    last = ""
    for attempt in range(1, retries + 1):
        try:
            resp = call("PUT", addr, "/bootstrap/register_rank", body, key, timeout_s, ca_certs)
            if resp.status_code == 200:
                logger.info(
                    "registered rank dp=%d tp=%d%s with bootstrap %s",
                    info.attn_dp_rank,
                    info.attn_tp_rank,
                    f" pp={info.pp_rank} (layers [{info.first_layer}, {info.end_layer}))" if info.pp_size > 1 else "",
                    addr,
                )
                return True
            last = f"HTTP {resp.status_code}: {resp.text[:300]}"
            if 400 <= resp.status_code < 500:
                break  # refused: retrying will not help
        except httpx.HTTPError as exc:
            last = repr(exc)
        except AudienceError as exc:
            last = str(exc)
            if not exc.retry:
                break
        if attempt < retries:
            time.sleep(interval_s)
    logger.error("could not register with bootstrap server %s after %d tries: %s", addr, retries, last)
    return False


def register_dp_rank(
    addr: str,
    room: int,
    dp_rank: int,
    timeout_s: float,
    token: bytes | None = None,
    ca_certs: str = "",
    client: httpx.Client | None = None,
) -> bool:
    """Tell the bootstrap server which DP rank serves `room` (P side, DP > 1); False (logged) if it failed.

    ``client``: a client to send it with (its connection kept between calls); None: a call of its own."""
    body = msgspec.json.encode({"bootstrap_room": room, "dp_rank": dp_rank})
    try:
        resp = call(
            "POST", addr, "/bootstrap/register_dp_rank", body, bootstrap_key(token), timeout_s, ca_certs, client
        )
        resp.raise_for_status()
    except (httpx.HTTPError, AudienceError) as exc:
        logger.error("room=%d: could not register dp rank %d with bootstrap %s: %r", room, dp_rank, addr, exc)
        return False
    return True


def release_room(
    addr: str,
    room: int,
    reason: str,
    timeout_s: float,
    token: bytes | None = None,
    ca_certs: str = "",
) -> dict[str, object]:
    """Ask the bootstrap server at ``addr`` to release ``room`` on every P rank (``reason``: why, logged
    there and told to a D that asks for the room); its answer (``bootstrap.rooms_api``). Raises
    ``BootstrapError`` naming the address when the call fails or is refused."""
    body = msgspec.json.encode({"room": room, "reason": reason})
    return _room_call("POST", addr, RELEASE_PATH, body, timeout_s, bootstrap_key(token), ca_certs)


def room_status(
    addr: str, room: int, timeout_s: float, token: bytes | None = None, ca_certs: str = ""
) -> dict[str, object]:
    """What the bootstrap server at ``addr`` (its leader rank) knows of ``room`` (``bootstrap.rooms_api``).
    Raises ``BootstrapError`` naming the address when the call fails or is refused."""
    return _room_call("GET", addr, f"{STATUS_PATH}?room={int(room)}", b"", timeout_s, bootstrap_key(token), ca_certs)


def _room_call(
    method: str, addr: str, path: str, body: bytes, timeout_s: float, key: bytes | None, ca_certs: str
) -> dict[str, object]:
    try:
        resp = call(method, addr, path, body, key, timeout_s, ca_certs)
    except (httpx.HTTPError, AudienceError) as exc:
        raise BootstrapError(f"bootstrap server {addr}: {method} {path.split('?')[0]} failed: {exc!r}") from None
    if resp.status_code != 200:
        _log_reply(addr, path.split("?")[0], resp)
        raise BootstrapError(f"bootstrap server {addr}: {method} {path.split('?')[0]} answered HTTP {resp.status_code}")
    try:
        answer = resp.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise BootstrapError(f"bootstrap server {addr}: {path.split('?')[0]} answered no JSON object")
    return answer


#: How long a route read from a bootstrap server is used before it is read again. A restarted
#: prefill deployment has new rank endpoints; without expiry, D would send its first request
#: after the restart to the old ones and wait out its whole KV timeout.
ROUTE_TTL_S = 10.0


class RouteCache:
    """GET /bootstrap/route per prefill deployment, cached for ``ttl_s`` or until invalidated.

    ``trusted``: the hosts it may contact (None: any, for tests and tools that name the server themselves).
    """

    def __init__(
        self,
        timeout_s: float,
        ttl_s: float = ROUTE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        token: bytes | None = None,
        ca_certs: str = "",
        trusted: TrustedHosts | None = None,
    ) -> None:
        self._key = bootstrap_key(token)  # calls are signed with it (bootstrap.signing); the token stays here
        self._ca_certs = ca_certs
        self._trusted = trusted
        self._timeout = timeout_s
        self._ttl = ttl_s
        self._clock = clock  # tests age entries by hand
        self._routes: dict[str, tuple[float, Route]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_config(cls, cfg: DisaggConfig, timeout_s: float | None = None, ttl_s: float = ROUTE_TTL_S) -> RouteCache:
        """A decode instance's cache: its token, CA bundle and trusted hosts."""
        from pd_connector.auth import token_of
        from pd_connector.bootstrap.trust import trusted_hosts_of

        return cls(
            cfg.http_timeout_s if timeout_s is None else timeout_s,
            ttl_s=ttl_s,
            token=token_of(cfg),
            ca_certs=cfg.bootstrap_ssl_ca_certs,
            trusted=trusted_hosts_of(cfg),
        )

    def check_trusted(self, addr: str) -> None:
        """Raise BootstrapUntrusted (naming ``addr``) unless this cache may contact it."""
        if self._trusted is not None and not self._trusted.allows(split_addr(addr)):
            raise BootstrapUntrusted(
                f"bootstrap address {addr} is not trusted by this decode instance (kv_connector_extra_config."
                f"trusted_bootstrap_hosts: {self._trusted.describe()})"
            )

    def get(self, addr: str) -> Route:
        self.check_trusted(addr)
        with self._lock:
            cached = self._routes.get(addr)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        try:
            resp = call("GET", addr, "/bootstrap/route", b"", self._key, self._timeout, self._ca_certs)
        except AudienceError as exc:
            raise (BootstrapBusy if exc.retry else BootstrapError)(str(exc)) from None
        except httpx.TimeoutException as exc:
            raise BootstrapBusy(f"bootstrap server {addr} did not answer in time: {exc!r}") from None
        except httpx.HTTPError as exc:
            raise BootstrapError(f"bootstrap server {addr} unreachable: {exc!r}") from None
        if resp.status_code != 200:
            _log_reply(addr, "GET /bootstrap/route", resp)
            raise BootstrapError(f"bootstrap server {addr} refused the route request (HTTP {resp.status_code})")
        try:
            route = msgspec.json.decode(resp.content, type=Route)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("bootstrap server %s sent a bad route: %s", addr, _printable(str(exc)))
            raise BootstrapError(f"bootstrap server {addr} sent a route that does not decode") from None
        if not route.is_ready:
            raise BootstrapBusy(
                f"prefill deployment at {addr} is not ready: {len(route.ranks)} of "
                f"{route.attn_tp_size * route.attn_cp_size * route.dp_size * route.pp_size} ranks registered"
            )
        with self._lock:
            self._routes[addr] = (self._clock() + self._ttl, route)
        return route

    def room_status(self, addr: str, room: int, timeout_s: float) -> dict[str, object]:
        """What the bootstrap server at ``addr`` knows of ``room`` (``room_status``), with this cache's
        key and CA bundle; an untrusted address raises ``BootstrapUntrusted`` before any connection."""
        self.check_trusted(addr)
        path = f"{STATUS_PATH}?room={int(room)}"
        return _room_call("GET", addr, path, b"", timeout_s, self._key, self._ca_certs)

    def invalidate(self, addr: str) -> None:
        with self._lock:
            self._routes.pop(addr, None)

    def query_dp_rank(self, addr: str, room: int) -> int | None:
        """The DP rank the prefill deployment at ``addr`` registered for ``room``; None when none did yet."""
        return self.query_dp_ranks(addr, [room]).get(room)

    def query_dp_ranks(self, addr: str, rooms: list[int]) -> dict[int, int]:
        """The DP ranks registered for those of ``rooms`` that have one (one call for all of them)."""
        self.check_trusted(addr)
        path = "/bootstrap/query_dp_ranks"
        body = msgspec.json.encode({"bootstrap_rooms": rooms})
        try:
            resp = call("POST", addr, path, body, self._key, self._timeout, self._ca_certs)
        except (httpx.HTTPError, AudienceError) as exc:
            raise BootstrapError(f"query_dp_ranks on {addr} failed: {exc!r}") from None
        if resp.status_code != 200:
            _log_reply(addr, f"POST {path}", resp)
            raise BootstrapError(f"bootstrap server {addr} refused query_dp_ranks (HTTP {resp.status_code})")
        try:
            found = msgspec.json.decode(resp.content, type=_DpRanks).dp_ranks
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise BootstrapError(f"bootstrap server {addr} sent a query_dp_ranks answer that does not decode") from None
        asked = set(rooms)
        return {int(room): dp for room, dp in found.items() if room.isdigit() and int(room) in asked}


class _DpRanks(msgspec.Struct):
    dp_ranks: dict[str, int] = {}


def _printable(text: str, limit: int = 300) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[:limit])


def _log_reply(addr: str, call: str, resp: httpx.Response) -> None:
    """What a bootstrap server answered to a refused call: for D's log only, never for its client."""
    logger.warning(
        "bootstrap server %s answered %s with HTTP %d: %s", addr, call, resp.status_code, _printable(resp.text)
    )
