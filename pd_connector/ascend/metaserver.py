"""D first, P on demand: vLLM-Ascend's layer-wise proxy (``load_balance_proxy_layerwise_server_example.py``).

That proxy sends the client's request to D only, with ``kv_transfer_params: {do_remote_prefill: true,
do_remote_decode: false, metaserver: http://<proxy>/v1/metaserver}`` and no room. D must post, to that
metaserver, the ``kv_transfer_params`` a prefill needs plus its own ``request_id`` (the id the proxy
filed the request under); the proxy then sends the request to a P of its choice with exactly those
parameters. vLLM-Ascend's ``MooncakeLayerwiseConnector`` posts them once D's blocks are allocated.

PDConnector's D does the same, in its own protocol:

- D's scheduler picks the room (:func:`kv_params.new_room`) and serves the request as a normal remote
  prefill from its configured prefill deployment (``bootstrap_host`` / ``bootstrap_port``: the proxy
  chooses a P instance, not D, so D asks the deployment's bootstrap server; with several P DP ranks
  D looks the room's DP rank up there, as for any request without ``prefill_dp_rank``). D's worker
  asks P for the room right away: P holds that request until the prefill comes (AWAITING_PREFILL),
  then pushes (in layer mode, layer by layer while it prefills).
- Once D's blocks are allocated, D posts ``{request_id, do_remote_decode: true, do_remote_prefill:
  false, bootstrap_room}`` to the metaserver (:func:`prefill_request_params`); P takes these as an
  ordinary prefill request for that room.
- The post runs on :class:`MetaserverSender`'s threads, never on the scheduler's (bounded queue,
  timeouts, connection retries bounded; failures logged with room and request id). If the metaserver
  never answers or P never pushes, D's load fails after ``kv_wait_timeout_s`` as any load does, and
  P's waiting request after ``room_timeout_s``.

Mutual TLS (vLLM-Ascend's ``tls_config``, ``ascend.settings``): to an https metaserver D presents
``metaserver_ssl_certfile`` / ``metaserver_ssl_keyfile`` and verifies the metaserver with
``metaserver_ssl_ca_certs`` (empty: the system's CA store) (:func:`tls_context_of`).

The metaserver URL comes from the client's request, so D posts only to hosts on
``trusted_metaservers`` (:func:`trusted_metaservers_of`; default: loopback only, and only when D's
``local_ip`` is loopback). D's HTTP middleware answers 403 naming the URL for any other one; without
the middleware the scheduler logs the refusal and the request is prefilled on D.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from pd_connector.ascend.settings import client_tls_context
from pd_connector.bootstrap.trust import LOOPBACK_ENTRIES, TrustedHosts, is_loopback_host
from pd_connector.config import DisaggConfig
from pd_connector.kv_params import (
    KV_PARAMS_KEY,
    REMOTE_DECODE,
    REMOTE_PREFILL,
    ROOM,
    DecodeParams,
    new_room,
)

logger = logging.getLogger(__name__)

#: The request's key naming the proxy's metaserver, and the posted body's key naming D's request.
METASERVER = "metaserver"
REQUEST_ID = "request_id"
#: The extra-config key listing the hosts D may post to.
TRUSTED_KEY = "trusted_metaservers"
#: HTTP answer of D's middleware for a metaserver D may not post to.
UNTRUSTED_STATUS, UNTRUSTED_TYPE = 403, "kv_transfer_untrusted_metaserver"
#: vLLM appends ``-<8 hex>`` to every request id it is given (``InputProcessor.assign_request_id``),
#: unless this variable is set; the proxy filed the request under the id without it.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_NO_SUFFIX_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
#: Sender: threads (the proxy answers a post only once P's prefill finished, so posts overlap),
#: pending posts at most, tries of a post that could not connect, the connect timeout.
SENDER_THREADS = 8
QUEUE_LIMIT = 1024
POST_ATTEMPTS = 3
CONNECT_TIMEOUT_S = 5.0
#: Where D's middleware keeps the parsed list on vLLM's app state.
_STATE_KEY = "pd_connector_trusted_metaservers"


class MetaserverError(ValueError):
    """A metaserver URL D may not post to (the message names the value)."""


def metaserver_of(params: Any) -> Any:
    """The ``metaserver`` value of D-first ``kv_transfer_params`` (a remote prefill naming no room, maybe
    malformed: :func:`check_url` judges it); None for any other params."""
    if not isinstance(params, dict) or params.get(REMOTE_PREFILL) is not True or params.get(ROOM) is not None:
        return None
    return params.get(METASERVER)


def trusted_metaservers_of(cfg: DisaggConfig) -> TrustedHosts:
    """Hosts D may post to: ``trusted_metaservers``, else loopback when D's ``local_ip`` is loopback, else none."""
    if cfg.trusted_metaservers:
        return TrustedHosts.parse(cfg.trusted_metaservers, key=TRUSTED_KEY)
    return TrustedHosts.parse(LOOPBACK_ENTRIES if is_loopback_host(cfg.local_ip) else ())


