"""D: telling P to free a room D will not load.

Two cases reach here, each after vLLM finished the request or the load ended without asking P:

- the request ended before its KV was asked for (aborted while it queued; a local prefix hit covered
  the prompt): :meth:`RoomRelease.abandon`;
- the load ended (``kv_wait_timeout_s``, an abort) while it waited for the room's prefill DP rank
  (``transfer.dp_wait``): :meth:`RoomRelease.release`.

P may hold the room's KV for it (or will, once its prefill ends), so D sends ``TransferCancel`` to the P
ranks that would have served it. When the room's DP rank is not known (no ``prefill_dp_rank``, none
registered on the bootstrap server), every DP rank of the deployment is told: the one that gets the
request frees the room at once (its prefill done) or as soon as the prefill ends (``PrefillSide``
remembers early cancels); the others only remember the cancel. Without this, P would hold the KV until
its ``room_timeout_s``. The cancels are ZMQ frames signed like every other (``transfer.frames``); they
leave on a thread of their own, so a slow bootstrap server never holds D's handshakes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pd_connector import messages as proto
from pd_connector.bootstrap.client import RouteCache
from pd_connector.metadata import RecvJob
from pd_connector.transfer.context import RankContext
from pd_connector.transfer.tasks import TaskPool

logger = logging.getLogger(__name__)

#: An abandoned room is not told to a prefill whose rank was lost this recently (its bootstrap
#: server would only hold the telling thread), nor again for a room a load of this rank already had.
LOST_ADDR_QUIET_S = 30.0
ROOMS_REMEMBERED = 10_000

#: (job, route, dp rank) -> the ZMQ endpoints of the P ranks that serve this D rank's part of the room.
Contacts = Callable[[RecvJob, proto.Route, int], dict[str, int]]


class RoomRelease:
    def __init__(self, ctx: RankContext, routes: RouteCache, peer_id: str, contacts: Contacts) -> None:
        self._ctx = ctx
        self._routes = routes
        self._peer_id = peer_id
        self._contacts = contacts
        self._pool = TaskPool(1)
        self._lock = threading.Lock()
        self._lost_addrs: dict[str, float] = {}  # bootstrap address -> when one of its ranks was lost
        self._loaded_rooms: OrderedDict[int, None] = OrderedDict()  # rooms a load of this rank had

    def loaded(self, room: int) -> None:
        """A load of this rank has ``room`` (its end tells P itself)."""
        with self._lock:
            self._loaded_rooms[room] = None
            while len(self._loaded_rooms) > ROOMS_REMEMBERED:
                self._loaded_rooms.popitem(last=False)

    def lost(self, addr: str) -> None:
        """A P rank of the deployment at ``addr`` went silent."""
        with self._lock:
            self._lost_addrs[addr] = time.monotonic()

    def abandon(self, jobs: Sequence[RecvJob]) -> None:
        """vLLM finished these requests before their KV was asked for: tell P (off the step loop)."""
        now = time.monotonic()
        for job in jobs:
            with self._lock:
                loaded = job.room in self._loaded_rooms  # that load's end already told P
                lost = now - self._lost_addrs.get(job.bootstrap_addr, -LOST_ADDR_QUIET_S) < LOST_ADDR_QUIET_S
            if loaded or lost:
                why = "a load of it already told prefill" if loaded else "prefill was lost"
                logger.info("room=%d req=%s: request ended before its KV was asked for; %s", job.room, job.req_id, why)
                continue
            self._pool.submit(self._cancel_room, job, "request ended before its KV was asked for")

    def release(self, job: RecvJob, why: str) -> None:
        """The load of ``job`` ended before P's ranks were asked (``why``): tell P (off the caller's thread)."""
        self._pool.submit(self._cancel_room, job, why)

    def _cancel_room(self, job: RecvJob, why: str) -> None:
        try:
            route = self._routes.get(job.bootstrap_addr)
            ranks = [job.prefill_dp_rank or 0]
            if job.prefill_dp_rank is None and route.dp_size > 1:
                dp = self._routes.query_dp_rank(job.bootstrap_addr, job.room)  # one look: no waiting
                ranks = [dp] if dp is not None else list(range(route.dp_size))
            endpoints: dict[str, int] = {}
            for dp in ranks:
                endpoints.update(self._contacts(job, route, dp))
        except Exception as exc:  # noqa: BLE001 - P's room_timeout_s frees it then
            logger.warning("room=%d req=%s: %s; prefill not told (%s)", job.room, job.req_id, why, exc)
            return
        cancel = proto.TransferCancel(room=job.room, request_id=job.req_id, peer_id=self._peer_id)
        for endpoint in endpoints:
            self._ctx.send(endpoint, cancel)
        told = f"every DP rank ({len(ranks)}) of prefill" if len(ranks) > 1 else "prefill"
        logger.info("room=%d req=%s: %s; %s told to free the room", job.room, job.req_id, why, told)
