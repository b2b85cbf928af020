"""D: waiting for a room's prefill DP rank without holding a transfer thread.

A request told no ``prefill_dp_rank`` (vLLM-Ascend's layer-wise proxy sends D first; a Router cannot know
which engine vLLM's DP load balancer picks) is served by the DP rank that registered its room on the
prefill deployment's bootstrap server (``bootstrap.dp_rooms``: P registers a room when the request
arrives). D's handshake looks once (``DecodeSide._start``, on a transfer thread); a room not registered
yet (the proxy has not sent P the request yet, or P's post is still on its way) is *parked* here and the
transfer thread goes back to the other loads. One thread of this module's own asks the bootstrap servers
every ``POLL_S`` for all parked rooms at once (one ``query_dp_ranks`` call per deployment), hands each
room that got its rank back to the handshake (``on_found``), and ends when nothing is parked.

The wait is bounded by the load's ``kv_wait_timeout_s`` (``DecodeSide.expire``): a load that times out,
or that vLLM aborts, while parked leaves it (:meth:`DpRankWait.drop`) and D tells every DP rank of the
deployment to free the room (``transfer.room_release``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pd_connector.bootstrap.client import BootstrapError, RouteCache
from pd_connector.metadata import RecvJob

logger = logging.getLogger(__name__)

#: How often the parked rooms are looked up (each deployment: one call for all of them).
POLL_S = 0.05
#: A deployment whose lookups keep failing is named in the log at most this often.
ERROR_LOG_EVERY_S = 10.0


class DpRankPending(Exception):
    """The prefill deployment registered no DP rank for the room yet: park the load, do not fail it."""


class DpRankWait:
    """Parked loads (request id -> job) and the thread that looks their rooms up."""

    def __init__(self, routes: RouteCache, on_found: Callable[[RecvJob, int], None], poll_s: float = POLL_S) -> None:
        """``on_found(job, dp_rank)``: called on this module's thread for a room whose rank was found (the
        job already left the wait)."""
        self._routes = routes
        self._on_found = on_found
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._parked: dict[str, tuple[RecvJob, float]] = {}  # req id -> (job, when it was parked)
        self._thread: threading.Thread | None = None
        self._errors_logged: dict[str, float] = {}

    def park(self, job: RecvJob) -> None:
        with self._lock:
            self._parked[job.req_id] = (job, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pd-dp-wait", daemon=True)
                self._thread.start()
        logger.info(
            "room=%d req=%s: prefill %s has registered no DP rank for the room yet; looking again every %g s "
            "(no transfer thread held)",
            job.room, job.req_id, job.bootstrap_addr, self._poll_s,
        )  # fmt: skip

    def drop(self, req_id: str) -> RecvJob | None:
        """Take a load out of the wait (it failed or was aborted); its job if it was parked."""
        with self._lock:
            parked = self._parked.pop(req_id, None)
        return parked[0] if parked is not None else None

    def parked(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._parked

    def _run(self) -> None:
        while True:
            time.sleep(self._poll_s)
            with self._lock:
                if not self._parked:
                    self._thread = None  # a later park starts another
                    return
                by_addr: dict[str, list[RecvJob]] = {}
                for job, _ in self._parked.values():
                    by_addr.setdefault(job.bootstrap_addr, []).append(job)
            for addr, jobs in by_addr.items():
                self._look_up(addr, jobs)

    def _look_up(self, addr: str, jobs: list[RecvJob]) -> None:
        try:
            found = self._routes.query_dp_ranks(addr, sorted({job.room for job in jobs}))
        except BootstrapError as exc:  # the load's kv_wait_timeout_s still bounds the wait
            now = time.monotonic()
            if now - self._errors_logged.get(addr, -ERROR_LOG_EVERY_S) >= ERROR_LOG_EVERY_S:
                self._errors_logged[addr] = now
                logger.warning("%d loads wait for their prefill DP rank; looking them up failed: %s", len(jobs), exc)
            return
        for job in jobs:
            dp = found.get(job.room)
            if dp is None:
                continue
            with self._lock:
                parked = self._parked.pop(job.req_id, None)
            if parked is None or parked[0] is not job:  # dropped meanwhile (failed, aborted)
                continue
            logger.info(
                "room=%d req=%s: prefill DP rank %d registered after %.2f s", job.room, job.req_id, dp,
                time.monotonic() - parked[1],
            )  # fmt: skip
            try:
                self._on_found(job, dp)
            except Exception:  # noqa: BLE001 - never lose the thread; the load's timeout ends it
                logger.exception("room=%d req=%s: resuming the handshake failed", job.room, job.req_id)