def tls_context_of(cfg: DisaggConfig) -> ssl.SSLContext | None:
    """D's client TLS toward https metaservers (``metaserver_ssl_*``, vLLM-Ascend's ``tls_config``); None
    when none is configured (httpx's default verification)."""
    if not (cfg.metaserver_ssl_certfile or cfg.metaserver_ssl_ca_certs):
        return None
    return client_tls_context(
        cfg.metaserver_ssl_certfile,
        cfg.metaserver_ssl_keyfile,
        cfg.metaserver_ssl_keyfile_password,
        cfg.metaserver_ssl_ca_certs,
    )


def check_url(url: object, trusted: TrustedHosts) -> str:
    """``url`` if D may post to it; raises MetaserverError naming the value otherwise."""
    if not isinstance(url, str) or not url or len(url) > 2048 or not url.isprintable():
        raise MetaserverError(f"kv_transfer_params.{METASERVER} must be an http(s) URL, got {url!r}")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # the port is parsed only to be checked
        usable = parts.scheme in ("http", "https") and bool(host) and not (parts.username or parts.password)
    except ValueError:
        host, usable = None, False
    if not usable or host is None:
        raise MetaserverError(f"kv_transfer_params.{METASERVER} must be an http(s) URL with a host, got {url!r}")
    if not trusted.allows(host):
        raise MetaserverError(
            f"kv_transfer_params.{METASERVER} {url!r} is not trusted by this decode instance "
            f"(kv_connector_extra_config.{TRUSTED_KEY}: {trusted.describe()})"
        )
    return url


def refusal(raw_body: bytes, trusted: TrustedHosts) -> str | None:
    """D's middleware: why a request body's metaserver may not be used (None: not D-first, or allowed)."""
    try:
        body = json.loads(raw_body)
    except (ValueError, RecursionError):
        return None  # judged by the middleware's own parse
    params = body.get(KV_PARAMS_KEY) if isinstance(body, dict) else None
    url = metaserver_of(params)
    if url is None:
        return None
    try:
        check_url(url, trusted)
    except MetaserverError as exc:
        return str(exc)
    return None


def trusted_of_app(scope: Any) -> TrustedHosts | None:
    """D's middleware: this decode instance's trusted metaservers (from vLLM's app state); None elsewhere."""
    from pd_connector.config import ConfigError, parse_config

    state = getattr(scope.get("app"), "state", None)
    kv = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
    if kv is None or kv.kv_connector != "PDConnector" or kv.kv_role != "kv_consumer":
        return None
    cached = getattr(state, _STATE_KEY, None)
    if isinstance(cached, TrustedHosts):
        return cached
    try:
        trusted = trusted_metaservers_of(parse_config(kv.kv_role, getattr(kv, "kv_connector_extra_config", None)))
    except ConfigError:
        return None  # the connector refuses to start with it anyway
    setattr(state, _STATE_KEY, trusted)
    return trusted


def external_request_id(request_id: str) -> str:
    """The id the proxy filed the request under: vLLM's internal id without its random suffix."""
    if os.environ.get(_NO_SUFFIX_ENV, "").strip() not in ("", "0"):
        return request_id
    return _RANDOM_SUFFIX.sub("", request_id)


def prefill_request_params(request_id: str, room: int) -> dict[str, Any]:
    """What D posts to the metaserver: P's kv_transfer_params for ``room``, plus the proxy's request id."""
    return {REQUEST_ID: external_request_id(request_id), REMOTE_DECODE: True, REMOTE_PREFILL: False, ROOM: room}


@dataclass(frozen=True)
class Post:
    url: str
    body: dict[str, Any]
    room: int
    request_id: str


