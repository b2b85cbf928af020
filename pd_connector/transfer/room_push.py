"""One push of a ready room's KV into one D request's blocks (request mode), and its log line.

`push_room` runs on the task pool (``PrefillSide._push``): it checks the peer, guards every write
against D's registered KV blocks (``write_guard``), writes the room's blocks through the transfer
backend and maps every failure to the ``DoneStatus`` D is told. It never raises: a room's end is
always reported, so its KV is never held forever. `log_push` writes the push's log line and counts
it; the end of a layer-wise stream's reader (``StreamResult``) logs through it too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pd_connector import messages as proto
from pd_connector.layouts.regions import LayoutError
from pd_connector.messages import DoneStatus
from pd_connector.metadata import SendJob
from pd_connector.transfer.backend import TransferBackend, TransferError, WriteStopped
from pd_connector.transfer.context import RankContext
from pd_connector.transfer.device_sync import Marker
from pd_connector.transfer.stats import TransferStats
from pd_connector.transfer.write_guard import guard_push
from pd_connector.transfer.write_plans import BlockRangeError, write_room

logger = logging.getLogger("pd_connector.transfer.prefill_side")


@dataclass(frozen=True)
class PushOutcome:
    """What one push did: D is told ``status`` (and ``error``); ``nbytes``/``entries`` were written."""

    status: DoneStatus
    error: str
    nbytes: int
    entries: int
    seconds: float
    checksum: int | None

    @property
    def ok(self) -> bool:
        return self.status is DoneStatus.OK


@dataclass(frozen=True)
class StreamResult:
    """How one layer-wise reader (``layerwise.Reader``) ended: D request ``req`` is told ``status``."""

    req: proto.TransferRequest
    status: DoneStatus
    error: str
    nbytes: int
    entries: int
    seconds: float
    checksum: int | None = None


def push_room(
    ctx: RankContext,
    backend: TransferBackend,
    job: SendJob,
    req: proto.TransferRequest,
    peer: proto.PeerHello | None,
    peer_error: str | None,
    still_wanted: Callable[[], bool],
    forward_done: Marker | None = None,
) -> PushOutcome:
    """Write ``job``'s KV into the blocks ``req`` names, on the D rank ``peer``; stop between
    batches once ``still_wanted()`` is False (room expired, D cancelled).

    ``forward_done`` (``device_sync``): waited for before the first byte is read, so an asynchronous
    device has written the KV the prefill's forward queued (the calling thread is bound to the rank's device)."""
    t0 = time.perf_counter()
    status, error = DoneStatus.OK, ""
    nbytes = entries = 0
    summed = None
    try:
        if peer is None:
            raise _Refused(DoneStatus.UNKNOWN_PEER, f"unknown decode peer {req.peer_id} (no PeerHello received)")
        if peer_error:
            raise _Refused(DoneStatus.INCOMPATIBLE, peer_error)
        guard, summed = guard_push(peer, req, ctx.spec)  # transfer.write_guard, transfer.checksum
        known: proto.PeerHello = peer
        if forward_done is not None:
            forward_done.wait()

        def write(src: list[int], dst: list[int], lengths: list[int]) -> None:
            guard.check(dst, lengths)  # inside D's registered KV blocks, else nothing is written
            backend.write(known.transfer_descriptor, src, dst, lengths, ctx.cfg.max_batch_entries, still_wanted)
            if summed is not None:
                summed.add(src, dst, lengths)

        nbytes, entries = write_room(ctx.spec, ctx, peer, job, req, write, ctx.plans)
    except _Refused as exc:
        status, error = exc.status, str(exc)
    except BlockRangeError as exc:
        status, error = DoneStatus.BAD_REQUEST, str(exc)
    except LayoutError as exc:
        status, error = DoneStatus.INCOMPATIBLE, str(exc)
    except WriteStopped as exc:  # D cancelled or the room closed: this answer tells D the writes ended
        status, error = DoneStatus.CANCELLED, str(exc)
    except TransferError as exc:
        status, error = DoneStatus.TRANSFER_FAILED, str(exc)
    except Exception as exc:  # noqa: BLE001 - report, never leak the room
        logger.exception("room=%d req=%s: unexpected send error", job.room, job.req_id)
        status, error = DoneStatus.INTERNAL_ERROR, f"internal error: {exc!r}"
    checksum = summed.value if summed is not None and status is DoneStatus.OK else None
    return PushOutcome(status, error, nbytes, entries, time.perf_counter() - t0, checksum)


class Pushed(Protocol):
    """How a push ended: a request-mode ``PushOutcome`` or a layer-wise ``StreamResult``."""

    @property
    def status(self) -> DoneStatus: ...
    @property
    def error(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def entries(self) -> int: ...
    @property
    def seconds(self) -> float: ...


def log_push(stats: TransferStats, room: int, req_id: str, req: proto.TransferRequest, done: Pushed) -> None:
    """The log line of the push of P request ``req_id`` (room ``room``) to ``req``; an OK push is observed
    in ``stats``, a failed one counted."""
    status, error, nbytes, entries, seconds = done.status, done.error, done.nbytes, done.entries, done.seconds
    if status is not DoneStatus.OK:
        stats.inc("transfers_failed")  # its reason is counted when D is told (PrefillSide._reply)
        log = logger.warning if status is DoneStatus.CANCELLED else logger.error  # D gave up: no fault here
        log("room=%d req=%s: KV push to %s failed (%s): %s", room, req_id, req.peer_id, status.name, error)
        return
    stats.observe_push(nbytes, entries, seconds)
    logger.info(
        "room=%d req=%s: pushed %d blocks (%d bytes, %d entries) to %s in %.2f ms",
        room,
        req_id,
        len(req.dst_block_ids),
        nbytes,
        entries,
        req.peer_id,
        seconds * 1e3,
    )


class _Refused(Exception):
    def __init__(self, status: DoneStatus, error: str) -> None:
        super().__init__(error)
        self.status = status
