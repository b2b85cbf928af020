"""P with several DP ranks: which rank serves a room, told to the bootstrap server when the request arrives.

A D told no ``prefill_dp_rank`` (vLLM-Ascend's layer-wise proxy, D first; a Router that cannot know which
engine vLLM's own DP load balancer picks) looks the room up on the deployment's bootstrap server
(``/bootstrap/query_dp_ranks``). The rank registers the room as soon as its scheduler gets the request
(vLLM calls the connector's ``on_new_request`` from ``Scheduler.add_request``), not after the prefill:
D can then ask the right rank for its KV while the request still queues or prefills, and a D that never
finds the room (it waited ``kv_wait_timeout_s``) is the exception, not the rule for a long prompt.

The scheduler does no I/O: :class:`DpRoomRegistrar` queues the room (bounded, never blocking) and one
thread of its own posts it (signed like every bootstrap call, ``bootstrap.signing``; over https with
``bootstrap_ssl_ca_certs``), keeping its connection to the server. A post that cannot connect is tried
again a bounded number of times; one that still fails is logged with room and request id (the rank
registers the room again once its prefill ended: ``transfer.prefill_side``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from pd_connector.bootstrap.client import register_dp_rank, verify_of
from pd_connector.kv_params import host_port

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

logger = logging.getLogger(__name__)

#: Rooms queued at most (beyond: logged, the rank registers the room after its prefill), tries of a
#: registration, and the pause before the second try (doubled for each further one).
QUEUE_LIMIT = 4096
ATTEMPTS = 3
RETRY_DELAY_S = 0.2


@dataclass(frozen=True)
class _Room:
    room: int
    request_id: str


class DpRoomRegistrar:
    """Registers rooms with this rank's DP rank on its own thread: ``seen`` only queues."""

    def __init__(
        self,
        addr: str,
        dp_rank: int,
        timeout_s: float,
        token: bytes | None = None,
        ca_certs: str = "",
        limit: int = QUEUE_LIMIT,
        retry_delay_s: float = RETRY_DELAY_S,
    ) -> None:
        self.addr, self.dp_rank = addr, dp_rank
        self._timeout_s, self._token, self._ca_certs = timeout_s, token, ca_certs
        self._retry_delay_s = retry_delay_s
        self._queue: queue.Queue[_Room | None] = queue.Queue(maxsize=limit)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.registered = 0
        self.failed = 0

    def seen(self, room: int, request_id: str) -> None:
        """The scheduler got a request for ``room``: register it (off the caller's thread)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pd-dp-rooms", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(_Room(room, request_id))
        except queue.Full:
            self.failed += 1
            logger.error(
                "room=%d req=%s: %d dp-rank registrations pending; this one waits until the prefill ends",
                room, request_id, self._queue.qsize(),
            )  # fmt: skip

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)

    def _run(self) -> None:
        with httpx.Client(trust_env=False, verify=verify_of(self._ca_certs)) as client:
            while (item := self._queue.get()) is not None:
                try:
                    self._register(client, item)
                except Exception:  # never lose the thread
                    logger.exception("room=%d req=%s: dp-rank registration failed", item.room, item.request_id)
                    self.failed += 1

    def _register(self, client: httpx.Client, item: _Room) -> None:
        for attempt in range(1, ATTEMPTS + 1):
            if register_dp_rank(
                self.addr, item.room, self.dp_rank, self._timeout_s, self._token, self._ca_certs, client
            ):
                logger.debug("room=%d req=%s: dp rank %d registered", item.room, item.request_id, self.dp_rank)
                self.registered += 1
                return
            if attempt < ATTEMPTS:
                time.sleep(self._retry_delay_s * 2 ** (attempt - 1))
        self.failed += 1
        logger.error(
            "room=%d req=%s: dp rank %d not registered with bootstrap %s after %d tries; a decode told no "
            "prefill_dp_rank finds the room only once its prefill ended",
            item.room, item.request_id, self.dp_rank, self.addr, ATTEMPTS,
        )  # fmt: skip


def dp_rooms_for(cfg: DisaggConfig, parallel_config: Any, dp_rank: int) -> DpRoomRegistrar | None:
    """P's registrar when its deployment has several DP ranks (``dp_size``, else vLLM's DP size); else None."""
    if not cfg.is_prefill:
        return None
    dp_size = cfg.dp_size if cfg.dp_size >= 0 else int(getattr(parallel_config, "data_parallel_size", 1))
    if dp_size <= 1:
        return None
    from pd_connector.auth import token_of

    addr = host_port(cfg.bootstrap_host, cfg.bootstrap_port)
    return DpRoomRegistrar(addr, dp_rank, cfg.http_timeout_s, token_of(cfg), cfg.bootstrap_ssl_ca_certs)