class MetaserverSender:
    """Posts to metaservers on its own threads: the scheduler only queues (never blocks, never waits)."""

    def __init__(
        self,
        read_timeout_s: float,
        threads: int = SENDER_THREADS,
        limit: int = QUEUE_LIMIT,
        client: Callable[[], httpx.Client] | None = None,
        retry_delay_s: float = 0.2,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: the client context of https posts (its certificate presented, its CAs trusted)."""
        self._timeout = httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S)
        self._queue: queue.Queue[Post | None] = queue.Queue(maxsize=limit)
        self._threads_wanted = threads
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        verify: ssl.SSLContext | bool = tls if tls is not None else True
        self._make_client = client or (lambda: httpx.Client(timeout=self._timeout, trust_env=False, verify=verify))
        self._retry_delay_s = retry_delay_s
        self.sent = 0
        self.failed = 0

    def submit(self, post: Post) -> bool:
        """Queue ``post`` (False, logged, when the queue is full: D's load then fails after kv_wait_timeout_s)."""
        self._start()
        try:
            self._queue.put_nowait(post)
        except queue.Full:
            self.failed += 1
            logger.error(
                "room=%d req=%s: metaserver %s not told (%d posts pending); the load will time out",
                post.room,
                post.request_id,
                post.url,
                self._queue.qsize(),
            )
            return False
        return True

    def _start(self) -> None:
        with self._lock:
            while len(self._threads) < self._threads_wanted:
                thread = threading.Thread(target=self._run, name=f"pd-metaserver-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            threads, self._threads, self._threads_wanted = self._threads, [], 0
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join(timeout_s)

    def _run(self) -> None:
        with self._make_client() as client:
            while (post := self._queue.get()) is not None:
                try:
                    self._post(client, post)
                except Exception:  # never lose the thread
                    logger.exception("room=%d req=%s: metaserver post failed", post.room, post.request_id)
                    self.failed += 1

    def _post(self, client: httpx.Client, post: Post) -> None:
        started = time.monotonic()
        for attempt in range(1, POST_ATTEMPTS + 1):
            try:
                resp = client.post(post.url, json=post.body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached the proxy: try again
                if attempt < POST_ATTEMPTS:
                    logger.warning(
                        "room=%d req=%s: metaserver %s: %s; retrying", post.room, post.request_id, post.url, exc
                    )
                    time.sleep(self._retry_delay_s * 2 ** (attempt - 1))
                    continue
                self._failed(post, f"{exc!r} after {attempt} tries")
                return
            except httpx.HTTPError as exc:  # it may have reached the proxy (and P): never sent twice
                self._failed(post, repr(exc))
                return
            if resp.status_code >= 400:
                self._failed(post, f"HTTP {resp.status_code} {resp.text[:200]!r}")
                return
            logger.info(
                "room=%d req=%s: metaserver %s answered after %.2f s (prefill requested)",
                post.room,
                post.request_id,
                post.url,
                time.monotonic() - started,
            )
            self.sent += 1  # after the log line: a reader that waits on the count sees the line
            return

    def _failed(self, post: Post, why: str) -> None:
        logger.error(
            "room=%d req=%s: metaserver %s: %s; the load fails after kv_wait_timeout_s unless a prefill pushes",
            post.room,
            post.request_id,
            post.url,
            why,
        )
        self.failed += 1  # after the log line: a reader that waits on the count sees the line


class DecodeFirst:
    """D's scheduler side of the flow: a room and prefill deployment per D-first request, the post queued
    once the request's blocks are allocated. No I/O here: the sender does it."""

    def __init__(self, cfg: DisaggConfig, sender: MetaserverSender | None = None) -> None:
        self._cfg = cfg
        self._trusted = trusted_metaservers_of(cfg)
        self._sender = sender
        self._pending: dict[str, Post] = {}

    def params_of(self, request: Any) -> DecodeParams | None:
        """DecodeParams for a D-first request (the room chosen here); None for any other request or a
        metaserver D may not post to (logged: the request is then prefilled here)."""
        raw = getattr(request, "kv_transfer_params", None)
        url = metaserver_of(raw)
        if url is None:
            return None
        rid = request.request_id
        try:
            url = check_url(url, self._trusted)
        except MetaserverError as exc:
            logger.error("req=%s: %s; prefilling it here", rid, exc)
            return None
        room = new_room()
        self._pending[rid] = Post(url, prefill_request_params(rid, room), room, rid)
        logger.info("room=%d req=%s: D first; the prefill is asked through metaserver %s", room, rid, url)
        return DecodeParams(room, self._cfg.bootstrap_host, self._cfg.bootstrap_port, None)

    def allocated(self, request_id: str) -> None:
        """D's blocks for ``request_id`` are allocated and its load is planned: tell the metaserver."""
        post = self._pending.pop(request_id, None)
        if post is None:
            return
        if self._sender is None:
            self._sender = MetaserverSender(self._cfg.kv_wait_timeout_s, tls=tls_context_of(self._cfg))
        self._sender.submit(post)

    def forget(self, request_id: str) -> None:
        """The request ended (or needs no load) before its post: nothing is posted."""
        self._pending.pop(request_id, None)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
